"""MMIDIDX .bin/.idx: exact byte layout, round trip, zero-copy reads, merging (builder and tools/merge_datasets.py)."""
import os
import struct
import sys

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder, best_fitting_dtype

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import merge_datasets  # noqa: E402


def _documents(seed, count, vocab):
    """count documents, each a list of 1-3 sequences (sentences) of random ids."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, vocab, rng.integers(1, 40)).tolist() for _ in range(rng.integers(1, 4))]
            for _ in range(count)]


def _write(prefix, documents, dtype):
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for document in documents:
        for sequence in document:
            builder.add_item(sequence)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def test_best_fitting_dtype():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(250880) == np.int32


def test_index_bytes_follow_megatron_layout(tmp_path):
    prefix = str(tmp_path / "tiny")
    _write(prefix, [[[1, 2, 3], [4]], [[5, 6]]], np.uint16)
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<Q", 3)
                + struct.pack("<Q", 3) + np.array([3, 1, 2], "<i4").tobytes() + np.array([0, 6, 8], "<i8").tobytes()
                + np.array([0, 2, 3], "<i8").tobytes())
    assert (tmp_path / "tiny.idx").read_bytes() == expected
    assert (tmp_path / "tiny.bin").read_bytes() == np.arange(1, 7, dtype="<u2").tobytes()


@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 50257), (np.int32, 250880)])
def test_round_trip(tmp_path, dtype, vocab):
    documents = _documents(0, 50, vocab)
    prefix = str(tmp_path / "data")
    _write(prefix, documents, dtype)
    dataset = MMapIndexedDataset(prefix)
    sequences = [seq for doc in documents for seq in doc]
    assert len(dataset) == len(sequences)
    assert dataset.dtype == np.dtype(dtype)
    assert dataset.sizes.tolist() == [len(s) for s in sequences]
    assert dataset.doc_idx.tolist() == np.cumsum([0] + [len(d) for d in documents]).tolist()
    for i, sequence in enumerate(sequences):
        assert dataset[i].tolist() == sequence
    assert dataset[-1].tolist() == sequences[-1]
    assert [s.tolist() for s in dataset[2:5]] == sequences[2:5]
    longest = int(np.argmax(dataset.sizes))
    assert dataset.get(longest, offset=2, length=3).tolist() == sequences[longest][2:5]
    assert dataset.get(longest, offset=4).tolist() == sequences[longest][4:]
    for d, document in enumerate(documents):
        flat = [t for seq in document for t in seq]
        assert dataset.document_sizes[d] == len(flat)
        assert dataset.get_document(d).tolist() == flat
        if len(flat) >= 3:
            assert dataset.get_document(d, 1, 2).tolist() == flat[1:3]
    assert not dataset[0].flags.writeable  # a view of the memory map, not a copy
    with pytest.raises(IndexError):
        dataset.get(0, offset=0, length=int(dataset.sizes[0]) + 1)


def test_missing_files_name_data_path(tmp_path):
    with pytest.raises(ValueError, match=r"^--data-path .*nothing: .*nothing.idx does not exist"):
        MMapIndexedDataset(str(tmp_path / "nothing"))


def test_merge_builder_and_tool(tmp_path):
    parts = [_documents(seed, 20, 1000) for seed in (1, 2, 3)]
    prefixes = [str(tmp_path / f"part{i}") for i in range(3)]
    for prefix, documents in zip(prefixes, parts):
        _write(prefix, documents, np.uint16)
    _write(str(tmp_path / "whole"), [d for part in parts for d in part], np.uint16)

    builder = MMapIndexedDatasetBuilder(str(tmp_path / "merged.bin"), dtype=np.uint16)
    for prefix in prefixes:
        builder.merge_file_(prefix)
    builder.finalize(str(tmp_path / "merged.idx"))
    for name in ("merged.bin", "merged.idx"):
        assert (tmp_path / name).read_bytes() == (tmp_path / name.replace("merged", "whole")).read_bytes()

    assert merge_datasets.main(["--input", *prefixes, "--output-prefix", str(tmp_path / "tool")]) == 0
    assert (tmp_path / "tool.idx").read_bytes() == (tmp_path / "whole.idx").read_bytes()
    assert (tmp_path / "tool.bin").read_bytes() == (tmp_path / "whole.bin").read_bytes()
    os.makedirs(tmp_path / "shards")
    for i, documents in enumerate(parts):
        _write(str(tmp_path / "shards" / f"s{i}"), documents, np.uint16)
    assert merge_datasets.main(["--input-dir", str(tmp_path / "shards"), "--output-prefix", str(tmp_path / "dir")]) == 0
    assert (tmp_path / "dir.bin").read_bytes() == (tmp_path / "whole.bin").read_bytes()


def test_merge_rejects_other_dtype(tmp_path):
    _write(str(tmp_path / "a"), [[[1, 2]]], np.uint16)
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "b.bin"), dtype=np.int32)
    with pytest.raises(ValueError, match="cannot merge .*a \\(dtype uint16\\) into a int32 dataset"):
        builder.merge_file_(str(tmp_path / "a"))
    builder.close()


def test_merge_tool_missing_input(tmp_path, capsys):
    assert merge_datasets.main(["--input", str(tmp_path / "x"), "--output-prefix", str(tmp_path / "y")]) == 2
    assert capsys.readouterr().err.strip() == (f"merge_datasets.py: error: --input {tmp_path / 'x'}: "
                                               f"{tmp_path / 'x'}.idx does not exist; pass prefixes without .bin/.idx")
