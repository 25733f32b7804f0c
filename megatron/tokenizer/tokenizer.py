"""Megatron tokenizers (GPT2BPETokenizer, PretrainedFromHF) on the Hugging Face `tokenizers` library, type inference.

Both types wrap a `tokenizers.Tokenizer`, so ids are exactly what that library gives for the same files,
and encoding runs in Rust (`tokenize_batch` encodes many documents in parallel).
"""
import json
import logging
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from megatron.config import pad_vocab_size  # noqa: F401  (vocab padding is config arithmetic; kept importable here)
from megatron.tokenizer.hf_files import (
    default_special_tokens,
    is_bloom_style_vocab,
    bloom_pre_tokenizer,
    read_special_tokens,
    save_tokenizer_folder,
)

logger = logging.getLogger(__name__)

TOKENIZER_TYPES = ("GPT2BPETokenizer", "PretrainedFromHF")
PAD_TOKEN = "<pad>"


class AbstractTokenizer:
    """What Megatron's data pipeline and model need from a tokenizer."""

    def __init__(self, name, tokenizer, special_tokens):
        self.name = name
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        eod_token = special_tokens.get("eos_token")
        if eod_token not in vocab:
            raise ValueError(f"{name}: the tokenizer has no end-of-document token (looked for "
                             f"{eod_token or '</s> or <|endoftext|>'}); use a tokenizer with an eos token")
        # Encoding uses the tokenizer as given, so ids equal the `tokenizers` library's for the same files
        # (a literal "<pad>" in text stays text). A pad token the tokenizer lacks is added to a copy, used
        # for decoding and save_pretrained: its id is the old vocab size, which encoding never produces.
        self._encoder = tokenizer
        pad_token = special_tokens.get("pad_token")
        if pad_token not in vocab:
            pad_token = PAD_TOKEN
            if pad_token not in vocab:
                tokenizer = Tokenizer.from_str(tokenizer.to_str())
                tokenizer.add_special_tokens([AddedToken(pad_token, special=True, normalized=False)])
                logger.info("%s: the tokenizer has no pad token; added %s as id %d", name, pad_token,
                            tokenizer.token_to_id(pad_token))
            special_tokens = {**special_tokens, "pad_token": pad_token}
        self._tokenizer = tokenizer
        self.special_tokens = special_tokens
        self._eod = tokenizer.token_to_id(eod_token)
        self._pad = tokenizer.token_to_id(pad_token)
        self._encode_batch = getattr(self._encoder, "encode_batch_fast", self._encoder.encode_batch)

    @property
    def vocab_size(self):
        """Tokens the tokenizer can emit, added pad token included (unpadded: see pad_vocab_size)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self):
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self):
        return {i: token for token, i in self.vocab.items()}

    @property
    def eod(self):
        return self._eod

    @property
    def pad(self):
        return self._pad

    @property
    def backend_tokenizer(self):
        return self._tokenizer

    def tokenize(self, text):
        """Ids of text without any added bos/eos (the data pipeline appends eod itself)."""
        return self._encoder.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts):
        """tokenize() for many texts at once, in parallel threads; same ids as calling tokenize() on each."""
        return [encoding.ids for encoding in self._encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, token_ids):
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def save_pretrained(self, folder):
        """Writes tokenizer.json, vocab.json, merges.txt and the config files AutoTokenizer reads offline."""
        return save_tokenizer_folder(self._tokenizer, folder, self.special_tokens)


def _read_json_file(path, flag):
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file; pass the path of an existing file")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{flag} {path}: cannot be read as JSON ({exc}); pass a valid vocab.json") from exc


def _bpe_from_vocab_merges(vocab_file, merge_file):
    """A byte-level BPE tokenizers.Tokenizer from GPT-2-format vocab.json and merges.txt."""
    vocab = _read_json_file(vocab_file, "--vocab-file")
    if not isinstance(vocab, dict) or not vocab:
        raise ValueError(f"--vocab-file {vocab_file}: expected a JSON object of token -> id")
    if not os.path.isfile(merge_file):
        raise ValueError(f"--merge-file {merge_file}: no such file; pass the merges.txt beside vocab.json")
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--merge-file {merge_file}: cannot be read ({exc}); pass a valid merges.txt") from exc
    merges = []
    for lineno, line in enumerate(lines, 1):
        if not line or line.startswith("#version"):
            continue
        pair = line.split(" ")
        if len(pair) != 2:
            raise ValueError(f"--merge-file {merge_file}: line {lineno} is not two space-separated tokens: "
                             f"{line[:60]!r}; pass a GPT-2-format merges.txt")
        merges.append((pair[0], pair[1]))
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    if is_bloom_style_vocab(vocab):
        logger.info("%s holds BLOOM's special tokens <unk> <s> </s> <pad> as ids 0-3: using BLOOM's "
                    "split-regex pre-tokenizer so ids match BLOOM's tokenizer.json", vocab_file)
        tokenizer.pre_tokenizer = bloom_pre_tokenizer()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [t for t in ("<|endoftext|>", "<unk>", "<s>", "</s>", "<pad>") if t in vocab]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer, vocab


class GPT2BPETokenizer(AbstractTokenizer):
    """Byte-level BPE from vocab.json + merges.txt; eod is <|endoftext|> (</s> for a BLOOM-style vocab)."""

    def __init__(self, vocab_file, merge_file):
        tokenizer, vocab = _bpe_from_vocab_merges(vocab_file, merge_file)
        special = default_special_tokens(vocab, {"eos_token": "<|endoftext|>"} if "<|endoftext|>" in vocab else {})
        super().__init__("GPT2BPETokenizer", tokenizer, special)


class PretrainedFromHFTokenizer(AbstractTokenizer):
    """A Hugging Face tokenizer from a local folder (tokenizer.json, or vocab.json + merges.txt) or tokenizer.json."""

    def __init__(self, tokenizer_name_or_path):
        path = tokenizer_name_or_path
        if path is None:
            raise ValueError("--tokenizer-type PretrainedFromHF needs --tokenizer-name-or-path "
                             "(a local folder holding tokenizer.json)")
        if os.path.isfile(path):
            folder = os.path.dirname(os.path.abspath(path))
            tokenizer = self._from_file(path)
        elif os.path.isdir(path):
            folder = path
            if os.path.isfile(os.path.join(path, "tokenizer.json")):
                tokenizer = self._from_file(os.path.join(path, "tokenizer.json"))
            elif os.path.isfile(os.path.join(path, "vocab.json")) and os.path.isfile(os.path.join(path, "merges.txt")):
                tokenizer, _ = _bpe_from_vocab_merges(os.path.join(path, "vocab.json"),
                                                      os.path.join(path, "merges.txt"))
            else:
                raise ValueError(f"--tokenizer-name-or-path {path}: the folder has no tokenizer.json "
                                 "(nor vocab.json + merges.txt); save the tokenizer there with "
                                 "tokenizer.save_pretrained(folder)")
        else:
            raise ValueError(f"--tokenizer-name-or-path {path}: not a local folder or tokenizer.json file, and "
                             "downloading from the Hugging Face hub is not available (no network); pass a local "
                             "folder holding tokenizer.json (for example examples/tokenizer)")
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        known = {role: tok for role, tok in read_special_tokens(folder).items() if tok in vocab}
        super().__init__("PretrainedFromHF", tokenizer, default_special_tokens(vocab, known))

    @staticmethod
    def _from_file(path):
        try:
            return Tokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises a bare Exception for bad files
            raise ValueError(f"--tokenizer-name-or-path {path}: not a valid tokenizer.json ({exc})") from exc


def infer_tokenizer_type(tokenizer_type, vocab_file=None, merge_file=None, tokenizer_name_or_path=None):
    """--tokenizer-type, or when it is unset: GPT2BPETokenizer when --vocab-file or --merge-file is given (a
    missing half is then named by build_tokenizer), else PretrainedFromHF with --tokenizer-name-or-path."""
    if tokenizer_type:
        return tokenizer_type
    if vocab_file or merge_file:
        return "GPT2BPETokenizer"
    if tokenizer_name_or_path:
        return "PretrainedFromHF"
    raise ValueError("no tokenizer: pass --vocab-file and --merge-file (GPT2BPETokenizer) or "
                     "--tokenizer-name-or-path (PretrainedFromHF: a local Hugging Face tokenizer folder)")


def build_tokenizer(tokenizer_type, vocab_file=None, merge_file=None, tokenizer_name_or_path=None):
    """Megatron's tokenizer factory: GPT2BPETokenizer (vocab + merges files) or PretrainedFromHF (local path)."""
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None or merge_file is None:
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file "
                             f"(got {vocab_file!r} and {merge_file!r})")
        tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    elif tokenizer_type == "PretrainedFromHF":
        tokenizer = PretrainedFromHFTokenizer(tokenizer_name_or_path)
    else:
        raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; use one of "
                         f"{', '.join(TOKENIZER_TYPES)}")
    logger.info("built %s: %d tokens, eod %d, pad %d", tokenizer_type, tokenizer.vocab_size,
                tokenizer.eod, tokenizer.pad)
    return tokenizer
