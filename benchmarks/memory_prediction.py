"""Predicted against measured peak GPU memory (megatron/planning/memory.py vs torch.cuda.max_memory_allocated).

    python benchmarks/memory_prediction.py --output memory_prediction.json        # one GPU, about 4 minutes

One process. For each configuration it builds the real engine through pretrain_bloom.py's path (load_and_resolve ->
setup_engine, bf16, DeepSpeed), runs --steps optimizer steps of --grad-accum micro batches of mock tokens, and
reads torch.cuda.max_memory_allocated (the log line's "peak allocated" figure), reset before the build, minus
what was still allocated before it (the previous engine is freed first). The prediction is
megatron.planning.memory.layout_memory of the same resolved Config, with the attention backend and the
cross-entropy path that served the run (FlexAttention and the fused kernel on CUDA). Prints a table of predicted,
measured and their ratio, and writes it as JSON. A configuration that runs out of memory is recorded as such.
"""
import argparse
import gc
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DOC = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
       "--max-position-embeddings", "2048", "--mock-vocab-size", "250880", "--pad-vocab-size-to", "250880"]
SMALL = ["--num-layers", "12", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
         "--max-position-embeddings", "1024", "--mock-vocab-size", "50304", "--pad-vocab-size-to", "50304"]
# (name, model flags, micro batch, checkpoint activations, ZeRO stage)
CONFIGS = [
    ("1.72B mb1", DOC, 1, False, 0),
    ("1.72B mb2", DOC, 2, False, 0),
    ("1.72B mb4", DOC, 4, False, 0),
    ("1.72B mb1 ckpt", DOC, 1, True, 0),
    ("1.72B mb2 ckpt", DOC, 2, True, 0),
    ("1.72B mb4 ckpt", DOC, 4, True, 0),
    ("1.72B mb4 zero1", DOC, 4, False, 1),
    ("1.72B mb2 ckpt zero1", DOC, 2, True, 1),
    ("small mb8", SMALL, 8, False, 0),
    ("small mb16 ckpt zero1", SMALL, 16, True, 1),
    ("small mb16 zero1", SMALL, 16, False, 1),  # added after the first run: not used to shape the model
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, help="write the table as JSON here")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per configuration")
    p.add_argument("--grad-accum", type=int, default=2, help="micro batches per optimizer step")
    p.add_argument("--only", nargs="*", default=None, help="run only the configurations with these names")
    p.add_argument("--time-budget", type=float, default=270.0,
                   help="seconds after which the remaining configurations are skipped (and listed as such)")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script runs (no figures)")
    return p.parse_args(argv)


