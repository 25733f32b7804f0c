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


def _corrupt(tmp_path, name, edit):
    """A 3-sequence, 2-document uint16 dataset (12 .bin bytes, 34 + 36 + 24 = 94 .idx bytes), then edit(idx, bin)."""
    prefix = str(tmp_path / name)
    _write(prefix, [[[1, 2, 3], [4]], [[5, 6]]], np.uint16)
    idx, data = tmp_path / f"{name}.idx", tmp_path / f"{name}.bin"
    edit(idx, data)
    return prefix


def _open_error(prefix):
    with pytest.raises(ValueError) as info:
        MMapIndexedDataset(prefix)
    return str(info.value)


def test_truncated_or_corrupt_files_name_the_file_and_the_fix(tmp_path):
    fix = "re-run tools/preprocess_data.py to rebuild {p}.bin/.idx"

    p = _corrupt(tmp_path, "short_idx", lambda idx, data: idx.write_bytes(idx.read_bytes()[:90]))
    assert _open_error(p) == (f"{p}.idx is truncated: 90 bytes, but its header describes 3 sequences in 2 "
                              f"documents (94 bytes); " + fix.format(p=p))
    p = _corrupt(tmp_path, "header", lambda idx, data: idx.write_bytes(idx.read_bytes()[:20]))
    assert _open_error(p) == f"{p}.idx is truncated: 20 bytes, shorter than the 34-byte MMIDIDX header; " + \
        fix.format(p=p)
    p = _corrupt(tmp_path, "empty", lambda idx, data: idx.write_bytes(b""))
    assert _open_error(p) == f"{p}.idx is truncated: 0 bytes, shorter than the 34-byte MMIDIDX header; " + \
        fix.format(p=p)
    p = _corrupt(tmp_path, "magic", lambda idx, data: idx.write_bytes(b"TNTIDX\x00\x00" + idx.read_bytes()[8:]))
    assert _open_error(p) == (f"{p}.idx is not an MMIDIDX index (it starts with b'TNTIDX\\x00\\x00\\x00', not "
                              f"b'MMIDIDX\\x00\\x00'); " + fix.format(p=p))
    p = _corrupt(tmp_path, "long_idx", lambda idx, data: idx.write_bytes(idx.read_bytes() + b"\x00" * 8))
    assert _open_error(p) == (f"{p}.idx is corrupt: 102 bytes, but its header describes 3 sequences in 2 "
                              f"documents (94 bytes); " + fix.format(p=p))
    p = _corrupt(tmp_path, "doc_idx", lambda idx, data: idx.write_bytes(idx.read_bytes()[:-8] + struct.pack("<q", 4)))
    assert _open_error(p) == (f"{p}.idx is corrupt: its last document ends at sequence 4, but it holds 3 "
                              f"sequences; " + fix.format(p=p))
    p = _corrupt(tmp_path, "no_docs", lambda idx, data: idx.write_bytes(
        idx.read_bytes()[:26] + struct.pack("<Q", 0) + idx.read_bytes()[34:-24]))
    assert _open_error(p) == (f"{p}.idx is corrupt: its document index is empty (it holds at least the offset 0); "
                              + fix.format(p=p))
    p = _corrupt(tmp_path, "short_bin", lambda idx, data: data.write_bytes(data.read_bytes()[:7]))
    assert _open_error(p) == (f"{p}.bin is truncated: 7 bytes, but {p}.idx describes 3 sequences of uint16 "
                              f"ending at byte 12; " + fix.format(p=p))
    p = _corrupt(tmp_path, "long_bin", lambda idx, data: data.write_bytes(data.read_bytes() * 2))
    assert _open_error(p) == (f"{p}.bin does not match its index: 24 bytes, but {p}.idx describes 3 sequences "
                              f"of uint16 ending at byte 12; " + fix.format(p=p))


def test_merge_tool_rejects_a_truncated_input(tmp_path, capsys):
    good = _corrupt(tmp_path, "good", lambda idx, data: None)
    bad = _corrupt(tmp_path, "bad", lambda idx, data: data.write_bytes(data.read_bytes()[:10]))
    out = tmp_path / "out"
    assert merge_datasets.main(["--input", good, bad, "--output-prefix", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"merge_datasets.py: error: {bad}.bin is truncated: 10 bytes, but {bad}.idx describes 3 sequences of "
        f"uint16 ending at byte 12; re-run tools/preprocess_data.py to rebuild {bad}.bin/.idx")
    assert sorted(os.listdir(tmp_path)) == ["bad.bin", "bad.idx", "good.bin", "good.idx"]
