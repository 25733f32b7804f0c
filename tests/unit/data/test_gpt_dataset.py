"""GPT datasets: packing across documents, epochs, --split semantics, cached indices, blending, rank-0 builds."""
import os

import numpy as np
import pytest

from megatron.data import gpt_dataset
from megatron.data.dataset_utils import get_train_valid_test_split_, parse_data_prefix
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from tests.distributed import run_distributed

SEQ = 16


def _write_dataset(prefix, num_docs, base=0, seed=0, sentences=False):
    """Document d holds tokens base + 1000 * d + k, so every token tells its dataset and document."""
    rng = np.random.default_rng(seed)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    documents = []
    for d in range(num_docs):
        tokens = base + 1000 * d + np.arange(int(rng.integers(1, 40)))
        documents.append(tokens)
        if sentences and len(tokens) > 2:
            builder.add_item(tokens[:2])
            builder.add_item(tokens[2:])
        else:
            builder.add_item(tokens)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return documents


def _doc_of(token, base=0):
    return (int(token) - base) // 1000


@pytest.mark.parametrize("split,size,expected", [
    ("969,30,1", 1000, [0, 969, 999, 1000]),
    ("0.9,0.05,0.05", 100, [0, 90, 95, 100]),
    ("98,2,0", 10, [0, 10, 10, 10]),
    ("100", 7, [0, 7, 7, 7]),
    ("8/1/1", 10, [0, 8, 9, 10]),
    ("969,30,1", 3, [0, 3, 3, 3]),
])
def test_split_string_semantics(split, size, expected):
    assert get_train_valid_test_split_(split, size) == expected


def test_bad_split_and_data_path():
    with pytest.raises(ValueError, match=r"^--split 'a,b' is not a list of numbers; use e.g. 969,30,1$"):
        get_train_valid_test_split_("a,b", 10)
    with pytest.raises(ValueError, match=r"^--split '0,0,0' sums to 0"):
        get_train_valid_test_split_("0,0,0", 10)
    with pytest.raises(ValueError, match=r"^--data-path: weight 'x' before p is not a number"):
        parse_data_prefix(["x", "p", "1", "q"])
    assert parse_data_prefix(["1", "a", "3", "b"]) == (["a", "b"], [0.25, 0.75])


def test_missing_data_files(tmp_path):
    """A data problem is an IndexedDatasetError: pretrain_bloom.py prints it as one line."""
    from megatron.data.indexed_dataset import IndexedDatasetError
    prefix = str(tmp_path / "absent_text_document")
    with pytest.raises(IndexedDatasetError) as info:
        build_train_valid_test_datasets([prefix], "969,30,1", (10, 0, 0), SEQ, 1234)
    assert str(info.value) == (f"--data-path {prefix}: {prefix}.idx does not exist; pass the output prefix of "
                               "tools/preprocess_data.py without .bin/.idx (e.g. c4_en_text_document)")


@pytest.mark.parametrize("sentences", [False, True])
def test_samples_pack_documents_in_doc_idx_order(tmp_path, sentences):
    prefix = str(tmp_path / "data")
    documents = _write_dataset(prefix, 60, sentences=sentences)
    train, valid, test = build_train_valid_test_datasets([prefix], "100,0,0", (200, 0, 0), SEQ, 1234)
    assert valid is None and test is None
    assert len(train) >= 200
    stream = np.concatenate([documents[d] for d in train.doc_idx])
    assert len(train.doc_idx) % 60 == 0 and len(train.doc_idx) >= 120  # several epochs were needed
    for i in range(len(train)):
        j = int(train.shuffle_idx[i])
        text = train[i]["text"]
        assert text.dtype == np.int64 and text.shape == (SEQ + 1,)
        np.testing.assert_array_equal(text, stream[j * SEQ:j * SEQ + SEQ + 1])
    assert sorted(train.shuffle_idx.tolist()) == list(range(len(train)))
    with pytest.raises(IndexError):
        train[len(train)]


