"""A KV cache allocated once: keys and values of every layer for max_batch rows (slots) x max_seq_len positions.

A slot holds one sequence; rows join (prefill into a free slot) and leave (the slot is freed) while others decode.
Position p of a slot holds the key/value of that sequence's token p, so a row needs no padding: its valid keys
are 0..pos. Each forward pass is either a prefill or a decode step, set by the engine before the pass:

    prefill  rows `slots` write their chunk's keys/values at [start, start + c); queries attend causally over
             [0, start + c) of their own slot
    decode   slots 0..B-1 each write one key/value at their own position pos[b] (a device tensor) and attend over
             the first kv_len positions, masked to j <= pos[b] (the engine's unfused path; its fused path,
             megatron/inference/decode.py, writes and reads self.k / self.v directly)

The ALiBi bias (slope_h * (j - i), the dtype's minimum where masked) is computed once per pass and shared by
all layers. Decode uses only fixed-shape kernels whose positions live on the device, so one CUDA graph per
(batch bucket, kv_len bucket) serves every step, with no recompilation and no host synchronisation.
"""
import torch
import torch.nn.functional as F

from megatron.model.attention import alibi_bias


class StaticKVCache:

    def __init__(self, num_layers, max_batch, num_heads, max_seq_len, head_dim, dtype, device, slopes):
        shape = (num_layers, max_batch, num_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.slopes = slopes.float().to(device)  # (nh,) this rank's heads
        self.layers = [_LayerCache(self, i) for i in range(num_layers)]
        self.rows = torch.arange(max_batch, device=device)
        self.positions = torch.arange(max_seq_len, device=device)
        self._pass = None

    @property
    def nbytes(self):
        return self.k.numel() * self.k.element_size() * 2

    def set_prefill(self, slots, start, length, dtype):
        """The next pass writes positions [start, start + length) of `slots` (a list of slot ids, or a device tensor
        of them: no host-to-device copy, so a CUDA graph can capture the pass)."""
        if start + length > self.max_seq_len:
            raise ValueError(f"prefill to position {start + length} exceeds the cache's {self.max_seq_len} positions")
        bias = alibi_bias(self.slopes, length, start + length, dtype=dtype)  # (1, nh, c, start + c)
        if len(slots) > 1:  # a materialised batch dimension: cuDNN's SDPA is wrong for stride-0 bias (attention.py)
            bias = bias.expand(len(slots), -1, -1, -1).contiguous()
        if isinstance(slots, torch.Tensor):
            index = slots
        else:
            index = slots[0] if len(slots) == 1 else torch.tensor(slots, device=self.k.device)
        self._pass = ("prefill", index, start, length, bias)

    def set_decode(self, batch, kv_len, pos, dtype):
        """The next pass is one token for slots 0..batch-1 at positions pos (a (batch,) int64 device tensor)."""
        distance = self.positions[None, :kv_len] - pos[:, None]  # (B, kv) j - i
        bias = self.slopes[None, :, None, None] * distance[:, None, None, :].float()  # (B, nh, 1, kv)
        bias = bias.masked_fill(distance[:, None, None, :] > 0, torch.finfo(torch.float32).min).to(dtype)
        self._pass = ("decode", batch, kv_len, pos, bias)

    def clear(self):
        self._pass = None


class _LayerCache:
    """One layer's view: stores the pass's keys/values and attends over the cache (InferenceCache's protocol)."""

    def __init__(self, cache, layer):
        self.cache, self.layer = cache, layer

    def attend(self, q, k, v, core_attention, key_padding_mask=None):
        if key_padding_mask is not None:
            raise ValueError("StaticKVCache rows are never padded: pass no attention mask")
        kind, *args = self.cache._pass
        kc, vc = self.cache.k[self.layer], self.cache.v[self.layer]
        if kind == "decode":
            return self._decode(q, k, v, kc, vc, core_attention.scale, *args)
        return self._prefill(q, k, v, kc, vc, core_attention.scale, *args)

    def _prefill(self, q, k, v, kc, vc, scale, index, start, length, bias):
        if isinstance(index, int):  # one slot: a view, no gather
            kc[index, :, start:start + length] = k[0]
            vc[index, :, start:start + length] = v[0]
            keys, values = kc[index:index + 1, :, :start + length], vc[index:index + 1, :, :start + length]
        else:
            kc[index, :, start:start + length] = k
            vc[index, :, start:start + length] = v
            keys, values = (k, v) if start == 0 else (kc[index, :, :start + length], vc[index, :, :start + length])
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale)

    def _decode(self, q, k, v, kc, vc, scale, batch, kv_len, pos, bias):
        rows = self.cache.rows[:batch]
        kc[rows, :, pos] = k[:, :, 0]  # (B, nh, hd) at each row's own position
        vc[rows, :, pos] = v[:, :, 0]
        return F.scaled_dot_product_attention(q, kc[:batch, :, :kv_len], vc[:batch, :, :kv_len], attn_mask=bias,
                                              scale=scale)
