"""tools/convert_tokenizer.py: a vocab.json + merges.txt folder becomes one AutoTokenizer loads, with our ids."""
import json
import os
import shutil
import sys

import pytest

from megatron.tokenizer import build_tokenizer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import convert_tokenizer  # noqa: E402

SOURCES = {"bloom_style": os.path.join(ROOT, "examples", "tokenizer"),
           "gpt2": os.path.join(ROOT, "tests", "fixtures", "gpt2")}


@pytest.fixture(scope="module")
def texts():
    with open(os.path.join(ROOT, "examples", "data", "sample.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    return docs[::10] + ["Hello world!", "Ünïcödé — “quotes” 日本語 🙂", "  \n\n\t x  "]


@pytest.mark.parametrize("source", ["bloom_style", "gpt2"])
def test_converted_folder_loads_with_auto_tokenizer_and_gives_our_ids(source, tmp_path, texts, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    folder = tmp_path / "bloom_tokenizer"  # what the document has: only vocab.json and merges.txt
    folder.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(os.path.join(SOURCES[source], name), folder / name)
    inputs = {name: (folder / name).read_bytes() for name in ("vocab.json", "merges.txt")}
    args = ["--vocab-file", str(folder / "vocab.json"), "--merge-file", str(folder / "merges.txt")]
    assert convert_tokenizer.main(args + ["--output-dir", str(folder)]) == 0  # in place
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=str(folder / "vocab.json"),
                           merge_file=str(folder / "merges.txt"))
    specials = {"bloom_style": "unk <unk>, bos <s>, eos </s>, pad <pad>",
                "gpt2": "eos <|endoftext|>, bos <|endoftext|>, pad <pad>"}[source]
    assert capsys.readouterr().out.strip() == (
        f"wrote tokenizer.json, tokenizer_config.json, special_tokens_map.json to {folder} ({ours.vocab_size} "
        f'tokens; {specials}); load it with AutoTokenizer.from_pretrained("{folder}")')
    assert sorted(os.listdir(folder)) == ["merges.txt", "special_tokens_map.json", "tokenizer.json",
                                          "tokenizer_config.json", "vocab.json"]
    assert {name: (folder / name).read_bytes() for name in inputs} == inputs  # inputs left as they were

    loaded = AutoTokenizer.from_pretrained(str(folder))
    assert [loaded(t, add_special_tokens=False)["input_ids"] for t in texts] == ours.tokenize_batch(texts)
    assert (loaded.eos_token_id, loaded.pad_token_id, len(loaded)) == (ours.eod, ours.pad, ours.vocab_size)
    assert (loaded.eos_token_id, loaded.pad_token_id) == {"bloom_style": (2, 3), "gpt2": (50256, 50257)}[source]
    for text in texts[:10]:
        assert loaded.decode(ours.tokenize(text)) == text
    reloaded = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=str(folder))
    assert reloaded.tokenize_batch(texts) == ours.tokenize_batch(texts)

    assert convert_tokenizer.main(args + ["--output-dir", str(tmp_path / "copy")]) == 0  # another folder
    assert (tmp_path / "copy" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert (tmp_path / "copy" / "vocab.json").read_bytes() == inputs["vocab.json"]


def test_existing_tokenizer_json_needs_force(tmp_path, capsys):
    vocab, merges = (os.path.join(SOURCES["bloom_style"], n) for n in ("vocab.json", "merges.txt"))
    out = tmp_path / "tok"
    assert convert_tokenizer.main(["--vocab-file", vocab, "--merge-file", merges, "--output-dir", str(out)]) == 0
    capsys.readouterr()
    assert convert_tokenizer.main(["--vocab-file", vocab, "--merge-file", merges, "--output-dir", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (f"convert_tokenizer.py: error: --output-dir {out} already holds "
                                               "tokenizer.json; pass --force to replace it or choose another folder")
    assert convert_tokenizer.main(["--vocab-file", vocab, "--merge-file", merges, "--output-dir", str(out),
                                   "--force"]) == 0
    assert convert_tokenizer.main(["--vocab-file", str(tmp_path / "none.json"), "--merge-file", merges,
                                   "--output-dir", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip() == (f"convert_tokenizer.py: error: --vocab-file {tmp_path / 'none.json'}: "
                                               "no such file; pass the path of an existing file")