def test_splits_use_disjoint_documents(tmp_path):
    prefix = str(tmp_path / "data")
    _write_dataset(prefix, 100)
    train, valid, test = build_train_valid_test_datasets([prefix], "80,15,5", (50, 20, 10), SEQ, 7)
    ranges = {"train": range(0, 80), "valid": range(80, 95), "test": range(95, 100)}
    for name, dataset in (("train", train), ("valid", valid), ("test", test)):
        docs = {_doc_of(t) for i in range(len(dataset)) for t in dataset[i]["text"]}
        assert docs <= set(ranges[name]), name
    assert build_train_valid_test_datasets([prefix], "80,20,0", (50, 20, 10), SEQ, 7)[2] is None


def test_index_files_cached_and_keyed_by_parameters(tmp_path, monkeypatch):
    prefix = str(tmp_path / "data")
    _write_dataset(prefix, 40)
    cache = tmp_path / "cache"
    first = build_train_valid_test_datasets([prefix], "100,0,0", (30, 0, 0), SEQ, 1, cache_dir=str(cache))[0]
    files = sorted(os.listdir(cache))
    assert len(files) == 3 and all(f.startswith("data_train_indexmap_30ns_16sl_1s_") for f in files)
    assert {f.rsplit("_", 2)[-2] + "_" + f.rsplit("_", 2)[-1] for f in files} == {
        "doc_idx.npy", "sample_idx.npy", "shuffle_idx.npy"}

    def fail(*args, **kwargs):
        raise AssertionError("index rebuilt although cached")

    monkeypatch.setattr(gpt_dataset, "compute_index_mappings", fail)
    again = build_train_valid_test_datasets([prefix], "100,0,0", (30, 0, 0), SEQ, 1, cache_dir=str(cache))[0]
    assert isinstance(again.sample_idx, np.memmap)
    for i in range(len(first)):
        np.testing.assert_array_equal(first[i]["text"], again[i]["text"])
    monkeypatch.undo()
    other = build_train_valid_test_datasets([prefix], "100,0,0", (30, 0, 0), SEQ, 2, cache_dir=str(cache))[0]
    assert len(os.listdir(cache)) == 6
    assert any(not np.array_equal(first[i]["text"], other[i]["text"]) for i in range(len(first)))
    # Without cache_dir the files go beside the data.
    build_train_valid_test_datasets([prefix], "100,0,0", (30, 0, 0), SEQ, 1)
    assert len([f for f in os.listdir(tmp_path) if "_indexmap_" in f]) == 3


def test_blending_ratios_within_one_percent(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    _write_dataset(a, 50, base=0, seed=1)
    _write_dataset(b, 80, base=1_000_000, seed=2)
    _write_dataset(c, 30, base=2_000_000, seed=3)
    weights = [0.2, 0.5, 0.3]
    num_samples = 3000
    train, valid, _ = build_train_valid_test_datasets(["2", a, "5", b, "3", c], "90,10,0", (num_samples, 100, 0),
                                                      SEQ, 1234)
    assert len(train) == num_samples and len(valid) == 100
    counts = np.bincount(train.dataset_index, minlength=3) / num_samples
    assert np.all(np.abs(counts - weights) < 0.01), counts
    sources = np.array([int(train[i]["text"][0]) // 1_000_000 for i in range(num_samples)])
    np.testing.assert_array_equal(sources, train.dataset_index)  # items really come from the chosen dataset


def _rank_builds(rank, world_size, prefix, cache):
    import torch.distributed as dist

    if rank != 0:
        def fail(*args, **kwargs):
            raise AssertionError(f"rank {rank} built the index")
        gpt_dataset.compute_index_mappings = fail
    train = build_train_valid_test_datasets([prefix], "100,0,0", (40, 0, 0), SEQ, 3, cache_dir=cache)[0]
    samples = np.stack([train[i]["text"] for i in range(len(train))])
    gathered = [None] * world_size
    dist.all_gather_object(gathered, samples)
    assert all(np.array_equal(gathered[0], g) for g in gathered)


def test_rank_zero_builds_other_ranks_wait(tmp_path):
    prefix = str(tmp_path / "data")
    _write_dataset(prefix, 40)
    run_distributed(_rank_builds, 2, prefix, str(tmp_path / "cache"))
    assert len(os.listdir(tmp_path / "cache")) == 3
