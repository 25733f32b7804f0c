"""What each rank's DeepSpeed engine holds, in bytes, for several layouts in one 4-process launch.

    torchrun --nproc_per_node 4 tests/engine_state_bytes.py OUT.json "LAYOUT_FLAGS" ["LAYOUT_FLAGS" ...]

For each layout (a string of pretrain_bloom.py flags added to a tiny model's), every rank builds the real engine
through pretrain_bloom's path (load_and_resolve -> initialize_model_parallel -> setup_engine), runs one training
step, and sorts every tensor storage alive in the process into: parameters (the model's weights, or ZeRO-3's
partitions of them), gradients (the .grad of weights and master weights, and DeepSpeed's flat gradient
partition), optimizer (the optimizer's state tensors and fp32 master weights), and other. Rank 0 writes
{layout flags: [per-rank dict, ...]} to OUT.json. Shared storages are counted once (the first category wins, in
the order above), so views of one flat buffer are not counted twice.
"""
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--mock-data", "--mock-vocab-size", "1000", "--lr", "1e-3",
        "--train-iters", "1", "--global-batch-size", "8", "--deepspeed"]


def _storage(tensor):
    if tensor is None or not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    return (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else None


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)


def _inner_optimizers(engine):
    """The torch optimizer(s) under DeepSpeed's wrappers."""
    found, opt = [], engine.optimizer
    for _ in range(4):
        if isinstance(opt, torch.optim.Optimizer) and getattr(opt, "state", None) is not None:
            found.append(opt)
        opt = getattr(opt, "optimizer", None)
        if opt is None:
            break
    return found


def held_bytes(engine):
    """{"parameters", "gradients", "optimizer", "other"}: bytes of the storages alive on this rank."""
    gc.collect()
    seen, out = set(), {"parameters": 0, "gradients": 0, "optimizer": 0, "other": 0}

    def add(kind, tensor):
        key = _storage(tensor)
        if key is not None and key not in seen:
            seen.add(key)
            out[kind] += key[1]

    params = list(engine.module.parameters())
    for p in params:
        add("parameters", getattr(p, "ds_tensor", None))
        add("parameters", p)
    inner = _inner_optimizers(engine)
    masters = [p for opt in inner for group in opt.param_groups for p in group["params"]]
    for p in params + masters:
        add("gradients", p.grad)
    wrapper = engine.optimizer
    for name in ("grads_in_partition", "averaged_gradients", "fp32_groups_gradients_flat",
                 "fp32_groups_gradients"):
        for t in _tensors_in(getattr(wrapper, name, None)):
            add("gradients", t)
    for opt in inner:
        for state in opt.state.values():
            for t in _tensors_in(state):
                add("optimizer", t)
    for p in masters:
        add("optimizer", p)
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition",
                 "fp32_groups_flat"):  # DeepSpeed's fp32 master weights, by wrapper
        for t in _tensors_in(getattr(wrapper, name, None)):
            add("optimizer", t)
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            add("other", obj)
    return out


def run_layout(flags):
    from megatron.arguments import load_and_resolve
    from megatron.core import parallel_state
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.data.samplers import build_pretraining_data_loader
    from megatron.initialize import deepspeed_output, set_random_seeds
    from megatron.training import setup_engine, train_step
    from megatron.training.trainer import PipeBatches

    config, ds_config, _ = load_and_resolve(TINY + flags.split())
    par = config.parallel
    state = parallel_state.initialize_model_parallel(par.tensor_model_parallel_size,
                                                     par.pipeline_model_parallel_size)
    set_random_seeds(config.model.seed, state)
    with deepspeed_output():
        engine, _ = setup_engine(config, ds_config, state)
    training = config.training
    data = MockGPTDataset(training.global_batch_size * 2, config.model.seq_length, config.data.mock_vocab_size)
    loader = iter(build_pretraining_data_loader(data, 0, training.micro_batch_size, state.dp_rank,
                                                state.data_parallel_size, 0))
    pipelined = state.pipeline_model_parallel_size > 1
    snapshots = []
    for opt in _inner_optimizers(engine)[-1:]:  # the innermost optimizer's step: every gradient is in place
        step = opt.step

        def snapshot_then_step(*args, _step=step, **kwargs):
            snapshots.append(held_bytes(engine))  # ZeRO 1/2 step one parameter group at a time
            return _step(*args, **kwargs)
        opt.step = snapshot_then_step
    train_step(engine, PipeBatches(loader) if pipelined else loader, training.gradient_accumulation_steps,
               pipelined, state.dp_group)
    held = max(snapshots, key=lambda snap: snap["gradients"])
    after = held_bytes(engine)  # the optimizer state exists only after the first step
    held["optimizer"] = after["optimizer"]
    held.update(rank=dist.get_rank(), tp_rank=state.tp_rank, pp_rank=state.pp_rank, dp_rank=state.dp_rank)
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine, loader
    parallel_state.destroy_model_parallel()
    gc.collect()
    return held


def main():
    from megatron.config import ParallelConfig
    from megatron.initialize import initialize_distributed, setup_logging, shutdown_distributed
    setup_logging(log_level="warning")
    out_path, layouts = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    initialize_distributed(ParallelConfig(world_size=int(os.environ["WORLD_SIZE"])))  # pretrain_bloom.py's
    results = {}
    for flags in layouts:
        start = time.perf_counter()
        held = run_layout(flags)
        if dist.get_rank() == 0:
            print(f"{flags}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, held)
        results[flags] = gathered
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    shutdown_distributed()


if __name__ == "__main__":
    main()
