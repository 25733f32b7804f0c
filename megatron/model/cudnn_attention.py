"""Causal ALiBi self-attention through cuDNN's fused attention (its own ALiBi), forward and backward.

cuDNN's SDPA adds slope_h * (j - i) to the scaled scores with slope_h = 2^(-8 (h + 1) / n) for n heads (and the
interleaved slopes of 2n heads past the largest power of two): the same slopes as BLOOM's, and under the causal
mask softmax ignores the row constant -slope_h * i, so the result is BLOOM's attention. cuDNN computes the slopes
from the head count it is given, so it serves a rank only when its heads are all the model's heads (TP 1):
`serves()` checks the rank's slopes against cuDNN's formula, and attention falls back to FlexAttention otherwise.

The operator takes the fused projection's output as it lies, (B, S, heads, 3, head_dim), and returns (B, S, heads,
head_dim), ready for the dense projection: cuDNN reads q, k, v through strides and writes dq, dk, dv into one
(B, S, heads, 3, head_dim) gradient, so neither direction copies, splits or stacks. It is a torch custom op, opaque
to torch.compile (a compiled block calls it as one node). cuDNN comes from the `nvidia-cudnn-frontend` package
(Python bindings of cuDNN's graph API; the cuDNN library is the one torch loads); without it, or on the CPU, the
backend is not offered.
"""
import functools
import math

import torch

_GRAPHS = {}
_HANDLES = {}
# cuDNN's backward accumulates dQ in a fixed order (bit-reproducible runs, as the rest of the step); False lets it
# use atomics. A measurement knob for benchmarks, not a flag.
DETERMINISTIC = True


@functools.lru_cache(maxsize=None)
def _cudnn():
    try:
        import cudnn
    except Exception:  # not installed, or its library does not load: the backend is simply not offered
        return None
    return cudnn


def available():
    return _cudnn() is not None and torch.cuda.is_available()


def cudnn_alibi_slopes(num_heads):
    """cuDNN's ALiBi slopes for num_heads heads (cudnn_frontend's get_alibi_slope), in fp32."""
    p = 1 << int(math.log2(num_heads))
    exponents = [float(i + 1) for i in range(p)] + [(i + 1) * 0.5 for i in range(0, 2 * (num_heads - p), 2)]
    return torch.tensor([2.0 ** (-8.0 * e / p) for e in exponents], dtype=torch.float32)


def slopes_match(values):
    """Whether a rank's slopes (host floats) are cuDNN's for that head count: all the model's heads (TP 1)."""
    ours = torch.tensor(values, dtype=torch.float32)
    return bool(torch.allclose(ours, cudnn_alibi_slopes(len(values)), rtol=1e-6, atol=0.0))


def serves(scale, dtype, device):
    """Whether cuDNN computes this attention: a CUDA bf16/fp16 tensor, a head dimension (1 / scale^2) its fused
    kernels take (a multiple of 8 up to 256), and cuDNN importable. The slopes are the caller's check."""
    head_dim = round(scale ** -2)
    return (torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and head_dim % 8 == 0 and head_dim <= 256 and available())


def _handle(device):
    cudnn = _cudnn()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HANDLES:
        with torch.cuda.device(index):
            _HANDLES[index] = cudnn.create_handle()
    handle = _HANDLES[index]
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(index).cuda_stream)
    return handle


def _io_type(dtype):
    cudnn = _cudnn()
    return cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF


def _qkv_dims(qkv):
    """(dims, strides of q, k and v, each (B, heads, S, head_dim)) read through qkv (B, S, heads, 3, head_dim)."""
    b, s, h, _, d = qkv.shape
    sb, ss, sh, s3, sd = qkv.stride()
    dims = [b, h, s, d]
    strides = [sb, sh, ss, sd]
    return dims, strides, s3


def _build(graph):
    cudnn = _cudnn()
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph


def _forward_graph(qkv, scale):
    dims, strides, _ = _qkv_dims(qkv)
    key = ("fwd", tuple(qkv.shape), qkv.stride(), qkv.dtype, qkv.device, scale)
    if key not in _GRAPHS:
        cudnn = _cudnn()
        b, h, s, d = dims
        graph = cudnn.pygraph(io_data_type=_io_type(qkv.dtype), intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=_handle(qkv.device))
        q, k, v = (graph.tensor(name=name, dim=dims, stride=strides, data_type=_io_type(qkv.dtype))
                   for name in ("q", "k", "v"))
        o, stats = graph.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=True, attn_scale=scale,
                              use_causal_mask=True, use_alibi_mask=True)
        o.set_output(True).set_dim(dims).set_stride([s * h * d, d, h * d, 1])
        stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        _GRAPHS[key] = (_build(graph), (q, k, v, o, stats))
    return _GRAPHS[key]


