"""GPT pretraining datasets: documents packed into seq_length + 1 token samples, shuffled, with cached indices.

For a split holding documents D (a contiguous range of the .bin/.idx documents), three index arrays
are built once and cached as .npy files beside the data (or in cache_dir):
    doc_idx      the documents of every epoch, shuffled (epochs repeated until num_samples fit)
    sample_idx   (num_samples + 1, 2): where sample i starts, as (position in doc_idx, token offset);
                 sample i is tokens [i * seq_length, (i + 1) * seq_length] of the concatenation
    shuffle_idx  a permutation of the samples
File names hold a hash of every parameter (documents, their sizes, num_samples, seq_length, seed),
so a change rebuilds them. Global rank 0 builds; the other ranks wait at a barrier, then all mmap them.
"""
import hashlib
import logging
import os
import time

import numpy as np
import torch

from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.dataset_utils import get_datasets_weights_and_num_samples, get_train_valid_test_split_
from megatron.data.helpers import build_sample_idx
from megatron.data.indexed_dataset import MMapIndexedDataset

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
_INDEX_FORMAT_VERSION = 1


def build_train_valid_test_datasets(data_prefix, splits_string, train_valid_test_num_samples, seq_length, seed,
                                    cache_dir=None):
    """(train, valid, test) datasets from --data-path (one prefix, or weight/prefix pairs to blend).

    A split with 0 requested samples or no documents is None. Each item is {"text": int64 (seq_length + 1,)}.
    """
    if isinstance(data_prefix, str):
        data_prefix = [data_prefix]
    num_samples = tuple(int(n) for n in train_valid_test_num_samples)
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise ValueError(f"train_valid_test_num_samples must be three counts >= 0, got {train_valid_test_num_samples}")
    if seq_length < 1:
        raise ValueError(f"--seq-length {seq_length} must be >= 1")
    if len(data_prefix) == 1:
        datasets = _build_single(data_prefix[0], splits_string, num_samples, seq_length, seed, cache_dir)
        if num_samples[1] > 0 and datasets[1] is None:
            docs = len(MMapIndexedDataset(data_prefix[0]).doc_idx) - 1
            _warn_empty_validation(f"--split {splits_string} gives it none of the {docs} documents of "
                                   f"{data_prefix[0]}")
        return datasets

    paths, weights, per_dataset = get_datasets_weights_and_num_samples(data_prefix, num_samples)
    built = [_build_single(path, splits_string, counts, seq_length, seed, cache_dir)
             for path, counts in zip(paths, per_dataset)]
    blended = []
    for split, name in enumerate(SPLIT_NAMES):
        parts = [(ds[split], w) for ds, w in zip(built, weights) if ds[split] is not None and w > 0]
        if num_samples[split] == 0 or not parts:
            blended.append(None)
            continue
        missing = [p for p, ds, w in zip(paths, built, weights) if w > 0 and ds[split] is None]
        if missing:
            logger.warning("%s split: %s have no documents in it; blending the others with renormalised weights",
                           name, ", ".join(missing))
        blended.append(BlendableDataset([ds for ds, _ in parts], [w for _, w in parts], num_samples[split]))
    if num_samples[1] > 0 and blended[1] is None:
        _warn_empty_validation(f"--split {splits_string} gives it no document of any --data-path dataset")
    return tuple(blended)


def _warn_empty_validation(why):
    """One warning (global rank 0) that no validation loss will be reported."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning("the validation split is empty: %s, so no validation loss is computed; add documents or "
                       "raise the validation part of --split", why)


def _build_single(path_prefix, splits_string, num_samples, seq_length, seed, cache_dir):
    indexed = MMapIndexedDataset(path_prefix)  # IndexedDatasetError names the file and the fix
    total_docs = len(indexed.doc_idx) - 1
    bounds = get_train_valid_test_split_(splits_string, total_docs)
    logger.info("%s: %d documents, split %s -> train [%d, %d) valid [%d, %d) test [%d, %d)", path_prefix,
                total_docs, splits_string, bounds[0], bounds[1], bounds[1], bounds[2], bounds[2], bounds[3])
    datasets = []
    for split, name in enumerate(SPLIT_NAMES):
        start, end = bounds[split], bounds[split + 1]
        if num_samples[split] == 0 or end <= start:
            datasets.append(None)
            continue
        documents = np.arange(start, end, dtype=np.int64)
        datasets.append(GPTDataset(name, path_prefix, documents, indexed, num_samples[split], seq_length, seed,
                                   cache_dir=cache_dir))
    return tuple(datasets)


class GPTDataset(torch.utils.data.Dataset):
    """Packed, shuffled samples of seq_length + 1 tokens over `documents` of an MMapIndexedDataset."""

    def __init__(self, name, data_prefix, documents, indexed_dataset, num_samples, seq_length, seed, cache_dir=None):
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.seq_length = int(seq_length)
        documents = np.asarray(documents, dtype=np.int64)
        num_docs = len(indexed_dataset.doc_idx) - 1
        assert len(documents) > 0 and documents.min() >= 0 and documents.max() < num_docs, (len(documents), num_docs)
        self.doc_idx, self.sample_idx, self.shuffle_idx = build_index_mappings(
            name, data_prefix, documents, indexed_dataset.document_sizes, num_samples, self.seq_length, seed,
            cache_dir)

    def __len__(self):
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, idx):
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for the {self.name} dataset of {len(self)} samples")
        idx = int(self.shuffle_idx[idx])
        doc_f, offset_f = (int(v) for v in self.sample_idx[idx])
        doc_l, offset_l = (int(v) for v in self.sample_idx[idx + 1])
        get = self.indexed_dataset.get_document
        if doc_f == doc_l:
            tokens = get(int(self.doc_idx[doc_f]), offset_f, offset_l - offset_f + 1)
        else:
            parts = [get(int(self.doc_idx[doc_f]), offset_f)]
            parts += [get(int(self.doc_idx[i])) for i in range(doc_f + 1, doc_l)]
            parts.append(get(int(self.doc_idx[doc_l]), 0, offset_l + 1))
            tokens = np.concatenate(parts)
        text = tokens.astype(np.int64)
        assert text.shape == (self.seq_length + 1,), (text.shape, self.seq_length)
        return {"text": text}


def num_epochs_needed(tokens_per_epoch, seq_length, num_samples):
    """Smallest E with (E * tokens_per_epoch - 1) // seq_length >= num_samples."""
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_doc_idx(documents, num_epochs, np_rng, separate_last_epoch):
    """documents repeated num_epochs times and shuffled (the last epoch on its own when separate)."""
    if not separate_last_epoch or num_epochs == 1:
        doc_idx = np.tile(np.asarray(documents, dtype=np.int64), num_epochs)
        np_rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, num_epochs - 1, np_rng, False)
    last = build_doc_idx(documents, 1, np_rng, False)
    return np.concatenate((first, last))


