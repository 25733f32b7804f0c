"""Attention backends agree on the GPU (bf16), forward and backward, and the model picks one that works.

Only what needs CUDA is here: flex, the fused kernel, SDPA's CUDA kernels (cuDNN / memory-efficient: a different
code path from the CPU's, and the one where a broadcast bias once went wrong) and auto choosing flex. SDPA on the
CPU, backend resolution off CUDA and whole-model agreement on the CPU: tests/unit/model/test_attention_backends.py.
"""
import pytest
import torch

from megatron.model.alibi import get_alibi_slopes
from megatron.model.attention import BACKENDS, resolve_backend, torch_attention

pytestmark = pytest.mark.gpu


def qkv(b=2, h=16, s=256, d=64, sk=None, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda n: torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()  # noqa
    return make(s), make(sk or s), make(sk or s)


@pytest.mark.parametrize("impl", ["sdpa", "flex", "fused"])
@pytest.mark.parametrize("s,sk", [(256, 256), (128, 384), (1000, 1000)])
def test_backend_matches_fp32_reference(impl, s, sk):
    q, k, v = qkv(s=s, sk=sk)
    slopes = get_alibi_slopes(16).cuda()
    scale = 64 ** -0.5
    ref = torch_attention(q.float(), k.float(), v.float(), slopes, scale, 0.0)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    out = BACKENDS[impl](q, k, v, slopes, scale, 0.0)
    grads = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    # bf16 inputs against an fp32 reference: relative Frobenius error of the output below 1%, of the gradients
    # below 2% (bf16 keeps 8 bits of mantissa; sums over 1000 keys add rounding).
    assert relative_error(out, ref) < 1e-2, relative_error(out, ref)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert relative_error(got, want) < 2e-2, (name, relative_error(got, want))


def relative_error(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def test_fused_and_torch_dropout_masks_agree():
    q, k, v = qkv(s=128)
    slopes = get_alibi_slopes(16).cuda()
    torch.manual_seed(3)
    a = BACKENDS["fused"](q, k, v, slopes, 0.125, 0.3)
    torch.manual_seed(3)
    b = BACKENDS["torch"](q, k, v, slopes, 0.125, 0.3)
    torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)


def test_auto_picks_flex_only_for_fixed_training_shapes():
    q, _, _ = qkv(s=256)
    assert resolve_backend("auto", q, 0.0, None) == "flex"
    assert resolve_backend("auto", q, 0.0, None, sk=256) == "flex"
    assert resolve_backend("auto", q, 0.1, None) == "sdpa"  # dropout
    assert resolve_backend("auto", q, 0.0, None, sk=300) == "sdpa"  # a KV cache's growing key length
    assert resolve_backend("auto", q[:, :, :200], 0.0, None) == "sdpa"  # not a multiple of 128
    assert resolve_backend("fused", q.float(), 0.0, None) == "sdpa"


def test_bf16_model_backends_agree():
    """Whole bf16 models with each backend against the same weights in fp32 with the torch reference: the logits,
    and the gradients of every layer's query_key_value weight (they flow only through attention's backward, so a
    backend that dropped or mis-scaled attention fails here; a mean loss would hide it)."""
    from megatron.config import ModelConfig
    from megatron.model import BloomModel
    ids = torch.randint(0, 512, (2, 256), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))

    def run(impl, dtype):
        config = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=512, seq_length=256,
                             attention_impl=impl)
        torch.manual_seed(0)
        model = BloomModel(config).cuda().to(dtype)
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.roll(-1, 1).flatten())
        loss.backward()
        qkv_grads = [layer.self_attention.query_key_value.weight.grad.float() for layer in model.layers]
        return logits.float(), qkv_grads

    want_logits, want_grads = run("torch", torch.float32)
    for impl in ("torch", "sdpa", "flex", "fused"):
        logits, grads = run(impl, torch.bfloat16)
        assert relative_error(logits, want_logits) < 1e-2, (impl, relative_error(logits, want_logits))
        for layer, (got, want) in enumerate(zip(grads, want_grads)):
            assert want.norm() > 0
            assert relative_error(got, want) < 5e-2, (impl, layer, relative_error(got, want))


@pytest.mark.parametrize("knob,value", [
    ("FLEX_KERNEL_OPTIONS", {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True}),
    ("SDPA_BACKENDS", ["CUDNN_ATTENTION"]),
    ("SDPA_BACKENDS", ["EFFICIENT_ATTENTION"]),
], ids=["flex-safe", "sdpa-cudnn", "sdpa-efficient"])
def test_benchmark_attention_variants_are_exact(monkeypatch, knob, value):
    """The variants tools/benchmark_training.py --attention-variants measures compute the same attention (the
    shared, cached ALiBi bias of sdpa included): same tolerances as test_backend_matches_fp32_reference."""
    from megatron.model import attention
    monkeypatch.setattr(attention, knob, value)
    impl = "flex" if knob == "FLEX_KERNEL_OPTIONS" else "sdpa"
    q, k, v = qkv(s=512, d=128, h=4)
    slopes = get_alibi_slopes(4).cuda()
    scale = 128 ** -0.5
    ref = torch_attention(q.float(), k.float(), v.float(), slopes, scale, 0.0)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    try:
        out = BACKENDS[impl](q, k, v, slopes, scale, 0.0)
    except RuntimeError as err:  # this torch build has no such SDPA kernel for these inputs
        if knob == "SDPA_BACKENDS" and ("No available kernel" in str(err) or "No viable backend" in str(err)):
            pytest.skip(f"{value[0]} is not available here")
        raise
    grads = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    assert relative_error(out, ref) < 1e-2, relative_error(out, ref)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert relative_error(got, want) < 2e-2, (name, relative_error(got, want))
    if impl == "sdpa":  # every layer reuses one bias tensor
        key = attention._slopes_key(slopes)
        assert attention._shared_alibi_bias(key, 512, 512, q.dtype) is attention._shared_alibi_bias(
            key, 512, 512, q.dtype)
