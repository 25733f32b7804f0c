"""Probe: do programmatic dependent launches (PDL) close the gaps between a batch-1 decode step's GEMVs?

    python benchmarks/decode_pdl_probe.py [--layers 24 --hidden 2048 --vocab 250880 --output FILE]

At batch 1 the step is a chain of 97 GEMVs (per layer QKV, dense, h->4h, 4h->h, then the LM head), each reading
8-34 MB of weights that do not depend on the step, each started only once the last has finished: on the H100 the
chain of torch's GEMMs ran at 2.26 TB/s (1.52 ms) and on the H200 at 2.36 TB/s (1.46 ms) although the H200 has
43% more bandwidth, so the time is latency (launch, ramp-up, tail), not bandwidth. A side stream streaming the
next weights into L2 made it slower (benchmarks/decode_l2_prefetch.py). With PDL (Hopper), kernel j+1 is launched
while kernel j runs, can read what does not depend on kernel j (its weights) and waits (griddepcontrol.wait) only
before it reads kernel j's output. This probe times one Triton GEMV, y = x W^T + b with each program owning
BLOCK_N rows of W (a BLOCK_N x BLOCK_K tile per iteration, summed over its columns at once; the first version's
fp32 BLOCK_N x 512 accumulator ran 4.4x slower than cuBLAS on an H100), as a true chain (each GEMV's input is the
first K outputs of the one before), in one CUDA graph:

- mode plain: no PDL;
- mode pdl: launched with PDL, waits at its start (only the launch latency is hidden);
- mode pdl+l2: before the wait, each program issues TMA bulk prefetches of its own rows into L2;
- mode pdl+tile: before the wait, each program loads its first BLOCK_K columns of W into registers.

Every mode's last output must equal mode plain's bit for bit (same arithmetic; a missing wait would race), and
plain must match torch's chain within bf16 rounding. Prints ms per chain, TB/s of the weights and tokens/s at
batch 1, beside torch's chain (F.linear) over the same weights. GPU (sm_90) only.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MODES = {"plain": 0, "pdl": 1, "pdl+l2": 2, "pdl+tile": 3}


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, sink, N, K: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, MODE: tl.constexpr, K_START: tl.constexpr):
        # x_ptr: a row whose first K values are the input (the previous GEMV's whole output row)
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        cols = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + tl.minimum(rows, N - 1)[:, None].to(tl.int64) * K + cols[None, :]  # (BLOCK_N, BLOCK_K)
        if MODE == 2:  # this program's rows (contiguous, K * 2 bytes each) into L2, not waited for
            row_starts = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * K
            done = tl.inline_asm_elementwise(
                "mov.u32 $0, 0; cp.async.bulk.prefetch.L2.global [$1], $2;", "=r,l,r",
                [row_starts, tl.full([BLOCK_N], K * 2, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
            tl.store(sink + tl.arange(0, BLOCK_N), done, mask=done != 0)  # never taken; keeps the asm
        if MODE == 3:
            w_first = tl.load(w_ptrs)
        if MODE >= 1:
            tl.extra.cuda.gdc_wait()  # the previous kernel (this one's x) has finished and flushed
            tl.extra.cuda.gdc_launch_dependents()  # now the next may launch: at most one kernel waits ahead
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)  # each tile summed over its columns at once: few registers
        if MODE == 3:  # K_START is BLOCK_K: the first columns are in registers already
            acc += tl.sum(w_first.to(tl.float32) * tl.load(x_ptr + cols).to(tl.float32)[None, :], axis=1)
        for k0 in range(K_START, K, BLOCK_K):
            w = tl.load(w_ptrs + k0)
            x = tl.load(x_ptr + k0 + cols)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        y = acc + tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)
    return gemv_kernel


def block_n_for(n, sms, programs_per_sm=4):
    """Rows per program: the largest power of two (<= 32) that still gives >= programs_per_sm programs per SM."""
    block = 32
    while block > 1 and n // block < programs_per_sm * sms:
        block //= 2
    return block


def build(layers, hidden, vocab, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden)] * layers
    shapes.append((vocab, hidden))
    return [(torch.randn(n, k, device=device, dtype=dtype, generator=g) * k ** -0.5,
             torch.randn(n, device=device, dtype=dtype, generator=g) * 0.02) for n, k in shapes]


def chain(mats, x0, gemv):
    """fn() running the chain: GEMV j's input is the first K values of GEMV j-1's output row (gemv(x, w, b) gets
    that whole row: every output here is at least as wide as the next K); returns the last output."""
    def fn():
        x = x0
        for w, b in mats:
            x = gemv(x, w, b)
        return x
    return fn


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=250880)
    parser.add_argument("--block-k", type=int, default=256)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    assert torch.cuda.is_available(), "a GPU probe"
    import triton
    from benchmarks.decode_l2_prefetch import graph_ms
    device, dtype = torch.device("cuda"), torch.bfloat16
    props = torch.cuda.get_device_properties(device)
    sms = props.multi_processor_count
    mats = build(args.layers, args.hidden, args.vocab, device, dtype)
    nbytes = sum(w.numel() * w.element_size() for w, _ in mats)
    print(f"{props.name}: {sms} SMs; triton {triton.__version__}; {len(mats)} GEMVs, {nbytes / 1e9:.3f} GB",
          flush=True)
    kernel = _kernel()
    sink = torch.zeros(64, dtype=torch.int32, device=device)
    x0 = torch.randn(1, args.hidden, device=device, dtype=dtype)
    results = dict(device=props.name, weights_gb=nbytes / 1e9, chains={})

    def report(label, ms, note=""):
        results["chains"][label] = dict(ms=ms, tbps=nbytes / ms / 1e9, tokens_per_s=1e3 / ms, note=note)
        print(f"  {label:<12} {ms:7.3f} ms  {nbytes / ms / 1e9:5.2f} TB/s  {1e3 / ms:8.1f} tokens/s {note}",
              flush=True)

    def torch_gemv(x, w, b):
        return F.linear(x[:, :w.shape[1]], w, b)
    ms, want = graph_ms(chain(mats, x0, torch_gemv), args.replays, args.repeats)
    want = want.float().clone()
    report("torch", ms)
    plain = None
    for name, mode in MODES.items():
        def triton_gemv(x, w, b, mode=mode):
            n, k = w.shape
            y = torch.empty(1, n, device=device, dtype=dtype)
            block_n = block_n_for(n, sms)
            extra = dict(launch_pdl=True) if mode else {}
            kernel[(triton.cdiv(n, block_n),)](x, w, b, y, sink, n, K=k, BLOCK_N=block_n, BLOCK_K=args.block_k,
                                               MODE=mode, K_START=args.block_k if mode == 3 else 0,
                                               num_warps=args.warps, **extra)
            return y
        try:
            ms, out = graph_ms(chain(mats, x0, triton_gemv), args.replays, args.repeats)
        except Exception as err:  # noqa: BLE001  a probe: say why and go on
            print(f"  {name:<12} failed ({type(err).__name__}: {str(err).splitlines()[0][:240]})", flush=True)
            continue
        out = out.float().clone()
        if plain is None:
            error = float((out - want).abs().max() / want.abs().max())
            report(name, ms, f"(last output vs torch's: max error {error:.2e} of its largest value)")
            plain = out
        else:
            report(name, ms, "(last output equals plain's)" if torch.equal(out, plain) else "OUTPUT DIFFERS")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
