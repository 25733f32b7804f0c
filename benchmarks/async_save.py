"""Checkpoint save cost to training, --async-save against a synchronous save, and the time to verify and load.

One process trains a model given by pretrain_bloom.py's flags and measures, in this order (each figure is written
to --output as soon as it exists, so a timeout keeps what was measured):
  1. the iteration time without any save (--baseline-iters iterations after --warmup-iters);
  2. --async-saves background saves: the time training is blocked (the snapshot into pinned host memory; the
     first save also allocates the pinned buffers), the background write's wall time and GB/s, and the iteration
     time while the write is in flight (training keeps going until the write is done);
  3. the time to verify (the ranks' shared checksum pass) and to load the last checkpoint into the engine;
  4. one synchronous save (blocked for the whole write), unless --no-sync.

    # GPU, the 1.72B model (bf16, ZeRO 0), one H200
    deepspeed --num_gpus 1 benchmarks/async_save.py --num-layers 24 --hidden-size 2048 \\
        --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --pad-vocab-size-to 250880 \\
        --micro-batch-size 1 --global-batch-size 1 --bf16 --deepspeed --save /tmp/ckpt_async --output async.json

    # CPU, tiny (a smoke run)
    DS_ACCELERATOR=cpu python benchmarks/async_save.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 32 --max-position-embeddings 32 --mock-vocab-size 1000 --micro-batch-size 2 \\
        --global-batch-size 2 --deepspeed --save /tmp/ckpt_async --output async.json

Own flags: --warmup-iters (3), --baseline-iters (10), --async-saves (2), --no-sync, --output FILE, --keep.
Every other flag goes to pretrain_bloom.py; --mock-data, --lr 1e-4 and --async-save are added; checkpoints are
pruned to the last one (--keep-last-n-checkpoints 1) and the --save folder is removed at the end unless --keep.
"""
import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def mean(values):
    return sum(values) / len(values) if values else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    parser.add_argument("--warmup-iters", type=int, default=3)
    parser.add_argument("--baseline-iters", type=int, default=10)
    parser.add_argument("--async-saves", type=int, default=2)
    parser.add_argument("--no-sync", action="store_true")
    parser.add_argument("--output")
    parser.add_argument("--keep", action="store_true")
    ours, flags = parser.parse_known_args(argv)
    if "--data-path" not in flags and "--mock-data" not in flags:
        flags.append("--mock-data")
    if "--lr" not in flags:
        flags += ["--lr", "1e-4"]
    flags += ["--train-iters", "100000", "--eval-iters", "0", "--async-save", "--keep-last-n-checkpoints", "1"]

    import torch

    from megatron.arguments import load_and_resolve
    from megatron.checkpoint.load import load_checkpoint
    from megatron.data.datasets import build_datasets
    from megatron.initialize import initialize_distributed, load_kernels, set_random_seeds, setup_logging, \
        shutdown_distributed
    from megatron.training import Trainer, setup_engine

    setup_logging()
    config, ds_config, tokenizer = load_and_resolve(flags)
    assert config.checkpoint.save, "pass --save (a folder on the disk to measure, with room for two checkpoints)"
    state = initialize_distributed(config.parallel)
    load_kernels(config.model)
    set_random_seeds(config.model.seed, state)
    engine, scheduler = setup_engine(config, ds_config, state)
    trainer = Trainer(config, state, engine, scheduler, build_datasets(config), tokenizer)
    trainer._new_window()
    cuda = torch.cuda.is_available()
    figures = {"parameters": config.model.num_parameters(), "precision": config.precision.name,
               "device": torch.cuda.get_device_name() if cuda else "cpu"}

    def dump():
        if ours.output and state.rank == 0:
            with open(ours.output, "w") as f:
                json.dump(figures, f, indent=2)

    def step():
        """One iteration; its wall time in seconds (the loss's .item() synchronizes)."""
        start = time.perf_counter()
        trainer._iteration()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(ours.warmup_iters):
        step()
    figures["baseline_ms_per_iteration"] = 1000 * mean([step() for _ in range(ours.baseline_iters)])
    dump()

    saves = []
    for _ in range(ours.async_saves):
        start = time.perf_counter()
        trainer.save()  # waits for nothing (the previous write is done), snapshots, starts the writer
        blocked = time.perf_counter() - start
        during = []
        while trainer.saver.thread is not None and trainer.saver.thread.is_alive():
            during.append(step())
        trainer.wait_for_save()
        saves.append({"blocked_seconds": blocked, "host_bytes": trainer.saver.host.bytes,
                      "write_seconds": trainer.saver.seconds, "bytes_written": trainer.saver.written,
                      "write_GBps": trainer.saver.written / 1e9 / trainer.saver.seconds,
                      "iterations_during_write": len(during),
                      "ms_per_iteration_during_write": 1000 * mean(during) if during else None})
        figures["async_saves"] = saves
        dump()
        step()  # the next save is at another iteration

    load_config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint,
                                                                              load=config.checkpoint.save))
    resumed = load_checkpoint(engine, load_config, state)
    figures.update(verify_seconds=resumed.verify_seconds, load_seconds=resumed.load_seconds,
                   loaded_iteration=resumed.iteration)
    dump()

    if not ours.no_sync:
        start = time.perf_counter()
        trainer.save(final=True)  # the synchronous path: blocked for the whole write
        figures["sync_blocked_seconds"] = time.perf_counter() - start
    last = saves[-1]["blocked_seconds"] if saves else None
    if last is not None and "sync_blocked_seconds" in figures:
        figures["async_blocked_over_sync"] = last / figures["sync_blocked_seconds"]
    if saves and saves[-1]["ms_per_iteration_during_write"]:
        figures["iteration_slowdown_during_write"] = (saves[-1]["ms_per_iteration_during_write"] /
                                                      figures["baseline_ms_per_iteration"])
    dump()
    if state.rank == 0:
        print("async_save: " + json.dumps(figures), flush=True)
        if not ours.keep:
            shutil.rmtree(config.checkpoint.save, ignore_errors=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
