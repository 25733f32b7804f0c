"""--gemm-epilogues on CUDA: the cuBLASLt DGELU epilogue GEMM (megatron.fused_kernels.gemm_epilogue) against its
unfused ATen reference, bf16 and fp32, at TP 1 widths and TP-slice widths; the MLP using it
(tensor_parallel.fused_mlp), forward and gradients, with and without gradient accumulation into .grad and on TP
slices; a whole model, eager, compiled blocks and activation checkpointing, with the flag against without. Every test
also asserts that no call fell back to ATen (gemm_epilogue.fallbacks()), so the epilogue itself is what is checked.

Tolerances as tests/gpu/test_fused_elementwise.py: results against the fp32 reference computed from the same
rounded inputs; fp32 within 1e-5 of max|ref| per element times sqrt(K) headroom for the GEMM's summation order
(2e-4 relative), bf16 no further off than 2 x the unfused bf16 ops + 1e-3 x max|ref|.
"""
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from megatron.fused_kernels import gemm_epilogue

pytestmark = pytest.mark.gpu

H = 256
WIDTHS = {"tp1": 4 * H, "tp2-slice": 2 * H, "tp4-slice": H}  # the MLP's 4h / p
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOKENS = 512


@pytest.fixture(autouse=True)
def no_fallback():
    torch._dynamo.reset()
    before = gemm_epilogue.fallbacks()
    yield
    assert gemm_epilogue.fallbacks() == before, "an epilogue GEMM fell back to the ATen ops"


def randn(shape, dtype, seed, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (scale * torch.randn(shape, device="cuda", generator=gen)).to(dtype)


def max_error(got, want):
    return (got.float() - want.float()).abs().max().item()


def check(got, eager, want, dtype):
    """got (the epilogue) and eager (the same maths in ATen ops, same dtype) against want (fp32)."""
    for i, (g, e, w) in enumerate(zip(got, eager, want)):
        assert g.shape == w.shape and g.dtype == dtype, (i, g.shape, w.shape, g.dtype)
        scale = w.abs().max().item()
        assert scale > 0, i
        bound = 2e-4 * scale if dtype == torch.float32 else 2 * max_error(e, w) + 1e-3 * scale
        assert max_error(g, w) <= bound, (i, max_error(g, w), bound)


def dgelu_reference(dy, w, pre):
    return torch.ops.aten.gelu_backward(dy.mm(w), pre, approximate="tanh")


def run_three(op, reference, inputs, dtype):
    fp32 = [t.float() for t in inputs]
    check(op(*inputs), reference(*inputs), reference(*fp32), dtype)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("width", WIDTHS.values(), ids=WIDTHS.keys())
def test_gemm_dgelu(dtype, width):
    dy, w, pre = randn((TOKENS, H), dtype, 0), randn((H, width), dtype, 1, 0.05), randn((TOKENS, width), dtype, 2)
    run_three(lambda *a: [torch.ops.megatron.gemm_dgelu(*a)], lambda *a: [dgelu_reference(*a)], [dy, w, pre], dtype)


def mlp_params(dtype, width, seed=0):
    return [randn(shape, dtype, seed + i, scale).requires_grad_()
            for i, (shape, scale) in enumerate([((width, H), 0.05), ((width,), 1.0), ((H, width), 0.05)])]


def mlp_reference(x, w1, b1, w2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2)


def mlp_run(fn, x, params, dy, micro_batches):
    """Output and every gradient after `micro_batches` backward passes (the later ones accumulate into .grad)."""
    x = x.detach().clone().requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in params]
    for _ in range(micro_batches):
        out = fn(x, *params)
        out.backward(dy)
    return [out.detach(), x.grad] + [p.grad for p in params]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("width", WIDTHS.values(), ids=WIDTHS.keys())
