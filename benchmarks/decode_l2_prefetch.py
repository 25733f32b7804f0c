"""Probe: does streaming the next weight matrix into L2 on a side stream speed up a decode step's chain of GEMMs?

    python benchmarks/decode_l2_prefetch.py [--rows 1 64 --layers 24 --hidden 2048 --vocab 250880 --output FILE]

A decode step reads every weight once (3.44 GB for the document's 1.72B model in bf16), but as 97 GEMMs of 8-34 MB
and one of 1 GB, each launched after the last has finished: every GEMM ramps its loads up and drains them down, and
HBM idles in between (the H200 measured the per-layer GEMMs at ~2 TB/s of its 4.8). The weights do not depend on the
activations, so a second stream can read matrix j+1 into L2 while GEMM j runs; GEMM j+1 then finds its weights in
L2. This probe times, inside one CUDA graph per variant (replays between events, best of --replays):

- read: one kernel reading every weight (the practical HBM ceiling for the step's bytes);
- chain: the step's GEMMs (per layer QKV 3h x h, dense h x h, h->4h, 4h->h; then the LM head) with torch's GEMMs
  and with the skinny Triton plans the engine would choose (megatron/inference/skinny_gemm.py);
- chain + inline prefetch: the same, with the bulk prefetch of matrix j + distance launched before GEMM j on the
  same stream (the prefetches are asynchronous: the kernel only issues them);
- chain + prefetch: the same with a side stream that, for each matrix j, prefetches matrix j + distance once GEMM
  j - 1 has finished, by TMA bulk prefetches into L2 (`cp.async.bulk.prefetch.L2`, no registers, a hint that the
  kernel does not wait for) or by a kernel that loads the bytes through L2 (`.cg`), over --prefetch-programs
  programs (few, so that the GEMMs keep the SMs).

Every variant's outputs are compared with the plain chain's (the prefetch reads weights only, so they must be equal).
Prints ms per step, the weights' TB/s and the tokens/s the step would allow at that many rows. GPU (sm_90) only.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

CHUNK = 4096  # bytes per bulk prefetch; every matrix here is a multiple of it


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def bulk_prefetch_kernel(ptr, sink, n_chunks, CHUNK: tl.constexpr, LANES: tl.constexpr, ITERS: tl.constexpr):
        # each lane issues one bulk L2 prefetch of CHUNK bytes per iteration; lanes past the end re-prefetch the last
        pid = tl.program_id(0)
        for i in range(ITERS):
            chunk = (pid * ITERS + i) * LANES + tl.arange(0, LANES)
            chunk = tl.minimum(chunk, n_chunks - 1).to(tl.int64)
            done = tl.inline_asm_elementwise(
                "mov.u32 $0, 0; cp.async.bulk.prefetch.L2.global [$1], $2;", "=r,l,r",
                [ptr + chunk * CHUNK, tl.full([LANES], CHUNK, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
            tl.store(sink + tl.arange(0, LANES), done, mask=done != 0)  # never taken; keeps the asm

    @triton.jit
    def load_kernel(ptr, sink, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        # reads int32 words BLOCK at a time through L2 (.cg: not L1); the xor-sum is stored only if it is a value
        # the weights cannot make together with the impossible mask below, so the loads are kept
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(ITERS):
            offs = (pid * ITERS + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            acc ^= tl.load(ptr + offs, mask=offs < n, other=0, cache_modifier=".cg")
        tl.store(sink + tl.arange(0, BLOCK), acc, mask=acc == 0x7F7F7F7F)
    return triton, bulk_prefetch_kernel, load_kernel


def make_prefetch(kind, programs):
    """fn(weight) that streams the weight's bytes into L2 on the current stream with `programs` programs."""
    triton, bulk_kernel, load_kernel = _kernels()
    sinks = {}

    def prefetch(weight):
        flat = weight.view(-1)
        sink = sinks.setdefault(weight.device, torch.zeros(1024, dtype=torch.int32, device=weight.device))
        nbytes = flat.numel() * flat.element_size()
        if kind == "bulk":
            lanes = 32
            chunks = triton.cdiv(nbytes, CHUNK)
            iters = triton.cdiv(chunks, programs * lanes)
            bulk_kernel[(programs,)](flat.view(torch.uint8), sink, chunks, CHUNK=CHUNK, LANES=lanes, ITERS=iters,
                                     num_warps=1)
        else:
            words = flat.view(torch.int32)
            block = 1024
            iters = triton.cdiv(words.numel(), programs * block)
            load_kernel[(programs,)](words, sink, words.numel(), BLOCK=block, ITERS=iters, num_warps=4)
    return prefetch


def build(layers, hidden, vocab, device, dtype):
    """Per layer (QKV, dense, h->4h, 4h->h) weights and biases, then the LM head's (no bias), in step order."""
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden)]
    mats = []
    for _ in range(layers):
        for n, k in shapes:
            w = torch.randn(n, k, device=device, dtype=dtype, generator=g) * k ** -0.5
            mats.append((w, torch.randn(n, device=device, dtype=dtype, generator=g) * 0.02))
    mats.append((torch.randn(vocab, hidden, device=device, dtype=dtype, generator=g) * hidden ** -0.5, None))
    return mats


