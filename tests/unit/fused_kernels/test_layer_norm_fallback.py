"""CPU tests of MixedFusedLayerNorm's torch fallback: nn.LayerNorm compatibility, dtypes, gradients."""
import pytest
import torch
import torch.nn.functional as F

from megatron.fused_kernels import MixedFusedLayerNorm, mixed_layer_norm, mixed_layer_norm_reference
from megatron.fused_kernels import loader


@pytest.fixture(autouse=True)
def fresh_loader():
    loader._reset_for_tests()
    yield
    loader._reset_for_tests()


def test_parameters_match_nn_layer_norm():
    ours, theirs = MixedFusedLayerNorm(8, eps=1e-6), torch.nn.LayerNorm(8, eps=1e-6)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert ours.weight.dtype == torch.float32 and ours.bias.dtype == torch.float32
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(ours(x), theirs(x))


def test_reference_matches_formula():
    torch.manual_seed(0)
    x = torch.randn(4, 16, dtype=torch.float64) * 3 + 1
    w, b = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5) * w + b
    torch.testing.assert_close(mixed_layer_norm_reference(x, (16,), w, b, 1e-5), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_input_keeps_dtype_and_fp32_grads(dtype):
    torch.manual_seed(1)
    ln = MixedFusedLayerNorm(32)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    x = torch.randn(6, 32).to(dtype).requires_grad_()
    y = ln(x)
    assert y.dtype == dtype
    expected = F.layer_norm(x.detach().float(), (32,), ln.weight.detach(), ln.bias.detach()).to(dtype)
    torch.testing.assert_close(y, expected)
    y.float().sum().backward()
    assert x.grad.dtype == dtype
    assert ln.weight.grad.dtype == torch.float32 and ln.bias.grad.dtype == torch.float32


def test_gradcheck_float64():
    x = torch.randn(3, 2, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: mixed_layer_norm(x, (2, 5), w, b, 1e-5), (x, w, b))


def test_non_affine_and_no_bias():
    x = torch.randn(2, 7)
    torch.testing.assert_close(MixedFusedLayerNorm(7, elementwise_affine=False)(x), F.layer_norm(x, (7,)))
    ln = MixedFusedLayerNorm(7, bias=False)
    assert ln.bias is None
    torch.testing.assert_close(ln(x), F.layer_norm(x, (7,), ln.weight))


def test_user_errors():
    with pytest.raises(ValueError, match="keeps its parameters in float32"):
        MixedFusedLayerNorm(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not end with normalized_shape"):
        MixedFusedLayerNorm(8)(torch.randn(2, 6))
