"""Benchmark: torch and every skinny-GEMM candidate plan at the 1.72B model's decode GEMM shapes, in CUDA graphs.

    python benchmarks/decode_gemm_sweep.py [--rows 1 8 32 64] [--layers 24] [--repeats 20] [--output FILE.json]
        [--parts gemm attention] [--attention-batches 1 64] [--contexts 32 160 288] [--max-seq-len 288]

For each decode GEMM of the fused step (N x K, its prologue and epilogue: qkv 6144x2048 LayerNorm + bias, dense
2048x2048 + bias + residual, h->4h 8192x2048 LayerNorm + bias + GeLU, 4h->h 2048x8192 + bias + residual, the LM
head 250880x2048 after the final LayerNorm; torch runs the LayerNorm as a kernel of its own, the Triton plans in
their prologue up to 8 rows, as the fused step does) and each row count, megatron/inference/skinny_gemm.py's
choose_plan (the engine's own choice) times torch and every plan of candidates(): a CUDA graph of the GEMM over
--layers distinct weights of that shape (the real layers' count, so the L2 cache holds none of them from one call
to the next; the LM head: its one weight) replayed --repeats times back to back. Prints us per call and the TB/s
of the bytes each call moves (W, bias, x, residual, y), marks the fastest, and writes the table as JSON
(--output). A plan that fails to compile or disagrees with torch is left out (logged).

attention: the fused step's decode attention (megatron/inference/decode.py, Triton) over --layers layers of a
cache of --max-seq-len positions (the benchmark's prompt 32 + 256 new tokens), every row at the same context, for
each launch configuration (decode.ATTENTION_LAUNCHES and MORE_ATTENTION_CONFIGS: keys per loop iteration, warps,
splits of a row's keys, prefetch): us per layer and the TB/s of the keys and values read. At batch 64 the keys and
values of the generation's mean context (160) are 2 GB a step, half the weights' bytes: this part says how far
that read is from the bandwidth.
"""
import argparse
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# (label, N, K, epilogue flags): the 1.72B model (hidden 2048, vocab 250880)
SHAPES = [("qkv", 6144, 2048, {"ln": True}), ("dense", 2048, 2048, {"residual": True}),
          ("h->4h", 8192, 2048, {"gelu": True, "ln": True}), ("4h->h", 2048, 8192, {"residual": True}),
          ("LM head", 250880, 2048, {"ln": True})]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64], help="decode batch buckets (<= 64)")
    parser.add_argument("--layers", type=int, default=24, help="distinct weights per shape (the LM head: one)")
    parser.add_argument("--repeats", type=int, default=20, help="graph replays per measurement")
    parser.add_argument("--shapes", nargs="+", choices=[s[0] for s in SHAPES], default=[s[0] for s in SHAPES])
    parser.add_argument("--parts", nargs="+", choices=["gemm", "attention"], default=["gemm", "attention"])
    parser.add_argument("--attention-batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32, 160, 288], help="keys each row attends to")
    parser.add_argument("--max-seq-len", type=int, default=288, help="the cache's positions (the split plan's)")
    parser.add_argument("--output", default=None, help="also write the table as JSON")
    return parser.parse_args(argv)


def call_bytes(rows, n, k, element, bias, residual):
    """Bytes one call reads and writes: W once, the bias, the rows of x, the residual and y."""
    return element * (n * k + (n if bias else 0) + rows * k + rows * n * (2 if residual else 1))


def gemm_part(args, report, save):
    from megatron.inference.skinny_gemm import GEMV_ROWS, choose_plan, graph_time

    print(f"{'GEMM':>8} {'N x K':>12} {'rows':>4} {'us':>8} {'TB/s':>6}  plan", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16
    for label, n, k, flags in SHAPES:
        if label not in args.shapes:
            continue
        flags = dict(flags)
        count = 1 if label == "LM head" else args.layers
        weights = [(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(dtype) for _ in range(count)]
        biases = [None if label == "LM head" else torch.randn(n, device="cuda", generator=gen).to(dtype)
                  for _ in range(count)]
        norms = [(1 + torch.randn(k, device="cuda", generator=gen).to(dtype) / 4,
                  torch.randn(k, device="cuda", generator=gen).to(dtype), 1e-5) for _ in range(count)]
        ln = flags.pop("ln", False)
        for rows in args.rows:
            start = time.perf_counter()
            plan, seconds = choose_plan(rows, weights, biases, label=label,
                                        timer=lambda fn: graph_time(fn, repeats=args.repeats),
                                        norms=norms if ln and rows <= GEMV_ROWS else None, **flags)
            moved = call_bytes(rows, n, k, 2, biases[0] is not None, flags.get("residual", False))
            best = min(seconds, key=seconds.get)
            for name, s in sorted(seconds.items(), key=lambda item: item[1]):
                print(f"{label:>8} {f'{n}x{k}':>12} {rows:>4} {s * 1e6:>8.1f} {moved / s / 1e12:>6.2f}  {name}"
                      + ("  <- fastest" if name == best else ""), flush=True)
            report["gemm"].append({"gemm": label, "n": n, "k": k, "rows": rows, "bytes": moved, "chosen": best,
                                   "chosen_plan": None if plan is None else list(plan),
                                   "us": {name: s * 1e6 for name, s in seconds.items()},
                                   "tbps": {name: moved / s / 1e12 for name, s in seconds.items()},
                                   "sweep_s": time.perf_counter() - start})
            save()
        del weights, biases, norms
        torch.cuda.empty_cache()
    for rows in args.rows:
        results = [r for r in report["gemm"] if r["rows"] == rows]
        per_step = {side: sum((r["us"][r["chosen"]] if side == "fastest" else r["us"]["torch"])
                              * (1 if r["gemm"] == "LM head" else args.layers) for r in results) / 1e3
                    for side in ("fastest", "torch")}
        print(f"rows {rows}: the step's GEMMs ({len(results)} shapes, {args.layers} layers) {per_step['fastest']:.3f} "
              f"ms with the fastest plans, {per_step['torch']:.3f} ms with torch's", flush=True)
        report["step_gemm_ms"][str(rows)] = per_step


# decode_attention_triton's launches besides decode.ATTENTION_LAUNCHES (the ones FusedDecoder.prepare times for
# gemm="auto"; {}: the defaults, the engine's otherwise). Registers bound the programs an SM holds (sm_90,
# triton 3.9, one split: 64 keys x 4 warps 197 registers a thread, 2 programs of 4 warps; 32 x 4: 106, 4; 16 x 4:
# 72, 7; 16 x 1: 138, 14), so small programs, several splits of a long row at batch 64 (target 2048/4096: 2/4
# programs per (row, head), each split min_keys keys at least) and the next block prefetched are timed too
MORE_ATTENTION_CONFIGS = [dict(last_combines=False), dict(block_n=32), dict(block_n=16, warps=4),
                          dict(block_n=16, warps=1), dict(block_n=32, prefetch=True),
                          dict(block_n=16, warps=1, prefetch=True), dict(block_n=16, warps=2),
                          dict(block_n=16, warps=1, target_programs=2048, min_keys=64, prefetch=True),
                          dict(block_n=16, warps=1, target_programs=4096, min_keys=64),
                          dict(block_n=16, warps=2, target_programs=4096, min_keys=64),
                          dict(block_n=32, target_programs=2048, min_keys=64),
                          dict(block_n=64, target_programs=2048, min_keys=128)]


def attention_name(batch, heads, max_len, config):
    """The launch in words: keys per iteration, warps, the most splits and their least keys, prefetch, merge."""
    import inspect

    from megatron.inference.decode import decode_attention_triton, split_plan
    c = {name: p.default for name, p in inspect.signature(decode_attention_triton).parameters.items()
         if p.default is not inspect.Parameter.empty}
    c.update(config)
    splits = split_plan(batch, heads, max_len, c["block_n"], c["target_programs"])
    return (f"{c['block_n']} keys, {c['warps']} warps, <= {splits} splits of >= {c['min_keys'] or c['block_n']} keys"
            + (", prefetch" if c["prefetch"] else "") + (", combine kernel" if splits > 1 and not c["last_combines"]
                                                         else ""))


def attention_part(args, report, save):
    from megatron.inference.decode import ATTENTION_LAUNCHES, decode_attention_triton
    from megatron.inference.skinny_gemm import graph_time

    heads, head_dim, dtype = 16, 128, torch.bfloat16
    slots_total = max(args.attention_batches) + 1
    shape = (args.layers, slots_total, heads, args.max_seq_len, head_dim)
    k, v = torch.randn(shape, device="cuda", dtype=dtype), torch.randn(shape, device="cuda", dtype=dtype)
    slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)], device="cuda")
    print(f"{'batch':>5} {'context':>7} {'us/layer':>8} {'TB/s':>6}  launch", flush=True)
    for batch in args.attention_batches:
        qkv = torch.randn(batch, heads * 3 * head_dim, device="cuda", dtype=dtype)
        slots = torch.arange(batch, device="cuda")
        for context in args.contexts:
            pos = torch.full((batch,), context - 1, device="cuda", dtype=torch.long)
            moved = 2 * batch * heads * context * head_dim * 2  # keys and values read
            times = {}
            for config in list(ATTENTION_LAUNCHES) + MORE_ATTENTION_CONFIGS:
                name = attention_name(batch, heads, args.max_seq_len, config)
                if name in times:  # the same launch at this batch (e.g. one split either way)
                    continue

                def fn():
                    for i in range(args.layers):
                        decode_attention_triton(qkv, k[i], v[i], slots, pos, slopes, head_dim ** -0.5, **config)
                try:
                    times[name] = graph_time(fn, repeats=args.repeats) / args.layers
                except Exception as err:  # noqa: BLE001  a launch that fails to compile or run is reported, not timed
                    print(f"{batch:>5} {context:>7} {name} failed ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:160] if str(err) else ''})", flush=True)
            best = min(times, key=times.get)
            default = attention_name(batch, heads, args.max_seq_len, {})
            for name, seconds in sorted(times.items(), key=lambda item: item[1]):
                print(f"{batch:>5} {context:>7} {seconds * 1e6:>8.1f} {moved / seconds / 1e12:>6.2f}  {name}"
                      + ("  <- fastest" if name == best else "") + ("  (the defaults)" if name == default else ""),
                      flush=True)
            report["attention"].append({"batch": batch, "context": context, "bytes": moved, "fastest": best,
                                        "defaults": default, "us": {n: t * 1e6 for n, t in times.items()}})
            save()
    del k, v
    torch.cuda.empty_cache()


