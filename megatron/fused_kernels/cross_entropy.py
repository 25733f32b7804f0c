"""Per-token cross entropy of (..., V) logits: a CUDA kernel that never makes an fp32 copy of the logits.

loss = logsumexp(z) - z_t in fp32, whatever the logits' dtype; a token whose target is ignore_index (-100, as in
torch) has loss 0 and no gradient. The kernel reads bf16/fp16/fp32 logits once in forward, and once more in
backward to write grad_z = g * (softmax(z) - onehot(t)) in the logits' dtype (over the logits themselves with
inplace_backward). torch's F.cross_entropy on the fp32-cast logits (the fallback, used off CUDA) moves several
times those bytes: at BLOOM's vocabulary and micro batch 4 x 2048 the fp32 logits alone are 8 GB.
"""
from typing import Optional

import torch
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


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, inplace_backward, module):
        loss, lse = module.cross_entropy_forward(logits, target, IGNORE_INDEX)
        ctx.save_for_backward(logits, target, lse)
        ctx.inplace_backward, ctx.module = inplace_backward, module
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        grad = ctx.module.cross_entropy_backward(grad_loss.float().contiguous(), logits, target, lse, IGNORE_INDEX,
                                                 ctx.inplace_backward)
        return grad, None, None, None


def _kernel_reason(logits: torch.Tensor, target: torch.Tensor) -> Optional[str]:
    if logits.dtype not in KERNEL_DTYPES:
        return f"cross entropy: logits dtype {logits.dtype} (the kernel takes float32, float16 or bfloat16)"
    if logits.stride(-1) != 1:
        return "cross entropy: logits are not contiguous along the vocabulary"
    if target.device != logits.device:
        return f"cross entropy: target on {target.device}, logits on {logits.device}"
    return None


def fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor, inplace_backward: bool = False) -> torch.Tensor:
    """Per-token fp32 loss (target's shape) of logits (..., V) against integer targets.

    CUDA tensors use the kernel (the reason is logged once, or raised under the abort flag, where they cannot);
    CPU tensors use cross_entropy_reference without a log line. inplace_backward lets the backward write the
    gradient over the logits: only for a caller that owns the logits and does not read them afterwards.
    """
    if not logits.is_cuda:
        return cross_entropy_reference(logits, target)
    module = kernel_module_or_fallback(_kernel_reason(logits, target))
    if module is None:
        return cross_entropy_reference(logits, target)
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab).contiguous()
    flat_target = target.reshape(-1).long().contiguous()
    return _FusedCrossEntropy.apply(flat_logits, flat_target, inplace_backward, module).view(target.shape)
