"""GPU tests of the fused kernels (ALiBi causal/masked softmax, mixed LayerNorm) against their fp32 torch references.

Tolerances (kernel output vs the fp32 reference computed from the same fp16/bf16 inputs):
- softmax probs: |err| <= 1e-5 + rtol * |ref|, rtol 1.6e-2 (bf16) / 2e-3 (fp16): output rounding only.
- softmax and LayerNorm grad_input: |err| <= tol * max|ref| + tol * |ref|, tol 2e-2 (bf16) / 4e-3 (fp16),
  because the kernel's backward reads the rounded saved probs / rounded grads.
- LayerNorm output: rtol 1.6e-2 / 2e-3 / 1e-5 (bf16 / fp16 / fp32), atol the same times max|ref|.
- LayerNorm grad_weight / grad_bias (fp32): 1e-4 relative to max|ref| (summation order only).
- cross entropy loss (fp32, from the same rounded logits): 1e-5 relative + 1e-5 absolute (fast exp, summation
  order); grad_logits: GRAD_TOL (output rounding to the logits' dtype).
Run with the abort flag on, so a silent fallback to torch would fail the test.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron.fused_kernels import (
    MixedFusedLayerNorm,
    alibi_causal_softmax,
    alibi_causal_softmax_reference,
    alibi_masked_softmax,
    alibi_masked_softmax_reference,
    cross_entropy_reference,
    fused_cross_entropy,
    load_fused_kernels,
)
from megatron.fused_kernels import loader
from tests.distributed import run_distributed
from tests.unit.core.test_tensor_parallel import vocab_parallel_ce_equals_torch

pytestmark = pytest.mark.gpu

PROB_RTOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
GRAD_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}
LN_RTOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-5}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    loader._reset_for_tests()
    module = load_fused_kernels(abort_on_unmet_constraints=True)
    assert module is not None
    yield module
    loader._reset_for_tests()


def bloom_slopes(nh):
    return torch.tensor([2.0 ** (-8.0 * (k + 1) / nh) for k in range(nh)], dtype=torch.float32, device="cuda")


def assert_grad_close(got, ref, tol, what):
    ref = ref.float()
    scale = ref.abs().max().item()
    err = (got.float() - ref).abs().max().item()
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol * max(scale, 1e-30), msg=lambda m: f"{what}: {m}")
    assert torch.isfinite(got).all(), f"{what}: non-finite values (max err {err})"


def check_softmax(fused_fn, reference_fn, shape, dtype, extra=()):
    torch.manual_seed(sum(shape))
    nh = shape[1]
    scale = 1.0 / (128 ** 0.5)
    x = (torch.randn(shape, device="cuda") * 20).to(dtype).requires_grad_()
    slopes = bloom_slopes(nh)
    probs = fused_fn(x, *extra, slopes, scale)
    assert probs.dtype == dtype and probs.shape == x.shape

    x_ref = x.detach().float().requires_grad_()
    ref = reference_fn(x_ref, *extra, slopes, scale)  # fp32
    torch.testing.assert_close(probs.float(), ref, rtol=PROB_RTOL[dtype], atol=1e-5)

    grad_probs = torch.randn_like(probs)
    (grad,) = torch.autograd.grad(probs, x, grad_probs)
    (grad_ref,) = torch.autograd.grad(ref, x_ref, grad_probs.float())
    assert_grad_close(grad, grad_ref, GRAD_TOL[dtype], f"grad {shape} {dtype}")
    return probs


SOFTMAX_SHAPES = [
    (2, 16, 1, 1),
    (2, 16, 17, 17),
    (1, 16, 17, 40),  # sq < sk (KV cache)
    (1, 16, 1, 2047),  # one new token over a 2047-long cache, odd length (scalar path)
    (1, 16, 64, 2047),
    (2, 16, 128, 128),
    (1, 16, 256, 512),  # largest warp-per-row length
    (1, 16, 100, 513),
    (1, 16, 2048, 2048),
    (1, 4, 64, 4096),
    (1, 2, 16, 8192),
    (1, 2, 8, 16384),
    (1, 2, 10, 6),  # sq > sk: the first rows see no key -> zeros
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_alibi_causal_softmax(shape, dtype):
    probs = check_softmax(alibi_causal_softmax, alibi_causal_softmax_reference, shape, dtype)
    sq, sk = shape[2:]
    masked = torch.ones(sq, sk, dtype=torch.bool, device="cuda").triu(sk - sq + 1)
    assert torch.all(probs[..., masked] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_batch", [1, 2])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (33, 2047), (64, 2048), (16, 4096), (8, 8192)])
def test_alibi_masked_softmax(sq, sk, mask_batch, dtype):
    torch.manual_seed(sq + sk)
    mask = torch.rand(mask_batch, 1, sq, sk, device="cuda") > 0.7
    mask[:, :, sq // 2] = True  # a fully masked row
    probs = check_softmax(alibi_masked_softmax, alibi_masked_softmax_reference, (2, 16, sq, sk), dtype, (mask,))
    assert torch.all(probs[:, :, sq // 2] == 0)
    assert torch.all(probs.masked_select(mask.expand_as(probs)) == 0)


def test_fp32_scores_are_an_unmet_constraint_under_the_abort_flag():
    x = torch.randn(1, 2, 4, 4, device="cuda")
    with pytest.raises(RuntimeError, match="float32.*--abort-on-unmet-fused-kernel-constraints"):
        alibi_causal_softmax(x, bloom_slopes(2), 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [64, 100, 512, 1000, 2048, 4096, 5120, 8192, 14336, 16384])
def test_mixed_layer_norm(hidden, dtype):
    torch.manual_seed(hidden)
    rows = 257
    ln = MixedFusedLayerNorm(hidden).cuda()
    with torch.no_grad():
        ln.weight.normal_(1.0, 0.2)
        ln.bias.normal_(0.0, 0.2)
    x = (torch.randn(rows, hidden, device="cuda") * 3 + 0.5).to(dtype).requires_grad_()
    y = ln(x)
    assert y.dtype == dtype

    w_ref = ln.weight.detach().clone().requires_grad_()
    b_ref = ln.bias.detach().clone().requires_grad_()
    x_ref = x.detach().float().requires_grad_()
    y_ref = F.layer_norm(x_ref, (hidden,), w_ref, b_ref, ln.eps)
    rtol = LN_RTOL[dtype]
    torch.testing.assert_close(y.float(), y_ref, rtol=rtol, atol=rtol * y_ref.abs().max().item())

    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    y_ref.backward(grad_y.float())
    assert_grad_close(x.grad, x_ref.grad, GRAD_TOL[dtype], f"grad_x h={hidden} {dtype}")
    assert ln.weight.grad.dtype == torch.float32 and ln.bias.grad.dtype == torch.float32
    assert_grad_close(ln.weight.grad, w_ref.grad, 1e-4, "grad_weight")
    assert_grad_close(ln.bias.grad, b_ref.grad, 1e-4, "grad_bias")


def test_layer_norm_3d_non_contiguous_input_and_deterministic_grads():
    ln = MixedFusedLayerNorm(2048).cuda()
    x = torch.randn(8, 4, 2048, device="cuda", dtype=torch.bfloat16).transpose(0, 1).requires_grad_()  # (b, s, h)
    y = ln(x)
    torch.testing.assert_close(y.float(), F.layer_norm(x.detach().float(), (2048,)), rtol=1.6e-2, atol=5e-2)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    first = ln.weight.grad.clone()
    ln.weight.grad = None
    ln(x).backward(grad_y)
    assert torch.equal(first, ln.weight.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 8), (7, 1000), (5, 1001), (64, 50304), (3, 250880)])
def test_cross_entropy_matches_torch(rows, vocab, dtype):
    torch.manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows,), device="cuda")
    target[0] = vocab - 1
    if rows > 2:
        target[1] = -100  # ignored: loss 0, no gradient
    loss = fused_cross_entropy(logits, target)
    assert loss.dtype == torch.float32 and loss.shape == (rows,)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = cross_entropy_reference(ref_logits, target)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    if rows > 2:
        assert loss[1].item() == 0.0

    grad_loss = torch.rand(rows, device="cuda")
    (grad,) = torch.autograd.grad(loss, logits, grad_loss)
    (grad_ref,) = torch.autograd.grad(ref, ref_logits, grad_loss)
    assert grad.dtype == dtype
    assert_grad_close(grad, grad_ref, GRAD_TOL[dtype], f"cross entropy grad {rows}x{vocab} {dtype}")
    if rows > 2:
        assert torch.count_nonzero(grad[1]).item() == 0


def test_cross_entropy_in_place_backward_reuses_the_logits_and_3d_shapes():
    torch.manual_seed(0)
    base = torch.randn(2, 6, 1024, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, 1024, (2, 6), device="cuda")
    grad_loss = torch.rand(2, 6, device="cuda")

    leaf = base.clone().requires_grad_()
    logits = leaf * 1  # a non-leaf the caller owns, as the LM head's output
    loss = fused_cross_entropy(logits, target, inplace_backward=True)
    assert loss.shape == (2, 6)
    grads = {}
    logits.register_hook(lambda g: grads.setdefault("logits", g))
    loss.backward(grad_loss)
    assert grads["logits"].data_ptr() == logits.data_ptr()  # written over the logits

    leaf_ref = base.clone().requires_grad_()
    cross_entropy_reference(leaf_ref, target).backward(grad_loss)
    assert_grad_close(leaf.grad, leaf_ref.grad, GRAD_TOL[torch.bfloat16], "in-place cross entropy grad")


def test_cross_entropy_out_of_range_target_gives_nan_not_a_silent_value():
    logits = torch.randn(3, 16, device="cuda", dtype=torch.bfloat16)
    loss = fused_cross_entropy(logits, torch.tensor([0, 16, -1], device="cuda"))
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1]) and torch.isnan(loss[2])


def test_cross_entropy_unsupported_dtype_is_an_unmet_constraint_under_the_abort_flag():
    logits = torch.randn(2, 16, device="cuda", dtype=torch.float64)
    with pytest.raises(RuntimeError, match="cross entropy: logits dtype torch.float64"):
        fused_cross_entropy(logits, torch.tensor([0, 1], device="cuda"))


def test_vocab_parallel_cross_entropy_kernel_tp2_equals_torch():
    """Two gloo processes sharing the GPU, each with half the vocabulary, through the kernel and its all-reduces."""
    run_distributed(vocab_parallel_ce_equals_torch, 2, "cuda", True)
