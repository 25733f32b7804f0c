"""Checkpoint size and save time: trains a few iterations of a model given by pretrain_bloom.py's flags, saves
once, and prints the bytes on disk per parameter (by kind of file) and the save's wall time.

    # CPU, tiny (one process; PP 2 through the deepspeed launcher)
    DS_ACCELERATOR=cpu python benchmarks/checkpoint_size.py --num-layers 4 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --mock-vocab-size 8000 \\
        --micro-batch-size 2 --global-batch-size 2 --bf16 --deepspeed
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 benchmarks/checkpoint_size.py ... --pipe-parallel-size 2

    # GPU, the 1.72B model (bf16, ZeRO 0)
    deepspeed --num_gpus 1 benchmarks/checkpoint_size.py --num-layers 24 --hidden-size 2048 \\
        --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --pad-vocab-size-to 250880 \\
        --micro-batch-size 1 --global-batch-size 1 --bf16 --deepspeed --save /tmp/ckpt_size --output size.json

Own flags: --steps N (iterations before the save, default 1: Adam's state exists only after a step),
--output FILE (the figures as JSON), --keep (leave the checkpoint; it is removed by default). Every other flag
goes to pretrain_bloom.py; --mock-data is added without --data-path, --lr 1e-4 without --lr, and --save
defaults to .ckpt_size_<pid> in the current folder. The save is timed from a barrier before it to a barrier
after it (every rank done, manifest written). Bytes per parameter divide the whole folder by the model's
parameter count (the tied word embedding counted once).
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

KINDS = (("model shards", lambda n: n.startswith("model_tp")),
         ("optimizer state", lambda n: n.startswith("optimizer_tp")),
         ("DeepSpeed files", lambda n: n.startswith(("mp_rank_", "layer_", "zero_pp_rank_", "bf16_zero_pp_rank_"))),
         ("other", lambda n: True))


def sizes_by_kind(folder):
    """{kind: bytes} for every file under folder (KINDS decides by the file's name; subfolders are "other")."""
    totals = dict.fromkeys((kind for kind, _ in KINDS), 0)
    for root, _, names in os.walk(folder):
        for name in names:
            kind = next(k for k, match in KINDS if match(name)) if root == folder else "other"
            totals[kind] += os.path.getsize(os.path.join(root, name))
    return totals


def report(folder, num_parameters, seconds, config, state):
    sizes = sizes_by_kind(folder)
    total = sum(sizes.values())
    per_kind = ", ".join(f"{kind} {size / num_parameters:.2f}" for kind, size in sizes.items())
    line = (f"checkpoint_size: {num_parameters} parameters, {config.precision.name}, TP "
            f"{state.tensor_model_parallel_size} x PP {state.pipeline_model_parallel_size} x DP "
            f"{state.data_parallel_size}, ZeRO {config.training.zero_stage}: {total / 1e6:.2f} MB on disk = "
            f"{total / num_parameters:.3f} bytes/parameter ({per_kind}); save {seconds:.2f} s")
    return line, {"parameters": num_parameters, "precision": config.precision.name,
                  "tp": state.tensor_model_parallel_size, "pp": state.pipeline_model_parallel_size,
                  "dp": state.data_parallel_size, "zero_stage": config.training.zero_stage, "bytes": total,
                  "bytes_per_parameter": total / num_parameters, "bytes_by_kind": sizes, "save_seconds": seconds}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--output")
    parser.add_argument("--keep", action="store_true")
    ours, flags = parser.parse_known_args(argv)
    if "--save" not in flags:  # rank 0's temporary folder, sent to the other ranks once they are connected
        flags += ["--save", os.path.join(os.getcwd(), f".ckpt_size_{os.getpid()}") if int(os.environ.get(
            "RANK", "0")) == 0 else "unused"]
    if "--data-path" not in flags and "--mock-data" not in flags:
        flags.append("--mock-data")
    if "--lr" not in flags:
        flags += ["--lr", "1e-4"]
    flags += ["--train-iters", str(ours.steps), "--eval-iters", "0", "--log-interval", str(ours.steps)]

    import torch
    import torch.distributed as dist

    from megatron.checkpoint.format import tag_for
    from megatron.arguments import load_and_resolve
    from megatron.initialize import initialize_distributed, load_kernels, set_random_seeds, setup_logging, \
        shutdown_distributed
    from megatron.data.datasets import build_datasets
    from megatron.training import Trainer, setup_engine

    setup_logging()
    config, ds_config, tokenizer = load_and_resolve(flags)
    state = initialize_distributed(config.parallel)
    if dist.get_world_size() > 1:  # every rank saves under rank 0's folder
        root = [config.checkpoint.save]
        dist.broadcast_object_list(root, src=0)
        config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, save=root[0]))
    load_kernels(config.model)
    set_random_seeds(config.model.seed, state)
    engine, scheduler = setup_engine(config, ds_config, state)

    saves = []

    class TimedSaves(Trainer):
        def save(self):  # the run saves once, after its last iteration
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            super().save()
            dist.barrier()
            folder = os.path.join(config.checkpoint.save, tag_for(self.progress.iteration))
            saves.append((folder, time.perf_counter() - start))

    TimedSaves(config, state, engine, scheduler, build_datasets(config), tokenizer).train()
    folder, seconds = saves[-1]
    if state.rank == 0:
        line, figures = report(folder, config.model.num_parameters(), seconds, config, state)
        print(line, flush=True)
        if ours.output:
            with open(ours.output, "w") as f:
                json.dump(figures, f, indent=2)
        if not ours.keep:
            shutil.rmtree(config.checkpoint.save, ignore_errors=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
