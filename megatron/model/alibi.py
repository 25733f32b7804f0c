"""ALiBi slopes for any head count, and each tensor-parallel rank's slice of them.

For n heads with p = 2^floor(log2 n) (Press et al., "Train Short, Test Long"):
    slopes_i = 2^(-8 i / p)                  i = 1..p
and, when n is not a power of two, the odd-indexed slopes of 2p heads fill the rest:
    extra_k  = 2^(-8 (2k - 1) / 2p)          k = 1..n-p
The attention score of query i and key j gets slope_h * j added (softmax is invariant to the
per-row constant -slope_h * i, so this equals slope_h * (j - i)).
"""
import math

import torch


def get_alibi_slopes(num_heads):
    """(num_heads,) fp32 slopes, identical to BLOOM's."""
    p = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * i / p) for i in range(1, p + 1)]
    if p < num_heads:
        slopes += [2.0 ** (-8.0 * (2 * k - 1) / (2 * p)) for k in range(1, num_heads - p + 1)]
    return torch.tensor(slopes, dtype=torch.float32)


def get_alibi_slopes_for_rank(num_heads, tp_rank, tp_size):
    """Slopes of the heads that tensor-parallel rank tp_rank owns (a contiguous block of heads)."""
    per_rank = num_heads // tp_size
    return get_alibi_slopes(num_heads)[tp_rank * per_rank:(tp_rank + 1) * per_rank].contiguous()
