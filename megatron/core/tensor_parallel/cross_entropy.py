"""Cross entropy over vocabulary-parallel logits, without gathering the full logits.

With logits z split along the vocabulary across p ranks and target t:

    loss = log(sum_v exp(z_v - m)) - (z_t - m),   m = max_v z_v

m, sum exp and z_t are each one all-reduce of a (..,) tensor over the TP group (MAX, SUM, SUM).
Backward: d loss / d z_v = softmax(z)_v - [v == t], computed on each rank's own slice.
Math is done in fp32 whatever the logits' dtype. A target of -100 (torch's ignore_index) gives loss 0 and no
gradient. On CUDA the csrc kernel (megatron.fused_kernels.fused_cross_entropy) does this without an fp32 copy of
the logits; the torch form below serves CPU tensors and the kernel's fallback.
"""
import torch
import torch.distributed as dist

from megatron.fused_kernels import fused_cross_entropy
from megatron.fused_kernels.cross_entropy import IGNORE_INDEX


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        ctx.logits_dtype = logits.dtype
        logits = logits.float()  # (..., V/p)
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        logits_max = logits.max(dim=-1)[0]
        if world > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        per_partition = shifted.shape[-1]
        start = rank * per_partition
        outside = (target < start) | (target >= start + per_partition)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        if world > 1:
            dist.all_reduce(predicted, group=group)
            dist.all_reduce(sum_exp, group=group)
        ignored = target == IGNORE_INDEX
        loss = (sum_exp.log() - predicted).masked_fill_(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1)).masked_fill_(ignored.unsqueeze(-1), 0.0)
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # reused in place: the saved tensor is not needed afterwards
        onehot = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, group=None, inplace_backward=False):
    """Per-token loss (fp32, shape of target) from logits split along the last dim over `group`.

    CUDA logits go through the fused kernel (for any TP size); elsewhere one rank uses torch's fused
    log-softmax + NLL on fp32 logits and several ranks the three-reduction form above. inplace_backward (kernel
    only): the gradient is written over the logits, for a caller that does not read them after the loss.
    """
    def torch_fallback(logits, labels):
        return _VocabParallelCrossEntropy.apply(logits, labels, group)

    tensor_parallel = group is not None and dist.get_world_size(group) > 1
    return fused_cross_entropy(vocab_parallel_logits, target, inplace_backward, group,
                               fallback=torch_fallback if tensor_parallel else None)