def _backward_graph(qkv, grad_out, scale):
    dims, strides, _ = _qkv_dims(qkv)
    key = ("bwd", tuple(qkv.shape), qkv.stride(), grad_out.stride(), qkv.dtype, qkv.device, scale, DETERMINISTIC)
    if key not in _GRAPHS:
        cudnn = _cudnn()
        b, h, s, d = dims
        io = _io_type(qkv.dtype)
        graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=_handle(qkv.device))
        q, k, v = (graph.tensor(name=name, dim=dims, stride=strides, data_type=io) for name in ("q", "k", "v"))
        out_strides = [s * h * d, d, h * d, 1]
        o = graph.tensor(name="o", dim=dims, stride=out_strides, data_type=io)
        go = grad_out.stride()  # (B, S, heads, head_dim) -> (B, heads, S, head_dim)
        d_o = graph.tensor(name="dO", dim=dims, stride=[go[0], go[2], go[1], go[3]], data_type=io)
        stats = graph.tensor(name="stats", dim=[b, h, s, 1], stride=[h * s, s, 1, 1],
                             data_type=cudnn.data_type.FLOAT)
        dq, dk, dv = graph.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=d_o, stats=stats,
                                         attn_scale=scale, use_causal_mask=True, use_alibi_mask=True,
                                         use_deterministic_algorithm=DETERMINISTIC)
        grad_strides = [s * h * 3 * d, 3 * d, h * 3 * d, 1]  # into one contiguous (B, S, heads, 3, head_dim)
        for t in (dq, dk, dv):
            t.set_output(True).set_dim(dims).set_stride(grad_strides)
        _GRAPHS[key] = (_build(graph), (q, k, v, o, d_o, stats, dq, dk, dv))
    return _GRAPHS[key]


def _execute(graph, pack, device):
    workspace = torch.empty(graph.get_workspace_size(), device=device, dtype=torch.uint8)
    graph.execute(pack, workspace, handle=_handle(device))


@torch.library.custom_op("megatron::cudnn_alibi_attention", mutates_args=())
def _attention(qkv: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, h, _, d = qkv.shape
    graph, (q, k, v, o, stats) = _forward_graph(qkv, scale)
    out = torch.empty(b, s, h, d, device=qkv.device, dtype=qkv.dtype)
    lse = torch.empty(b, h, s, 1, device=qkv.device, dtype=torch.float32)
    _execute(graph, {q: qkv[:, :, :, 0], k: qkv[:, :, :, 1], v: qkv[:, :, :, 2], o: out, stats: lse}, qkv.device)
    return out, lse


@_attention.register_fake
def _(qkv, scale):
    b, s, h, _, d = qkv.shape
    return qkv.new_empty(b, s, h, d), qkv.new_empty(b, h, s, 1, dtype=torch.float32)


@torch.library.custom_op("megatron::cudnn_alibi_attention_backward", mutates_args=())
def _attention_backward(qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                        scale: float) -> torch.Tensor:
    graph, (q, k, v, o, d_o, stats, dq, dk, dv) = _backward_graph(qkv, grad_out, scale)
    grad = torch.empty(qkv.shape, device=qkv.device, dtype=qkv.dtype)
    _execute(graph, {q: qkv[:, :, :, 0], k: qkv[:, :, :, 1], v: qkv[:, :, :, 2], o: out, d_o: grad_out,
                     stats: lse, dq: grad[:, :, :, 0], dk: grad[:, :, :, 1], dv: grad[:, :, :, 2]}, qkv.device)
    return grad


@_attention_backward.register_fake
def _(qkv, out, lse, grad_out, scale):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    qkv, scale = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse)
    ctx.scale = scale


def _backward(ctx, grad_out, grad_lse):
    qkv, out, lse = ctx.saved_tensors
    return _attention_backward(qkv, out, lse, grad_out, ctx.scale), None


_attention.register_autograd(_backward, setup_context=_setup_context)


def attention(qkv, scale):
    """qkv (B, S, heads, 3, head_dim) -> (B, S, heads, head_dim): causal ALiBi attention with cuDNN's slopes."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    return _attention(qkv, float(scale))[0]
