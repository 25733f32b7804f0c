"""The MLP's cuBLASLt GEMM epilogues (csrc/fused_kernels/gemm_epilogue.cpp, megatron/fused_kernels/gemm_epilogue.py)
on the GPU: each op against its unfused torch reference and an fp64 one, bf16, fp16 and fp32; the MLP function's
output and gradients at TP 1 and summed over TP 2 slices; the model's gradients with and without the epilogues,
eager and in compiled blocks. The wiring on the CPU: tests/unit/core/test_grad_accumulation.py.

Tolerance: the epilogues apply GeLU (and its gradient) to the fp32 accumulator where the unfused path rounds the
GEMM's output first, so their error against fp64 must be no larger than the unfused path's (times 1.5, plus a few
fp32 ulps of the output's scale).
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.core import tensor_parallel
from megatron.fused_kernels import gemm_epilogue
from megatron.fused_kernels.gemm_epilogue import TorchGemmEpilogueOps
from megatron.model import BloomModel

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def module():
    from megatron.fused_kernels import load_fused_kernels
    ops = load_fused_kernels()
    assert ops is not None, "the fused kernels did not build"
    return ops


def error(got, want):
    return (got.double() - want).abs().max().item()


def assert_no_worse(fused, unfused, exact, name):
    bound = 1.5 * error(unfused, exact) + 4 * torch.finfo(torch.float32).eps * exact.abs().max().item()
    assert error(fused, exact) <= bound, (name, error(fused, exact), error(unfused, exact))


def tensors(tokens, k, m, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(m, k, device="cuda", generator=gen) * k ** -0.5).to(dtype)
    b = torch.randn(m, device="cuda", generator=gen).to(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,k,m", [(512, 256, 1024), (1000, 128, 256), (8, 64, 128)])
def test_gemm_bias_gelu_matches_the_reference(dtype, tokens, k, m):
    x, w, b = tensors(tokens, k, m, dtype)
    out, pre = module().gemm_bias_gelu(x, w, b)
    ref_out, ref_pre = TorchGemmEpilogueOps.gemm_bias_gelu(x, w, b)
    exact_pre = torch.addmm(b.double(), x.double(), w.double().t())
    exact_out = F.gelu(exact_pre, approximate="tanh")
    assert out.dtype == pre.dtype == dtype and out.shape == pre.shape == (tokens, m)
    assert_no_worse(pre, ref_pre, exact_pre, "pre-activation")
    assert_no_worse(out, ref_out, exact_out, "GeLU output")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,k,m", [(512, 256, 1024), (1000, 128, 256), (8, 64, 128)])
def test_gemm_dgelu_bgrad_matches_the_reference(dtype, tokens, k, m):
    x, w_up, b = tensors(tokens, k, m, dtype)
    pre = torch.addmm(b, x, w_up.t())
    gen = torch.Generator(device="cuda").manual_seed(5)
    grad = torch.randn(tokens, k, device="cuda", generator=gen).to(dtype)
    w_down = (torch.randn(k, m, device="cuda", generator=gen) * m ** -0.5).to(dtype)
    grad_pre, grad_bias = module().gemm_dgelu_bgrad(grad, w_down, pre)
    ref_pre, ref_bias = TorchGemmEpilogueOps.gemm_dgelu_bgrad(grad, w_down, pre)
    exact_pre = torch.ops.aten.gelu_backward(grad.double().mm(w_down.double()), pre.double(), approximate="tanh")
    assert grad_pre.dtype == grad_bias.dtype == dtype and grad_bias.shape == (m,)
    assert_no_worse(grad_pre, ref_pre, exact_pre, "pre-activation gradient")
    assert_no_worse(grad_bias, ref_bias, exact_pre.sum(0), "bias gradient")


def unfused_mlp(x, w1, b1, w2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tp", [1, 2])
def test_mlp_output_and_gradients_on_tp_slices(dtype, tp):
    """The MLP at TP tp is the sum over its slices (h -> 4h split by rows, 4h -> h by columns): gelu_mlp on each
    slice, summed, against the unfused MLP of the whole weights; gradients of every slice likewise."""
    assert gemm_epilogue.available(torch.zeros(1, device="cuda", dtype=dtype))
    gen = torch.Generator(device="cuda").manual_seed(2)
    h, f = 256, 1024
    x = torch.randn(4, 128, h, device="cuda", generator=gen)
    w1, b1 = torch.randn(f, h, device="cuda", generator=gen) * h ** -0.5, torch.randn(f, device="cuda", generator=gen)
    w2 = torch.randn(h, f, device="cuda", generator=gen) * f ** -0.5
    dy = torch.randn(4, 128, h, device="cuda", generator=gen)
    exact = [t.double().requires_grad_() for t in (x, w1, b1, w2)]
    unfused_mlp(*exact).backward(dy.double())
    exact_out = unfused_mlp(*exact).detach()

    def run(fn, xs, w1s, b1s, w2s):
        leaves = [t.to(dtype).requires_grad_() for t in (xs, *w1s, *b1s, *w2s)]
        xin, rest = leaves[0], leaves[1:]
        out = sum(fn(xin, rest[r], rest[tp + r], rest[2 * tp + r]) for r in range(tp))
        out.backward(dy.to(dtype))
        return out.detach(), [t.grad for t in leaves]

    slices = (x, w1.chunk(tp, 0), b1.chunk(tp, 0), w2.chunk(tp, 1))
    fused_out, fused_grads = run(tensor_parallel.gelu_mlp, *slices)
    ref_out, ref_grads = run(unfused_mlp, *slices)
    exact_grads = [exact[0].grad, *exact[1].grad.chunk(tp, 0), *exact[2].grad.chunk(tp, 0), *exact[3].grad.chunk(tp, 1)]
    assert_no_worse(fused_out, ref_out, exact_out, "output")
    for i, (got, ref, want) in enumerate(zip(fused_grads, ref_grads, exact_grads)):
        assert_no_worse(got, ref, want, f"gradient {i}")


CONFIG = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=1024, seq_length=256,
                     attention_impl="sdpa")


def model_gradients(fields, dtype, epilogues):
    model = BloomModel(dataclasses.replace(CONFIG, gemm_epilogues=epilogues, **fields)).to("cuda", dtype).train()
    generator = torch.Generator().manual_seed(0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length + 1), generator=generator).cuda()
            model(ids[:, :-1], labels=ids[:, 1:]).mean().backward()
    calls = sum(e.count for e in prof.key_averages() if e.key == "megatron::gemm_dgelu_bgrad")
    return calls, {name: p.grad.double() for name, p in model.named_parameters()}


@pytest.mark.parametrize("fields", [{}, {"compile_blocks": True}, {"checkpoint_activations": True}],
                         ids=["eager", "compile-blocks", "checkpointed"])
def test_model_gradients_with_epilogues_match_fp32(fields):
    """bf16 model with and without the epilogues against the fp32 model of the same weights: every gradient no
    further from fp32's with them than without (2x, plus 1e-3 of its scale); fp32 with them equals fp32 without."""
    calls, fused = model_gradients(fields, torch.bfloat16, True)
    assert calls == 3 * CONFIG.num_layers  # the epilogue path ran in every layer's backward
    none, unfused = model_gradients(fields, torch.bfloat16, False)
    assert none == 0
    _, exact = model_gradients(fields, torch.float32, False)
    fp32_calls, fp32_fused = model_gradients(fields, torch.float32, True)
    assert fp32_calls == 3 * CONFIG.num_layers
    for name, want in exact.items():
        scale = want.abs().max().item()
        assert error(fused[name], want) <= 2 * error(unfused[name], want) + 1e-3 * scale, name
        torch.testing.assert_close(fp32_fused[name], want, rtol=0, atol=1e-4 * scale, msg=name)
