"""Causal ALiBi attention behind one interface, with several backends chosen by --attention-impl.

    torch  reference: fp32 softmax of (q k^T * scale + slope_h * j) under the causal mask
    sdpa   torch.nn.functional.scaled_dot_product_attention with the ALiBi bias as a float mask
    flex   FlexAttention (compiled) with ALiBi as score_mod and a causal block mask (CUDA)
    fused  our csrc softmax kernel with the ALiBi bias folded in (CUDA, bf16/fp16)
    cudnn  cuDNN's fused attention with its own ALiBi (megatron/model/cudnn_attention.py): self-attention
           without padding or attention dropout, CUDA bf16/fp16, when the rank's slopes are cuDNN's (TP 1);
           ParallelAttention hands it the fused QKV output whole
    auto   cudnn where it serves and is installed; else flex on CUDA for self-attention over a multiple of 128
           positions (training's fixed shapes: one compilation per sequence length), sdpa for every other call
           (a KV cache's growing key length, odd lengths, padding masks, the CPU), so it never recompiles per
           length; megatron.inference decodes with its own fixed-shape attention

Queries are the last sq positions of sk keys (sk > sq with a KV cache): query i sees keys j <= i + sk - sq.
An optional key padding mask (B, sk), True for real tokens, excludes padded keys.
"""
import contextlib
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.model import cudnn_attention

logger = logging.getLogger(__name__)
_LOGGED = set()

# Measurement knobs for tools/benchmark_training.py --attention-variants (None: torch's defaults). Not flags: the
# backend stays automatic, and these let one benchmark compare the exact ALiBi options on the device.
FLEX_KERNEL_OPTIONS = None  # FlexAttention kernel_options, e.g. {"BLOCK_M": 128, "BLOCK_N": 64}
SDPA_BACKENDS = None  # list of torch.nn.attention.SDPBackend names the sdpa backend may use, e.g. ["CUDNN_ATTENTION"]
FLEX_COMPILE_MODE = None  # torch.compile mode of FlexAttention, e.g. "max-autotune-no-cudagraphs" (read at first use)


def _log_once(message):
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)


def alibi_bias(slopes, sq, sk, key_padding_mask=None, dtype=torch.float32):
    """(B or 1, nh, sq, sk) additive bias: slope_h * (j - i) where allowed, the dtype's minimum where masked."""
    device = slopes.device
    j = torch.arange(sk, device=device)
    i = torch.arange(sq, device=device) + (sk - sq)
    allowed = (j[None, :] <= i[:, None])[None, None]  # (1, 1, sq, sk)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :].bool()
    # slope * (j - i): softmax ignores the per-row constant -slope * i, and keeping the values near the diagonal
    # small keeps them exact in bf16 (slope * j rounds to steps of 4 at j ~ 1000).
    distance = (j[None, :] - i[:, None]).float()  # (sq, sk)
    bias = slopes.float()[None, :, None, None] * distance  # (1, nh, sq, sk)
    bias = bias.expand(allowed.shape[0], -1, -1, -1)
    return bias.masked_fill(~allowed, torch.finfo(torch.float32).min).to(dtype)


