"""Fused CUDA kernels for BLOOM training (ALiBi softmax, mixed-precision LayerNorm, cross entropy) with torch
fallbacks.

Call load_fused_kernels(args.abort_on_unmet_fused_kernel_constraints) once at start-up; the functions
below then pick the kernel or the torch fallback per call (the first call loads the kernels if needed).
"""
from megatron.fused_kernels.cross_entropy import cross_entropy_reference, fused_cross_entropy
from megatron.fused_kernels.layer_norm import (
    MixedFusedLayerNorm,
    mixed_layer_norm,
    mixed_layer_norm_reference,
)
from megatron.fused_kernels.loader import ABORT_FLAG, load_fused_kernels
from megatron.fused_kernels.softmax import (
    alibi_causal_softmax,
    alibi_causal_softmax_reference,
    alibi_masked_softmax,
    alibi_masked_softmax_reference,
    causal_mask,
)

__all__ = [
    "ABORT_FLAG",
    "MixedFusedLayerNorm",
    "alibi_causal_softmax",
    "alibi_causal_softmax_reference",
    "alibi_masked_softmax",
    "alibi_masked_softmax_reference",
    "causal_mask",
    "cross_entropy_reference",
    "fused_cross_entropy",
    "load_fused_kernels",
    "mixed_layer_norm",
    "mixed_layer_norm_reference",
]
