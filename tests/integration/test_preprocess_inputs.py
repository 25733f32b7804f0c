"""tools/preprocess_data.py's input handling: refusing empty or mostly-skipped output (one line, nothing written),
Parquet/Arrow inputs (the same .bin/.idx as JSONL of the same records) and C4-style folders (train shards only,
top level only, the files read listed)."""
import functools
import gzip
import json
import logging
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from megatron.data.corpus import read_chunks
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import build_tokenizer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT2 = os.path.join(ROOT, "tests", "fixtures", "gpt2")
VOCAB, MERGES = os.path.join(GPT2, "vocab.json"), os.path.join(GPT2, "merges.txt")
sys.path.insert(0, os.path.join(ROOT, "tools"))

import preprocess_data  # noqa: E402


@pytest.fixture(scope="module")
def texts():
    with open(os.path.join(ROOT, "examples", "data", "sample.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f][:60]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)


def _jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def _run(input_path, prefix, *extra):
    return preprocess_data.main(["--input", str(input_path), "--output-prefix", str(prefix), "--vocab-file", VOCAB,
                                 "--merge-file", MERGES, *extra])


def _error(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


def _documents(prefix):
    dataset = MMapIndexedDataset(f"{prefix}_text_document")
    return [dataset.get_document(d).tolist() for d in range(len(dataset.doc_idx) - 1)]


def test_missing_key_stops_naming_the_key_to_pass(tmp_path, texts, capsys):
    data = _jsonl(tmp_path / "c4.jsonl", [{"content": t, "url": "https://x"} for t in texts[:50]])
    assert _run(data, tmp_path / "out") == 1
    assert _error(capsys) == ("preprocess_data.py: error: no document has key 'text'; the first record's keys are "
                              "content, url: pass --json-keys content")
    assert os.listdir(tmp_path) == ["c4.jsonl"]  # no .bin/.idx, not even a temporary one
    assert _run(data, tmp_path / "out", "--json-keys", "content") == 0
    assert len(_documents_of(tmp_path / "out_content_document")) == 50
    numbers = _jsonl(tmp_path / "numbers.jsonl", [{"text": 5, "body": texts[0]}, {"text": None, "body": texts[1]}])
    assert _run(numbers, tmp_path / "num") == 1
    assert _error(capsys) == (f"preprocess_data.py: error: no document has text under key 'text' (first: {numbers}:1: "
                              "missing key ('text' is int, not text)); the first record's keys are text, body: pass "
                              "--json-keys body")
    assert sorted(os.listdir(tmp_path)) == ["c4.jsonl", "numbers.jsonl", "out_content_document.bin",
                                            "out_content_document.idx"]


def _documents_of(prefix):
    dataset = MMapIndexedDataset(str(prefix))
    return [dataset.get_document(d).tolist() for d in range(len(dataset.doc_idx) - 1)]


def test_mostly_skipped_stops_unless_the_threshold_allows_it(tmp_path, texts, tokenizer, capsys):
    records = [{"content": t, "url": "https://x"} for t in texts[:10]] + [{"text": t} for t in texts[10:15]]
    data = _jsonl(tmp_path / "mixed.jsonl", records)
    assert _run(data, tmp_path / "out") == 1
    assert _error(capsys) == (
        f"preprocess_data.py: error: skipped 10 of 15 records (66.7%, more than --max-skipped-fraction 0.5: 10 "
        f"missing key); first: {data}:1: missing key (no 'text'); the first record's keys are content, url: pass "
        "--json-keys content; fix the input or raise --max-skipped-fraction; nothing written")
    assert os.listdir(tmp_path) == ["mixed.jsonl"]
    assert _run(data, tmp_path / "out", "--max-skipped-fraction", "0.7") == 0
    assert _documents(tmp_path / "out") == tokenizer.tokenize_batch(texts[10:15])


def test_input_without_documents_stops(tmp_path, capsys):
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    assert _run(tmp_path / "blank.jsonl", tmp_path / "out") == 1
    assert _error(capsys) == (f"preprocess_data.py: error: --input {tmp_path / 'blank.jsonl'} holds no documents "
                              "(1 file, 2 blank lines); nothing written")
    (tmp_path / "bad.jsonl").write_text('{"text": "   "}\n{"text": 7}\n')
    assert _run(tmp_path / "bad.jsonl", tmp_path / "out") == 1
    assert _error(capsys) == (
        f"preprocess_data.py: error: no document to write: every record was skipped (1 missing key, 1 empty "
        f"document); first: {tmp_path / 'bad.jsonl'}:1: empty document (key 'text'); fix --input "
        f"{tmp_path / 'bad.jsonl'}; nothing written")
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "blank.jsonl"]


def test_parquet_and_arrow_give_the_bytes_of_the_same_jsonl(tmp_path, texts, monkeypatch):
    """What `datasets` exports: Parquet (row groups of 16), Arrow IPC streams (save_to_disk) and IPC files; read in
    chunks of 7 rows that cut across the files' batches, the output equals the JSONL run's byte for byte."""
    monkeypatch.setattr(preprocess_data, "read_chunks", functools.partial(read_chunks, chunk_lines=7))
    table = pa.table({"text": texts, "url": [f"https://x/{i}" for i in range(len(texts))]})
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet", row_group_size=16)
    with ipc.new_stream(str(tmp_path / "data-00000-of-00001.arrow"), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=25):
            writer.write_batch(batch)
    with ipc.new_file(str(tmp_path / "file.arrow"), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=11):
            writer.write_batch(batch)
    _jsonl(tmp_path / "same.jsonl", [{"text": t, "url": f"https://x/{i}"} for i, t in enumerate(texts)])
    outputs = {}
    for name in ("same.jsonl", "train-00000-of-00001.parquet", "data-00000-of-00001.arrow", "file.arrow"):
        stem = name.split(".")[0]
        assert _run(tmp_path / name, tmp_path / stem, "--append-eod") == 0
        outputs[name] = [(tmp_path / f"{stem}_text_document{ext}").read_bytes() for ext in (".bin", ".idx")]
    assert len(MMapIndexedDataset(str(tmp_path / "same_text_document")).doc_idx) == len(texts) + 1
    assert all(output == outputs["same.jsonl"] for output in outputs.values())


def test_parquet_without_the_column_names_its_columns(tmp_path, texts, capsys):
    pq.write_table(pa.table({"content": texts[:3], "id": [1, 2, 3]}), tmp_path / "a.parquet")
    assert _run(tmp_path / "a.parquet", tmp_path / "out") == 2
    assert _error(capsys) == (f"preprocess_data.py: error: --input {tmp_path / 'a.parquet'} has no column 'text'; "
                              "its columns are content, id: pass --json-keys content")
    pq.write_table(pa.table({"text": [1, 2], "body": ["a", "b"]}), tmp_path / "b.parquet")
    assert _run(tmp_path / "b.parquet", tmp_path / "out") == 2
    assert _error(capsys) == (f"preprocess_data.py: error: --input {tmp_path / 'b.parquet'}: column 'text' holds "
                              "int64, not text; its columns are text, body: pass --json-keys body")
    assert sorted(os.listdir(tmp_path)) == ["a.parquet", "b.parquet"]


def test_dataset_dict_folder_reads_its_train_split(tmp_path, texts, tokenizer):
    """`datasets`' DatasetDict.save_to_disk layout: one folder per split of Arrow streams, plus JSON metadata."""
    for split, part in (("train", texts[:7]), ("validation", texts[7:9])):
        (tmp_path / "dd" / split).mkdir(parents=True)
        table = pa.table({"text": part})
        with ipc.new_stream(str(tmp_path / "dd" / split / "data-00000-of-00001.arrow"), table.schema) as writer:
            writer.write_table(table)
        (tmp_path / "dd" / split / "state.json").write_text('{\n  "_split": null\n}\n')
        (tmp_path / "dd" / split / "dataset_info.json").write_text("{}")
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "validation"]}')
    assert _run(tmp_path / "dd", tmp_path / "out", "--recursive") == 0
    assert _documents(tmp_path / "out") == tokenizer.tokenize_batch(texts[:7])


