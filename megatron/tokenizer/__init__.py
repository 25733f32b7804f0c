"""Tokenizers for the data pipeline and the model: infer_tokenizer_type, build_tokenizer and vocab padding."""
from megatron.tokenizer.tokenizer import (
    TOKENIZER_TYPES,
    AbstractTokenizer,
    GPT2BPETokenizer,
    PretrainedFromHFTokenizer,
    build_tokenizer,
    infer_tokenizer_type,
    pad_vocab_size,
)

__all__ = ["TOKENIZER_TYPES", "AbstractTokenizer", "GPT2BPETokenizer", "PretrainedFromHFTokenizer",
           "build_tokenizer", "infer_tokenizer_type", "pad_vocab_size"]
