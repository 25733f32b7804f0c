"""Attention backends on the CPU: SDPA against the fp32 torch reference (fp32 and bf16, with a KV cache's longer keys
and a padding mask), which backend serves each call off CUDA, and whole models agreeing across --attention-impl.
The CUDA-only parts (flex, the fused kernel, CUDA SDPA kernels, auto picking flex) are in tests/gpu/test_attention.py.
"""
import logging

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model import BloomModel, attention
from megatron.model.alibi import get_alibi_slopes
from megatron.model.attention import BACKENDS, resolve_backend, torch_attention

HEADS, HEAD_DIM = 16, 64
SCALE = HEAD_DIM ** -0.5
# relative Frobenius error of the output / the gradients against the fp32 reference: bf16 keeps 8 bits of
# mantissa (sums over 1000 keys add rounding); fp32 differs by the summation order only
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2e-2)}


def qkv(s, sk, dtype, b=2):
    gen = torch.Generator().manual_seed(0)
    make = lambda n: torch.randn(b, HEADS, n, HEAD_DIM, generator=gen).to(dtype).requires_grad_()  # noqa: E731
    return make(s), make(sk), make(sk)


def relative_error(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("s,sk", [(256, 256), (128, 384), (1000, 1000)])
def test_sdpa_matches_fp32_reference(dtype, s, sk):
    q, k, v = qkv(s, sk, dtype, b=2 if s < 1000 else 1)
    slopes = get_alibi_slopes(HEADS)
    ref = torch_attention(q.float(), k.float(), v.float(), slopes, SCALE, 0.0)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    out = BACKENDS["sdpa"](q, k, v, slopes, SCALE, 0.0)
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    out_tol, grad_tol = TOLERANCE[dtype]
    assert relative_error(out, ref) < out_tol, relative_error(out, ref)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert relative_error(got, want) < grad_tol, (name, relative_error(got, want))


def test_sdpa_with_a_padding_mask_matches_the_reference_and_ignores_padded_keys():
    q, k, v = qkv(12, 20, torch.float32)
    slopes = get_alibi_slopes(HEADS)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :5] = False  # row 1: five left-padding keys
    ref = torch_attention(q, k, v, slopes, SCALE, 0.0, key_padding_mask=mask)
    out = BACKENDS["sdpa"](q, k, v, slopes, SCALE, 0.0, key_padding_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    changed = v.detach().clone()
    changed[1, :, :5] = 1e4  # the padded keys' values do not reach any output
    torch.testing.assert_close(BACKENDS["sdpa"](q, k, changed, slopes, SCALE, 0.0, key_padding_mask=mask), out,
                               atol=0, rtol=0)


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """attention logs each fallback once per process: start from an empty record of what was logged."""
    monkeypatch.setattr(attention, "_LOGGED", set())
    caplog.set_level(logging.INFO, logger="megatron.model.attention")
    return caplog


@pytest.mark.parametrize("impl, dtype, dropout, padded, want, logged", [
    ("auto", torch.float32, 0.0, False, "sdpa", []),  # a fixed multiple-of-128 shape: flex only on CUDA
    ("auto", torch.bfloat16, 0.1, True, "sdpa", []),
    ("torch", torch.bfloat16, 0.1, True, "torch", []),
    ("sdpa", torch.float32, 0.0, False, "sdpa", []),
    ("flex", torch.bfloat16, 0.0, False, "sdpa",
     ["attention: flex needs CUDA, no attention dropout and no padding mask; using sdpa"]),
    ("fused", torch.bfloat16, 0.0, False, "sdpa",
     ["attention: the fused softmax needs CUDA bf16/fp16 without a padding mask; using sdpa"]),
])
def test_backend_resolution_off_cuda(fresh_log, impl, dtype, dropout, padded, want, logged):
    q = torch.zeros(1, 4, 256, 8, dtype=dtype)
    mask = torch.ones(1, 256, dtype=torch.bool) if padded else None
    assert resolve_backend(impl, q, dropout, mask) == want
    assert resolve_backend(impl, q, dropout, mask, sk=256) == want
    assert [r.getMessage() for r in fresh_log.records] == logged  # once, not per call


@pytest.mark.parametrize("dtype, padded, got", [(torch.bfloat16, False, "cpu bfloat16"),
                                                (torch.float16, True, "cpu float16, a padding mask")])
def test_fused_on_cpu_aborts_under_the_flag(dtype, padded, got):
    q = torch.zeros(1, 4, 128, 8, dtype=dtype)
    mask = torch.ones(1, 128, dtype=torch.bool) if padded else None
    with pytest.raises(RuntimeError) as err:
        resolve_backend("fused", q, 0.0, mask, abort_on_unmet=True)
    assert str(err.value) == (f"--attention-impl fused needs CUDA bf16/fp16 scores without a padding mask (got {got}) "
                              "and --abort-on-unmet-fused-kernel-constraints is set")


def test_model_logits_agree_across_attention_impls_on_cpu():
    """torch and sdpa agree to fp32 rounding; auto, flex and fused fall back to sdpa off CUDA: identical logits."""
    ids = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(0))
    logits = {}
    for impl in ("torch", "sdpa", "flex", "fused", "auto"):
        config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=128,
                             attention_impl=impl)
        torch.manual_seed(0)
        model = BloomModel(config).eval()
        with torch.no_grad():
            logits[impl] = model(ids)
    assert logits["torch"].shape == (2, 128, 512)
    torch.testing.assert_close(logits["sdpa"], logits["torch"], atol=1e-5, rtol=0)
    for impl in ("flex", "fused", "auto"):
        assert torch.equal(logits[impl], logits["sdpa"]), impl
