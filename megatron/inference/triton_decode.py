"""The Triton kernels of megatron/inference/decode.py's attention (imported only where triton is used).

decode_attention_kernel: one program per (row, head, split of the keys). Split 0 stores the row's new key and
value at position pos of its cache slot; the row's pos + 1 keys are cut into `active` splits of whole blocks of
BLOCK_N keys, active = min(NUM_SPLITS, cdiv(pos + 1, MIN_KEYS)), read from the device: one launch shape serves every
length, a short row uses one split (no partials, no merge) and a long one up to NUM_SPLITS (splits past active do
nothing; one that rounding leaves without keys contributes nothing to the merge). Each split runs an online softmax
over its keys in blocks of BLOCK_N (PREFETCH: the next block's keys and values loaded while this block's are
summed, twice the registers; Triton does not software-pipeline a loop without a dot):
    out = sum_j softmax_j(q.k_j * scale + slope * (j - pos)) v_j, accumulated in fp32.
The key and value at pos come from the qkv input, not from the cache just written (other threads of the program
may not see that store yet). With one active split the program writes the output; with several, each writes its
unnormalised sum, running maximum and denominator, and the splits are merged (flash-decoding), so a small batch
or a long context still fills the GPU: by combine_kernel (a second launch) or, with LAST_COMBINES, by the last
split of each (row, head) to finish (an arrival counter per (row, head), taken with an acquire-release atomic after
a block barrier and reset to 0 by that program, as megatron/inference/triton_gemm.py's split-K sums do): one launch
per layer.
"""
import triton
import triton.language as tl


@triton.jit
def _active_splits(pos, MIN_KEYS: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """The splits a row at position pos uses: as many as keep MIN_KEYS keys each, at most NUM_SPLITS."""
    return tl.minimum(tl.cdiv(pos + 1, MIN_KEYS), NUM_SPLITS)


@triton.jit
def _load_block(kc_ptr, vc_ptr, cache, j, d, stride_pos, last):
    """The keys and values at positions j (< last; 0 elsewhere) of one (slot, head), both loads issued together."""
    offsets = cache + j[:, None] * stride_pos + d[None, :]
    valid = (j < last)[:, None]
    return (tl.load(kc_ptr + offsets, mask=valid, other=0.0), tl.load(vc_ptr + offsets, mask=valid, other=0.0))


@triton.jit
def decode_attention_kernel(qkv_ptr, kc_ptr, vc_ptr, slots_ptr, pos_ptr, slopes_ptr, out_ptr, part_ptr, stat_ptr,
                            lock_ptr, scale, stride_qkv, stride_slot, stride_head, stride_pos, stride_out,
                            HD: tl.constexpr, BLOCK_N: tl.constexpr, MIN_KEYS: tl.constexpr,
                            NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, LAST_COMBINES: tl.constexpr,
                            PREFETCH: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int32)
    active = _active_splits(pos, MIN_KEYS, NUM_SPLITS)
    if split < active:
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
        chunk = tl.cdiv(tl.cdiv(pos + 1, active), BLOCK_N) * BLOCK_N  # whole blocks of keys per split
        first = split * chunk
        last = tl.minimum(first + chunk, pos + 1)
        if PREFETCH:  # the first block's keys and values
            k_next, v_next = _load_block(kc_ptr, vc_ptr, cache, first + tl.arange(0, BLOCK_N), d, stride_pos, last)
        for start in range(first, last, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            valid = j < last
            new = (j == pos)[:, None]
            if PREFETCH:  # this block's loads were issued an iteration ago; the next block's go out now
                k, v = k_next, v_next
                k_next, v_next = _load_block(kc_ptr, vc_ptr, cache, j + BLOCK_N, d, stride_pos, last)
            else:
                k, v = _load_block(kc_ptr, vc_ptr, cache, j, d, stride_pos, last)
            k = tl.where(new, k_new[None, :], k).to(tl.float32)
            v = tl.where(new, v_new[None, :], v).to(tl.float32)
            s = tl.sum(k * q[None, :], axis=1) * scale + slope * (j - pos).to(tl.float32)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            total = total * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = m_new
        if active == 1:
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
                if arrived == active - 1:  # the other splits' partials are visible (acquire; loads bypass L1)
                    _combine(part_ptr, stat_ptr, out_ptr, stride_out, row, head, num_heads, active, HD, NUM_SPLITS,
                             SPLITS_P2, ".cg")
                    tl.atomic_xchg(lock_ptr + pair, 0)


@triton.jit
def combine_kernel(part_ptr, stat_ptr, pos_ptr, out_ptr, stride_out, HD: tl.constexpr, MIN_KEYS: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
    row = tl.program_id(0)
    active = _active_splits(tl.load(pos_ptr + row).to(tl.int32), MIN_KEYS, NUM_SPLITS)
    if active > 1:  # else the attention kernel wrote the output
        _combine(part_ptr, stat_ptr, out_ptr, stride_out, row, tl.program_id(1), tl.num_programs(1), active, HD,
                 NUM_SPLITS, SPLITS_P2, "")


@triton.jit
def _combine(part_ptr, stat_ptr, out_ptr, stride_out, row, head, num_heads, active, HD: tl.constexpr,
             NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, CACHE: tl.constexpr):
    s = tl.arange(0, SPLITS_P2)
    used = s < active
    index = (row * num_heads + head) * NUM_SPLITS + s
    m = tl.load(stat_ptr + index * 2, mask=used, other=float("-inf"), cache_modifier=CACHE)
    total = tl.load(stat_ptr + index * 2 + 1, mask=used, other=0.0, cache_modifier=CACHE)
    d = tl.arange(0, HD)
    acc = tl.load(part_ptr + index[:, None] * HD + d[None, :], mask=used[:, None], other=0.0, cache_modifier=CACHE)
    weight = tl.exp(m - tl.max(m, axis=0))  # split 0 always holds key 0: the maximum is finite; a split without
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * total, axis=0)  # keys has weight 0
    tl.store(out_ptr + row * stride_out + head * HD + d, out.to(out_ptr.dtype.element_ty))
