"""The MLP's dgrad GEMM with GeLU's gradient in its cuBLASLt epilogue (csrc/fused_kernels/gemm_epilogue.cpp), as
a torch custom op (opaque to torch.compile, so a compiled block calls it with no graph break):

    megatron::gemm_dgelu(dy, w, pre) -> (dy w) * GeLU_tanh'(pre)        dy (tokens, H), w (H, F/p), pre (tokens, F/p)

Off CUDA, without the built kernels, or where cuBLASLt has no algorithm for the epilogue, the same maths runs as
ATen ops (mm, gelu_backward); the csrc counts the last case (fallbacks()).

Measured on an H100 in the training step (the document's model, `tools/benchmark_training.py --compile-blocks`,
benchmarks/results/h100_2026-12-06-late.md): cuBLASLt runs DGELU inside its GEMM kernel (470 us per call at 8192
tokens, against 417 us for the plain dgrad GEMM plus 132 us for the compiled block's GeLU-backward kernel). Its other
epilogues were slower where they would serve: DGELU_BGRAD (the bias gradient too) and BGRADB (a weight gradient's
bias gradient) run as separate cuBLASLt kernels after the GEMM (975 against 571 us), and the forward's
GELU_AUX_BIAS GEMM took longer than the plain GEMM plus the compiled block's bias + GeLU kernel.
"""
import torch

from megatron.fused_kernels.loader import kernel_module_or_fallback

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def usable(*tensors):
    """Whether the epilogue GEMM serves these operands: CUDA, one dtype among fp32/fp16/bf16, autocast off (the op
    takes its operands as they are)."""
    first = tensors[0]
    return (first.is_cuda and first.dtype in DTYPES and not torch.is_autocast_enabled("cuda")
            and all(t.is_cuda and t.dtype == first.dtype for t in tensors))


def _module(t):
    return kernel_module_or_fallback(None) if t.is_cuda else None


def fallbacks():
    """How many epilogue GEMMs found no cuBLASLt algorithm and ran as ATen ops (0 without the built kernels)."""
    module = _module(torch.empty(0, device="cuda")) if torch.cuda.is_available() else None
    return module.gemm_epilogue_fallbacks() if module is not None else 0


@torch.library.custom_op("megatron::gemm_dgelu", mutates_args=())
def gemm_dgelu(dy: torch.Tensor, weight: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    module = _module(dy)
    if module is None:
        return torch.ops.aten.gelu_backward(dy.mm(weight), pre, approximate="tanh")
    return module.gemm_dgelu(dy.contiguous(), weight.contiguous(), pre.contiguous())


@gemm_dgelu.register_fake
def _(dy, weight, pre):
    return torch.empty_like(pre)
