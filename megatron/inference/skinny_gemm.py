"""GEMMs of a decode step (M <= 64 rows): a Triton split-K kernel with the bias, GeLU and residual in its epilogue,
chosen per weight shape and batch bucket against torch's matmul by timing both on the device.

    y = [residual +] [gelu_tanh](LN(x) W^T [+ b])      x (M, K), W (N, K) as nn.Linear stores it, y (M, N)

where LN (optional) is the LayerNorm that precedes the GEMM (the block's input and post-attention LayerNorms
before the QKV and h->4h GEMMs), computed in the kernel's prologue instead of by a separate launch.

A decode step's GEMMs read every weight once for a handful of rows: they are bound by memory bandwidth, and at
the 1.72B model's shapes (N x K = 6144x2048, 2048x2048, 8192x2048, 2048x8192, the LM head 250880x2048) cuBLAS's
GEMV-like choices leave part of it unused (few programs for 8-33 MB of weights). The kernel splits K so that a
launch has about two programs per SM, each streaming a BLOCK_N x K/SPLIT_K slice of W.

A plan is (block_n, block_k, split_k, last_reduces, gemv, warps), or None for torch (F.linear, then the epilogue
in torch ops). gemv (at most GEMV_ROWS rows): the kernel's CUDA-core products over a wide W tile instead of a
tensor-core dot whose rows are padded to 16 (triton_gemm.py). choose_plan
times each candidate and torch inside a CUDA graph over the real layers' weights of that shape (so neither the
host's launch cost nor the L2 cache flatters a side) and keeps the faster. The kernel is the custom op
torch.ops.megatron.skinny_linear, so torch.compile'd segments call it as one opaque op (inductor still fuses the
LayerNorms the kernel does not run).
"""
import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MAX_ROWS = 64  # the kernel is for decode batches; above it torch's GEMMs are the right choice
GEMV_ROWS = 8  # the CUDA-core products hold BLOCK_M x BLOCK_N x BLOCK_K values in registers: a few rows only
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def triton_gemm_available(device):
    """True where the Triton kernel can run: CUDA with triton, or any device under TRITON_INTERPRET=1 (tests)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.device(device).type == "cuda" or _INTERPRETED


def block_m(rows, gemv=False):
    """The kernel's tile over rows: a dot's 16, 32 or 64; the GEMV products' power of two >= rows (1..8)."""
    if gemv:
        assert rows <= GEMV_ROWS, f"the GEMV products take at most {GEMV_ROWS} rows, got {rows}"
        return 1 << (rows - 1).bit_length()
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


_LOCKS = {}  # device -> int32 arrival counters of split tiles (all 0 between launches; launches on one stream)
_MAX_TILES = 1 << 16


