"""Mixed-precision LayerNorm (fp32 weight/bias/statistics, fp16/bf16/fp32 activations): CUDA kernel with torch fallback."""
import math
import numbers
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from megatron.fused_kernels.loader import kernel_module_or_fallback

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HIDDEN = 16384  # csrc/fused_kernels/fused_kernels.h kMaxRowLength


def mixed_layer_norm_reference(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float = 1e-5,
) -> torch.Tensor:
    """F.layer_norm in fp32 (fp64 stays fp64) cast back to x.dtype; weight/bias grads in their own dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(compute) if weight is not None else None
    b = bias.to(compute) if bias is not None else None
    return F.layer_norm(x.to(compute), tuple(normalized_shape), w, b, eps).to(x.dtype)


class _MixedLayerNormFunction(torch.autograd.Function):
    """x2d (rows, hidden) -> y (rows, hidden); saves x, weight and the fp32 mean/rstd per row."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, eps, module):
        y, mean, rstd = module.layer_norm_forward(x2d, weight, bias, eps)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.module = module
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x2d, weight, mean, rstd = ctx.saved_tensors
        grad_x, grad_w, grad_b = ctx.module.layer_norm_backward(grad_y.contiguous(), x2d, weight, mean, rstd)
        return grad_x, grad_w, grad_b, None, None


def _kernel_reason(x: torch.Tensor, hidden: int, weight, bias) -> Optional[str]:
    if not x.is_cuda:
        return f"layer norm: input is on {x.device.type}, not CUDA"
    if x.dtype not in KERNEL_DTYPES:
        return f"layer norm: input dtype {x.dtype} (the kernel takes float32, float16 or bfloat16)"
    if not 0 < hidden <= MAX_HIDDEN:
        return f"layer norm: hidden size {hidden} outside [1, {MAX_HIDDEN}]"
    if weight is None or bias is None:
        return "layer norm: the kernel needs both weight and bias (elementwise_affine=True, bias=True)"
    if weight.dtype != torch.float32 or bias.dtype != torch.float32:
        return f"layer norm: weight/bias dtype {weight.dtype}/{bias.dtype} (the kernel takes float32)"
    if weight.device != x.device or bias.device != x.device:
        return f"layer norm: weight on {weight.device}, input on {x.device}"
    return None


def mixed_layer_norm(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float = 1e-5,
) -> torch.Tensor:
    """LayerNorm of x (..., *normalized_shape) -> x.dtype; kernel on CUDA for fp32/fp16/bf16, hidden <= 16384."""
    normalized_shape = tuple(normalized_shape)
    if tuple(x.shape[x.dim() - len(normalized_shape):]) != normalized_shape:
        raise ValueError(
            f"layer norm: input shape {tuple(x.shape)} does not end with normalized_shape {normalized_shape}"
        )
    hidden = math.prod(normalized_shape)
    module = kernel_module_or_fallback(_kernel_reason(x, hidden, weight, bias))
    if module is None:
        return mixed_layer_norm_reference(x, normalized_shape, weight, bias, eps)
    x2d = x.reshape(-1, hidden).contiguous()  # (rows, hidden)
    y = _MixedLayerNormFunction.apply(x2d, weight.reshape(-1).contiguous(), bias.reshape(-1).contiguous(), eps, module)
    return y.view(x.shape)


class MixedFusedLayerNorm(torch.nn.Module):
    """torch.nn.LayerNorm with fp32 parameters and statistics for fp16/bf16 activations; output in input dtype.

    y = (x - E[x]) / sqrt(Var[x] + eps) * weight + bias over the trailing normalized_shape dims.
    """

    def __init__(
        self,
        normalized_shape: Union[int, Sequence[int]],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if dtype is not None and dtype != torch.float32:
            raise ValueError(
                f"MixedFusedLayerNorm keeps its parameters in float32; got dtype={dtype}. "
                "Pass dtype=None (activations may still be fp16/bf16)."
            )
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(int(d) for d in normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=torch.float32))
            if bias:
                self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=torch.float32))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mixed_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
