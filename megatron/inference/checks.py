"""The checks generation and serving share: the tokenizer against the model, a prompt's length against the context.

tools/generate_text.py and tools/run_text_generation_server.py load through loading.load_model (loading.tokenizer_for,
which calls check_tokenizer_fits_model); both (and the server's API, api.tokenize_prompts) measure prompts with
check_prompt_length, so a prompt the server answers with HTTP 400 is refused by generate_text.py with the same
words.
"""
from megatron.config import pad_vocab_size

# Without a record of how the model's vocabulary was padded (a Hugging Face folder from elsewhere), the largest
# padding this project's defaults give: a multiple of 128 (--make-vocab-size-divisible-by) x TP 8.
MAX_DEFAULT_PADDING_MULTIPLE = 128 * 8


class PromptLengthError(ValueError):
    """A prompt that does not fit the context; `field` is the request field (or flag) to change."""

    def __init__(self, message, field):
        super().__init__(message)
        self.field = field


def check_prompt_length(length, max_new_tokens, context, where="prompt", tokens_field="max_tokens",
                        prompt_field="prompt"):
    """PromptLengthError when a prompt of `length` tokens leaves no room in `context`, or no room for
    max_new_tokens more."""
    if length >= context:
        raise PromptLengthError(f"{where} is {length} tokens long; the model's context is {context} tokens "
                                f"(prompt + {tokens_field}): shorten the prompt", prompt_field)
    if length + max_new_tokens > context:
        raise PromptLengthError(f"{where} ({length} tokens) plus {tokens_field} ({max_new_tokens}) exceeds the "
                                f"model's context of {context} tokens: ask for at most {context - length} tokens",
                                tokens_field)


def expected_padded_vocab(run_config, tokenizer_vocab_size):
    """The padded vocabulary a run with run_config (a checkpoint's config.json) gives a tokenizer of this size,
    or None when the config does not say how it padded."""
    data, parallel = (run_config or {}).get("data"), (run_config or {}).get("parallel")
    if not isinstance(data, dict) or not isinstance(parallel, dict):
        return None
    try:
        return pad_vocab_size(tokenizer_vocab_size, data.get("make_vocab_size_divisible_by") or 128,
                              parallel.get("tensor_model_parallel_size") or 1, data.get("pad_vocab_size_to"))
    except ValueError:
        return None


def check_tokenizer_fits_model(tokenizer, tokenizer_dir, model_vocab_size, run_config=None, own_tokenizer=None,
                               own_tokenizer_dir=None, flag="--tokenizer-name-or-path"):
    """ValueError naming the flag when `tokenizer` (from tokenizer_dir) cannot be the one the model was trained
    with: more tokens than the model's vocabulary; another vocabulary than the checkpoint's own tokenizer
    (own_tokenizer, when the flag overrides it); a size the run's padding (run_config) does not turn into the
    model's vocabulary; or, with no record of the padding, far fewer tokens than the model has rows."""
    size = tokenizer.vocab_size
    fix = "pass the tokenizer the model was trained with"
    if own_tokenizer is not None and own_tokenizer.vocab != tokenizer.vocab:
        raise ValueError(f"{flag} {tokenizer_dir}: its vocabulary ({size} tokens) is not the one the model was "
                         f"trained with ({own_tokenizer_dir}, {own_tokenizer.vocab_size} tokens); leave the flag out "
                         "to use the model's own tokenizer")
    if size > model_vocab_size:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has {size} tokens but the model's vocabulary holds "
                         f"{model_vocab_size}; {fix}")
    expected = expected_padded_vocab(run_config, size)
    if expected is not None and expected != model_vocab_size:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has {size} tokens, which the run's padding makes "
                         f"{expected}, but the model's vocabulary is {model_vocab_size} (its config.json); {fix}")
    if expected is None and model_vocab_size - size >= MAX_DEFAULT_PADDING_MULTIPLE:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has {size} tokens but the model's vocabulary is "
                         f"{model_vocab_size} (its config.json), more than padding adds; {fix}")
