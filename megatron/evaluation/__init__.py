"""megatron.evaluation: lm-evaluation-harness on our model, any TP x PP layout, during training and through the server.

    scoring.py    Scorer: token log-probs (LM head on the scored positions only, padding rows of the vocabulary
                  masked, pipeline stages chained), EvalStage (one pipeline stage built from a checkpoint)
    harness.py    MegatronLM: lm-eval's LM ("megatron"): loglikelihood, loglikelihood_rolling, generate_until;
                  run_tasks / task_manager / flat_metrics
    loading.py    this rank's slice of a checkpoint or HF folder (tools/evaluate.py)
    callback.py   EvalHarnessCallback: --eval-harness-tasks during training
"""
