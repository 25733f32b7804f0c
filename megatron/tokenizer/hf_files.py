"""BLOOM-style byte-level BPE pieces and the Hugging Face files that let AutoTokenizer load a tokenizer offline.

BLOOM's tokenizer (public in its tokenizer.json) is a byte-level BPE whose pre-tokenizer is
    Split(regex=` ?[^(\\s|[.,!?…。，、।۔،])]+`, behavior="isolated")  followed by
    ByteLevel(add_prefix_space=False, use_regex=False)
with the special tokens <unk> <s> </s> <pad> as ids 0-3 and no normalizer.
tools/train_tokenizer.py trains one; megatron/tokenizer/tokenizer.py loads one.
"""
import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

BLOOM_SPLIT_REGEX = r" ?[^(\s|[.,!?…。，、।۔،])]+"
BLOOM_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")

# Keys of tokenizer_config.json / special_tokens_map.json, with the token each role takes when present.
_ROLE_CANDIDATES = {
    "unk_token": ("<unk>",),
    "bos_token": ("<s>", "<|endoftext|>"),
    "eos_token": ("</s>", "<|endoftext|>"),
    "pad_token": ("<pad>",),
}


def bloom_pre_tokenizer():
    """BLOOM's pre-tokenizer: isolate the split regex's matches, then map bytes to ByteLevel characters."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(BLOOM_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def is_bloom_style_vocab(vocab):
    """True when the vocabulary holds <unk> <s> </s> <pad> as ids 0-3, as BLOOM's does."""
    return all(vocab.get(token) == i for i, token in enumerate(BLOOM_SPECIAL_TOKENS))


def new_bloom_tokenizer():
    """An untrained BLOOM-style tokenizer (empty BPE model) ready for a BpeTrainer."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = bloom_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def token_content(value):
    """A special-token entry of tokenizer_config.json is a string or a dict with "content"."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def read_special_tokens(folder):
    """Role -> token string from tokenizer_config.json then special_tokens_map.json in folder (if present)."""
    roles = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} is not valid JSON ({exc}); fix or delete it") from exc
        for role in _ROLE_CANDIDATES:
            content = token_content(config.get(role))
            if isinstance(content, str):
                roles[role] = content
    return roles


def default_special_tokens(vocab, known=None):
    """Fills each role from `known` or, failing that, the first candidate token found in vocab."""
    roles = dict(known or {})
    for role, candidates in _ROLE_CANDIDATES.items():
        if role in roles:
            continue
        for token in candidates:
            if token in vocab:
                roles[role] = token
                break
    return roles


def write_hf_config_files(folder, special_tokens, model_max_length=None):
    """Writes tokenizer_config.json and special_tokens_map.json next to tokenizer.json.

    tokenizer_class PreTrainedTokenizerFast makes AutoTokenizer load tokenizer.json exactly as saved,
    without a config.json or any network access.
    """
    special = {role: token for role, token in special_tokens.items() if token is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "model_max_length": model_max_length or 1000000000000000019884624838656,
        **special,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(folder, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(special, f, indent=2, ensure_ascii=False)
        f.write("\n")


def save_tokenizer_folder(tokenizer, folder, special_tokens, write_vocab_merges=True):
    """tokenizer.json (+ vocab.json/merges.txt for a BPE model) + the AutoTokenizer config files."""
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    if write_vocab_merges and isinstance(tokenizer.model, models.BPE):
        tokenizer.model.save(folder)
    write_hf_config_files(folder, special_tokens)
    return folder
