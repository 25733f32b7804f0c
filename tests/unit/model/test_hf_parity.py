"""Our BLOOM equals Hugging Face BloomForCausalLM in fp32 on tiny configs, through the name table both ways."""
import pytest
import torch
from transformers import BloomForCausalLM

from megatron.config import ModelConfig
from megatron.model import BloomModel, InferenceCache
from megatron.model.alibi import get_alibi_slopes
from megatron.model.hf_bloom import from_hf_state_dict, to_hf_config, to_hf_state_dict

CONFIGS = [
    dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000),
    dict(num_layers=3, hidden_size=96, num_attention_heads=6, vocab_size=777),
]


def build_pair(fields, attention_impl="torch"):
    config = ModelConfig(seq_length=32, attention_impl=attention_impl, **fields)
    torch.manual_seed(0)
    hf = BloomForCausalLM(to_hf_config(config)).eval()
    ours = BloomModel(config, parallel_output=False).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    return config, ours, hf


@pytest.mark.parametrize("fields", CONFIGS, ids=["h64-4heads", "h96-6heads"])
@pytest.mark.parametrize("impl", ["torch", "sdpa"])
def test_logits_and_loss_equal_hf(fields, impl):
    config, ours, hf = build_pair(fields, impl)
    ids = torch.randint(0, config.vocab_size, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, labels=ids)
        logits = ours(ids)
        losses = ours(ids[:, :-1], labels=ids[:, 1:])
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(losses.mean(), ref.loss, atol=1e-6, rtol=1e-6)


def test_padded_batch_equals_hf():
    config, ours, hf = build_pair(CONFIGS[0])
    ids = torch.randint(4, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in the second row
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits
        logits = ours(ids, attention_mask=mask.bool())
    torch.testing.assert_close(logits[0], ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1, 5:], ref[1, 5:], atol=1e-5, rtol=0)


def test_kv_cache_decoding_equals_full_forward():
    config, ours, _ = build_pair(CONFIGS[1])
    ids = torch.randint(0, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = ours(ids)
        cache = InferenceCache(config.num_layers)
        steps = [ours(ids[:, :6], cache=cache)]
        for t in range(6, 10):
            steps.append(ours(ids[:, t:t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.seq_len == 10


def test_round_trip_to_hf_gives_identical_tensors():
    config, ours, hf = build_pair(CONFIGS[1])
    exported = to_hf_state_dict(ours.state_dict())
    reference = hf.state_dict()
    assert sorted(exported) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), name
    fresh = BloomForCausalLM(to_hf_config(config))
    fresh.load_state_dict(exported, strict=True)
    assert torch.equal(fresh.lm_head.weight, ours.embedding.word_embeddings.weight)


@pytest.mark.parametrize("heads", [16, 12, 6, 1, 5])
def test_alibi_slopes_equal_hf(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    mask = torch.ones(1, 2)
    hf_alibi = build_alibi_tensor(mask, heads, torch.float32)  # (heads, 1, 2): slope_h * [0, 1]
    # Ours rounds the exact power of two once; HF raises a rounded fp32 base to a power: 1 ulp apart at most.
    torch.testing.assert_close(get_alibi_slopes(heads), hf_alibi[:, 0, 1], atol=0, rtol=3e-7)


def test_fused_attention_on_cpu_falls_back_or_aborts():
    fields = dict(CONFIGS[0], seq_length=8)
    ids = torch.randint(0, 1000, (1, 8))
    torch.manual_seed(0)
    fallback = BloomModel(ModelConfig(attention_impl="fused", **fields)).eval()
    torch.manual_seed(0)
    reference = BloomModel(ModelConfig(attention_impl="torch", **fields)).eval()
    with torch.no_grad():
        torch.testing.assert_close(fallback(ids), reference(ids), atol=1e-5, rtol=0)
    strict = BloomModel(ModelConfig(attention_impl="fused", abort_on_unmet_fused_kernel_constraints=True, **fields))
    with pytest.raises(RuntimeError) as err:
        strict(ids)
    assert str(err.value) == ("--attention-impl fused needs CUDA bf16/fp16 scores without a padding mask (got cpu "
                              "float32) and --abort-on-unmet-fused-kernel-constraints is set")
