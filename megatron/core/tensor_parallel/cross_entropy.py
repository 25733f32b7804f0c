"""Cross entropy over vocabulary-parallel logits, without gathering the full logits.

With logits z split along the vocabulary across the p ranks of `group` (rank r holds [r V/p, (r+1) V/p)) and
target t, each rank computes with the local ops of megatron.fused_kernels.cross_entropy (the CUDA kernel, or torch)

    lse_r = log sum_{v in slice r} exp(z_v),     predicted_r = z_t if t is in slice r else 0

and this module owns the communication, three all-reduces of (tokens,) fp32 tensors over group:

    M = max_r lse_r (MAX),   lse = M + log sum_r exp(lse_r - M) (SUM),   z_t = sum_r predicted_r (SUM)
    loss = lse - z_t

Backward needs no communication: d loss / d z_v = softmax(z)_v - [v == t] = exp(z_v - lse) - [v == t], computed
on each rank's own slice by the local backward op. Math is in fp32 whatever the logits' dtype (the (tokens,) lse
is fp64 when the torch ops serve, which keeps exp(z - lse) exact for large logits); the loss is fp32. A target of
-100 (torch's ignore_index) gives loss 0 and no gradient.
"""
import torch.distributed as dist

from megatron.core.tensor_parallel import comm_timing

from megatron.core.tensor_parallel.mappings import get_group_size_and_rank
from megatron.fused_kernels.cross_entropy import fused_cross_entropy, sliced_cross_entropy


def _combine_over(group):
    """The slices' (lse_r, predicted_r) -> the whole vocabulary's (lse, z_t): three all-reduces over group."""

    def combine(lse, predicted):
        lse_max = lse.clone()
        token = comm_timing.begin()
        dist.all_reduce(lse_max, op=dist.ReduceOp.MAX, group=group)
        comm_timing.end(token)
        sum_exp = (lse - lse_max).exp_()
        token = comm_timing.begin()
        dist.all_reduce(sum_exp, group=group)
        dist.all_reduce(predicted, group=group)
        comm_timing.end(token)
        return sum_exp.log_().add_(lse_max), predicted

    return combine


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, group=None, inplace_backward=False):
    """Per-token loss (fp32, shape of target) from logits (..., V/p) split along the last dim over `group`.

    group: the tensor-parallel ProcessGroup the vocabulary is split over, or None (the logits hold it all; then
    fused_cross_entropy: the kernel on CUDA, torch's F.cross_entropy elsewhere). inplace_backward (kernel, or
    the torch ops for p > 1): the gradient is written over the logits, for a caller that does not read them after
    the loss.
    """
    tp_size, tp_rank = get_group_size_and_rank(group)
    if tp_size == 1:
        return fused_cross_entropy(vocab_parallel_logits, target, inplace_backward)
    vocab = vocab_parallel_logits.shape[-1]
    return sliced_cross_entropy(vocab_parallel_logits, target, tp_rank * vocab, tp_size * vocab,
                                _combine_over(group), inplace_backward)
