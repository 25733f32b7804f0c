"""Typed, frozen configs built once from the command line; cross-field checks and derived values live here.

Components receive only the sub-config they need. Errors a user can cause raise ValueError naming the
flag, the values and the fix.
"""
import math
from dataclasses import dataclass, field
from typing import Optional

ATTENTION_IMPLS = ("auto", "flex", "sdpa", "fused", "torch")


def pad_vocab_size(orig_vocab_size, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
                   pad_vocab_size_to=None):
    """Smallest multiple of divisible_by * TP that holds the vocabulary (250680 -> 250880 for BLOOM)."""
    if pad_vocab_size_to is not None:
        if pad_vocab_size_to < orig_vocab_size:
            raise ValueError(f"--pad-vocab-size-to {pad_vocab_size_to} is smaller than the tokenizer's "
                             f"vocabulary ({orig_vocab_size}); pass at least {orig_vocab_size}")
        if pad_vocab_size_to % tensor_model_parallel_size != 0:
            raise ValueError(f"--pad-vocab-size-to {pad_vocab_size_to} is not divisible by "
                             f"--tensor-model-parallel-size {tensor_model_parallel_size}; pass a multiple of it")
        return pad_vocab_size_to
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(orig_vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a BLOOM network (vocab_size is the padded size the embedding holds)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int = 2048
    max_position_embeddings: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    layernorm_epsilon: float = 1e-5
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    embed_layernorm: bool = True
    position_embedding_type: str = "alibi"
    apply_residual_connection_post_layernorm: bool = False
    attention_impl: str = "auto"
    checkpoint_activations: bool = False
    fused_layernorm: bool = False
    loss_chunk_size: int = 0
    tensor_model_parallel_size: int = 1
    seed: int = 1234

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; choose a head count that divides the hidden size")
        tp = self.tensor_model_parallel_size
        if self.num_attention_heads % tp != 0:
            raise ValueError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}; choose a TP size that divides the head count")
        if self.ffn_dim % tp != 0:
            raise ValueError(f"--ffn-hidden-size {self.ffn_dim} is not divisible by "
                             f"--tensor-model-parallel-size {tp}")
        if self.vocab_size % tp != 0:
            raise ValueError(f"padded vocabulary {self.vocab_size} is not divisible by "
                             f"--tensor-model-parallel-size {tp}; use --make-vocab-size-divisible-by")
        if self.position_embedding_type != "alibi":
            raise ValueError(f"--position-embedding-type {self.position_embedding_type} is not supported: "
                             "BLOOM uses alibi")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"--attention-impl {self.attention_impl} is not one of {', '.join(ATTENTION_IMPLS)}")
        if self.max_position_embeddings is not None and self.seq_length > self.max_position_embeddings:
            raise ValueError(f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                             f"{self.max_position_embeddings}; raise the latter or shorten the sequence")

    @property
    def ffn_dim(self):
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self):
        """Trainable parameters (the LM head is tied to the word embeddings)."""
        h, f, l = self.hidden_size, self.ffn_dim, self.num_layers
        per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        embed = self.vocab_size * h + (2 * h if self.embed_layernorm else 0)
        return embed + l * per_layer + 2 * h
