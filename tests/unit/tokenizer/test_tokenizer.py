"""Tokenizer tests: ids equal the `tokenizers` library's on real text, special ids, save/load, vocab padding."""
import json
import os

import pytest
import tokenizers

from megatron.tokenizer import build_tokenizer, pad_vocab_size

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
GPT2 = os.path.join(ROOT, "tests", "fixtures", "gpt2")
EXAMPLE_TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")
SAMPLE = os.path.join(ROOT, "examples", "data", "sample.jsonl")


@pytest.fixture(scope="module")
def texts():
    with open(SAMPLE, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    # Real text from every book, plus odd cases: specials inside text, non-ASCII, whitespace runs.
    return docs[::8] + ["Hello world!", "a<|endoftext|>b </s> <pad>", "Ünïcödé — “quotes” 日本語 🙂", "  \n\n\t x  ", ""]


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("GPT2BPETokenizer", vocab_file=os.path.join(GPT2, "vocab.json"),
                           merge_file=os.path.join(GPT2, "merges.txt"))


def test_gpt2_ids_equal_tokenizers_library(gpt2, texts):
    reference = tokenizers.Tokenizer.from_file(os.path.join(GPT2, "tokenizer.json"))
    for text in texts:
        assert gpt2.tokenize(text) == reference.encode(text).ids, text[:80]
    assert gpt2.tokenize_batch(texts) == [e.ids for e in reference.encode_batch(texts)]


def test_gpt2_known_ids_and_specials(gpt2):
    assert gpt2.tokenize("Hello world!") == [15496, 995, 0]
    assert gpt2.eod == 50256
    assert gpt2.pad == 50257  # <pad> added: GPT-2 has none
    assert gpt2.vocab_size == 50258
    assert gpt2.detokenize([15496, 995, 0]) == "Hello world!"


def test_detokenize_round_trip(gpt2, texts):
    for text in texts:
        assert gpt2.detokenize(gpt2.tokenize(text)) == text


def test_gpt2_save_pretrained_loads_with_auto_tokenizer(gpt2, texts, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    gpt2.save_pretrained(str(tmp_path))
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).is_file(), name
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.eos_token_id == gpt2.eod and loaded.pad_token_id == gpt2.pad
    for text in texts[:20]:
        assert loaded(text, add_special_tokens=False)["input_ids"] == gpt2.tokenize(text)
    reloaded = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=str(tmp_path))
    assert (reloaded.eod, reloaded.pad, reloaded.vocab_size) == (gpt2.eod, gpt2.pad, gpt2.vocab_size)


def test_pretrained_from_hf_folder_and_file(texts):
    folder = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=EXAMPLE_TOKENIZER)
    file = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=os.path.join(EXAMPLE_TOKENIZER, "tokenizer.json"))
    reference = tokenizers.Tokenizer.from_file(os.path.join(EXAMPLE_TOKENIZER, "tokenizer.json"))
    assert (folder.eod, folder.pad, folder.vocab_size) == (2, 3, 8000)  # </s>, <pad>: BLOOM-style ids
    for text in texts:
        assert folder.tokenize(text) == file.tokenize(text) == reference.encode(text).ids


def test_bloom_style_vocab_merges_match_tokenizer_json(texts):
    """GPT2BPETokenizer on a BLOOM-style vocab.json/merges.txt uses BLOOM's pre-tokenizer: same ids."""
    from_files = build_tokenizer("GPT2BPETokenizer", vocab_file=os.path.join(EXAMPLE_TOKENIZER, "vocab.json"),
                                 merge_file=os.path.join(EXAMPLE_TOKENIZER, "merges.txt"))
    reference = tokenizers.Tokenizer.from_file(os.path.join(EXAMPLE_TOKENIZER, "tokenizer.json"))
    assert (from_files.eod, from_files.pad, from_files.vocab_size) == (2, 3, 8000)
    assert from_files.tokenize_batch(texts) == [e.ids for e in reference.encode_batch(texts)]


def test_hub_name_is_refused_with_one_line():
    with pytest.raises(ValueError) as info:
        build_tokenizer("PretrainedFromHF", tokenizer_name_or_path="bigscience/bloom")
    message = str(info.value)
    assert "\n" not in message
    assert message == ("--tokenizer-name-or-path bigscience/bloom: not a local folder or tokenizer.json file, and "
                       "downloading from the Hugging Face hub is not available (no network); pass a local folder "
                       "holding tokenizer.json (for example examples/tokenizer)")


def test_bad_vocab_and_merge_files(tmp_path):
    bad = tmp_path / "vocab.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"^--vocab-file .*vocab.json: cannot be read as JSON"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(bad), merge_file=os.path.join(GPT2, "merges.txt"))
    with pytest.raises(ValueError, match=r"^--merge-file .*missing.txt: no such file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=os.path.join(GPT2, "vocab.json"),
                        merge_file=str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="--tokenizer-type 'SentencePiece' is not supported"):
        build_tokenizer("SentencePiece")


@pytest.mark.parametrize("tp,expected", [(1, 250752), (2, 250880), (4, 250880), (3, 250752)])
def test_pad_vocab_size_bloom(tp, expected):
    assert pad_vocab_size(250680, 128, tp) == expected
    assert pad_vocab_size(250680, 128, tp) % (128 * tp) == 0


def test_pad_vocab_size_to():
    assert pad_vocab_size(250680, 128, 1, pad_vocab_size_to=250880) == 250880  # BLOOM's size at any TP
    assert pad_vocab_size(50257) == 50304
    with pytest.raises(ValueError, match=r"--pad-vocab-size-to 250000 is smaller than the tokenizer's vocabulary"):
        pad_vocab_size(250680, pad_vocab_size_to=250000)
    with pytest.raises(ValueError, match=r"--pad-vocab-size-to 250881 is not divisible by "
                                         r"--tensor-model-parallel-size 4; .* \(for example 250884\)"):
        pad_vocab_size(250680, 128, 4, pad_vocab_size_to=250881)
