"""Gradient accumulation fusion: weight gradients summed straight into `.grad`, with no separate gradient tensor.

Without it, each micro batch's backward hands autograd a fresh dW and AccumulateGrad adds it into `.grad`: one
elementwise add over every weight per micro batch (for the tied word embedding, a V x H dense gradient as well, and
the sum of its two gradients). With it, once `.grad` exists (from the first micro batch after the optimizer set it
to None, which autograd handles as before: it keeps the first gradient without an add):

    linear_with_grad_accumulation    Y = X W^T + b; backward: dX = dY W, db = sum dY (returned as usual) and
                                     .grad += dY^T X as one GEMM with beta = 1 (addmm_ with .grad as its output)
    embedding_with_grad_accumulation Y = W[ids]; backward: the rows of dY index_put_ into .grad (accumulate=True: the
                                     CUDA kernel sums each row's duplicates in fp32 and adds them once,
                                     deterministically), where autograd builds a dense V x H gradient and adds it

and autograd gets None for W. The choice is made in forward, by whether `.grad` exists, so a torch.compile'd region
(--compile-blocks) holds it as a guard (one graph for the first micro batch, one for the others): the GEMM into
`.grad` is the custom op megatron::wgrad_accumulate_, which inductor calls in place on the `.grad` input of the
backward graph, with no graph break and no copy.

Hooks: a fused parameter's AccumulateGrad receives nothing, so its hooks would not run. DeepSpeed 0.19.8 moves
gradients out of `.grad` in post-accumulate-grad hooks at ZeRO 3 always, at ZeRO 1/2 with contiguous_gradients (its
default), overlap_comm, partitioned gradients or another accumulation dtype, and in BF16_Optimizer (bf16 with
PP > 1, or fp32 accumulation at ZeRO 1) with bf16.immediate_grad_update (off by default); a parameter with any
gradient hook (tensor or post-accumulate-grad) is therefore left to autograd. The wrappers without hooks
are served: torch's optimizer at fp32 ZeRO 0 and FP16_UnfusedOptimizer at bf16/fp16 ZeRO 0 read `.grad` at the
step and set it to None after; BF16_Optimizer without immediate_grad_update zeroes `.grad` in place before each
backward and adds it into its fp32 buffer after. Either suits the fused path, which adds into whatever `.grad`
holds when backward runs: the tensor is kept on ctx, not saved for backward, whose version check would reject
that zeroing (and the tied word embedding's two additions into one `.grad`).

Numerics: the first micro batch is autograd's own. Each later one rounds once, inside the GEMM (beta = 1) or the
index_put_, where autograd rounds dW and then the sum: equal up to that rounding
(tests/unit/core/test_grad_accumulation.py).
"""
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


@torch.library.custom_op("megatron::wgrad_accumulate_", mutates_args=("grad",))
def _wgrad_accumulate_(grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    """grad += dy^T x, one GEMM with beta = 1: dy (tokens, out), x (tokens, in), grad (out, in)."""
    grad.addmm_(dy.t(), x)


def fusable(param, fuse=True):
    """Whether param's gradient may bypass AccumulateGrad in this forward's backward: fusion on, a gradient being
    recorded, `.grad` there to add into and no hook relying on AccumulateGrad."""
    return (fuse and torch.is_grad_enabled() and param.requires_grad and param.grad is not None
            and not param._backward_hooks and not getattr(param, "_post_accumulate_grad_hooks", None))


def _flat(t):
    return t.reshape(-1, t.shape[-1])  # (..., n) -> (tokens, n)


class _LinearWithGradAccumulation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, grad):
        ctx.save_for_backward(x, weight)
        ctx.grad, ctx.has_bias = grad, bias is not None  # .grad not saved: see the module docstring
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[2] else None
        torch.ops.megatron.wgrad_accumulate_(ctx.grad, _flat(dy), _flat(x))
        return dx, None, db, None


class _EmbeddingWithGradAccumulation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, grad):
        ctx.save_for_backward(ids)
        ctx.grad = grad  # not saved: see the module docstring
        return F.embedding(ids, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        ids, = ctx.saved_tensors
        ctx.grad.index_put_((ids.reshape(-1),), _flat(dy), accumulate=True)
        return None, None, None


def linear_with_grad_accumulation(x, weight, bias=None, fuse=True):
    """F.linear(x, weight, bias) whose weight gradient is added into weight.grad by its GEMM where fusable()."""
    if not fusable(weight, fuse):
        return F.linear(x, weight, bias)
    return _LinearWithGradAccumulation.apply(x, weight, bias, weight.grad)


def embedding_with_grad_accumulation(ids, weight, fuse=True):
    """F.embedding(ids, weight) whose weight gradient is added into weight.grad row by row where fusable() (eager
    only: the embedding is never inside a compiled region)."""
    if not fusable(weight, fuse):
        return F.embedding(ids, weight)
    return _EmbeddingWithGradAccumulation.apply(ids, weight, weight.grad)
