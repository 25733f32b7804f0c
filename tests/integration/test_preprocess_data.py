"""tools/preprocess_data.py end to end: outputs, worker-independence, inputs, bad records, start-up errors."""
import functools
import gzip
import json
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.corpus import read_chunks
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import build_tokenizer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT2 = os.path.join(ROOT, "tests", "fixtures", "gpt2")
VOCAB, MERGES = os.path.join(GPT2, "vocab.json"), os.path.join(GPT2, "merges.txt")
SCRIPT = os.path.join(ROOT, "tools", "preprocess_data.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import preprocess_data  # noqa: E402


@pytest.fixture(scope="module")
def texts():
    with open(os.path.join(ROOT, "examples", "data", "sample.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f][:150]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)


def _jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def _run(input_path, prefix, *extra):
    return preprocess_data.main(["--input", str(input_path), "--output-prefix", str(prefix), "--vocab-file", VOCAB,
                                 "--merge-file", MERGES, "--dataset-impl", "mmap", "--tokenizer-type",
                                 "GPT2BPETokenizer", *extra])


def _documents(prefix):
    dataset = MMapIndexedDataset(f"{prefix}_text_document")
    return dataset, [dataset.get_document(d).tolist() for d in range(len(dataset.doc_idx) - 1)]


def test_output_equals_tokenizer_ids(tmp_path, texts, tokenizer, capsys, monkeypatch):
    data = _jsonl(tmp_path / "c4.jsonl", [{"text": t, "timestamp": "2019-04-25", "url": "u"} for t in texts])
    monkeypatch.setattr(preprocess_data, "read_chunks", functools.partial(read_chunks, chunk_lines=50))
    assert _run(data, tmp_path / "out", "--append-eod", "--log-interval", "50") == 0
    dataset, documents = _documents(tmp_path / "out")
    expected = [ids + [tokenizer.eod] for ids in tokenizer.tokenize_batch(texts)]
    assert dataset.dtype == np.uint16 and len(documents) == 150
    assert documents == expected
    # one line per 50 documents (a chunk of 50 lines each), then the final line: documents, tokens, input read
    line_bytes = [len(line) for line in (tmp_path / "c4.jsonl").read_bytes().splitlines(keepends=True)]
    progress = [re.fullmatch(r"Processed (\d+) documents \([\d.]+ docs/s, [\d.]+ MB/s, (\d+) tokens, ([\d.]+)% of "
                             r"input, ETA \d\d:\d\d:\d\d\)", line)
                for line in capsys.readouterr().err.splitlines() if line.startswith("Processed")]
    assert [match.groups() for match in progress] == [
        (str(n), str(sum(map(len, expected[:n]))), f"{100 * sum(line_bytes[:n]) / sum(line_bytes):.1f}")
        for n in (50, 100, 150, 150)]
    assert progress[-1].group(3) == "100.0"
    assert sorted(os.listdir(tmp_path)) == ["c4.jsonl", "out_text_document.bin", "out_text_document.idx"]


def test_workers_give_identical_bytes(tmp_path, texts, monkeypatch):
    data = _jsonl(tmp_path / "c4.jsonl", [{"text": t} for t in texts])
    monkeypatch.setattr(preprocess_data, "read_chunks", functools.partial(read_chunks, chunk_lines=7))
    assert _run(data, tmp_path / "w1", "--append-eod", "--workers", "1") == 0
    assert _run(data, tmp_path / "w2", "--append-eod", "--workers", "2") == 0
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1_text_document{ext}").read_bytes() == (tmp_path / f"w2_text_document{ext}").read_bytes()


def test_folder_glob_and_gzip_inputs(tmp_path, texts, tokenizer):
    folder = tmp_path / "c4"
    folder.mkdir()
    _jsonl(folder / "c4-train.00000-of-00002.json", [{"text": t} for t in texts[:40]])
    with gzip.open(folder / "c4-train.00001-of-00002.json.gz", "wt", encoding="utf-8") as f:
        for t in texts[40:90]:
            f.write(json.dumps({"text": t, "timestamp": "2019-04-25T12:57:54Z", "url": "https://x"}) + "\n")
    expected = tokenizer.tokenize_batch(texts[:90])
    assert _run(folder, tmp_path / "dir") == 0
    assert _documents(tmp_path / "dir")[1] == expected
    assert _run(str(folder / "c4-train.*"), tmp_path / "glob") == 0
    assert _documents(tmp_path / "glob")[1] == expected


def _bad_corpus(path, texts):
    lines = [json.dumps({"text": texts[0]}).encode(),
             b'{"text": "broken',
             json.dumps({"url": "no text here"}).encode(),
             b'{"text": "caf\xe9 latin-1"}',
             json.dumps({"text": "   \n  "}).encode(),
             b"",
             json.dumps(["a", "list"]).encode(),
             json.dumps({"text": 42}).encode(),
             json.dumps({"text": texts[1]}).encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def test_bad_records_are_skipped_counted_and_named(tmp_path, texts, tokenizer, caplog):
    data = _bad_corpus(tmp_path / "bad.jsonl", texts)
    with caplog.at_level(logging.WARNING, logger="preprocess_data"):
        assert _run(data, tmp_path / "out", "--append-eod", "--max-skipped-fraction", "0.8") == 0
    assert _documents(tmp_path / "out")[1] == [ids + [tokenizer.eod] for ids in tokenizer.tokenize_batch(texts[:2])]
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped")]
    assert summary == [
        f"skipped 6 bad records (1 non-UTF-8 bytes, 2 malformed JSON, 2 missing key, 1 empty document); first: "
        f"{data}:2: malformed JSON (Unterminated string starting at: column 10); "
        f"{data}:3: missing key (no 'text'); "
        f"{data}:4: non-UTF-8 bytes (byte 0xe9 at offset 13); "
        f"{data}:5: empty document (key 'text'); "
        f"{data}:7: malformed JSON (expected an object, got list); also 1 blank lines"]


def test_strict_stops_at_first_bad_record_and_leaves_nothing(tmp_path, texts, capsys):
    data = _bad_corpus(tmp_path / "bad.jsonl", texts)
    assert _run(data, tmp_path / "out", "--strict", "--workers", "2") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"preprocess_data.py: error: --strict: bad input at {data}:2: malformed JSON "
                   "(Unterminated string starting at: column 10); no output written")
    assert os.listdir(tmp_path) == ["bad.jsonl"]


def test_corrupt_gzip_is_reported(tmp_path, texts, caplog):
    good = tmp_path / "a.jsonl.gz"
    with gzip.open(good, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": texts[0]}) + "\n")
    (tmp_path / "b.jsonl.gz").write_bytes(good.read_bytes()[:20])
    with caplog.at_level(logging.WARNING, logger="preprocess_data"):
        assert _run(tmp_path, tmp_path / "out") == 0
    assert any("1 unreadable file" in r.getMessage() and "b.jsonl.gz" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("case", ["input", "vocab", "merges", "prefix", "impl", "hub"])
def test_start_up_errors_are_one_line(tmp_path, texts, capsys, case):
    data = _jsonl(tmp_path / "c4.jsonl", [{"text": texts[0]}])
    bad_vocab = tmp_path / "vocab.json"
    bad_vocab.write_text("{oops")
    argv = {"input": ["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "o"),
                      "--vocab-file", VOCAB, "--merge-file", MERGES],
            "vocab": ["--input", data, "--output-prefix", str(tmp_path / "o"), "--vocab-file", str(bad_vocab),
                      "--merge-file", MERGES],
            "merges": ["--input", data, "--output-prefix", str(tmp_path / "o"), "--vocab-file", VOCAB,
                       "--merge-file", str(tmp_path / "merges.txt")],
            "prefix": ["--input", data, "--output-prefix", str(tmp_path / "nodir" / "o"), "--vocab-file", VOCAB,
                       "--merge-file", MERGES],
            "impl": ["--input", data, "--output-prefix", str(tmp_path / "o"), "--vocab-file", VOCAB,
                     "--merge-file", MERGES, "--dataset-impl", "lazy"],
            "hub": ["--input", data, "--output-prefix", str(tmp_path / "o"), "--tokenizer-name-or-path",
                    "bigscience/bloom"]}[case]
    expected = {"input": f"--input {tmp_path / 'missing.jsonl'}: no such file, folder or glob match",
                "vocab": f"--vocab-file {bad_vocab}: cannot be read as JSON (Expecting property name enclosed in "
                         "double quotes: line 1 column 2 (char 1)); pass a valid vocab.json",
                "merges": f"--merge-file {tmp_path / 'merges.txt'}: no such file; pass the merges.txt beside vocab.json",
                "prefix": f"--output-prefix {tmp_path / 'nodir' / 'o'}: folder {tmp_path / 'nodir'} does not exist; "
                          "create it first",
                "impl": "--dataset-impl lazy: only mmap (Megatron's MMIDIDX .bin/.idx) is supported; "
                        "pass --dataset-impl mmap",
                "hub": "--tokenizer-name-or-path bigscience/bloom: not a local folder or tokenizer.json file, and "
                       "downloading from the Hugging Face hub is not available (no network); pass a local folder "
                       "holding tokenizer.json (for example examples/tokenizer)"}[case]
    assert preprocess_data.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"preprocess_data.py: error: {expected}"
    assert sorted(os.listdir(tmp_path)) == ["c4.jsonl", "vocab.json"]


def test_cli_subprocess_exit_codes(tmp_path, texts):
    data = _jsonl(tmp_path / "c4.jsonl", [{"text": t} for t in texts[:5]])
    ok = subprocess.run([sys.executable, SCRIPT, "--input", data, "--output-prefix", str(tmp_path / "o"),
                         "--vocab-file", VOCAB, "--merge-file", MERGES, "--append-eod"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert os.path.isfile(tmp_path / "o_text_document.idx")
    bad = subprocess.run([sys.executable, SCRIPT, "--input", str(tmp_path / "none*.jsonl"), "--output-prefix",
                          str(tmp_path / "o"), "--vocab-file", VOCAB, "--merge-file", MERGES],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip() == (f"preprocess_data.py: error: --input {tmp_path / 'none*.jsonl'}: "
                                  "no such file, folder or glob match")


@pytest.mark.parametrize("keep_newlines", [False, True])
def test_split_sentences(tmp_path, texts, tokenizer, keep_newlines, caplog):
    text = "Alice was tired. She sat down!\n\nThen the Rabbit ran by. Why?  It was late."
    data = _jsonl(tmp_path / "c4.jsonl", [{"text": text}, {"text": texts[3]}])
    extra = ["--keep-newlines"] if keep_newlines else []
    with caplog.at_level(logging.INFO, logger="preprocess_data"):
        assert _run(data, tmp_path / "s", "--split-sentences", "--append-eod", *extra) == 0
    assert any("splitting sentences with" in r.getMessage() for r in caplog.records)
    dataset = MMapIndexedDataset(str(tmp_path / "s_text_document"))
    first = [dataset[i].tolist() for i in range(int(dataset.doc_idx[0]), int(dataset.doc_idx[1]))]
    assert len(first) == 5 and first[-1][-1] == tokenizer.eod
    decoded = [tokenizer.detokenize(ids) for ids in first]
    if keep_newlines:
        assert "".join(decoded) == text + "<|endoftext|>"
        assert decoded[1] == "She sat down!\n\n"
    else:
        assert decoded == ["Alice was tired.", "She sat down!", "Then the Rabbit ran by.", "Why?",
                           "It was late.<|endoftext|>"]


def test_normalisation_options_and_several_keys(tmp_path, tokenizer):
    data = _jsonl(tmp_path / "c4.jsonl", [{"text": "Ｆｉｎｅ ﬁsh\r\nNEXT\x00 line\u200b", "title": "A Title"}])
    assert _run(data, tmp_path / "raw", "--json-keys", "text", "title") == 0
    assert _documents(tmp_path / "raw")[1] == [tokenizer.tokenize("Ｆｉｎｅ ﬁsh\r\nNEXT\x00 line\u200b")]
    assert MMapIndexedDataset(str(tmp_path / "raw_title_document"))[0].tolist() == tokenizer.tokenize("A Title")
    assert _run(data, tmp_path / "norm", "--normalize", "nfkc", "--remove-control-chars", "--lowercase") == 0
    assert _documents(tmp_path / "norm")[1] == [tokenizer.tokenize("fine fish\nnext line")]


def test_truncated_bin_stops_pretrain_bloom_with_one_line(tmp_path, texts):
    """pretrain_bloom.py (one process) on a .bin cut short: exit code 1, one line naming the file and the fix."""
    from tests.launch import TINY_MODEL, run_pretrain
    assert _run(_jsonl(tmp_path / "c4.jsonl", [{"text": t} for t in texts[:20]]), tmp_path / "c4", "--append-eod") == 0
    prefix = str(tmp_path / "c4_text_document")
    full = os.path.getsize(prefix + ".bin")
    assert full == 2 * int(MMapIndexedDataset(prefix).sizes.sum())
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(full - 100)
    proc = run_pretrain(TINY_MODEL + ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--deepspeed",
                                      "--data-path", prefix, "--vocab-file", VOCAB, "--merge-file", MERGES],
                        check=False, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "Traceback" not in output
    assert [line.split(" ERROR megatron: ")[-1] for line in output.splitlines() if prefix in line] == [
        f"{prefix}.bin is truncated: {full - 100} bytes, but {prefix}.idx describes 20 sequences of uint16 ending "
        f"at byte {full}; re-run tools/preprocess_data.py to rebuild {prefix}.bin/.idx"]