def main(argv=None):
    from megatron.inference.skinny_gemm import MAX_ROWS

    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("decode_gemm_sweep.py times CUDA graphs: run it on a GPU machine")
    bad = [r for r in args.rows if not 1 <= r <= MAX_ROWS]
    if bad:
        sys.exit(f"--rows {bad}: the skinny GEMM is for 1..{MAX_ROWS} rows")
    if max(args.contexts) > args.max_seq_len:
        sys.exit(f"--contexts {max(args.contexts)} exceeds --max-seq-len {args.max_seq_len}: raise --max-seq-len")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # failed plans are logged as warnings
    import triton
    report = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "triton": triton.__version__, "args": vars(args), "gemm": [], "step_gemm_ms": {}, "attention": []}

    def save():  # after each measurement: a run cut short keeps what it measured
        if args.output:
            with open(args.output, "w") as f:
                f.write(json.dumps(report, indent=2))
    print(f"{report['device']}, torch {torch.__version__}, triton {triton.__version__}; {args.layers} layers' "
          f"weights per shape, {args.repeats} graph replays per measurement", flush=True)
    if "gemm" in args.parts:
        gemm_part(args, report, save)
    if "attention" in args.parts:
        attention_part(args, report, save)
    save()


if __name__ == "__main__":
    main()
