"""The MLP's GeLU inside its GEMMs (cuBLASLt epilogues), as torch custom ops that torch.compile keeps whole:

    megatron::gemm_bias_gelu(x, w, b)        -> (gelu_tanh(x w^T + b), x w^T + b)   the h -> 4h GEMM, forward
    megatron::gemm_dgelu_bgrad(g, w, pre)    -> (gelu_tanh'(pre) * (g w), column sums of that)
                                                                                    the 4h -> h dgrad GEMM, backward

On CUDA (fp32, fp16, bf16) the csrc module runs them (csrc/fused_kernels/gemm_epilogue.cpp: GELU_AUX_BIAS and
DGELU_BGRAD, computed on the fp32 accumulator before rounding); elsewhere TorchGemmEpilogueOps, the same maths as
the unfused MLP (a GEMM with its bias, then GeLU; GeLU's backward of the rounded product), which is the reference
the kernels are tested against. The forward's GeLU and the backward's GeLU gradient and bias gradient then cost no
pass over the (tokens, 4h) activations of their own. megatron.core.tensor_parallel.grad_accumulation.gelu_mlp is
the autograd function built on them.
"""
import logging

import torch
import torch.nn.functional as F

from megatron.fused_kernels.loader import kernel_module_or_fallback

logger = logging.getLogger(__name__)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SELF_CHECKED = {}  # (device, dtype) -> whether the csrc epilogues passed their start-up check there


class TorchGemmEpilogueOps:
    """The two ops in torch, with the csrc module's signatures."""

    @staticmethod
    def gemm_bias_gelu(x, weight, bias):
        pre = torch.addmm(bias, x, weight.t())
        return F.gelu(pre, approximate="tanh"), pre

    @staticmethod
    def gemm_dgelu_bgrad(grad, weight, pre):
        grad_pre = torch.ops.aten.gelu_backward(grad.mm(weight), pre, approximate="tanh")
        return grad_pre, grad_pre.sum(0)


def unserved_reason(t):
    """Why the csrc epilogues cannot serve tensors like t (None if they can)."""
    if not t.is_cuda:
        return "GEMM epilogues need CUDA tensors"
    if t.dtype not in KERNEL_DTYPES:
        return f"GEMM epilogues do not take {t.dtype}"
    return None


def _module():
    """The csrc module if it was built with the epilogues (a build without them keeps the other kernels)."""
    module = kernel_module_or_fallback(None)
    return module if module is not None and hasattr(module, "gemm_bias_gelu") else None


def _ops(t):
    module = _module() if unserved_reason(t) is None else None
    return module if module is not None else TorchGemmEpilogueOps


@torch.library.custom_op("megatron::gemm_bias_gelu", mutates_args=())
def gemm_bias_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (tokens, k), weight (m, k), bias (m,) -> (GeLU output, pre-activation), both (tokens, m)."""
    out, pre = _ops(x).gemm_bias_gelu(x.contiguous(), weight.contiguous(), bias.contiguous())
    return out, pre


@gemm_bias_gelu.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("megatron::gemm_dgelu_bgrad", mutates_args=())
def gemm_dgelu_bgrad(grad: torch.Tensor, weight: torch.Tensor,
                     pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grad (tokens, k) of the 4h -> h output, weight (k, m), pre (tokens, m) -> (gradient of the pre-activation
    (tokens, m), the h -> 4h bias gradient (m,))."""
    grad_pre, grad_bias = _ops(grad).gemm_dgelu_bgrad(grad.contiguous(), weight.contiguous(), pre.contiguous())
    return grad_pre, grad_bias


@gemm_dgelu_bgrad.register_fake
def _(grad, weight, pre):
    return grad.new_empty(grad.shape[0], weight.shape[1]), grad.new_empty(weight.shape[1])


def _self_check(device, dtype):
    """Runs both csrc ops once on a small problem against TorchGemmEpilogueOps in fp32: False (with one warning
    naming the cause) if they fail or disagree, so that the MLP stays unfused rather than wrong."""
    module = _module()
    if module is None:
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    x, grad = (torch.randn(64, 96, device=device, generator=gen).to(dtype) for _ in range(2))
    w_up, w_down = (torch.randn(shape, device=device, generator=gen).mul(0.1).to(dtype) for shape in
                    ((128, 96), (96, 128)))
    bias = torch.randn(128, device=device, generator=gen).to(dtype)
    try:
        got = [*module.gemm_bias_gelu(x, w_up, bias)]
        got += module.gemm_dgelu_bgrad(grad, w_down, got[1])
    except RuntimeError as exc:
        logger.warning("GEMM epilogues not used on %s for %s: %s", device, dtype, str(exc).splitlines()[0])
        return False
    fp32 = [t.float() for t in (x, w_up, bias, grad, w_down)]
    want = [*TorchGemmEpilogueOps.gemm_bias_gelu(*fp32[:3])]
    want += TorchGemmEpilogueOps.gemm_dgelu_bgrad(fp32[3], fp32[4], got[1].float())
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    errors = [((g.float() - w).norm() / w.norm()).item() for g, w in zip(got, want)]
    if not all(e <= tolerance for e in errors):  # also catches NaN
        logger.warning("GEMM epilogues not used on %s for %s: relative errors %s against torch exceed %g", device,
                       dtype, ", ".join(f"{e:.2e}" for e in errors), tolerance)
        return False
    return True


def available(t):
    """Whether the csrc epilogues serve tensors like t: CUDA, a kernel dtype, the kernels built with the epilogues
    and their start-up check passed on t's device for t's dtype (run once each)."""
    if unserved_reason(t) is not None:
        return False
    key = (t.device, t.dtype)
    if key not in _SELF_CHECKED:
        _SELF_CHECKED[key] = _self_check(t.device, t.dtype)
    return _SELF_CHECKED[key]
