"""The Triton kernels of megatron/inference/decode.py's attention (imported only where triton is used).

decode_attention_kernel: one program per (row, head, split of the keys). Split 0 stores the row's new key and
value at position pos of its cache slot; each split runs an online softmax over its keys
[split * SPLIT, min((split + 1) * SPLIT, pos + 1)) in blocks of BLOCK_N (the bound is read from the device, so
one launch shape serves every length; a split past pos does nothing):
    out = sum_j softmax_j(q.k_j * scale + slope * (j - pos)) v_j, accumulated in fp32.
The key and value at pos come from the qkv input, not from the cache just written (other threads of the program
may not see that store yet). With one split the program writes the output; with several, each writes its
unnormalised sum, running maximum and denominator, and the splits are merged (flash-decoding), so a small batch
still fills the GPU: by combine_kernel (a second launch) or, with LAST_COMBINES, by the last split of each (row,
head) to finish (an arrival counter per (row, head), taken with an acquire-release atomic after a block barrier and
reset to 0 by that program, as megatron/inference/triton_gemm.py's split-K sums do): one launch per layer.
"""
import triton
import triton.language as tl


@triton.jit
def decode_attention_kernel(qkv_ptr, kc_ptr, vc_ptr, slots_ptr, pos_ptr, slopes_ptr, out_ptr, part_ptr, stat_ptr,
                            lock_ptr, scale, stride_qkv, stride_slot, stride_head, stride_pos, stride_out,
                            HD: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr,
                            SPLITS_P2: tl.constexpr, LAST_COMBINES: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int32)
    d = tl.arange(0, HD)
    base = qkv_ptr + row * stride_qkv + head * 3 * HD
    q = tl.load(base + d).to(tl.float32)
    k_new = tl.load(base + HD + d)
    v_new = tl.load(base + 2 * HD + d)
    cache = slot * stride_slot + head * stride_head
    if split == 0:
        tl.store(kc_ptr + cache + pos * stride_pos + d, k_new)
        tl.store(vc_ptr + cache + pos * stride_pos + d, v_new)
    slope = tl.load(slopes_ptr + head).to(tl.float32)
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([HD], dtype=tl.float32)
    first = split * SPLIT
    for start in range(first, tl.minimum(first + SPLIT, pos + 1), BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        valid = (j <= pos) & (j < first + SPLIT)
        new = (j == pos)[:, None]
        offsets = cache + j[:, None] * stride_pos + d[None, :]
        k = tl.load(kc_ptr + offsets, mask=valid[:, None], other=0.0)
        k = tl.where(new, k_new[None, :], k).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale + slope * (j - pos).to(tl.float32)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(vc_ptr + offsets, mask=valid[:, None], other=0.0)
        v = tl.where(new, v_new[None, :], v).to(tl.float32)
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    if NUM_SPLITS == 1:
        tl.store(out_ptr + row * stride_out + head * HD + d, (acc / total).to(out_ptr.dtype.element_ty))
    else:
        index = (row * num_heads + head) * NUM_SPLITS + split
        tl.store(part_ptr + index * HD + d, acc)
        tl.store(stat_ptr + index * 2, m)
        tl.store(stat_ptr + index * 2 + 1, total)
        if LAST_COMBINES:
            pair = row * num_heads + head
            tl.debug_barrier()  # every thread's partial is stored before the release below
            arrived = tl.atomic_add(lock_ptr + pair, 1, sem="acq_rel", scope="gpu")
            if arrived == NUM_SPLITS - 1:  # the other splits' partials are visible (acquire; loads bypass L1)
                _combine(part_ptr, stat_ptr, out_ptr, stride_out, row, head, num_heads, HD, NUM_SPLITS, SPLITS_P2,
                         ".cg")
                tl.atomic_xchg(lock_ptr + pair, 0)


@triton.jit
def combine_kernel(part_ptr, stat_ptr, out_ptr, stride_out, HD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   SPLITS_P2: tl.constexpr):
    _combine(part_ptr, stat_ptr, out_ptr, stride_out, tl.program_id(0), tl.program_id(1), tl.num_programs(1), HD,
             NUM_SPLITS, SPLITS_P2, "")


@triton.jit
def _combine(part_ptr, stat_ptr, out_ptr, stride_out, row, head, num_heads, HD: tl.constexpr,
             NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, CACHE: tl.constexpr):
    s = tl.arange(0, SPLITS_P2)
    used = s < NUM_SPLITS
    index = (row * num_heads + head) * NUM_SPLITS + s
    m = tl.load(stat_ptr + index * 2, mask=used, other=float("-inf"), cache_modifier=CACHE)
    total = tl.load(stat_ptr + index * 2 + 1, mask=used, other=0.0, cache_modifier=CACHE)
    d = tl.arange(0, HD)
    acc = tl.load(part_ptr + index[:, None] * HD + d[None, :], mask=used[:, None], other=0.0, cache_modifier=CACHE)
    weight = tl.exp(m - tl.max(m, axis=0))  # split 0 always holds key 0: the maximum is finite
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * total, axis=0)
    tl.store(out_ptr + row * stride_out + head * HD + d, out.to(out_ptr.dtype.element_ty))
