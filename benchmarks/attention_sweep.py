"""FlexAttention block sizes for training's causal ALiBi attention: forward and backward timed per kernel_options
set, against torch's defaults and against SDPA's causal kernel without ALiBi (the floor an exact ALiBi kernel
would approach).

    python3 benchmarks/attention_sweep.py --output attention_sweep.json     # one GPU, ~3 minutes

Shapes default to the document's model at micro batch 4 (B 4, 16 heads, S 2048, head dim 128, bf16). Each set is
compiled once (torch.compile of flex_attention, as megatron/model/attention.py does), checked against the default
set's output and gradients (max |diff| printed: block sizes change only the order of fp32 sums), then timed with
CUDA events: forward alone under no_grad, and forward + backward; backward = the difference. The fastest forward
set and the fastest backward set are combined and timed last, as the candidate for FLEX_KERNEL_OPTIONS.
"""
import argparse
import json
import time

import torch

SAFE = {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True}
FORWARD = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3),
]
BACKWARD = [  # (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)
    (64, 64, 64, 64, 4, 3), (64, 128, 128, 64, 8, 3), (32, 128, 128, 32, 4, 3), (64, 128, 128, 64, 4, 3),
    (32, 64, 64, 32, 4, 3), (64, 128, 128, 64, 8, 2),
]


def forward_options(config):
    m, n, warps, stages = config
    return {"fwd_BLOCK_M": m, "fwd_BLOCK_N": n, "fwd_num_warps": warps, "fwd_num_stages": stages}


def backward_options(config):
    m1, n1, m2, n2, warps, stages = config
    return {"bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2,
            "bwd_num_warps": warps, "bwd_num_stages": stages}


def elapsed_ms(fn, iters):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def forward_and_backward_ms(run, grad, inputs, iters):
    """(forward ms under no_grad, forward + backward ms) of run(), the inputs' gradients cleared after."""
    with torch.no_grad():
        forward = elapsed_ms(run, iters)
    both = elapsed_ms(lambda: run().backward(grad), iters)
    for t in inputs:
        t.grad = None
    return forward, both


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = 64  # one compilation per options set (each is a guard miss)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64

    torch.manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    slopes = torch.tensor([2 ** (-8 * (h + 1) / args.heads) for h in range(args.heads)], device="cuda")
    scale = args.head_dim ** -0.5

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * kv_idx

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx
    mask = create_block_mask(causal, B=None, H=None, Q_LEN=args.seq, KV_LEN=args.seq, device="cuda")
    results, reference = [], None

    def measure(name, options, compiled=None):
        compiled = compiled or torch.compile(flex_attention, dynamic=False)
        started = time.perf_counter()

        def run():
            return compiled(q, k, v, score_mod=alibi, block_mask=mask, scale=scale, kernel_options=options)
        try:
            out = run()
            out.backward(grad)
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001  a set the template rejects (shared memory, shape): reported
            print(f"{name:34s} failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}", flush=True)
            results.append({"name": name, "options": options, "error": f"{type(err).__name__}: {err}"[:400]})
            return None
        compile_s = time.perf_counter() - started
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        fwd, both_ms = forward_and_backward_ms(run, grad, (q, k, v), args.iters)
        row = {"name": name, "options": options, "forward_ms": fwd, "backward_ms": both_ms - fwd,
               "total_ms": both_ms, "compile_s": compile_s}
        nonlocal reference
        if reference is None:
            reference = (out.detach(), grads)
        else:
            row["max_abs_diff_out"] = (out.detach().float() - reference[0].float()).abs().max().item()
            row["max_abs_diff_grad"] = max((a.float() - b.float()).abs().max().item()
                                           for a, b in zip(grads, reference[1]))
        results.append(row)
        diff = (f"  diff out {row['max_abs_diff_out']:.2e} grad {row['max_abs_diff_grad']:.2e}"
                if "max_abs_diff_out" in row else "")
        print(f"{name:34s} fwd {fwd:6.3f}  bwd {both_ms - fwd:6.3f}  total {both_ms:6.3f} ms"
              f"  (compile {compile_s:4.1f} s){diff}", flush=True)
        return row

    def sdpa_floor():
        def run():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        fwd, both_ms = forward_and_backward_ms(run, grad, (q, k, v), args.iters)
        results.append({"name": "sdpa causal, no ALiBi (floor)", "forward_ms": fwd, "backward_ms": both_ms - fwd,
                        "total_ms": both_ms})
        print(f"{'sdpa causal, no ALiBi (floor)':34s} fwd {fwd:6.3f}  bwd {both_ms - fwd:6.3f}  total {both_ms:6.3f} ms")

    print(f"B {args.batch} heads {args.heads} S {args.seq} d {args.head_dim} bf16, causal ALiBi, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    measure("default", None)
    measure("default + safe", dict(SAFE))
    sdpa_floor()
    fwd_rows = [measure(f"fwd {c}", {**SAFE, **forward_options(c)}) for c in FORWARD]
    bwd_rows = [measure(f"bwd {c}", {**SAFE, **backward_options(c)}) for c in BACKWARD]
    best_fwd = min((r for r in fwd_rows if r), key=lambda r: r["forward_ms"], default=None)
    best_bwd = min((r for r in bwd_rows if r), key=lambda r: r["backward_ms"], default=None)
    if best_fwd and best_bwd:
        options = {**best_fwd["options"], **{k: v for k, v in best_bwd["options"].items() if k.startswith("bwd_")}}
        measure("best fwd + best bwd", options)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"shape": shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
