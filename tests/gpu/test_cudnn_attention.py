"""cuDNN's fused ALiBi attention (megatron/model/cudnn_attention.py) on the GPU: forward and gradients against the
fp32 reference and beside FlexAttention, bf16 and fp16, odd lengths and a head count that is not a power of two;
the model's automatic choice, eager against compiled blocks, and bit-reproducible gradients. Skipped without CUDA
or without the nvidia-cudnn-frontend package. The slope formula and the TP fallback: tests/unit/model/
test_cudnn_attention.py."""
import pytest
import torch

from megatron.model import attention, cudnn_attention
from megatron.model.alibi import get_alibi_slopes

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cudnn_attention.available(), reason="needs CUDA and nvidia-cudnn-frontend")]


def relative_error(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def fused_qkv(b, s, h, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(b, s, h, 3, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()


def split(qkv):
    return [t.transpose(1, 2) for t in qkv.unbind(3)]  # each (B, heads, S, head_dim)


def reference(qkv, slopes):
    q, k, v = split(qkv.detach().float().requires_grad_())
    return attention.torch_attention(q, k, v, slopes, q.shape[-1] ** -0.5, 0.0).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,s,h,d", [(2, 256, 16, 128), (1, 1000, 16, 128), (2, 384, 12, 64), (3, 128, 5, 32)])
def test_forward_and_gradients_match_the_fp32_reference_as_flex_does(dtype, b, s, h, d):
    slopes = get_alibi_slopes(h).cuda()
    qkv = fused_qkv(b, s, h, d, dtype)
    grad = torch.randn(b, s, h, d, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    ref_in = qkv.detach().float().requires_grad_()
    q, k, v = split(ref_in)
    ref = attention.torch_attention(q, k, v, slopes, d ** -0.5, 0.0).transpose(1, 2)
    ref.backward(grad)
    out = cudnn_attention.attention(qkv, d ** -0.5)
    assert out.shape == (b, s, h, d) and out.dtype == dtype and out.is_contiguous()
    out.backward(grad.to(dtype))
    tolerance = 1e-2 if dtype == torch.bfloat16 else 2e-3
    errors = {"out": relative_error(out, ref)}
    errors.update({f"d{name}": relative_error(qkv.grad[:, :, :, i], ref_in.grad[:, :, :, i]) for i, name in
                   enumerate("qkv")})
    assert max(errors.values()) < tolerance, errors
    if s % 128 == 0:  # FlexAttention on the same inputs: cuDNN's error is no larger than flex's (+10%)
        flex_in = qkv.detach().clone().requires_grad_()
        fq, fk, fv = split(flex_in)
        flex = attention.flex_attention(fq, fk, fv, slopes, d ** -0.5, 0.0).transpose(1, 2)
        flex.backward(grad.to(dtype))
        assert errors["out"] <= 1.1 * relative_error(flex, ref) + 1e-5
        for i, name in enumerate("qkv"):
            assert errors[f"d{name}"] <= 1.1 * relative_error(flex_in.grad[:, :, :, i], ref_in.grad[:, :, :, i]) + 1e-5


def test_gradients_are_bit_reproducible():
    qkv = fused_qkv(2, 512, 16, 128, torch.bfloat16)
    grad = torch.randn(2, 512, 16, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        qkv.grad = None
        cudnn_attention.attention(qkv, 128 ** -0.5).backward(grad)
        runs.append(qkv.grad.clone())
    assert torch.equal(runs[0], runs[1])


def model_step(impl, compile_blocks, dtype=torch.bfloat16):
    from megatron.config import ModelConfig
    from megatron.model import BloomModel
    ids = torch.randint(0, 512, (2, 256), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    config = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=512, seq_length=256,
                         attention_impl=impl, compile_blocks=compile_blocks)
    torch.manual_seed(0)
    model = BloomModel(config).cuda().to(dtype)
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    return model, logits.float(), [layer.self_attention.query_key_value.weight.grad.float() for layer in model.layers]


def test_the_model_uses_cudnn_by_default_and_agrees_with_fp32_eager_and_compiled(monkeypatch):
    calls = []
    real = cudnn_attention.attention
    monkeypatch.setattr(cudnn_attention, "attention", lambda qkv, scale: calls.append(qkv.shape) or real(qkv, scale))
    _, want_logits, want_grads = model_step("torch", False, torch.float32)
    assert not calls
    model, logits, grads = model_step("auto", False)
    assert len(calls) == 2 and model.layers[0].self_attention.core_attention.cudnn_serves(
        torch.device("cuda"), torch.bfloat16)
    assert relative_error(logits, want_logits) < 1e-2
    for got, want in zip(grads, want_grads):
        assert relative_error(got, want) < 5e-2
    torch._dynamo.reset()
    _, compiled_logits, compiled_grads = model_step("auto", True)  # the custom op inside each compiled block
    assert relative_error(compiled_logits, logits) < 1e-2
    for got, want in zip(compiled_grads, grads):
        assert relative_error(got, want) < 2e-2
