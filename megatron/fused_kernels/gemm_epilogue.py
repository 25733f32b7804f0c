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
import torch
import torch.nn.functional as F

from megatron.fused_kernels.loader import kernel_module_or_fallback

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


def _ops(t):
    reason = unserved_reason(t)
    module = kernel_module_or_fallback(reason) if reason is None else None
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


def available(t):
    """Whether the csrc epilogues serve tensors like t (built, CUDA, a kernel dtype); loads the kernels once."""
    return unserved_reason(t) is None and kernel_module_or_fallback(None) is not None
