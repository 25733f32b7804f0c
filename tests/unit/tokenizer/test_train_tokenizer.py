"""tools/train_tokenizer.py: a BLOOM-style tokenizer trained from txt and jsonl inputs, loadable offline."""
import gzip
import json
import os
import sys

import tokenizers

from megatron.tokenizer import build_tokenizer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import train_tokenizer  # noqa: E402


def _sample_texts(count=120):
    with open(os.path.join(ROOT, "examples", "data", "sample.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f][:count]


def test_train_bloom_style_tokenizer(tmp_path):
    texts = _sample_texts()
    (tmp_path / "a.txt").write_text("\r\n\r\n".join(t.replace("\n", "\r\n") for t in texts[:60]), encoding="utf-8")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        for text in texts[60:]:
            f.write(json.dumps({"text": text}) + "\n")
    out = tmp_path / "tok"
    assert train_tokenizer.main(["--input", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl.gz"),
                                 "--vocab-size", "600", "--output-dir", str(out)]) == 0
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).is_file(), name
    spec = json.loads((out / "tokenizer.json").read_text())
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"]["Regex"] == " ?[^(\\s|[.,!?…。，、।۔،])]+" and split["behavior"] == "Isolated"
    assert byte_level["type"] == "ByteLevel" and byte_level["use_regex"] is False
    vocab = json.loads((out / "vocab.json").read_text())
    assert [vocab[t] for t in ("<unk>", "<s>", "</s>", "<pad>")] == [0, 1, 2, 3]
    assert len(vocab) == 600
    assert not any("č" in token and len(token) > 1 for token in vocab), "CRLF leaked into the vocabulary"

    tokenizer = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=str(out))
    assert (tokenizer.eod, tokenizer.pad, tokenizer.vocab_size) == (2, 3, 600)
    reference = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.tokenize(texts[0]) == reference.encode(texts[0]).ids
    assert tokenizer.detokenize(tokenizer.tokenize(texts[0])) == texts[0]


def test_missing_input_fails_with_one_line(tmp_path, capsys):
    assert train_tokenizer.main(["--input", str(tmp_path / "nope.txt"), "--output-dir", str(tmp_path / "t")]) == 2
    assert capsys.readouterr().err.strip() == (f"train_tokenizer.py: error: --input {tmp_path / 'nope.txt'}: "
                                               "no such file, folder or glob match")
