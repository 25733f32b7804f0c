"""Benchmark: torch and every skinny-GEMM candidate plan at the 1.72B model's decode GEMM shapes, in CUDA graphs.

    python benchmarks/decode_gemm_sweep.py [--rows 1 8 32 64] [--layers 24] [--repeats 20] [--output FILE.json]

For each decode GEMM of the fused step (N x K and its epilogue: qkv 6144x2048 + bias, dense 2048x2048 + bias +
residual, h->4h 8192x2048 + bias + GeLU, 4h->h 2048x8192 + bias + residual, the LM head 250880x2048) and each row
count, megatron/inference/skinny_gemm.py's choose_plan (the engine's own choice) times torch and every plan of
candidates(): a CUDA graph of the GEMM over --layers distinct weights of that shape (the real layers' count, so the
L2 cache holds none of them from one call to the next; the LM head: its one weight) replayed --repeats times back
to back. Prints us per call and the TB/s of the bytes each call moves (W, bias, x, residual, y), marks the fastest,
and writes the table as JSON (--output). A plan that fails to compile or disagrees with torch is left out (logged).
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
SHAPES = [("qkv", 6144, 2048, {}), ("dense", 2048, 2048, {"residual": True}), ("h->4h", 8192, 2048, {"gelu": True}),
          ("4h->h", 2048, 8192, {"residual": True}), ("LM head", 250880, 2048, {})]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64], help="decode batch buckets (<= 64)")
    parser.add_argument("--layers", type=int, default=24, help="distinct weights per shape (the LM head: one)")
    parser.add_argument("--repeats", type=int, default=20, help="graph replays per measurement")
    parser.add_argument("--shapes", nargs="+", choices=[s[0] for s in SHAPES], default=[s[0] for s in SHAPES])
    parser.add_argument("--output", default=None, help="also write the table as JSON")
    return parser.parse_args(argv)


def call_bytes(rows, n, k, element, bias, residual):
    """Bytes one call reads and writes: W once, the bias, the rows of x, the residual and y."""
    return element * (n * k + (n if bias else 0) + rows * k + rows * n * (2 if residual else 1))


def main(argv=None):
    from megatron.inference.skinny_gemm import MAX_ROWS, choose_plan, graph_time

    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("decode_gemm_sweep.py times CUDA graphs: run it on a GPU machine")
    bad = [r for r in args.rows if not 1 <= r <= MAX_ROWS]
    if bad:
        sys.exit(f"--rows {bad}: the skinny GEMM is for 1..{MAX_ROWS} rows")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # failed plans are logged as warnings
    import triton
    report = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "triton": triton.__version__, "args": vars(args), "results": []}
    print(f"{report['device']}, torch {torch.__version__}, triton {triton.__version__}; {args.layers} weights per "
          f"shape, {args.repeats} graph replays per measurement", flush=True)
    print(f"{'GEMM':>8} {'N x K':>12} {'rows':>4} {'us':>8} {'TB/s':>6}  plan", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16
    for label, n, k, flags in SHAPES:
        if label not in args.shapes:
            continue
        count = 1 if label == "LM head" else args.layers
        weights = [(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(dtype) for _ in range(count)]
        biases = [None if label == "LM head" else torch.randn(n, device="cuda", generator=gen).to(dtype)
                  for _ in range(count)]
        for rows in args.rows:
            start = time.perf_counter()
            plan, seconds = choose_plan(rows, weights, biases, label=label,
                                        timer=lambda fn: graph_time(fn, repeats=args.repeats), **flags)
            moved = call_bytes(rows, n, k, 2, biases[0] is not None, flags.get("residual", False))
            best = min(seconds, key=seconds.get)
            for name, s in sorted(seconds.items(), key=lambda item: item[1]):
                print(f"{label:>8} {f'{n}x{k}':>12} {rows:>4} {s * 1e6:>8.1f} {moved / s / 1e12:>6.2f}  {name}"
                      + ("  <- fastest" if name == best else ""), flush=True)
            report["results"].append({"gemm": label, "n": n, "k": k, "rows": rows, "bytes": moved, "chosen": best,
                                      "chosen_plan": None if plan is None else list(plan),
                                      "us": {name: s * 1e6 for name, s in seconds.items()},
                                      "tbps": {name: moved / s / 1e12 for name, s in seconds.items()},
                                      "sweep_s": time.perf_counter() - start})
            if args.output:
                with open(args.output, "w") as f:
                    json.dump(report, f, indent=2)
        del weights, biases
        torch.cuda.empty_cache()
    chosen = {}
    for r in report["results"]:
        chosen.setdefault(r["rows"], 0.0)
        chosen[r["rows"]] += r["us"][r["chosen"]] * (1 if r["gemm"] == "LM head" else args.layers)
    for rows, us in chosen.items():
        torch_us = sum(r["us"]["torch"] * (1 if r["gemm"] == "LM head" else args.layers)
                       for r in report["results"] if r["rows"] == rows)
        print(f"rows {rows}: the step's GEMMs ({len(args.shapes)} shapes, {args.layers} layers) {us / 1e3:.3f} ms "
              f"with the fastest plans, {torch_us / 1e3:.3f} ms with torch's", flush=True)
        report.setdefault("step_gemm_ms", {})[str(rows)] = {"fastest": us / 1e3, "torch": torch_us / 1e3}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