@pytest.mark.parametrize("micro_batches", [1, 2], ids=["grad-returned", "grad-accumulated"])
def test_fused_mlp(dtype, width, micro_batches):
    """gelu_mlp's output, input gradient and the three parameter gradients; with two micro batches the second adds
    its weight gradients into .grad by the GEMMs (beta = 1)."""
    from megatron.core.tensor_parallel import fused_mlp
    x, params = randn((2, TOKENS // 2, H), dtype, 10), mlp_params(dtype, width)
    dy = randn((2, TOKENS // 2, H), dtype, 11)
    assert fused_mlp.serves(x, *params)
    got = mlp_run(fused_mlp.gelu_mlp, x, params, dy, micro_batches)
    eager = mlp_run(mlp_reference, x, params, dy, micro_batches)
    want = mlp_run(mlp_reference, x.float(), [p.float() for p in params], dy.float(), micro_batches)
    check(got, eager, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fused_mlp_tp_slices_sum_to_the_whole(dtype):
    """TP 2 by hand: each rank's slice through gelu_mlp, summed (the all-reduce), equals the whole MLP; the slices'
    gradients are the slices of the whole one's."""
    from megatron.core.tensor_parallel import fused_mlp
    x, (w1, b1, w2) = randn((TOKENS, H), dtype, 20), mlp_params(dtype, 4 * H, seed=21)
    dy = randn((TOKENS, H), dtype, 22)
    half = 2 * H
    slices = [[t.detach()[s].clone().requires_grad_() for t, s in
               ((w1, slice(r * half, (r + 1) * half)), (b1, slice(r * half, (r + 1) * half)),
                (w2, (slice(None), slice(r * half, (r + 1) * half))))] for r in range(2)]
    xs = [x.clone().requires_grad_() for _ in range(2)]
    out = sum(fused_mlp.gelu_mlp(xr, *sl) for xr, sl in zip(xs, slices))
    out.backward(dy)
    got = [out.detach(), xs[0].grad + xs[1].grad, torch.cat([s[0].grad for s in slices]),
           torch.cat([s[1].grad for s in slices]), torch.cat([s[2].grad for s in slices], dim=1)]
    eager = mlp_run(mlp_reference, x, [w1, b1, w2], dy, 1)
    want = mlp_run(mlp_reference, x.float(), [p.float() for p in (w1, b1, w2)], dy.float(), 1)
    check(got, eager, want, dtype)


def model_loss_and_grads(dtype, ids, micro_batches=2, **options):
    """Loss and every gradient after `micro_batches` backward passes, and how many megatron::gemm_dgelu calls ran."""
    from megatron.config import ModelConfig
    from megatron.model import BloomModel
    config = ModelConfig(num_layers=3, hidden_size=H, num_attention_heads=4, vocab_size=512, seq_length=256,
                         **options)
    torch.manual_seed(0)
    model = BloomModel(config).cuda().to(dtype).train()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # non-zero biases and affines
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    # the op's body runs once per real call; a profile's "megatron::gemm_dgelu" events also count the compiler's
    # tracing of compiled blocks (on fake tensors)
    with mock.patch.object(gemm_epilogue, "_module", wraps=gemm_epilogue._module) as counted:
        for i in range(micro_batches):
            loss = model(ids[i, :-1].view(1, -1), labels=ids[i, 1:].view(1, -1)).mean()
            loss.backward()
    epilogue_calls = counted.call_count
    grads = {"loss": loss.detach().float(), **{name: p.grad.float() for name, p in model.named_parameters()}}
    return grads, epilogue_calls


@pytest.mark.parametrize("options", [{}, {"compile_blocks": True}, {"compile_blocks": True,
                                                                     "checkpoint_activations": True}],
                         ids=["eager", "compiled-blocks", "compiled-blocks-checkpointed"])
def test_model_with_epilogues_equals_without(options):
    """A bf16 model, two micro batches (the second accumulating into .grad through the GEMMs): the loss and every
    gradient with --gemm-epilogues (the default) against the fp32 model no further off than without it (2x + 1e-3);
    the epilogue GEMM ran once per layer and micro batch."""
    ids = torch.randint(0, 512, (2, 257), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    reference, _ = model_loss_and_grads(torch.float32, ids, gemm_epilogues=False)
    without, calls_without = model_loss_and_grads(torch.bfloat16, ids, gemm_epilogues=False, **options)
    with_epilogues, calls = model_loss_and_grads(torch.bfloat16, ids, **options)
    assert (calls_without, calls) == (0, 3 * 2)
    for name, want in reference.items():
        assert want.norm() > 0, name
        rel = lambda got: ((got - want).norm() / want.norm()).item()  # noqa: E731
        assert rel(with_epilogues[name]) < 2 * rel(without[name]) + 1e-3, (name, rel(with_epilogues[name]),
                                                                            rel(without[name]))


def test_model_fp32_epilogues_equal_without():
    """fp32 (the epilogue's GeLU derivative is the tanh approximation's, as BLOOM's GeLU): with = without to 1e-4
    (relative norm)."""
    ids = torch.randint(0, 512, (2, 257), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    want, _ = model_loss_and_grads(torch.float32, ids, compile_blocks=True, gemm_epilogues=False)
    got, calls = model_loss_and_grads(torch.float32, ids, compile_blocks=True)
    assert calls == 3 * 2
    for name, w in want.items():
        rel = ((got[name] - w).norm() / w.norm()).item()
        assert rel < 1e-4, (name, rel)
