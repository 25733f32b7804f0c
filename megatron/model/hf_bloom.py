"""Our canonical state dict <-> Hugging Face BloomForCausalLM's, and the config map.

The names come from the parameter spec (megatron/model/spec.py: each row's hf_name). Both sides keep BLOOM's
per-head fused QKV layout, so tensors move unchanged; only names differ, and HF's lm_head.weight is the word
embedding (tied), added on export and dropped (after a check) on import.
"""
import torch

from megatron.config import ModelConfig
from megatron.model.spec import HF_TIED_HEAD, from_hf_name, to_hf_name  # noqa: F401 (the name table: spec.py)


def to_hf_state_dict(state_dict):
    """Our full (merged) state dict -> HF BloomForCausalLM's, with the tied lm_head.weight added."""
    hf = {to_hf_name(name): tensor for name, tensor in state_dict.items()}
    hf[HF_TIED_HEAD] = hf["transformer.word_embeddings.weight"]
    return hf


def from_hf_state_dict(hf_state_dict):
    """HF BloomForCausalLM's (or BloomModel's, without the transformer. prefix) state dict -> ours."""
    ours = {}
    for name, tensor in hf_state_dict.items():
        if not name.startswith(("transformer.", HF_TIED_HEAD)):
            name = "transformer." + name
        if name == HF_TIED_HEAD:
            embedding = hf_state_dict.get("transformer.word_embeddings.weight",
                                          hf_state_dict.get("word_embeddings.weight"))
            if embedding is not None and not torch.equal(tensor, embedding):
                raise ValueError("lm_head.weight differs from the word embeddings; BLOOM ties them "
                                 "(tie_word_embeddings) and this converter supports only tied heads")
            continue
        ours[from_hf_name(name)] = tensor
    return ours


def to_hf_config(config, dtype=torch.float32, bos_token_id=1, eos_token_id=2, pad_token_id=3):
    """A transformers BloomConfig for our ModelConfig (HF BLOOM fixes FFN = 4h and has the embedding norm)."""
    from transformers import BloomConfig

    if config.ffn_dim != 4 * config.hidden_size:
        raise ValueError(f"Hugging Face BLOOM fixes the MLP at 4 x hidden ({4 * config.hidden_size}); "
                         f"this model has --ffn-hidden-size {config.ffn_dim}")
    if not config.embed_layernorm:
        raise ValueError("Hugging Face BLOOM always has the embedding LayerNorm; train with --embed-layernorm")
    return BloomConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, n_layer=config.num_layers,
        n_head=config.num_attention_heads, layer_norm_epsilon=config.layernorm_epsilon,
        initializer_range=config.init_method_std, hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
        apply_residual_connection_post_layernorm=config.apply_residual_connection_post_layernorm,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        seq_length=config.seq_length, tie_word_embeddings=True, dtype=str(dtype).replace("torch.", ""),
        architectures=["BloomForCausalLM"])


def from_hf_config(hf_config, **overrides):
    """Our ModelConfig for a transformers BloomConfig (overrides: e.g. tensor_model_parallel_size)."""
    fields = dict(
        num_layers=hf_config.n_layer, hidden_size=hf_config.hidden_size, num_attention_heads=hf_config.n_head,
        vocab_size=hf_config.vocab_size, layernorm_epsilon=hf_config.layer_norm_epsilon,
        init_method_std=hf_config.initializer_range, hidden_dropout=hf_config.hidden_dropout,
        attention_dropout=hf_config.attention_dropout,
        apply_residual_connection_post_layernorm=hf_config.apply_residual_connection_post_layernorm,
        seq_length=getattr(hf_config, "seq_length", None) or 2048)
    fields.update(overrides)
    return ModelConfig(**fields)