@pytest.fixture
def c4_folder(tmp_path, texts):
    """c4/en as C4's release lays it out (plus what `datasets` leaves beside and a subfolder)."""
    folder = tmp_path / "c4" / "en"
    (folder / "extra").mkdir(parents=True)
    shards = {"c4-train.00000-of-00002.json.gz": texts[:10], "c4-train.00001-of-00002.json.gz": texts[10:25],
              "c4-validation.00000-of-00001.json.gz": texts[25:30], "extra/c4-train.00000-of-00001.json": texts[30:33]}
    for name, part in shards.items():
        _jsonl(folder / name, [{"text": t, "timestamp": "2019-04-25T12:57:54Z", "url": "https://x"} for t in part],
               gzip.open if name.endswith(".gz") else open)
    (folder / "dataset_info.json").write_text('{\n  "description": "not a record"\n}\n')
    return folder


def test_c4_folder_reads_training_shards_at_its_top_level(tmp_path, c4_folder, texts, tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="preprocess_data"):
        assert _run(c4_folder, tmp_path / "train") == 0
    assert _documents(tmp_path / "train") == tokenizer.tokenize_batch(texts[:25])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("reading", "left out"))]
    assert lines == ["reading 2 input files: c4-train.00000-of-00002.json.gz, c4-train.00001-of-00002.json.gz",
                     "left out 1 file of other splits (--input-split train; all reads them): "
                     "c4-validation.00000-of-00001.json.gz"]
    assert _run(c4_folder, tmp_path / "valid", "--input-split", "validation") == 0
    assert _documents(tmp_path / "valid") == tokenizer.tokenize_batch(texts[25:30])
    assert _run(c4_folder, tmp_path / "all", "--input-split", "all", "--recursive") == 0
    assert _documents(tmp_path / "all") == tokenizer.tokenize_batch(texts[:33])  # sorted paths: extra/ last


def test_folder_without_the_split_names_the_flag(tmp_path, texts, capsys):
    folder = tmp_path / "c4"
    folder.mkdir()
    _jsonl(folder / "c4-validation.00000-of-00001.json", [{"text": texts[0]}])
    assert _run(folder, tmp_path / "out") == 2
    assert _error(capsys) == (f"preprocess_data.py: error: --input {folder}: the folder holds no files of split "
                              "train (only validation); pass --input-split validation or --input-split all")
    nested = tmp_path / "nested"
    (nested / "sub").mkdir(parents=True)
    _jsonl(nested / "sub" / "a.jsonl", [{"text": texts[0]}])
    assert _run(nested, tmp_path / "out") == 2
    assert _error(capsys) == (f"preprocess_data.py: error: --input {nested}: the folder holds no "
                              ".json/.jsonl/.json.gz/.jsonl.gz/.parquet/.arrow files at its top level (pass "
                              "--recursive to read its subfolders)")
    assert np.array_equal(sorted(os.listdir(tmp_path)), ["c4", "nested"])