def step_fn(mats, plans, xs, prefetch=None, distance=1, wait=False, inline=False):
    """The chain: GEMM j reads xs by its K, fn() returns every output; with prefetch, a side stream streams matrix
    j + distance into L2 once GEMM j - 1 is done (wait: GEMM j also waits for its own prefetch); inline: no side
    stream, the (bulk, asynchronous) prefetch of matrix j + distance is launched on the main stream before GEMM j."""
    from megatron.inference.skinny_gemm import linear
    if inline:
        def fn():
            outs = []
            for j, (w, b) in enumerate(mats):
                if j + distance < len(mats):
                    prefetch(mats[j + distance][0])
                outs.append(linear(xs[w.shape[1]], w, b, plans.get(tuple(w.shape))))
            return outs
        return fn
    side = torch.cuda.Stream() if prefetch else None

    def fn():
        main = torch.cuda.current_stream()
        done_gemm, done_pf, outs = [], {}, []
        if prefetch:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for j in range(min(distance, len(mats))):
                    prefetch(mats[j][0])
                    done_pf[j] = torch.cuda.Event()
                    done_pf[j].record(side)
        for j, (w, b) in enumerate(mats):
            if prefetch and j + distance < len(mats):
                with torch.cuda.stream(side):
                    if j >= 1:
                        side.wait_event(done_gemm[j - 1])
                    prefetch(mats[j + distance][0])
                    done_pf[j + distance] = torch.cuda.Event()
                    done_pf[j + distance].record(side)
            if prefetch and wait:
                main.wait_event(done_pf[j])
            outs.append(linear(xs[w.shape[1]], w, b, plans.get(tuple(w.shape))))
            done_gemm.append(torch.cuda.Event())
            done_gemm[-1].record(main)
        if prefetch:
            main.wait_stream(side)
        return outs
    return fn


def graph_ms(fn, replays, repeats):
    """(best ms per replay of fn captured in a CUDA graph, skinny_gemm.graph_time's; fn's outputs as the replays
    leave them)."""
    from megatron.inference.skinny_gemm import graph_time
    held = []  # the eager call's outputs, then the capture's (the graph's own)
    seconds = graph_time(lambda: held.append(fn()), replays, repeats)
    return seconds * 1e3, held[-1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=250880)
    parser.add_argument("--prefetch-programs", type=int, nargs="+", default=[16, 132])
    parser.add_argument("--distances", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--wait", action="store_true", help="also the load prefetch that GEMM j waits for")
    parser.add_argument("--no-triton", action="store_true", help="torch's GEMMs only")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    assert torch.cuda.is_available(), "a GPU probe"
    device, dtype = torch.device("cuda"), torch.bfloat16
    props = torch.cuda.get_device_properties(device)
    mats = build(args.layers, args.hidden, args.vocab, device, dtype)
    nbytes = sum(w.numel() * w.element_size() for w, _ in mats)
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 2**20:.0f} MiB; "
          f"{len(mats)} GEMMs, {nbytes / 1e9:.3f} GB of weights", flush=True)
    results = dict(device=props.name, weights_gb=nbytes / 1e9, rows={})

    def report(label, ms, rows, bucket):
        line = dict(ms=ms, tbps=nbytes / ms / 1e9, tokens_per_s=rows / ms * 1e3)
        bucket[label] = line
        print(f"  {label:<44} {ms:7.3f} ms  {line['tbps']:5.2f} TB/s  {line['tokens_per_s']:10,.1f} tokens/s",
              flush=True)

    flat = [w for w, _ in mats]
    for kind in ("load",):
        pf = make_prefetch(kind, props.multi_processor_count * 4)
        ms, _ = graph_ms(lambda: [pf(w) for w in flat], args.replays, 2)
        report(f"read every weight ({kind}, {props.multi_processor_count * 4} programs)", ms, 1, results)
    for rows in args.rows:
        print(f"rows {rows}:", flush=True)
        bucket = results["rows"].setdefault(str(rows), {})
        xs = {k: torch.randn(rows, k, device=device, dtype=dtype) for k in (args.hidden, 4 * args.hidden)}
        plan_sets = {"torch": {}}
        if not args.no_triton:
            from megatron.inference.skinny_gemm import choose_plan
            chosen = {}
            for shape in dict.fromkeys(tuple(w.shape) for w, _ in mats):
                same = [(w, b) for w, b in mats if tuple(w.shape) == shape]
                chosen[shape], _ = choose_plan(rows, [w for w, _ in same], [b for _, b in same])
            plan_sets["chosen"] = chosen
            print("  plans: " + ", ".join(f"{n}x{k} {p}" for (n, k), p in chosen.items()), flush=True)
        reference = {}
        for name, plans in plan_sets.items():
            ms, outs = graph_ms(step_fn(mats, plans, xs), args.replays, args.repeats)
            reference[name] = [o.clone() for o in outs]
            del outs
            report(f"{name} chain", ms, rows, bucket)
            for kind in ("inline", "bulk", "load"):
                for programs in args.prefetch_programs:
                    for distance in args.distances:
                        for wait in ((False, True) if kind == "load" and args.wait else (False,)):
                            label = f"{name} + {kind} prefetch p{programs} d{distance}" + (" wait" if wait else "")
                            try:
                                fn = step_fn(mats, plans, xs, make_prefetch("bulk" if kind == "inline" else kind,
                                                                            programs), distance, wait, kind == "inline")
                                ms, outs = graph_ms(fn, args.replays, args.repeats)
                                same = all(torch.equal(o, r) for o, r in zip(outs, reference[name]))
                                del outs
                            except Exception as err:  # noqa: BLE001  a probe: report and go on
                                print(f"  {label}: failed ({type(err).__name__}: {str(err).splitlines()[0][:200]})")
                                continue
                            report(label + ("" if same else " OUTPUTS DIFFER"), ms, rows, bucket)
        if args.output:
            with open(args.output, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
