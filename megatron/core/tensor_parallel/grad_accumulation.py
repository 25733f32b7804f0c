"""Gradient accumulation fusion: weight gradients summed straight into `.grad`, with no separate gradient tensor.

Without it, each micro batch's backward hands autograd a fresh dW and AccumulateGrad adds it into `.grad`: one
elementwise add over every weight per micro batch (for the tied word embedding, a V x H dense gradient as well).
With it:

    linear_with_grad_accumulation    Y = X W^T + b; backward: dX = dY W, db = sum dY (returned as usual),
                                     dW: .grad = dY^T X on the first micro batch, then .grad += dY^T X as one GEMM
                                     with beta = 1 (addmm_ with .grad as its output)
    embedding_with_grad_accumulation Y = W[ids]; backward: .grad = the embedding gradient on the first micro batch,
                                     then the rows of dY index_put_ into .grad (accumulate=True: the CUDA kernel sums
                                     each row's duplicates in fp32 and adds them to .grad once, deterministically)

and autograd gets None for W. A parameter's AccumulateGrad never runs, so its hooks would not either: DeepSpeed's
ZeRO 1-3 optimizers and BF16_Optimizer (bf16 at ZeRO 0 with PP > 1) move gradients out of `.grad` in
post-accumulate-grad hooks. The fused path therefore serves a parameter only while it has no hook (tensor hooks or
post-accumulate-grad hooks), in a backward without create_graph; otherwise dW is returned to autograd as without
fusion. The wrappers without hooks, which read `.grad` at the step (torch's optimizer at fp32 ZeRO 0,
FP16_UnfusedOptimizer at bf16/fp16 ZeRO 0), are served; they set `.grad` to None after each step, which the first
micro batch's assignment expects.

Numerics: the first micro batch's `.grad` equals the unfused one exactly (the same GEMM, the same embedding
backward); each later addition rounds once, inside the GEMM (beta = 1) or the index_put_, where the unfused path
rounds dW and then the sum: equal up to that rounding (tests/unit/core/test_grad_accumulation.py).

Not used inside a torch.compile'd region (--compile-blocks): a Python side effect on `.grad` in backward is a graph
break in dynamo, so under compilation the layers trace the plain ops and autograd accumulates.
"""
import torch
import torch.nn.functional as F


def fusable(param):
    """Whether param's gradient may bypass AccumulateGrad now: no hook relies on it, no graph of the gradient."""
    return (not torch.is_grad_enabled() and not param._backward_hooks
            and not getattr(param, "_post_accumulate_grad_hooks", None))


def _flat(t):
    return t.reshape(-1, t.shape[-1])  # (..., n) -> (tokens, n)


class _LinearWithGradAccumulation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dy2, x2 = _flat(dy), _flat(x)  # (tokens, out), (tokens, in)
        if not fusable(weight):
            return dx, dy2.t().mm(x2), db
        if weight.grad is None:
            weight.grad = dy2.t().mm(x2)  # (out, in), contiguous like the weight
        else:
            weight.grad.addmm_(dy2.t(), x2)
        return dx, None, db


class _EmbeddingWithGradAccumulation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.num_weights = weight.shape[0]
        ctx.weight = weight  # the parameter itself (its .grad), not a saved tensor: it is only written to
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        ids, = ctx.saved_tensors
        weight = ctx.weight
        if weight.grad is None or not fusable(weight):
            dw = torch.ops.aten.embedding_dense_backward(dy, ids, ctx.num_weights, -1, False)
            if not fusable(weight):
                return None, dw
            weight.grad = dw
        else:
            weight.grad.index_put_((ids.reshape(-1),), _flat(dy), accumulate=True)
        return None, None


def linear_with_grad_accumulation(x, weight, bias=None, fuse=True):
    """F.linear(x, weight, bias) whose weight gradient accumulates into weight.grad (see the module docstring);
    fuse=False, or inside a compiled region: F.linear itself."""
    if not fuse or torch.compiler.is_compiling() or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight, bias)
    return _LinearWithGradAccumulation.apply(x, weight, bias)


def embedding_with_grad_accumulation(ids, weight, fuse=True):
    """F.embedding(ids, weight) whose weight gradient accumulates into weight.grad; fuse=False: F.embedding."""
    if not fuse or torch.compiler.is_compiling() or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.embedding(ids, weight)
    return _EmbeddingWithGradAccumulation.apply(ids, weight)
