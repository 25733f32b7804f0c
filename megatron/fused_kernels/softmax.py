"""ALiBi + causal / explicit-mask softmax over raw attention scores: fused CUDA kernel with an fp32 torch fallback.

probs[b, h, i, j] = softmax_j(scale * scores[b, h, i, j] + slopes[h] * j) over the unmasked j, 0 where masked.
Causal rule: j is masked when j > i + (sk - sq), i.e. the sq queries are the last sq of the sk keys (KV cache).
A row with every j masked gives zeros. Backward: grad_scores = scale * probs * (grad_probs - sum_j grad_probs * probs).
"""
from typing import Optional

import torch

from megatron.fused_kernels.loader import kernel_module_or_fallback

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_KEY_LENGTH = 16384  # csrc/fused_kernels/fused_kernels.h kMaxRowLength


def causal_mask(sq: int, sk: int, device=None) -> torch.Tensor:
    """(sq, sk) bool, True where key j is masked for query i: j > i + (sk - sq)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(diagonal=sk - sq + 1)


def _check_shapes(scores: torch.Tensor, slopes: torch.Tensor) -> None:
    if scores.dim() != 4:
        raise ValueError(f"scores must be (B, nh, sq, sk), got shape {tuple(scores.shape)}")
    if slopes.numel() != scores.shape[1]:
        raise ValueError(
            f"slopes must have one entry per head: got {slopes.numel()} slopes for nh={scores.shape[1]}"
        )


def _alibi_softmax_reference(scores, slopes, scale, mask):
    """Shared fallback: scores (B, nh, sq, sk); mask broadcastable to it, True = masked."""
    compute = torch.promote_types(scores.dtype, torch.float32)  # fp32 math (fp64 stays fp64 for gradcheck)
    nh, sk = scores.shape[1], scores.shape[-1]
    positions = torch.arange(sk, device=scores.device, dtype=compute)
    bias = slopes.to(device=scores.device, dtype=compute).view(1, nh, 1, 1) * positions.view(1, 1, 1, sk)
    logits = scores.to(compute) * scale + bias  # (B, nh, sq, sk)
    # A finite fill keeps fully masked rows finite (uniform), and the final fill zeroes them and their gradient.
    logits = logits.masked_fill(mask, torch.finfo(compute).min)
    probs = torch.softmax(logits, dim=-1).masked_fill(mask, 0.0)
    return probs.to(scores.dtype)


def alibi_causal_softmax_reference(scores: torch.Tensor, slopes: torch.Tensor, scale: float) -> torch.Tensor:
    """Torch reference of alibi_causal_softmax (math in fp32, or fp64 for fp64 inputs)."""
    _check_shapes(scores, slopes)
    sq, sk = scores.shape[-2:]
    return _alibi_softmax_reference(scores, slopes, scale, causal_mask(sq, sk, scores.device))


def alibi_masked_softmax_reference(
    scores: torch.Tensor, mask: torch.Tensor, slopes: torch.Tensor, scale: float
) -> torch.Tensor:
    """Torch reference of alibi_masked_softmax; mask broadcastable to scores, True = masked out."""
    _check_shapes(scores, slopes)
    return _alibi_softmax_reference(scores, slopes, scale, mask.to(device=scores.device, dtype=torch.bool))


class _AlibiSoftmaxFunction(torch.autograd.Function):
    """Runs the CUDA kernels; saves only probs for the backward."""

    @staticmethod
    def forward(ctx, scores, slopes, scale, mask, causal, module):
        probs = module.alibi_softmax_forward(scores, slopes, scale, mask, causal)  # (B, nh, sq, sk)
        ctx.save_for_backward(probs)
        ctx.scale, ctx.causal, ctx.module = scale, causal, module
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        (probs,) = ctx.saved_tensors
        grad_scores = ctx.module.alibi_softmax_backward(grad_probs.contiguous(), probs, ctx.scale, ctx.causal)
        return grad_scores, None, None, None, None, None


def _kernel_reason(scores: torch.Tensor) -> Optional[str]:
    """Why scores cannot go through the kernel, or None."""
    if not scores.is_cuda:
        return f"alibi softmax: scores are on {scores.device.type}, not CUDA"
    if scores.dtype not in KERNEL_DTYPES:
        return f"alibi softmax: scores dtype {scores.dtype} (the kernel takes float16 or bfloat16)"
    sk = scores.shape[-1]
    if not 0 < sk <= MAX_KEY_LENGTH:
        return f"alibi softmax: key length sk={sk} outside [1, {MAX_KEY_LENGTH}]"
    return None


def _mask_reason(scores: torch.Tensor, mask: torch.Tensor) -> Optional[str]:
    batch, _, sq, sk = scores.shape
    if mask.dtype != torch.bool:
        return f"alibi softmax: mask dtype {mask.dtype} (the kernel takes bool)"
    if mask.device != scores.device:
        return f"alibi softmax: mask on {mask.device}, scores on {scores.device}"
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or tuple(mask.shape[1:]) != (1, sq, sk):
        return f"alibi softmax: mask shape {tuple(mask.shape)} (the kernel takes (B or 1, 1, sq, sk))"
    return None


def alibi_causal_softmax(scores: torch.Tensor, slopes: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal ALiBi softmax of raw scores q·kᵀ (B, nh, sq, sk) -> probs (B, nh, sq, sk) in scores.dtype.

    slopes: (nh,) ALiBi slopes (fp32); scale: the 1/sqrt(head_dim) (times any layer scaling) applied to scores.
    Uses the CUDA kernel when scores are fp16/bf16 on CUDA with sk <= 16384, else the torch fallback.
    """
    _check_shapes(scores, slopes)
    module = kernel_module_or_fallback(_kernel_reason(scores))
    if module is None:
        return alibi_causal_softmax_reference(scores, slopes, scale)
    slopes = slopes.to(device=scores.device, dtype=torch.float32).contiguous()
    return _AlibiSoftmaxFunction.apply(scores.contiguous(), slopes, float(scale), None, True, module)


def alibi_masked_softmax(
    scores: torch.Tensor, mask: torch.Tensor, slopes: torch.Tensor, scale: float
) -> torch.Tensor:
    """ALiBi softmax with an explicit mask: scores (B, nh, sq, sk), mask (B or 1, 1, sq, sk) bool, True = masked.

    Fully masked rows give zeros. Other mask layouts (per head, non-bool) use the torch fallback.
    """
    _check_shapes(scores, slopes)
    reason = _kernel_reason(scores) or _mask_reason(scores, mask)
    module = kernel_module_or_fallback(reason)
    if module is None:
        return alibi_masked_softmax_reference(scores, mask, slopes, scale)
    slopes = slopes.to(device=scores.device, dtype=torch.float32).contiguous()
    return _AlibiSoftmaxFunction.apply(scores.contiguous(), slopes, float(scale), mask.contiguous(), False, module)
