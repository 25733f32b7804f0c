"""Per-token cross entropy of (..., V) logits: a CUDA kernel that never makes an fp32 copy of the logits.

loss = logsumexp(z) - z_t in fp32, whatever the logits' dtype; a token whose target is ignore_index (-100, as in
torch) has loss 0 and no gradient, any other target outside the vocabulary a NaN loss. The kernel reads
bf16/fp16/fp32 logits once in forward, and once more in backward to write grad_z = g * (softmax(z) - onehot(t))
in the logits' dtype (over the logits themselves with inplace_backward). torch's F.cross_entropy on the
fp32-cast logits (the reference) moves several times those bytes: at BLOOM's vocabulary and micro batch
4 x 2048 the fp32 logits alone are 8 GB.

With a tensor-parallel group the logits are this rank's vocabulary slice (rank r holds [r * V/p, (r+1) * V/p));
the kernel gives each row's slice logsumexp and the target logit where the slice holds it, and three all-reduces
of (tokens,) fp32 tensors (MAX, SUM, SUM) combine them; the backward needs no communication.
"""
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.fused_kernels.loader import kernel_module_or_fallback

IGNORE_INDEX = -100
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """torch's fused log-softmax + NLL on fp32 logits: per-token fp32 loss of target's shape."""
    vocab = logits.shape[-1]
    loss = F.cross_entropy(logits.float().reshape(-1, vocab), target.reshape(-1), reduction="none",
                           ignore_index=IGNORE_INDEX)
    return loss.view(target.shape)


def _group_size_and_rank(group):
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class _FusedCrossEntropy(torch.autograd.Function):
    """logits (rows, V/p) contiguous, target (rows,) int64 global ids -> loss (rows,) fp32."""

    @staticmethod
    def forward(ctx, logits, target, group, inplace_backward, module):
        world, rank = _group_size_and_rank(group)
        vocab_start, total_vocab = rank * logits.shape[1], world * logits.shape[1]
        lse, predicted = module.cross_entropy_forward(logits, target, vocab_start, total_vocab, IGNORE_INDEX)
        if world > 1:
            # logsumexp over the ranks' slice logsumexps, computed around their maximum
            lse_max = lse.clone()
            dist.all_reduce(lse_max, op=dist.ReduceOp.MAX, group=group)
            sum_exp = (lse - lse_max).exp_()
            dist.all_reduce(sum_exp, group=group)
            lse = sum_exp.log_().add_(lse_max)
            dist.all_reduce(predicted, group=group)
        loss = (lse - predicted).masked_fill_(target == IGNORE_INDEX, 0.0)
        ctx.save_for_backward(logits, target, lse)
        ctx.slice = (vocab_start, total_vocab)
        ctx.inplace_backward, ctx.module = inplace_backward, module
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        grad = ctx.module.cross_entropy_backward(grad_loss.float().contiguous(), logits, target, lse, *ctx.slice,
                                                 IGNORE_INDEX, ctx.inplace_backward)
        return grad, None, None, None, None


def _kernel_reason(logits: torch.Tensor, target: torch.Tensor) -> Optional[str]:
    if logits.dtype not in KERNEL_DTYPES:
        return f"cross entropy: logits dtype {logits.dtype} (the kernel takes float32, float16 or bfloat16)"
    if logits.stride(-1) != 1:
        return "cross entropy: logits are not contiguous along the vocabulary"
    if target.device != logits.device:
        return f"cross entropy: target on {target.device}, logits on {logits.device}"
    return None


def fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor, inplace_backward: bool = False,
                        group=None, fallback: Optional[Callable] = None) -> torch.Tensor:
    """Per-token fp32 loss (target's shape) of logits (..., V/p) against integer targets (global ids).

    group: the tensor-parallel group the vocabulary is split over (None: the logits hold it all).
    CUDA tensors use the kernel (the reason is logged once, or raised under the abort flag, where they cannot);
    otherwise fallback(logits, target) runs, by default cross_entropy_reference (one rank only), with no log line
    for CPU tensors. inplace_backward lets the backward write the gradient over the logits: only for a caller
    that owns the logits and does not read them afterwards.
    """
    module = kernel_module_or_fallback(_kernel_reason(logits, target)) if logits.is_cuda else None
    if module is None:
        if fallback is None:
            if _group_size_and_rank(group)[0] > 1:
                raise ValueError("fused_cross_entropy: vocabulary-parallel logits need a fallback off the kernel")
            fallback = cross_entropy_reference
        return fallback(logits, target)
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab).contiguous()
    flat_target = target.reshape(-1).long().contiguous()
    return _FusedCrossEntropy.apply(flat_logits, flat_target, group, inplace_backward, module).view(target.shape)
