"""Fused elementwise regions of the BLOOM block: torch.compile'd (one Triton kernel forward, one backward) on CUDA.

The three regions around the block's GEMMs, with the linear layers' biases folded in (the GEMMs run without
their bias, as Megatron's skip_bias_add), so the bias gradient is reduced inside the region's backward kernel:

    bias_gelu(y, b)                               = GeLU_tanh(y + b)                      (MLP, 4h/p wide)
    bias_dropout_add(y, b, r, p)                  = r + dropout_p(y + b)                  (block output)
    bias_dropout_add_layer_norm(y, b, r, w, c, p) = (x, LN_{w,c}(x)) with x = r + dropout_p(y + b)
                                                                                          (after attention)

The LayerNorm is computed in fp32 and returned in x's dtype (as torch's bf16 LayerNorm does). On CUDA with p = 0
each region is a torch.compile'd function (fixed shapes: compiled once per shape, forward and backward); with
dropout (p > 0 while training) or off CUDA the same maths runs as eager torch ops, so dropout draws from the
global RNG exactly as the unfused block does (activation checkpointing's recomputation replays it).
Everything is local to one rank: under tensor parallelism y is the row-parallel output after its all-reduce (or
the column-parallel slice for bias_gelu) and b the matching bias.
"""
import functools

import torch
import torch.nn.functional as F


def bias_gelu_reference(y, bias):
    return F.gelu(y + bias, approximate="tanh")


def bias_dropout_add_reference(y, bias, residual, p=0.0, training=False):
    return residual + F.dropout(y + bias, p=p, training=training)


def bias_dropout_add_layer_norm_reference(y, bias, residual, weight, ln_bias, eps, p=0.0, training=False):
    x = bias_dropout_add_reference(y, bias, residual, p, training)
    return x, _layer_norm(x, weight, ln_bias, eps)


def _layer_norm(x, weight, bias, eps):
    """LayerNorm over the last dim in fp32, returned in x's dtype (weight/bias of any float dtype)."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def _bias_add(y, bias, residual):
    return residual + (y + bias)


def _bias_add_layer_norm(y, bias, residual, weight, ln_bias, eps):
    x = residual + (y + bias)
    return x, _layer_norm(x, weight, ln_bias, eps)


_REGIONS = {"bias_gelu": bias_gelu_reference, "bias_add": _bias_add, "bias_add_layer_norm": _bias_add_layer_norm}


@functools.lru_cache(maxsize=None)
def compiled(name):
    """The torch.compile'd region `name` (compiled lazily, at its first call, once per input shape and dtype)."""
    return torch.compile(_REGIONS[name], dynamic=False, fullgraph=True)


def _use_compiled(y, p, training):
    return y.is_cuda and not (training and p > 0)


def bias_gelu(y, bias):
    """GeLU_tanh(y + bias): one kernel forward; backward one kernel for grad y and the bias gradient."""
    return compiled("bias_gelu")(y, bias) if y.is_cuda else bias_gelu_reference(y, bias)


def bias_dropout_add(y, bias, residual, p=0.0, training=False):
    """residual + dropout_p(y + bias)."""
    if _use_compiled(y, p, training):
        return compiled("bias_add")(y, bias, residual)
    return bias_dropout_add_reference(y, bias, residual, p, training)


def bias_dropout_add_layer_norm(y, bias, residual, weight, ln_bias, eps, p=0.0, training=False):
    """(x, LayerNorm(x)) with x = residual + dropout_p(y + bias): the residual stream and the next sublayer's input."""
    if _use_compiled(y, p, training):
        return compiled("bias_add_layer_norm")(y, bias, residual, weight, ln_bias, eps)
    return bias_dropout_add_layer_norm_reference(y, bias, residual, weight, ln_bias, eps, p, training)