def build_shuffle_idx(num_samples, total_size, np_rng):
    """A permutation of [0, num_samples) followed by one of [num_samples, total_size)."""
    first = np.arange(num_samples, dtype=np.int64)
    np_rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=np.int64)
    np_rng.shuffle(last)
    return np.concatenate((first, last))


def compute_index_mappings(documents, sizes, num_samples, seq_length, seed):
    """(doc_idx, sample_idx, shuffle_idx) for the documents, in memory (Megatron's recipe, numpy RandomState)."""
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    if tokens_per_epoch < 2:
        raise ValueError(f"the documents hold {tokens_per_epoch} tokens; a sample needs at least 2 "
                         "(preprocess more text or change --split)")
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate_last_epoch = False
    if num_epochs > 1:
        # Shuffle the last epoch apart when it is used for less than 80% of an epoch, so that its
        # leftover samples stay at the end instead of mixing into the epochs that are used in full.
        samples_before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_last_epoch = (num_samples - samples_before_last) < int(0.80 * samples_per_epoch)
    np_rng = np.random.RandomState(seed=seed)
    doc_idx = build_doc_idx(documents, num_epochs, np_rng, separate_last_epoch)
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, total_samples)
    first_part = samples_before_last if separate_last_epoch else total_samples
    shuffle_idx = build_shuffle_idx(first_part, total_samples, np_rng)
    return doc_idx, sample_idx, shuffle_idx


def index_cache_prefix(name, data_prefix, documents, sizes, num_samples, seq_length, seed, cache_dir=None):
    """Path prefix of the cached index files; the hash covers every input of compute_index_mappings."""
    digest = hashlib.md5()
    digest.update(f"v{_INDEX_FORMAT_VERSION} {name} {num_samples} {seq_length} {seed} {len(documents)}".encode())
    digest.update(np.ascontiguousarray(documents, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(sizes[documents], dtype=np.int64).tobytes())
    folder = cache_dir if cache_dir is not None else os.path.dirname(os.path.abspath(data_prefix))
    base = os.path.basename(data_prefix)
    return os.path.join(folder, f"{base}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s_"
                                f"{digest.hexdigest()[:16]}")


def _save_npy_atomic(path, array):
    tmp = f"{path}.tmp{os.getpid()}.npy"
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def build_index_mappings(name, data_prefix, documents, sizes, num_samples, seq_length, seed, cache_dir=None):
    """Loads (mmap) the cached doc/sample/shuffle index arrays, building them on global rank 0 if missing."""
    prefix = index_cache_prefix(name, data_prefix, documents, sizes, num_samples, seq_length, seed, cache_dir)
    paths = {key: f"{prefix}_{key}.npy" for key in ("doc_idx", "sample_idx", "shuffle_idx")}
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if distributed else 0
    error = None
    if rank == 0 and not all(os.path.isfile(p) for p in paths.values()):
        folder = os.path.dirname(prefix)
        try:
            if cache_dir is not None:
                os.makedirs(folder, exist_ok=True)
            if not os.access(folder, os.W_OK):
                raise RuntimeError(f"cannot write the {name} index files to {folder}; pass a writable "
                                   "--data-cache-path (cache_dir)")
            start = time.perf_counter()
            arrays = compute_index_mappings(documents, sizes, num_samples, seq_length, seed)
            for key, array in zip(("doc_idx", "sample_idx", "shuffle_idx"), arrays):
                _save_npy_atomic(paths[key], array)
            logger.info("built %s index mappings (%d samples, %d epochs of documents) in %.2f s: %s_*.npy", name,
                        arrays[1].shape[0] - 1, len(arrays[0]) // max(1, len(documents)),
                        time.perf_counter() - start, prefix)
        except Exception as exc:  # re-raised after the barrier so the other ranks are not left waiting
            error = exc
    if distributed:
        torch.distributed.barrier()
    if error is not None:
        raise error
    missing = [p for p in paths.values() if not os.path.isfile(p)]
    if missing:
        raise RuntimeError(f"rank {rank}: index file {missing[0]} is missing after rank 0 built the {name} "
                           "indices; see rank 0's log, and put the cache on a filesystem all ranks share")
    arrays = tuple(np.load(paths[key], mmap_mode="r", allow_pickle=False)
                   for key in ("doc_idx", "sample_idx", "shuffle_idx"))
    if arrays[1].shape[0] - 1 < num_samples:
        raise RuntimeError(f"{prefix}: cached {name} index holds {arrays[1].shape[0] - 1} samples, fewer than "
                           f"{num_samples}; delete the stale *_indexmap_* files")
    return arrays