def torch_attention(q, k, v, slopes, scale, dropout_p, key_padding_mask=None):
    """Reference: q (B, nh, sq, hd), k/v (B, nh, sk, hd) -> (B, nh, sq, hd); softmax in fp32."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # (B, nh, sq, sk)
    scores = scores + alibi_bias(slopes, q.shape[2], k.shape[2], key_padding_mask)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)


_SLOPES_KEYS = WeakIdKeyDictionary()


def _slopes_key(slopes):
    """(device, slope values) of a slopes tensor; read from the device once per tensor object, not per call (a
    .tolist() of a CUDA tensor is a host sync: one per layer and micro batch would stall the launch queue)."""
    if slopes not in _SLOPES_KEYS:
        _SLOPES_KEYS[slopes] = (str(slopes.device), tuple(slopes.tolist()))
    return _SLOPES_KEYS[slopes]


@functools.lru_cache(maxsize=8)
def _shared_alibi_bias(key, sq, sk, dtype):
    """One (1, nh, sq, sk) bias per slope set and shape, shared by every layer (one tensor saved for backward,
    not one per layer)."""
    device, values = key
    return alibi_bias(torch.tensor(values, device=device), sq, sk, dtype=dtype).contiguous()


def _sdpa_backends():
    if SDPA_BACKENDS is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, name) for name in SDPA_BACKENDS])


def sdpa_attention(q, k, v, slopes, scale, dropout_p, key_padding_mask=None):
    # Materialised: cuDNN's SDPA gave wrong results (25% relative error on the H200) for a broadcast (stride-0) bias.
    if key_padding_mask is None and q.is_cuda:
        bias = _shared_alibi_bias(_slopes_key(slopes), q.shape[2], k.shape[2], q.dtype)
    else:
        bias = alibi_bias(slopes, q.shape[2], k.shape[2], key_padding_mask, dtype=q.dtype).contiguous()
    with _sdpa_backends():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)


def plan_free_attention(device):
    """SDPA without its cuDNN backend on CUDA, for calls whose shapes vary (a prefill's group size and prompt
    length, evaluation's batches): cuDNN builds an execution plan for every new shape (60-90 ms of host time for the
    1.72B model's 24 layers, measured on the H100), the memory-efficient kernel takes the ALiBi bias as it is."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False, mode=FLEX_COMPILE_MODE)


@functools.lru_cache(maxsize=16)
def _causal_block_mask(sq, sk, device):
    from torch.nn.attention.flex_attention import create_block_mask
    offset = sk - sq

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset
    return create_block_mask(causal, B=None, H=None, Q_LEN=sq, KV_LEN=sk, device=device)


_SCORE_MODS = {}


def _alibi_score_mod(slopes):
    """One score_mod per distinct slope set, so the compiled kernel is reused by every layer."""
    key = _slopes_key(slopes)
    if key not in _SCORE_MODS:
        captured = slopes.float().clone()

        def alibi(score, b, h, q_idx, kv_idx):
            return score + captured[h] * kv_idx
        _SCORE_MODS[key] = alibi
    return _SCORE_MODS[key]


def flex_attention(q, k, v, slopes, scale, dropout_p, key_padding_mask=None):
    block_mask = _causal_block_mask(q.shape[2], k.shape[2], str(q.device))
    return _compiled_flex()(q, k, v, score_mod=_alibi_score_mod(slopes), block_mask=block_mask, scale=scale,
                            kernel_options=FLEX_KERNEL_OPTIONS)


CUDNN = "cudnn"  # block_attention_inputs' answer when ParallelAttention hands the fused QKV output to cuDNN


def block_attention_inputs(core, seq_len, device, dtype):
    """What a transformer block compiled as a whole (BloomBlock with --compile-blocks) hands to attend_in_graph for
    self-attention over seq_len positions, built outside the compiled region (cached, shared by every layer):
    CUDNN where cuDNN serves, (block_mask, score_mod, None) for flex, (None, None, bias) for sdpa; None where
    none serves (another backend, or attention dropout while training)."""
    if core.training and core.attention_dropout > 0:
        return None
    if core.cudnn_serves(device, dtype):
        return CUDNN
    impl = core.impl if core.impl not in ("auto", "cudnn") else ("flex" if seq_len % 128 == 0 else "sdpa")
    if impl not in ("flex", "sdpa"):
        return None
    if core.slopes.device != device:
        core.slopes = core.slopes.to(device)
    if impl == "flex":
        return _causal_block_mask(seq_len, seq_len, str(device)), _alibi_score_mod(core.slopes), None
    return None, None, _shared_alibi_bias(_slopes_key(core.slopes), seq_len, seq_len, dtype)


def attend_in_graph(q, k, v, scale, block_mask, score_mod, bias):
    """Causal ALiBi self-attention traced into the caller's torch.compile graph (inputs from
    block_attention_inputs): FlexAttention lowered by inductor, or SDPA with the shared bias."""
    if block_mask is not None:
        from torch.nn.attention.flex_attention import flex_attention as flex
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                    kernel_options=FLEX_KERNEL_OPTIONS)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def fused_attention(q, k, v, slopes, scale, dropout_p, key_padding_mask=None):
    from megatron import fused_kernels
    scores = torch.matmul(q, k.transpose(-1, -2))  # (B, nh, sq, sk), unscaled
    probs = fused_kernels.alibi_causal_softmax(scores, slopes, scale)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)