def arrival_counters(device, count):
    """The kernels' shared arrival counters (this GEMM's split-K tiles, the decode attention's splits): each
    launch leaves them at 0, so kernels that run one after the other on a stream can share them."""
    assert count <= _MAX_TILES, f"{count} split tiles exceed the {_MAX_TILES} arrival counters"
    if device not in _LOCKS:  # allocated at a first (warm-up) call, outside any graph capture
        _LOCKS[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return _LOCKS[device]


def skinny_linear_triton(x, weight, bias=None, residual=None, gelu=False, block_n=64, block_k=128, split_k=1,
                         last_reduces=False, gemv=False, warps=4, ln_weight=None, ln_bias=None, eps=1e-5, pdl=False):
    """The kernel: x (M, K) contiguous rows, weight (N, K), bias (N,), residual (M, N) -> (M, N) in x's dtype.
    last_reduces (split_k > 1): the last split of each tile sums the splits (one launch), else a second kernel.
    gemv (M <= GEMV_ROWS): CUDA-core products instead of a dot; warps: the programs' num_warps.
    ln_weight, ln_bias (K,), eps: x goes through that LayerNorm first (in the kernel).
    pdl (Hopper, pdl_available): a programmatic dependent launch (triton_gemm.py)."""
    from megatron.inference.triton_gemm import skinny_gemm_kernel, splitk_epilogue_kernel
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1, (x.shape, weight.shape)
    assert residual is None or (residual.shape == (m, n) and residual.stride(1) == 1), residual.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else y
    b = bias if bias is not None else y  # a pointer the kernel never reads
    assert (ln_weight is None) == (ln_bias is None), "a LayerNorm needs its weight and bias"
    g, beta = (ln_weight, ln_bias) if ln_weight is not None else (y, y)
    r = residual if residual is not None else y
    last_reduces = bool(last_reduces) and split_k > 1
    flags = dict(HAS_BIAS=bias is not None, GELU=bool(gelu), RESIDUAL=residual is not None)
    meta = kernel_meta(m, n, k, x.dtype, block_n, block_k, split_k, last_reduces, gemv, warps,
                       ln=ln_weight is not None, pdl=pdl, **flags)
    grid = (triton_cdiv(n, block_n), split_k, triton_cdiv(m, meta["BLOCK_M"]))
    locks = arrival_counters(x.device, grid[0] * grid[2]) if last_reduces else y
    launch = {"launch_pdl": True} if pdl else {}  # the keyword only where it is asked for (the interpreter has none)
    skinny_gemm_kernel[grid](x, weight, b, r, y, part, locks, g, beta, float(eps), m, n, k, x.stride(0),
                             weight.stride(0), r.stride(0), y.stride(0), **meta, **launch)
    if split_k > 1 and not last_reduces:
        splitk_epilogue_kernel[(triton_cdiv(n, 64), triton_cdiv(m, 16))](part, b, r, y, m, n, r.stride(0), y.stride(0),
                                                                         SPLIT_K=split_k, BLOCK_M=16, BLOCK_N=64,
                                                                         **flags)
    return y


def kernel_meta(m, n, k, dtype, block_n, block_k, split_k, last_reduces, gemv, warps, ln, HAS_BIAS, GELU, RESIDUAL,
                interpreted=_INTERPRETED, pdl=False):
    """skinny_gemm_kernel's compile-time arguments (constexprs, num_stages, num_warps) for an (m, k) x (n, k)^T call
    in `dtype`: what a launch compiles (tests compile them for the GPU ahead of time, without one)."""
    bm = block_m(m, gemv)
    # software-pipelined stages of the x and W tiles, within ~160 KB of shared memory (fp32 tiles are twice as big)
    stage_bytes = (bm + block_n) * block_k * (4 if dtype == torch.float32 or interpreted else dtype.itemsize)
    return dict(HAS_BIAS=HAS_BIAS, GELU=GELU, RESIDUAL=RESIDUAL, LN=ln, IEEE=dtype == torch.float32 or interpreted,
                EVEN=n % block_n == 0 and k % (split_k * block_k) == 0, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k,
                SPLIT_K=split_k, LAST_REDUCES=last_reduces, GEMV=bool(gemv), PDL=bool(pdl),
                num_stages=max(1, min(3, (160 << 10) // stage_bytes)), num_warps=warps)


def triton_cdiv(a, b):
    return -(-a // b)


@torch.library.custom_op("megatron::skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     residual: Optional[torch.Tensor], gelu: bool, block_n: int, block_k: int,
                     split_k: int, last_reduces: bool, gemv: bool, warps: int, ln_weight: Optional[torch.Tensor],
                     ln_bias: Optional[torch.Tensor], eps: float, pdl: bool = False) -> torch.Tensor:
    return skinny_linear_triton(x.contiguous(), weight, bias, None if residual is None else residual.contiguous(),
                                gelu, block_n, block_k, split_k, last_reduces, gemv, warps, ln_weight, ln_bias, eps,
                                pdl)


@skinny_linear_op.register_fake
def _skinny_linear_fake(x, weight, bias, residual, gelu, block_n, block_k, split_k, last_reduces, gemv, warps,
                        ln_weight, ln_bias, eps, pdl=False):
    return x.new_empty(x.shape[0], weight.shape[0])


def layer_norm(x, weight, bias, eps):
    if weight.dtype != x.dtype:  # MixedFusedLayerNorm: fp32 parameters and statistics, output in x's dtype
        return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def linear(x, weight, bias=None, plan=None, gelu=False, residual=None, ln=None):
    """[residual +] [gelu_tanh](LN(x) W^T + b) with the Triton kernel (plan) or torch (plan None); ln: None or the
    LayerNorm's (weight, bias, eps)."""
    if plan is not None:  # a plan: its 6 fields, and a 7th (pdl) if choose_plan chose the PDL launch
        return torch.ops.megatron.skinny_linear(x, weight, bias, residual, gelu, *plan[:6], *(ln or (None, None, 0.0)),
                                                len(plan) > 6 and plan[6])
    if ln is not None:
        x = layer_norm(x, *ln)
    y = F.linear(x, weight, bias)
    if gelu:
        y = F.gelu(y, approximate="tanh")
    return y if residual is None else residual + y


def _split(n, k, block_n, block_k, programs, min_blocks):
    """Split-K doubled until a launch has `programs` programs, while each split keeps >= min_blocks blocks of K."""
    tiles, split = triton_cdiv(n, block_n), 1
    while tiles * split < programs and k // (2 * split) >= min_blocks * block_k:
        split *= 2
    return split


def candidates(rows, n, k, sms):
    """Plans (block_n, block_k, split_k, last_reduces, gemv, warps) to time for an (rows, K) x (N, K)^T GEMM.

    Any rows: two dot tile shapes (rows of W read 256 and 512 bytes at a time in bf16), each split until a launch
    has about two programs per SM (at least two blocks of K a split), the splits summed in the kernel; the first
    also with the sums in a second kernel. At most GEMV_ROWS rows: the CUDA-core products with 4 and 8 warps, a
    tile of ~64 fp32 products per thread (BLOCK_K 512, or 256 from 4 rows), split to about four programs per SM
    (one block of K a split at least: short, many loads in flight). More rows: 8-warp dot tiles split to about
    one program per SM (the fp32 partials of 64 rows are a large share of the traffic)."""
    out = []
    for block_n, block_k in ((64, 128), (32, 256)):
        split = _split(n, k, block_n, block_k, 2 * sms, 2)
        out.append((block_n, block_k, split, split > 1, False, 4))
    if out[0][2] > 1:
        out.append(out[0][:3] + (False, False, 4))
    if rows <= GEMV_ROWS:
        rows_tile = block_m(rows, gemv=True)
        block_k = 512 if rows_tile <= 2 else 256
        for warps in (4, 8):
            block_n = 32 * 64 * warps // (rows_tile * block_k)
            split = _split(n, k, block_n, block_k, 4 * sms, 1)
            out.append((block_n, block_k, split, split > 1, True, warps))
    else:
        for block_n, block_k in ((128, 64), (64, 128)):
            split = _split(n, k, block_n, block_k, sms, 2)
            out.append((block_n, block_k, split, split > 1, False, 8))
    return list(dict.fromkeys(out))


def plan_name(plan):
    if plan is None:
        return "torch"
    block_n, block_k, split, last_reduces, gemv, warps = plan[:6]
    return (f"triton {'gemv' if gemv else 'dot'} {block_n}x{block_k} split {split}"
            + (" in-kernel sum" if last_reduces else "") + ("" if warps == 4 else f" {warps} warps")
            + (" pdl" if len(plan) > 6 and plan[6] else ""))


def pdl_available(device):
    """Whether the kernel can be a programmatic dependent launch there: a Hopper or newer GPU, not interpreted."""
    device = torch.device(device)
    return device.type == "cuda" and not _INTERPRETED and torch.cuda.get_device_capability(device)[0] >= 9


def graph_time(fn, replays=3, repeats=1):
    """Seconds of one fn() call sequence, captured once in a CUDA graph and replayed `repeats` times back to back
    between two events (best of `replays` such measurements, divided by `repeats`)."""
    fn()  # compiles the kernels, warms cuBLAS
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    best = float("inf")
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / repeats)
    del graph
    return best


def choose_plan(rows, weights, biases, gelu=False, residual=False, label="", sms=None, timer=None, norms=None,
                pdl=None):
    """The fastest of torch and the candidate plans for `rows` rows over `weights` (a list of same-shape (N, K)
    tensors, e.g. every layer's), timed in a CUDA graph (timer(fn) -> seconds of fn(), for tests); a plan that
    fails or disagrees with torch is dropped; norms: each layer's LayerNorm (weight, bias, eps) before the GEMM
    (torch: a LayerNorm then the GEMM). pdl (default: pdl_available): the fastest candidate is also timed as a
    programmatic dependent launch, the plan's 7th field (the chain of calls then overlaps each launch with the
    previous kernel's tail, as the step's chain of GEMMs would). Returns (plan or None, {name: seconds per call})."""
    n, k = weights[0].shape
    device, dtype = weights[0].device, weights[0].dtype
    x = torch.randn(rows, k, device=device, dtype=dtype)
    r = torch.randn(rows, n, device=device, dtype=dtype) if residual else None

    norms = norms or [None] * len(weights)

    def run(plan):
        def fn():
            for w, b, ln in zip(weights, biases, norms):
                linear(x, w, b, plan, gelu, r, ln)
        return fn
    sms = sms or torch.cuda.get_device_properties(device).multi_processor_count
    timer = timer or graph_time
    want = linear(x, weights[0], biases[0], None, gelu, r, norms[0]).float()
    tol = (1e-3 if dtype == torch.float32 else 3e-2) * (1.0 + float(want.abs().max()))
    times = {}

    def attempt(plan):
        name = plan_name(plan)
        try:
            if plan is not None:  # a plan must agree with torch before it is timed
                error = float((linear(x, weights[0], biases[0], plan, gelu, r, norms[0]).float() - want).abs().max())
                if not error <= tol:
                    raise RuntimeError(f"max error {error:.3g} against torch (tolerance {tol:.3g})")
            seconds = timer(run(plan)) / len(weights)
        except Exception as err:  # noqa: BLE001  a candidate that fails to compile, agree or capture is not chosen
            logger.warning(f"inference: GEMM {label} {name} failed ({type(err).__name__}: "
                           f"{str(err).splitlines()[0][:160] if str(err) else ''}); not a candidate")
            return
        times[name] = seconds if plan is None else (seconds, plan)
    for plan in [None] + candidates(rows, n, k, sms):
        attempt(plan)
    kernels = [value for key, value in times.items() if key != "torch"]
    if kernels and (pdl_available(device) if pdl is None else pdl):
        attempt(min(kernels)[1] + (True,))
    best_name = min(times, key=lambda key: times[key] if key == "torch" else times[key][0])
    plan = None if best_name == "torch" else times[best_name][1]
    seconds = {key: (value if key == "torch" else value[0]) for key, value in times.items()}
    logger.info(f"inference: GEMM {label} rows {rows} N x K {n}x{k}: {best_name} ("
                + ", ".join(f"{key} {value * 1e6:.1f} us" for key, value in seconds.items()) + ")")
    return plan, seconds
