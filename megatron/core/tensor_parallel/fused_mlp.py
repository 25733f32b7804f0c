"""The MLP with GeLU's gradient in the epilogue of its 4h -> h dgrad GEMM (--gemm-epilogues, cuBLASLt):

    y = GeLU_tanh(x W1^T + b1) W2^T               on one rank's slices: W1 (F/p, H), b1 (F/p), W2 (H, F/p)

    forward   pre = x W1^T + b1,  h = GeLU_tanh(pre),  y = h W2^T     (a compiled block fuses the bias + GeLU)
    backward  d_pre = gemm_dgelu(dy, W2, pre)          = (dy W2) GeLU_tanh'(pre) in one GEMM kernel, where autograd
                                                         runs the GEMM and then a GeLU-backward kernel
              dW2 = dy^T h,  dW1 = d_pre^T x,  db1 = sum d_pre,  dx = d_pre W1

h and pre are kept for backward, the two (tokens, F/p) tensors autograd keeps for the unfused MLP. With gradient
accumulation fusion (grad_accumulation.py) dW1 and dW2 are added into `.grad` by their GEMMs (beta = 1) where
fusable(). Everything is local to the rank: the caller copies x into the TP region, all-reduces y and adds the
4h -> h bias (RowParallelLinear's order), where a compiled block fuses it with the residual add.
"""
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from megatron.core.tensor_parallel.grad_accumulation import fusable
from megatron.fused_kernels import gemm_epilogue


def _weight_grad(grad, dy, x):
    """dy^T x, or None after adding it into grad (the fused .grad) by the GEMM."""
    if grad is None:
        return dy.t().mm(x)
    torch.ops.megatron.wgrad_accumulate_(grad, dy, x)
    return None


class _GeluMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, grad1, grad2):
        x2 = x.reshape(-1, x.shape[-1])
        pre = torch.addmm(b1, x2, w1.t())
        h = F.gelu(pre, approximate="tanh")
        ctx.save_for_backward(x2, w1, w2, h, pre)
        ctx.grads, ctx.x_shape = (grad1, grad2), x.shape  # .grad: not saved (grad_accumulation.py says why)
        return h.mm(w2.t()).view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x2, w1, w2, h, pre = ctx.saved_tensors
        grad1, grad2 = ctx.grads
        dy2 = dy.reshape(-1, dy.shape[-1])
        d_pre = torch.ops.megatron.gemm_dgelu(dy2, w2, pre)
        dx = d_pre.mm(w1).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        return dx, _weight_grad(grad1, d_pre, x2), d_pre.sum(0), _weight_grad(grad2, dy2, h), None, None


def serves(x, w1, b1, w2):
    """Whether gelu_mlp serves this call: recording gradients for every parameter, operands that the epilogue
    GEMM takes (gemm_epilogue.usable), gradients in the parameters' dtype."""
    params = [w1, b1, w2]
    return (torch.is_grad_enabled() and all(p.requires_grad for p in params)
            and gemm_epilogue.usable(x, *params) and all(p.grad is None or p.grad.dtype == p.dtype for p in params))


def gelu_mlp(x, w1, b1, w2, fuse=True):
    """GeLU_tanh(x W1^T + b1) W2^T with the epilogue GEMM in backward (the caller checked serves()); fuse: weight
    gradients into `.grad` where fusable() (--gradient-accumulation-fusion)."""
    grad1 = w1.grad if fusable(w1, fuse) else None
    grad2 = w2.grad if fusable(w2, fuse) else None
    return _GeluMLP.apply(x, w1, b1, w2, grad1, grad2)
