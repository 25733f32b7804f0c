"""Training on DeepSpeed: engine set-up, the Trainer loop with callbacks, its guards and its metrics.

    engine.py     the model (BloomModel, or a PipelineModule for PP > 1), optimizer and schedule in deepspeed.initialize
    trainer.py    Trainer: iterations, log line, evaluation, checkpoint saves, exits; train_step and evaluate
    guards.py     fatal errors, the exit signal, the NonFiniteGuard
    metrics.py    the FLOPs formula, MFU denominator, peak memory, the log line, the metrics writer
    timers.py     phase timers (--timing-log-level): CUDA-event phase clock, engine hooks, communication share, bubble
    monitoring.py NVML GPU utilization, the --profile window, the W&B writer
    callbacks.py  Callback: how code outside the loop (fault injection in tests, probes) joins a run
"""
from megatron.training.callbacks import Callback
from megatron.training.engine import build_model, setup_engine
from megatron.training.guards import FatalTrainingError, NonFiniteError
from megatron.training.trainer import Trainer, evaluate, train_step

__all__ = ["Callback", "FatalTrainingError", "NonFiniteError", "Trainer", "build_model", "evaluate",
           "setup_engine", "train_step"]