def run_config(name, model_flags, micro, ckpt, zero, args):
    import torch
    from megatron.arguments import load_and_resolve
    from megatron.core import parallel_state
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.data.samplers import build_pretraining_data_loader
    from megatron.fused_kernels import cross_entropy as ce
    from megatron.initialize import deepspeed_output, set_random_seeds
    from megatron.planning.memory import GIB, layout_memory, zero_buckets
    from megatron.training import setup_engine, train_step

    argv = model_flags + ["--micro-batch-size", str(micro), "--global-batch-size", str(micro * args.grad_accum),
                          "--train-iters", str(args.steps), "--lr", "1e-4", "--mock-data", "--bf16",
                          "--zero-stage", str(zero), "--deepspeed"] + (["--checkpoint-activations"] if ckpt else [])
    config, ds_config, _ = load_and_resolve(argv, world_size=1)
    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    state = parallel_state.initialize_model_parallel(1, 1)
    set_random_seeds(config.model.seed, state)
    record = {"name": name, "micro_batch_size": micro, "checkpoint_activations": ckpt, "zero_stage": zero,
              "num_layers": config.model.num_layers, "hidden_size": config.model.hidden_size,
              "seq_length": config.model.seq_length, "vocab_size": config.model.vocab_size,
              "gradient_accumulation": args.grad_accum, "baseline_gib": base / GIB}
    engine = None
    try:
        with deepspeed_output():
            engine, _ = setup_engine(config, ds_config, state)
        data = MockGPTDataset(micro * args.grad_accum * args.steps, config.model.seq_length, config.model.vocab_size)
        it = iter(build_pretraining_data_loader(data, 0, micro, 0, 1))
        for _ in range(args.steps):
            train_step(engine, it, args.grad_accum, False)
        if not cuda:
            record["measured_gib"], fused = None, False
        else:
            torch.cuda.synchronize()
            record["measured_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
            probe = torch.zeros(2, 8, device="cuda", dtype=torch.bfloat16)
            fused = ce.cross_entropy_kernel(probe, torch.zeros(2, device="cuda", dtype=torch.long)) is not None
    except torch.cuda.OutOfMemoryError:
        record["measured_gib"], fused = None, True
        record["oom"] = True
    record["seconds"] = time.perf_counter() - start
    stages = layout_memory(config.model, 1, 1, 1, micro, args.grad_accum, "bf16", zero, ckpt, cuda=cuda,
                           attention="flex" if cuda else "torch", fused_cross_entropy=fused,
                           buckets=zero_buckets(ds_config))
    stage = stages[0]
    record.update(predicted_gib=stage.peak / GIB, fused_cross_entropy=fused,
                  weights_gib=stage.states.weights / GIB, gradients_gib=stage.states.gradients / GIB,
                  accumulating_gradients_gib=stage.states.accumulating_gradients / GIB,
                  optimizer_gib=stage.states.optimizer / GIB, comm_buffers_gib=stage.states.comm_buffers / GIB,
                  activations_gib=stage.activations / GIB, transient_gib=stage.transient / GIB)
    if record["measured_gib"]:
        record["ratio"] = record["predicted_gib"] / record["measured_gib"]
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()  # DeepSpeed's hooks and buffers
    del engine
    parallel_state.destroy_model_parallel()
    gc.collect()
    torch.cuda.empty_cache()
    return record


def main(argv=None):
    args = parse_args(argv)
    import torch
    from megatron.initialize import initialize_distributed, setup_logging
    from megatron.config import ParallelConfig
    configs = CONFIGS
    if args.smoke:
        tiny = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                "--mock-vocab-size", "256", "--pad-vocab-size-to", "256"]
        configs = [("tiny mb2", tiny, 2, False, 0), ("tiny mb2 ckpt zero1", tiny, 2, True, 1)]
    elif not torch.cuda.is_available():
        raise SystemExit("benchmarks/memory_prediction.py needs a CUDA GPU (--smoke runs a tiny model on the CPU)")
    setup_logging(log_level="warning")
    # Each (shape, grad mode) compiles FlexAttention once; ten configurations need more than dynamo's default 8
    # recompilations, past which it would run flex unfused (materialising the scores) and spoil the figures.
    import torch._dynamo
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    initialize_distributed(ParallelConfig(world_size=1, distributed_backend="nccl" if torch.cuda.is_available()
                                          else "gloo"))
    records, skipped, start = [], [], time.perf_counter()
    for name, flags, micro, ckpt, zero in configs:
        if args.only and name not in args.only:
            continue
        if time.perf_counter() - start > args.time_budget:
            skipped.append(name)
            continue
        record = run_config(name, flags, micro, ckpt, zero, args)
        records.append(record)
        _write(args.output, device_name(), records, skipped)  # what is done survives a kill
        print(f"{name:24s} predicted {record['predicted_gib']:7.2f} GiB  measured "
              f"{record['measured_gib'] if record['measured_gib'] is None else round(record['measured_gib'], 2)}"
              f"  ({record['seconds']:.0f} s)", flush=True)
    device = (f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2 ** 30:.1f} "
              "GiB)") if torch.cuda.is_available() else "cpu (smoke run: nothing measured)"
    print(f"\n{device}, bf16, {args.grad_accum} micro batches per step, {args.steps} steps")
    print(f"{'config':24s} {'predicted GiB':>13s} {'measured GiB':>12s} {'ratio':>6s}  weights grads(step) optim "
          f"activ+logits transient")
    for r in records:
        measured = "OOM" if r.get("oom") else "-" if r["measured_gib"] is None else f"{r['measured_gib']:.2f}"
        ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "-"
        print(f"{r['name']:24s} {r['predicted_gib']:13.2f} {measured:>12s} {ratio:>6s}  {r['weights_gib']:7.2f} "
              f"{r['gradients_gib']:11.2f} {r['optimizer_gib']:5.2f} {r['activations_gib']:12.2f} "
              f"{r['transient_gib']:9.2f}")
    worst = max((abs(r["ratio"] - 1) for r in records if r.get("ratio")), default=None)
    if worst is not None:
        print(f"largest deviation: {100 * worst:.1f}%")
    if skipped:
        print(f"skipped past --time-budget {args.time_budget:g} s: {', '.join(skipped)}")
    print(f"total {time.perf_counter() - start:.0f} s")
    _write(args.output, device, records, skipped)


def device_name():
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _write(path, device, records, skipped):
    import torch
    with open(path, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "records": records, "skipped": skipped}, f,
                  indent=2)


if __name__ == "__main__":
    main()
