"""--gemm-epilogues on CPU, fp32: the autograd structure of the fused MLP (tensor_parallel.fused_mlp), run through
the custom ops' ATen fallbacks, equals autograd's gradients after one micro batch (returned) and after three (the
later ones added into .grad by the GEMMs); a model built with the flag computes on CPU exactly what it computes
without it (the epilogues serve CUDA only). The cuBLASLt kernels themselves: tests/gpu/test_gemm_epilogue.py.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import fused_mlp
from megatron.fused_kernels import gemm_epilogue
from megatron.model import BloomModel
from tests.unit.core.test_grad_accumulation import CONFIG, accumulate

H, FFN, TOKENS = 16, 64, 24


def params(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in shapes]


def run(fn, tensors, dy, micro_batches):
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    for _ in range(micro_batches):
        out = fn(*tensors)
        out.backward(dy)
    return [out.detach()] + [t.grad for t in tensors]


def assert_close(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, i
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"tensor {i}: {m}")


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_fused_mlp_gradients_equal_autograd(micro_batches):
    tensors = params([(2, TOKENS // 2, H), (FFN, H), (FFN,), (H, FFN)], seed=micro_batches)
    dy = torch.randn(2, TOKENS // 2, H, generator=torch.Generator().manual_seed(9))
    got = run(fused_mlp.gelu_mlp, tensors, dy, micro_batches)
    want = run(lambda x, w1, b1, w2: F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2), tensors, dy,
               micro_batches)
    assert_close(got, want)


def test_fused_mlp_adds_weight_gradients_into_grad(monkeypatch):
    """From the second micro batch on, both weight gradients go into .grad through wgrad_accumulate_ (none is
    returned to autograd's add)."""
    calls = []
    real = torch.ops.megatron.wgrad_accumulate_
    monkeypatch.setattr(torch.ops.megatron, "wgrad_accumulate_", lambda *a: calls.append(a[0].shape) or real(*a))
    tensors = params([(TOKENS, H), (FFN, H), (FFN,), (H, FFN)], seed=4)
    run(fused_mlp.gelu_mlp, tensors, torch.ones(TOKENS, H), 3)
    assert calls == [(FFN, H), (H, FFN)] * 2


def test_fused_mlp_serves_only_cuda_operands():
    x, w1, b1, w2 = params([(TOKENS, H), (FFN, H), (FFN,), (H, FFN)], seed=7)
    assert not fused_mlp.serves(x, w1, b1, w2)
    assert not gemm_epilogue.usable(x, w1)


def test_model_on_cpu_is_unchanged_by_the_flag():
    assert CONFIG.gemm_epilogues  # the default
    torch.manual_seed(0)
    plain = accumulate(BloomModel(CONFIG).train())
    torch.manual_seed(0)
    flagged = accumulate(BloomModel(dataclasses.replace(CONFIG, gemm_epilogues=False)).train())
    assert plain.keys() == flagged.keys()
    for name in plain:
        assert torch.equal(plain[name], flagged[name]), name
