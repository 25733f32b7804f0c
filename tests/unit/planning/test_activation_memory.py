"""The activation model (megatron/planning/memory.py) against what our model really saves for backward.

torch.autograd.graph.saved_tensors_hooks sees every tensor an op keeps for backward; the storages that are not
parameters are the activations. Measured on the CPU in fp32 with the torch attention reference (FlexAttention has
no CPU backward; its share, q/k/v + output + logsumexp, is the GPU benchmark's business) and torch's cross entropy.
"""
import pytest
import torch

from megatron.config import ModelConfig
from megatron.model.bloom import BloomBlock, BloomModel
from megatron.planning import memory


def saved_activation_bytes(module, fn):
    """Bytes of the distinct non-parameter storages saved for backward while fn() runs."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return sum(seen.values()), out


def tiny(**overrides):
    values = dict(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=384, seq_length=48,
                  attention_impl="torch", ffn_hidden_size=192)
    values.update(overrides)
    return ModelConfig(**values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_block_saves_what_the_formula_says(dtype):
    config = tiny()
    block = BloomBlock(config, 0).to(dtype)
    b, s = 2, config.seq_length
    x = torch.randn(b, s, config.hidden_size, dtype=dtype, requires_grad=True)
    saved, _ = saved_activation_bytes(block, lambda: block(x))
    w = 4 if dtype == torch.float32 else 2
    expected = memory.layer_activation_bytes(b, s, config.hidden_size, config.ffn_dim, config.num_attention_heads, 1,
                                             w, "torch")
    if dtype == torch.bfloat16:  # the CPU LayerNorm keeps its statistics in the input dtype (CUDA: fp32)
        expected -= 2 * 2 * b * s * (4 - w)
    assert saved == expected


@pytest.mark.parametrize("checkpoint", [False, True])
def test_whole_model_with_loss(checkpoint):
    config = tiny(checkpoint_activations=checkpoint)
    model = BloomModel(config).train()
    b, s = 3, config.seq_length
    ids, labels = torch.randint(0, config.vocab_size, (2, b, s))  # separate tensors, as in training
    saved, loss = saved_activation_bytes(model, lambda: model(ids, labels=labels))
    h, f, a, v = config.hidden_size, config.ffn_dim, config.num_attention_heads, config.vocab_size
    per_layer = memory.layer_activation_bytes(b, s, h, f, a, 1, 4, "torch")
    layers = config.num_layers * (b * s * h * 4 if checkpoint else per_layer)
    expected = (layers + memory.embedding_activation_bytes(b, s, h, 4)
                + memory.head_activation_bytes(b, s, h, v, 1, 4, fused_cross_entropy=False))
    assert saved == expected
    stage = memory.stage_memory(config, 1, 1, 1, 0, b, 1, "fp32", 0, checkpoint, cuda=False)
    assert stage.activations == expected
    loss.mean().backward()
