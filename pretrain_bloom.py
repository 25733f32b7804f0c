"""Pretrain a BLOOM-architecture model: parse flags -> validate everything -> build -> train.

    deepspeed --num_gpus 2 pretrain_bloom.py --tensor-model-parallel-size 2 ... --deepspeed --deepspeed_config ds.json
"""
import logging

from megatron.arguments import load_and_resolve
from megatron.initialize import deepspeed_output, exit_before_distributed, setup_logging

logger = logging.getLogger("megatron")


def main(argv=None, callbacks=()):
    """callbacks: megatron.training.Callback objects joining the run (tests inject faults and probes this way)."""
    setup_logging()
    from megatron.checkpoint.format import CheckpointError, checkpoint_bytes
    from megatron.checkpoint.load import load_checkpoint
    from megatron.checkpoint.save import check_save_dir
    from megatron.training.startup_checks import check_before_start
    try:
        config, ds_config, tokenizer = load_and_resolve(argv)
        check_before_start(config, tokenizer)  # data vs vocabulary, flags vs the checkpoint's shape, fp16 on CPU
        if config.eval_harness.enabled:  # lm-eval tasks on the live model; unknown task names stop here
            from megatron.evaluation.callback import EvalHarnessCallback
            callbacks = tuple(callbacks) + (EvalHarnessCallback(config, tokenizer),)
        if config.checkpoint.save:  # writable, with room for one more checkpoint
            check_save_dir(config.checkpoint.save, checkpoint_bytes(
                config.model.num_parameters(), config.precision.name, config.checkpoint.no_save_optim))
    except ValueError as err:
        exit_before_distributed(str(err), 2)  # printed once, not once per process
    setup_logging(log_level=config.logging.log_level)

    from megatron.initialize import (exit_after_error, initialize_distributed, load_kernels, set_random_seeds,
                                     shutdown_distributed)
    from megatron.data.indexed_dataset import IndexedDatasetError
    from megatron.data.datasets import build_datasets
    from megatron.training import FatalTrainingError, Trainer, setup_engine

    state = initialize_distributed(config.parallel)
    try:
        load_kernels(config.model)
    except RuntimeError as err:  # --abort-on-unmet-fused-kernel-constraints and the kernels cannot serve
        exit_after_error(err, 1)
    set_random_seeds(config.model.seed, state)
    from megatron.planning.advice import check_before_build
    import torch
    check_before_build(config, ds_config, state, torch.cuda.is_available())  # the predicted peak; a warning if over
    with deepspeed_output():  # its prints (topology, memory dumps) only with --log-level debug
        engine, scheduler = setup_engine(config, ds_config, state)
    try:
        start = None
        if config.checkpoint.load:
            start = load_checkpoint(engine, config, state)
        trainer = Trainer(config, state, engine, scheduler, build_datasets(config), tokenizer, start, callbacks)
        result = trainer.train()
    except (CheckpointError, FatalTrainingError, IndexedDatasetError) as err:  # one line, exit 1
        exit_after_error(err, 1)
    shutdown_distributed()
    return result


if __name__ == "__main__":
    main()
