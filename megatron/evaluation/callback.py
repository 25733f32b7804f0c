"""lm-evaluation-harness during training: --eval-harness-tasks run on the live model every --eval-harness-interval.

Every rank takes part (tensor- and pipeline-parallel ranks compute each batch together, data-parallel replicas
split the batches; megatron/evaluation/harness.py); nothing is written to disk for it. Each task runs on its own,
so a task that fails on every rank alike (its data, its template, a metric) logs one warning naming it and the
error, and training goes on with the others. ZeRO-3 (partitioned parameters) is refused before training starts.
The metrics go to one log line

    eval harness at iteration 100 | alice_cloze/acc: 0.1250 | alice_cloze/perplexity: 512.3 | ... |

to tensorboard (eval_harness/<task>/<metric>) and to the metrics file ({"kind": "eval_harness", ...}).
"""
import contextlib
import logging
import time

from megatron.training.callbacks import Callback

logger = logging.getLogger("megatron.training")


def format_harness_line(iteration, metrics, seconds):
    parts = [f"eval harness at iteration {iteration}"]
    parts += [f"{name}: {value:.6g}" for name, value in sorted(metrics.items())]
    parts.append(f"seconds: {seconds:.1f}")
    return " | ".join(parts) + " |"


class EvalHarnessCallback(Callback):
    """Runs config.eval_harness's tasks at its interval. Unknown task names raise ValueError at construction
    (before training starts); a task failing at run time only warns."""

    def __init__(self, config, tokenizer):
        from megatron.evaluation.harness import task_manager

        self.config, self.harness, self.tokenizer = config, config.eval_harness, tokenizer
        if config.training.zero_stage == 3:
            raise ValueError("--eval-harness-tasks does not run under --zero-stage 3 (the parameters are partitioned "
                             "across ranks); use --zero-stage 0, 1 or 2, or evaluate the saved checkpoints with "
                             "tools/evaluate.py")
        if tokenizer is None:
            raise ValueError("--eval-harness-tasks needs a tokenizer (--vocab-file/--merge-file or "
                             "--tokenizer-name-or-path), not --mock-data alone")
        try:
            task_manager(self.harness.eval_harness_tasks, self.harness.eval_harness_include_path)
        except ValueError as err:
            raise ValueError(str(err).replace("--tasks", "--eval-harness-tasks").replace(
                "--include-path", "--eval-harness-include-path")) from None
        self.history = []  # (iteration, metrics) of each run, for callers and tests
        if logging.getLogger("megatron").getEffectiveLevel() > logging.DEBUG:
            logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-task chatter: --log-level debug

    def on_iteration_end(self, trainer, iteration, loss):
        if iteration % self.harness.eval_harness_interval == 0:
            self.run(trainer, iteration)

    def _lm(self, trainer):
        from megatron.evaluation.harness import MegatronLM
        from megatron.inference.scoring import Scorer

        module, state = trainer.engine.module, trainer.state
        vocab = self.tokenizer.vocab_size
        if trainer.pipelined:
            scorer = Scorer.for_pipeline_module(module, state, self.config.model, vocab)
            model = None
        else:
            scorer = Scorer.for_bloom_model(module, vocab, state)
            model = module
        return MegatronLM(scorer, self.tokenizer, self.config.model.seq_length, self.harness.eval_harness_batch_size,
                          model=model, state=state, seed=self.config.model.seed)

    @contextlib.contextmanager
    def _eval_mode(self, trainer):
        """The live module in eval mode, gathering its full-vocabulary logits for generation, attention on SDPA
        (training's FlexAttention would compile once per shape); everything is restored afterwards."""
        from megatron.model.attention import CoreAttention

        engine, module = trainer.engine, trainer.engine.module
        was_training, parallel_output = module.training, getattr(module, "parallel_output", None)
        attentions = [(m, m.impl) for m in module.modules() if isinstance(m, CoreAttention)]
        engine.eval()
        if parallel_output is not None:
            module.parallel_output = False
        for attention, impl in attentions:
            attention.impl = "sdpa" if impl in ("auto", "flex") else impl
        try:
            yield
        finally:
            for attention, impl in attentions:
                attention.impl = impl
            if parallel_output is not None:
                module.parallel_output = parallel_output
            if was_training:
                engine.train()

    def run(self, trainer, iteration):
        from megatron.evaluation.harness import flat_metrics, run_tasks

        harness, start = self.harness, time.perf_counter()
        limit = harness.eval_harness_limit
        limit = int(limit) if limit is not None and limit >= 1 else limit
        metrics = {}
        with self._eval_mode(trainer):
            lm = self._lm(trainer)
            for task in harness.eval_harness_tasks:
                try:
                    results = run_tasks(lm, [task], harness.eval_harness_include_path,
                                        harness.eval_harness_num_fewshot, limit, bootstrap_iters=0)
                except Exception as err:  # noqa: BLE001  lm-eval raises anything; a task never stops training
                    logger.warning("eval harness: task %s failed at iteration %d (%s: %s); training continues",
                                   task, iteration, type(err).__name__, str(err).splitlines()[0][:300] if str(err)
                                   else "")
                    continue
                if results is not None:  # lm-eval returns them on local rank 0 only
                    metrics.update(flat_metrics(results))
        seconds = time.perf_counter() - start
        logger.info(format_harness_line(iteration, metrics, seconds))
        writer = getattr(trainer, "writer", None)
        if writer is not None:
            writer.write("eval_harness", {"iteration": iteration, **metrics, "seconds": seconds})
        self.history.append((iteration, metrics))
        return metrics