BACKENDS = {"torch": torch_attention, "sdpa": sdpa_attention, "flex": flex_attention, "fused": fused_attention}


def resolve_backend(impl, q, dropout_p, key_padding_mask, abort_on_unmet=False, sk=None):
    """The backend that serves this call, honouring `impl` where it can; logs each fallback once.

    With abort_on_unmet (--abort-on-unmet-fused-kernel-constraints) a call the fused path cannot serve raises.
    sk: the key length (default: the query length).
    """
    if impl == "cudnn":  # cuDNN takes the fused QKV output in ParallelAttention; a call that reaches here it cannot serve
        _log_once("attention: cudnn serves self-attention without padding or dropout at TP 1 (with "
                  "nvidia-cudnn-frontend installed); using auto for this call")
        impl = "auto"
    if impl == "auto":
        sq = q.shape[2]
        fixed_shape = (sk is None or sk == sq) and sq % 128 == 0 and key_padding_mask is None and dropout_p == 0
        impl = "flex" if q.is_cuda and fixed_shape else "sdpa"
    if impl == "flex" and (not q.is_cuda or dropout_p > 0 or key_padding_mask is not None):
        _log_once("attention: flex needs CUDA, no attention dropout and no padding mask; using sdpa")
        impl = "sdpa"
    if impl == "fused" and (not q.is_cuda or q.dtype == torch.float32 or key_padding_mask is not None):
        if abort_on_unmet:
            raise RuntimeError("--attention-impl fused needs CUDA bf16/fp16 scores without a padding mask (got "
                               f"{q.device.type} {str(q.dtype).replace('torch.', '')}"
                               f"{', a padding mask' if key_padding_mask is not None else ''}) and "
                               "--abort-on-unmet-fused-kernel-constraints is set")
        _log_once("attention: the fused softmax needs CUDA bf16/fp16 without a padding mask; using sdpa")
        impl = "sdpa"
    return impl


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + ALiBi) v for this rank's heads; dropout draws from the model-parallel RNG."""

    def __init__(self, slopes, head_dim, attention_dropout=0.0, impl="auto", abort_on_unmet=False):
        super().__init__()
        # Kept out of the buffers on purpose: module.bfloat16() must not round the slopes.
        self.slopes = slopes.float()
        self.scale = head_dim ** -0.5
        self.attention_dropout = attention_dropout
        self.impl = impl
        self.abort_on_unmet = abort_on_unmet
        # Decided once from the slopes (host values at construction): cuDNN computes its own.
        self.cudnn_slopes = cudnn_attention.slopes_match(tuple(self.slopes.tolist()))
        _log_once(f"attention: --attention-impl {impl}")

    def cudnn_serves(self, device, dtype, key_padding_mask=None):
        """Whether ParallelAttention should hand this self-attention to cuDNN (megatron/model/cudnn_attention.py)."""
        return (self.impl in ("auto", "cudnn") and self.cudnn_slopes and key_padding_mask is None
                and not (self.training and self.attention_dropout > 0)
                and cudnn_attention.serves(self.scale, dtype, device))

    def forward(self, q, k, v, key_padding_mask=None):
        if self.slopes.device != q.device:
            self.slopes = self.slopes.to(q.device)
        dropout_p = self.attention_dropout if self.training else 0.0
        backend = BACKENDS[resolve_backend(self.impl, q, dropout_p, key_padding_mask, self.abort_on_unmet,
                                           sk=k.shape[2])]
        if dropout_p > 0:
            with get_rng_tracker().fork():
                return backend(q, k, v, self.slopes, self.scale, dropout_p, key_padding_mask)
        return backend(q, k, v, self.slopes, self.scale, 0.0, key_padding_mask)
