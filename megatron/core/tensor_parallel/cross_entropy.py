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
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import get_group_size_and_rank
from megatron.fused_kernels.cross_entropy import IGNORE_INDEX, cross_entropy_ops, fused_cross_entropy


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """logits (rows, V/p) contiguous, target (rows,) int64 global ids -> loss (rows,) fp32."""

    @staticmethod
    def forward(ctx, logits, target, group, tp_size, tp_rank, inplace_backward, ops):
        vocab_start, total_vocab = tp_rank * logits.shape[1], tp_size * logits.shape[1]
        lse, predicted = ops.cross_entropy_forward(logits, target, vocab_start, total_vocab, IGNORE_INDEX)
        lse_max = lse.clone()
        dist.all_reduce(lse_max, op=dist.ReduceOp.MAX, group=group)
        sum_exp = (lse - lse_max).exp_()
        dist.all_reduce(sum_exp, group=group)
        lse = sum_exp.log_().add_(lse_max)
        dist.all_reduce(predicted, group=group)
        loss = (lse - predicted).float().masked_fill_(target == IGNORE_INDEX, 0.0)
        ctx.save_for_backward(logits, target, lse)
        ctx.slice = (vocab_start, total_vocab)
        ctx.inplace_backward, ctx.ops = inplace_backward, ops
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        grad = ctx.ops.cross_entropy_backward(grad_loss.float().contiguous(), logits, target, lse, *ctx.slice,
                                              IGNORE_INDEX, ctx.inplace_backward)
        return grad, None, None, None, None, None, None


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
    ops = cross_entropy_ops(vocab_parallel_logits, target)
    vocab = vocab_parallel_logits.shape[-1]
    flat_logits = vocab_parallel_logits.reshape(-1, vocab).contiguous()
    flat_target = target.reshape(-1).long().contiguous()
    loss = _VocabParallelCrossEntropy.apply(flat_logits, flat_target, group, tp_size, tp_rank, inplace_backward,
                                            ops)
    return loss.view(target.shape)
