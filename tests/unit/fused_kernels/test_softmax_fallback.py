"""CPU tests of the ALiBi softmax torch fallbacks: formula, causal/KV-cache offsets, masked rows, gradients."""
import math

import pytest
import torch

from megatron.fused_kernels import (
    alibi_causal_softmax,
    alibi_causal_softmax_reference,
    alibi_masked_softmax,
    alibi_masked_softmax_reference,
    causal_mask,
)
from megatron.fused_kernels import loader


@pytest.fixture(autouse=True)
def fresh_loader():
    loader._reset_for_tests()
    yield
    loader._reset_for_tests()


def bloom_slopes(nh):
    """ALiBi slopes of BLOOM for a power-of-two head count: 2^(-8 k / nh), k = 1..nh."""
    return torch.tensor([2.0 ** (-8.0 * (k + 1) / nh) for k in range(nh)], dtype=torch.float32)


def loop_softmax(scores, slopes, scale, masked):
    """The definition, one row at a time in float64: masked(b, h, i, j) -> bool."""
    B, nh, sq, sk = scores.shape
    out = torch.zeros(B, nh, sq, sk, dtype=torch.float64)
    for b in range(B):
        for h in range(nh):
            for i in range(sq):
                keep = [j for j in range(sk) if not masked(b, h, i, j)]
                if not keep:
                    continue
                logits = [scale * float(scores[b, h, i, j]) + float(slopes[h]) * j for j in keep]
                top = max(logits)
                exps = [math.exp(v - top) for v in logits]
                total = sum(exps)
                for j, e in zip(keep, exps):
                    out[b, h, i, j] = e / total
    return out


@pytest.mark.parametrize("sq,sk", [(5, 5), (3, 7), (1, 6), (6, 4)])
def test_causal_reference_matches_definition(sq, sk):
    torch.manual_seed(0)
    scores = torch.randn(2, 3, sq, sk, dtype=torch.float64) * 4
    slopes = bloom_slopes(3)
    expected = loop_softmax(scores, slopes, 0.3, lambda b, h, i, j: j > i + (sk - sq))
    got = alibi_causal_softmax_reference(scores, slopes, 0.3)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_causal_rows_above_the_cache_are_zero():
    # sq > sk: query i sees keys j <= i - 2, so the first two rows see nothing.
    probs = alibi_causal_softmax_reference(torch.randn(1, 2, 6, 4), bloom_slopes(2), 1.0)
    assert torch.all(probs[:, :, :2] == 0)
    torch.testing.assert_close(probs[:, :, 2:].sum(-1), torch.ones(1, 2, 4))


def test_causal_mask_layout():
    assert causal_mask(2, 4).tolist() == [[False, False, False, True], [False, False, False, False]]


def test_masked_reference_matches_definition_and_zeroes_full_rows():
    torch.manual_seed(1)
    scores = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    mask = torch.rand(2, 1, 4, 5) > 0.5
    mask[0, 0, 2] = True  # a fully masked row
    slopes = bloom_slopes(3)
    expected = loop_softmax(scores, slopes, 0.7, lambda b, h, i, j: bool(mask[b, 0, i, j]))
    got = alibi_masked_softmax_reference(scores, mask, slopes, 0.7)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.all(got[0, :, 2] == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fully_masked_rows_give_zero_probs_and_grads_without_nan(dtype):
    scores = torch.randn(1, 2, 3, 4, dtype=dtype, requires_grad=True)
    mask = torch.zeros(1, 1, 3, 4, dtype=torch.bool)
    mask[0, 0, 1] = True
    probs = alibi_masked_softmax(scores, mask, bloom_slopes(2), 0.5)
    assert probs.dtype == dtype
    assert torch.all(probs[:, :, 1] == 0)
    probs.float().pow(2).sum().backward()
    assert torch.isfinite(scores.grad).all()
    assert torch.all(scores.grad[:, :, 1] == 0)


def test_backward_formula():
    torch.manual_seed(2)
    scale = 0.125
    scores = torch.randn(2, 2, 5, 7, dtype=torch.float64, requires_grad=True)
    probs = alibi_causal_softmax_reference(scores, bloom_slopes(2).double(), scale)
    grad_probs = torch.randn_like(probs)
    (grad,) = torch.autograd.grad(probs, scores, grad_probs)
    expected = scale * probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))
    torch.testing.assert_close(grad, expected.detach())


@pytest.mark.parametrize("sq,sk", [(3, 3), (2, 5), (4, 3)])
def test_causal_gradcheck(sq, sk):
    scores = torch.randn(1, 2, sq, sk, dtype=torch.float64, requires_grad=True)
    slopes = bloom_slopes(2).double()
    assert torch.autograd.gradcheck(lambda s: alibi_causal_softmax(s, slopes, 0.4), (scores,))


def test_masked_gradcheck():
    scores = torch.randn(2, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(1, 1, 3, 4) > 0.6
    mask[0, 0, 0] = True
    slopes = bloom_slopes(2).double()
    assert torch.autograd.gradcheck(lambda s: alibi_masked_softmax(s, mask, slopes, 1.3), (scores,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_public_fallback_keeps_dtype_and_is_close_to_fp32(dtype):
    torch.manual_seed(3)
    scores = torch.randn(2, 4, 9, 9) * 8
    slopes = bloom_slopes(4)
    probs = alibi_causal_softmax(scores.to(dtype), slopes, 0.125)
    assert probs.dtype == dtype
    expected = alibi_causal_softmax_reference(scores.to(dtype).float(), slopes, 0.125)
    torch.testing.assert_close(probs.float(), expected, rtol=0, atol=1e-2)


def test_bad_shapes_raise_value_error():
    with pytest.raises(ValueError, match="scores must be"):
        alibi_causal_softmax(torch.randn(2, 3, 4), bloom_slopes(2), 1.0)
    with pytest.raises(ValueError, match="one entry per head"):
        alibi_causal_softmax(torch.randn(1, 3, 2, 2), bloom_slopes(2), 1.0)
