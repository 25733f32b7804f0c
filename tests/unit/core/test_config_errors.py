"""Bad model shapes raise a ValueError naming the flag, the values and the fix."""
import pytest

from megatron.config import ModelConfig, pad_vocab_size


def make(**overrides):
    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1024)
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.mark.parametrize("overrides,message", [
    (dict(hidden_size=96, num_attention_heads=6, tensor_model_parallel_size=4),
     "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4; "
     "choose a TP size that divides the head count"),
    (dict(hidden_size=100, num_attention_heads=8),
     "--hidden-size 100 is not divisible by --num-attention-heads 8; "
     "choose a head count that divides the hidden size"),
    (dict(seq_length=4096, max_position_embeddings=2048),
     "--seq-length 4096 exceeds --max-position-embeddings 2048; raise the latter or shorten the sequence"),
    (dict(attention_impl="xformers"), "--attention-impl xformers is not one of auto, cudnn, flex, sdpa, fused, torch"),
])
def test_bad_shapes(overrides, message):
    with pytest.raises(ValueError) as err:
        make(**overrides)
    assert str(err.value) == message


def test_vocab_padding():
    assert pad_vocab_size(250680, 128, 1) == 250752  # BLOOM trained at TP 4: 128 x 4 gives 250880
    assert pad_vocab_size(250680, 128, 4) == 250880
    assert pad_vocab_size(50257, 128, 2) == 50432
    assert pad_vocab_size(1000, 128, 1, pad_vocab_size_to=1000) == 1000
    with pytest.raises(ValueError, match="--pad-vocab-size-to 900 is smaller than the tokenizer's vocabulary"):
        pad_vocab_size(1000, pad_vocab_size_to=900)
