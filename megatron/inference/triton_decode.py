"""The Triton kernel of megatron/inference/decode.py's attention (imported only where triton is used).

decode_attention_kernel: one program per (row, head). It stores the row's new key and value at position pos of
its cache slot, then runs an online softmax over keys 0..pos in blocks of BLOCK_N (the loop bound is read from
the device, so one launch shape serves every length): out = sum_j softmax_j(q.k_j * scale + slope * (j - pos)) v_j,
accumulated in fp32. The key and value at pos come from the qkv input, not from the cache just written (other
threads of the program may not see that store yet).
"""
import triton
import triton.language as tl


@triton.jit
def decode_attention_kernel(qkv_ptr, kc_ptr, vc_ptr, slots_ptr, pos_ptr, slopes_ptr, out_ptr, scale,
                            stride_qkv, stride_slot, stride_head, stride_pos, stride_out,
                            HD: tl.constexpr, BLOCK_N: tl.constexpr):
    # one program per (row, head): online softmax over keys 0..pos in blocks of BLOCK_N
    row = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int32)
    d = tl.arange(0, HD)
    base = qkv_ptr + row * stride_qkv + head * 3 * HD
    q = tl.load(base + d).to(tl.float32)
    k_new = tl.load(base + HD + d)
    v_new = tl.load(base + 2 * HD + d)
    cache = slot * stride_slot + head * stride_head
    tl.store(kc_ptr + cache + pos * stride_pos + d, k_new)
    tl.store(vc_ptr + cache + pos * stride_pos + d, v_new)
    slope = tl.load(slopes_ptr + head).to(tl.float32)
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([HD], dtype=tl.float32)
    for start in range(0, pos + 1, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        valid = j <= pos
        new = (j == pos)[:, None]  # this program's own store is not read back: the new key comes from qkv
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
    out = acc / total
    tl.store(out_ptr + row * stride_out + head * HD + d, out.to(out_ptr.dtype.element_ty))
