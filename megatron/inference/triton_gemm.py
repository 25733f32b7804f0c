"""The Triton kernels of megatron/inference/skinny_gemm.py (imported only where triton is used).

skinny_gemm_kernel: y = epilogue(x W^T) for a few rows x (M, K) and a weight W (N, K) in its nn.Linear layout,
one program per (BLOCK_N output columns, split of K, BLOCK_M rows): the program streams its BLOCK_N x K/SPLIT_K
slice of W once and accumulates in fp32. With SPLIT_K == 1 it applies the epilogue itself:
    y = [residual +] [gelu_tanh](acc + bias)        (one rounding to y's dtype, at the end)
with SPLIT_K > 1 it stores its fp32 partial sum, and either splitk_epilogue_kernel sums the splits and applies
it (a second launch) or, with LAST_REDUCES, the tile's last split to finish does (an arrival counter per tile,
taken with an acquire-release atomic after a block barrier, and reset to 0 by that program, so the counters are
all 0 between launches); either way the splits are summed in order 0..SPLIT_K-1, so the result does not depend
on which program finishes last.
IEEE: fp32 products (fp32 inputs; bf16/fp16 ones under Triton's interpreter, whose dot does not take 16-bit
floats: their products are exact in fp32 either way, so only the order of the fp32 sums differs from the GPU's).
LN: x is first normalised by a LayerNorm (weight g, bias beta, eps) over its K columns, the statistics in fp32,
the result rounded to x's dtype: the GEMM reads the LayerNorm's input instead of a separate kernel's output.
GEMV (at most 8 rows): the products on the CUDA cores, x (BLOCK_M, BLOCK_K) times W (BLOCK_N, BLOCK_K) broadcast
and summed over K in fp32, so BLOCK_M is the rows' power of two (1..8) instead of a dot's 16, and a program's
registers go to a wide W tile (BLOCK_N x BLOCK_K of 8-16 KB: 16-byte loads, several tiles in flight per SM).
PDL (Hopper): the kernel is launched as a programmatic dependent launch (launch_pdl) and waits for the kernel
before it (griddepcontrol.wait) before reading anything, then lets the next one launch: the launch latency between
dependent GEMMs overlaps the previous kernel's tail.
"""
import triton
import triton.language as tl


@triton.jit
def _epilogue(acc, n, n_mask, m, mask, b_ptr, r_ptr, stride_rm, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
              RESIDUAL: tl.constexpr):
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GELU:  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(u) = 1 - 2 / (exp(2u) + 1)
        u = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = 0.5 * acc * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
    if RESIDUAL:
        acc = acc + tl.load(r_ptr + m[:, None] * stride_rm + n[None, :], mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["M"])  # one compilation for every row count of a BLOCK_M
def skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, part_ptr, lock_ptr, g_ptr, beta_ptr, eps, M, N, K,
                       stride_xm, stride_wn, stride_rm, stride_ym, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                       RESIDUAL: tl.constexpr, IEEE: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                       LAST_REDUCES: tl.constexpr, GEMV: tl.constexpr, LN: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched as a programmatic dependent launch: the previous kernel has finished and its writes are
        tl.extra.cuda.gdc_wait()  # visible past this wait (every global read comes after it); then the next
        tl.extra.cuda.gdc_launch_dependents()  # kernel may launch, so at most one waits beside this one
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = m < M, n < N
    if LN:  # each row's mean and 1/std over all of K (fp32, two passes; the rows are a few KB, read from L2)
        row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            row_sum += tl.sum(tl.load(x_ptr + m[:, None] * stride_xm + k[None, :],
                                      mask=m_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32), axis=1)
        mean = row_sum / K
        row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            valid = m_mask[:, None] & (k < K)[None, :]
            d = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=valid, other=0.0).to(tl.float32)
            d = tl.where(valid, d - mean[:, None], 0.0)
            row_sum += tl.sum(d * d, axis=1)
        rstd = 1.0 / tl.sqrt(row_sum / K + eps)
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # whole blocks of K per split
    first = pid_k * chunk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(first, tl.minimum(first + chunk, K), BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_mask = k < K
        if EVEN:  # N a multiple of BLOCK_N, K of SPLIT_K * BLOCK_K: W unmasked (wide loads), x masked by row only
            x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :])
        else:
            x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)
            w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0)
        if LN:  # the LayerNorm's output in x's dtype, as the separate LayerNorm would hand it to the GEMM
            g = tl.load(g_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
            normed = (x.to(tl.float32) - mean[:, None]) * rstd[:, None] * g[None, :] + beta[None, :]
            x = tl.where(m_mask[:, None] & k_mask[None, :], normed, 0.0).to(x.dtype)
        if GEMV:  # (BLOCK_M, 1, BLOCK_K) * (1, BLOCK_N, BLOCK_K) summed over K: exact fp32 products
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        elif IEEE:  # fp32 inputs (or upcast ones): full fp32 products, as torch's matmul without TF32
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        acc = _epilogue(acc, n, n_mask, m, mask, b_ptr, r_ptr, stride_rm, HAS_BIAS, GELU, RESIDUAL)
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # part: (SPLIT_K, M, N) fp32
        tl.store(part_ptr + (pid_k * M + m[:, None]) * N + n[None, :], acc, mask=mask)
        if LAST_REDUCES:
            tile = pid_m * tl.num_programs(0) + pid_n
            tl.debug_barrier()  # every thread's partial is stored before the release below
            arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the other splits' partials are visible (acquire; loads bypass L1)
                summed = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT_K):
                    summed += tl.load(part_ptr + (s * M + m[:, None]) * N + n[None, :], mask=mask, other=0.0,
                                      cache_modifier=".cg")
                summed = _epilogue(summed, n, n_mask, m, mask, b_ptr, r_ptr, stride_rm, HAS_BIAS, GELU, RESIDUAL)
                tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], summed.to(y_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit(do_not_specialize=["M"])  # one compilation for every row count of a BLOCK_M
def splitk_epilogue_kernel(part_ptr, b_ptr, r_ptr, y_ptr, M, N, stride_rm, stride_ym, HAS_BIAS: tl.constexpr,
                           GELU: tl.constexpr, RESIDUAL: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    mask = (m < M)[:, None] & n_mask[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT_K):  # in order: the sum does not depend on timing
        acc += tl.load(part_ptr + (s * M + m[:, None]) * N + n[None, :], mask=mask, other=0.0)
    acc = _epilogue(acc, n, n_mask, m, mask, b_ptr, r_ptr, stride_rm, HAS_BIAS, GELU, RESIDUAL)
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
