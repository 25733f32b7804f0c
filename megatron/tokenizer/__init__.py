"""Tokenizers for the data pipeline and the model: build_tokenizer and vocab padding."""
from megatron.tokenizer.tokenizer import (
    TOKENIZER_TYPES,
    AbstractTokenizer,
    GPT2BPETokenizer,
    PretrainedFromHFTokenizer,
    build_tokenizer,
    pad_vocab_size,
)

__all__ = ["TOKENIZER_TYPES", "AbstractTokenizer", "GPT2BPETokenizer", "PretrainedFromHFTokenizer",
           "build_tokenizer", "pad_vocab_size"]
