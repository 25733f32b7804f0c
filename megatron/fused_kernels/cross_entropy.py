"""Cross entropy of (rows, V) logits as local ops: a CUDA kernel that never makes an fp32 copy of the logits.

loss = logsumexp(z) - z_t in fp32, whatever the logits' dtype; a token whose target is ignore_index (-100, as in
torch) has loss 0 and no gradient, any other target outside the vocabulary a NaN loss. The kernel reads
bf16/fp16/fp32 logits once in forward, and once more in backward to write grad_z = g * (softmax(z) - onehot(t))
in the logits' dtype (over the logits themselves with inplace_backward). torch's F.cross_entropy on the
fp32-cast logits (the reference) moves several times those bytes: at BLOOM's vocabulary and micro batch
4 x 2048 the fp32 logits alone are 8 GB.

Everything here is local to one process (no communication). The logits may be one slice of a vocabulary split
across ranks, [vocab_start, vocab_start + V_local) of total_vocab; the two local ops are

    cross_entropy_forward:  lse_r = log sum_{v in slice} exp(z_v),   predicted_r = z_t if t is in the slice else 0
    cross_entropy_backward: grad_v = g * (exp(z_v - lse) - [v == t])  given the full-vocabulary lse

and megatron.core.tensor_parallel.vocab_parallel_cross_entropy combines the ranks' lse_r and predicted_r with
its own all-reduces. `cross_entropy_ops` picks the csrc module or the torch ops of the same signature.
fused_cross_entropy is the one-rank (whole vocabulary) loss.
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


class TorchCrossEntropyOps:
    """The kernel's two local ops in torch (CPU tensors, or CUDA ones the kernel cannot serve); same signatures.

    logits (rows, V_local) contiguous, target (rows,) int64 global ids. The per-element work is fp32 on logits
    shifted by the slice maximum; lse is returned as fp64 (a (rows,) tensor), so that exp(z - lse) keeps fp32
    accuracy for large logits (lse ~ 60 in fp32 would carry an absolute error of 2e-6).
    """

    @staticmethod
    def _slice_target(target, vocab_start, vocab):
        local = target - vocab_start
        inside = (local >= 0) & (local < vocab)
        return local.masked_fill(~inside, 0), inside

    @staticmethod
    def cross_entropy_forward(logits, target, vocab_start, total_vocab, ignore_index):
        """-> (lse_r (rows,) fp64, predicted_r (rows,) fp32); predicted is NaN for a target outside the vocab."""
        z = logits.float()
        z_max = z.max(dim=-1)[0]
        sum_exp = (z - z_max.unsqueeze(-1)).exp_().sum(dim=-1)
        lse = sum_exp.double().log_().add_(z_max.double())
        local, inside = TorchCrossEntropyOps._slice_target(target, vocab_start, z.shape[-1])
        predicted = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        invalid = (target != ignore_index) & ((target < 0) | (target >= total_vocab))
        return lse, predicted.masked_fill(invalid, float("nan")).masked_fill(target == ignore_index, 0.0)

    @staticmethod
    def cross_entropy_backward(grad_loss, logits, target, lse, vocab_start, total_vocab, ignore_index, inplace):
        """-> g * (exp(z - lse) - onehot(t)) in logits.dtype (rows, V_local); g is 0 for ignored rows, NaN for
        targets outside the vocabulary. inplace: written over the logits."""
        local, inside = TorchCrossEntropyOps._slice_target(target, vocab_start, logits.shape[-1])
        g = grad_loss.float().masked_fill(target == ignore_index, 0.0)
        g = g.masked_fill((target != ignore_index) & ((target < 0) | (target >= total_vocab)), float("nan"))
        z = logits.float()
        z_max = z.max(dim=-1)[0]
        offset = (lse.double() - z_max.double()).float()  # small: exact enough in fp32
        grad = (z - z_max.unsqueeze(-1)).sub_(offset.unsqueeze(-1)).exp_()
        grad.scatter_add_(-1, local.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        grad.mul_(g.unsqueeze(-1))
        if inplace:
            return logits.copy_(grad)
        return grad.to(logits.dtype)


def _kernel_reason(logits: torch.Tensor, target: torch.Tensor) -> Optional[str]:
    if logits.dtype not in KERNEL_DTYPES:
        return f"cross entropy: logits dtype {logits.dtype} (the kernel takes float32, float16 or bfloat16)"
    if logits.stride(-1) != 1:
        return "cross entropy: logits are not contiguous along the vocabulary"
    if target.device != logits.device:
        return f"cross entropy: target on {target.device}, logits on {logits.device}"
    return None


def cross_entropy_kernel(logits: torch.Tensor, target: torch.Tensor):
    """The csrc module for CUDA logits it can serve, else None (the reason logged once, or raised under the abort
    flag; CPU tensors give None without a log line)."""
    if not logits.is_cuda:
        return None
    return kernel_module_or_fallback(_kernel_reason(logits, target))


def cross_entropy_ops(logits: torch.Tensor, target: torch.Tensor):
    """An object with cross_entropy_forward / cross_entropy_backward (the local ops above): the kernel or torch."""
    return cross_entropy_kernel(logits, target) or TorchCrossEntropyOps


class _CrossEntropy(torch.autograd.Function):
    """logits (rows, V_local) contiguous: the slice [vocab_start, vocab_start + V_local) of total_vocab; target
    (rows,) int64 global ids -> loss (rows,) fp32. combine(lse_r, predicted_r) -> (lse, predicted) joins the
    slices' partial results (the caller's communication; None for the whole vocabulary on one rank)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, total_vocab, combine, inplace_backward, ops):
        lse, predicted = ops.cross_entropy_forward(logits, target, vocab_start, total_vocab, IGNORE_INDEX)
        if combine is not None:
            lse, predicted = combine(lse, predicted)
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


def sliced_cross_entropy(logits, target, vocab_start=0, total_vocab=None, combine=None, inplace_backward=False,
                         ops=None):
    """Per-token fp32 loss (target's shape) of logits (..., V_local), one slice of the vocabulary, through the
    local ops (`ops`, or the kernel / torch by cross_entropy_ops); combine as in _CrossEntropy."""
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab).contiguous()
    flat_target = target.reshape(-1).long().contiguous()
    ops = ops or cross_entropy_ops(flat_logits, flat_target)
    loss = _CrossEntropy.apply(flat_logits, flat_target, vocab_start, total_vocab or vocab, combine,
                               inplace_backward, ops)
    return loss.view(target.shape)


def fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor, inplace_backward: bool = False) -> torch.Tensor:
    """Per-token fp32 loss (target's shape) of logits (..., V) over the whole vocabulary against integer targets.

    CUDA tensors use the kernel (the reason is logged once, or raised under the abort flag, where they cannot);
    otherwise cross_entropy_reference runs. inplace_backward lets the backward write the gradient over the
    logits: only for a caller that owns the logits and does not read them afterwards.
    Vocabulary-parallel logits: megatron.core.tensor_parallel.vocab_parallel_cross_entropy.
    """
    module = cross_entropy_kernel(logits, target)
    if module is None:
        return cross_entropy_reference(logits, target)
    return sliced_cross_entropy(logits, target, inplace_backward=inplace_backward, ops=module)
