"""megatron.evaluation: lm-evaluation-harness on our model, any TP x PP layout, during training and through the server.

    (megatron/inference/scoring.py: Scorer, the token log-probs this package and the server share)
    harness.py    MegatronLM: lm-eval's LM ("megatron"): loglikelihood, loglikelihood_rolling, generate_until;
                  run_tasks / task_manager / flat_metrics
    loading.py    this rank's slice of a checkpoint or HF folder (tools/evaluate.py)
    callback.py   EvalHarnessCallback: --eval-harness-tasks during training
"""
