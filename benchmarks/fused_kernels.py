"""Benchmark: forward and forward+backward time of the fused kernels vs their torch references at BLOOM 1.7B shapes.

Shapes: attention scores (4, 16, 2048, 2048) bf16 (causal, and with an explicit (4, 1, 2048, 2048) mask);
LayerNorm input (4 * 2048, 2048) bf16, plus (4096, 14336) (BLOOM-176B hidden size); cross entropy of (4 * 2048,
250880) bf16 logits (the LM loss of one micro batch). References: the eager fp32-math torch fallbacks, F.layer_norm in bf16, and the references under torch.compile (skip with
--no-compile). Times are medians of CUDA-event timings of CUDA-graph replays (GPU time), plus the
fwd+bwd time with ordinary eager launches (what a step sees when the CPU cannot run ahead).

Run on a CUDA machine from the repo root: PYTHONPATH=$PWD python benchmarks/fused_kernels.py
"""
import argparse
import logging
import statistics
import sys

import torch

from megatron.fused_kernels import (
    MixedFusedLayerNorm,
    alibi_causal_softmax,
    alibi_causal_softmax_reference,
    alibi_masked_softmax,
    alibi_masked_softmax_reference,
    cross_entropy_reference,
    fused_cross_entropy,
    load_fused_kernels,
    mixed_layer_norm_reference,
)


def cuda_time_ms(fn, warmup=5, iters=30):
    """Median milliseconds of fn() over iters runs, each timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_time_ms(fn, iters=30):
    """Median milliseconds of one replay of fn captured in a CUDA graph: GPU time without launch overhead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = cuda_time_ms(graph.replay, warmup=3, iters=iters)
    del graph
    return ms


def time_fwd_bwd(forward, x, grad_out):
    """{'fwd', 'fb'}: CUDA-graph GPU ms of forward(x) and of forward+backward; 'fb_launch': fwd+bwd ms with
    eager launches (CPU launch overhead included). Graph timing falls back to eager timing if capture fails."""
    def fwd():
        with torch.no_grad():
            forward(x)

    def fwd_bwd():
        x.grad = None
        forward(x).backward(grad_out)

    out = {"fb_launch": cuda_time_ms(fwd_bwd)}
    try:
        out["fwd"], out["fb"] = graph_time_ms(fwd), graph_time_ms(fwd_bwd)
    except RuntimeError as exc:  # capture not supported by this callable
        logging.warning("CUDA graph capture failed (%s); timing with eager launches", str(exc).splitlines()[0])
        out["fwd"], out["fb"] = cuda_time_ms(fwd), out["fb_launch"]
    return out


def row(name, impl, t, nbytes, base):
    speedup = f"{base['fb'] / t['fb']:6.2f}x"
    gbs = nbytes / (t["fb"] * 1e-3) / 1e9
    print(f"| {name:<26} | {impl:<18} | {t['fwd']:8.3f} | {t['fb']:8.3f} | {t['fb_launch']:9.3f} | {gbs:6.0f} "
          f"| {speedup} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd references")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fused_kernels.py needs a CUDA device")
    load_fused_kernels(abort_on_unmet_constraints=True)
    torch.manual_seed(0)
    dtype = torch.bfloat16
    B, nh, s, h = 4, 16, 2048, 2048
    slopes = torch.tensor([2.0 ** (-8.0 * (k + 1) / nh) for k in range(nh)], device="cuda")
    scale = 1.0 / (h // nh) ** 0.5

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, dtype {dtype}")
    print("fwd, fwd+bwd: GPU time of one CUDA-graph replay (median); launched: fwd+bwd with eager launches (CPU "
          "overhead included). GB/s: nominal bytes / graph fwd+bwd (softmax: read x, write p, read g and p, write "
          "dx, although causal rows read only their unmasked half; LN: read x, write y, read g and x, write dx; cross "
          "entropy: read z, read z, write dz). "
          "speedup: torch eager reference graph fwd+bwd / this graph fwd+bwd.")
    print("| op                         | impl               | fwd ms   | fwd+bwd  | launched  | GB/s   | speedup |")
    print("|----------------------------|--------------------|----------|----------|-----------|--------|---------|")

    scores = torch.randn(B, nh, s, s, device="cuda", dtype=dtype).mul_(10).requires_grad_()
    grad_probs = torch.randn_like(scores)
    mask = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1).expand(B, 1, s, s).contiguous()
    softmax_bytes = scores.numel() * scores.element_size() * 5
    shape = "x".join(map(str, scores.shape))
    cases = [
        (f"alibi_causal_softmax {shape}",
         lambda x: alibi_causal_softmax(x, slopes, scale),
         lambda x: alibi_causal_softmax_reference(x, slopes, scale), scores, grad_probs, softmax_bytes),
        (f"alibi_masked_softmax {shape}",
         lambda x: alibi_masked_softmax(x, mask, slopes, scale),
         lambda x: alibi_masked_softmax_reference(x, mask, slopes, scale), scores, grad_probs, softmax_bytes),
    ]
    for rows, hidden in ((B * s, h), (4096, 14336)):
        x = torch.randn(rows, hidden, device="cuda", dtype=dtype).requires_grad_()
        ln = MixedFusedLayerNorm(hidden).cuda()
        reference = (lambda ln: lambda t: mixed_layer_norm_reference(t, ln.normalized_shape, ln.weight, ln.bias))(ln)
        cases.append((f"mixed_layer_norm {rows}x{hidden}", ln, reference, x, torch.randn_like(x),
                      x.numel() * x.element_size() * 5))

    vocab = 250880
    logits = torch.randn(B * s, vocab, device="cuda", dtype=dtype).mul_(3).requires_grad_()
    target = torch.randint(0, vocab, (B * s,), device="cuda")
    cases.append((f"cross_entropy {B * s}x{vocab}", lambda z: fused_cross_entropy(z, target),
                  lambda z: cross_entropy_reference(z, target), logits, torch.rand(B * s, device="cuda"),
                  logits.numel() * logits.element_size() * 3))

    baselines = {}
    for name, fused, reference, inp, grad, nbytes in cases:
        base = baselines[name] = time_fwd_bwd(reference, inp, grad)
        row(name, "torch eager (fp32)", base, nbytes, base)
        if name.startswith("mixed_layer_norm"):
            w16, b16 = fused.weight.detach().to(dtype), fused.bias.detach().to(dtype)
            native = (lambda w, b: lambda t: torch.nn.functional.layer_norm(t, (t.shape[-1],), w, b))(w16, b16)
            row(name, "F.layer_norm bf16", time_fwd_bwd(native, inp, grad), nbytes, base)
        row(name, "fused kernel", time_fwd_bwd(fused, inp, grad), nbytes, base)

    if args.no_compile:
        return
    for name, _, reference, inp, grad, nbytes in cases:
        row(name, "torch.compile ref", time_fwd_bwd(torch.compile(reference), inp, grad), nbytes, baselines[name])


if __name__ == "__main__":
    main()
