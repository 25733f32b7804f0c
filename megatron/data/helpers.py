"""Index builders of the GPT data pipeline: the C++ module (csrc/data/helpers.cpp) with numpy fallbacks.

build_sample_idx and build_blending_indices call megatron.data.helpers_cpp when it is built
(`pip install -e .`) and otherwise the numpy versions below, which return identical arrays.
"""
import logging

import numpy as np

logger = logging.getLogger(__name__)

try:
    from megatron.data import helpers_cpp
except ImportError:  # not built: numpy fallback, same results, slower for blending
    helpers_cpp = None


def cpp_helpers_available():
    return helpers_cpp is not None


def build_sample_idx_numpy(sizes, doc_idx, seq_length, num_samples):
    """(num_samples + 1, 2) int64: row i is (position in doc_idx, token offset) of global token i * seq_length.

    Sample i spans tokens [i * seq_length, (i + 1) * seq_length] of the documents concatenated in doc_idx
    order (seq_length + 1 tokens). The token at position p lies in the first document whose cumulative end
    exceeds p, which skips empty documents exactly as the C++ walk does.
    """
    if seq_length <= 0:
        raise ValueError(f"seq_length must be positive, got {seq_length}")
    doc_lengths = np.asarray(sizes, dtype=np.int64)[np.asarray(doc_idx, dtype=np.int64)]
    ends = np.cumsum(doc_lengths, dtype=np.int64)  # ends[k]: tokens in documents 0..k
    positions = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    if num_samples > 0 and (len(ends) == 0 or positions[-1] >= ends[-1]):
        raise IndexError(f"documents run out before sample {num_samples}: {int(ends[-1]) if len(ends) else 0} "
                         f"tokens for {num_samples} samples of {seq_length}")
    where = np.searchsorted(ends, positions, side="right")
    starts = np.where(where > 0, ends[np.maximum(where - 1, 0)], 0)
    sample_idx = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample_idx[1:, 0] = where
    sample_idx[1:, 1] = positions - starts
    return sample_idx


def build_blending_indices_numpy(weights, size):
    """Greedy blending: sample i goes to argmax_d (w_d * (i + 1) - count_d), the first maximum on ties."""
    weights = [float(w) for w in np.asarray(weights, dtype=np.float64)]
    dataset_index = np.zeros(size, dtype=np.uint8)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    current = [0] * len(weights)
    num_datasets = range(len(weights))
    for i in range(size):
        position = float(i + 1)
        best, best_error = 0, weights[0] * position - current[0]
        for d in num_datasets:
            error = weights[d] * position - current[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i] = best
        dataset_sample_index[i] = current[best]
        current[best] += 1
    return dataset_index, dataset_sample_index


def build_sample_idx(sizes, doc_idx, seq_length, num_samples):
    if helpers_cpp is not None:
        return helpers_cpp.build_sample_idx(np.asarray(sizes, dtype=np.int32), np.asarray(doc_idx, dtype=np.int64),
                                            int(seq_length), int(num_samples))
    return build_sample_idx_numpy(sizes, doc_idx, seq_length, num_samples)


def build_blending_indices(weights, size):
    if helpers_cpp is not None:
        return helpers_cpp.build_blending_indices(np.asarray(weights, dtype=np.float64), int(size))
    if size > 1_000_000:
        logger.warning("building a blending index of %d samples in Python; run `pip install -e .` to build "
                       "the C++ helpers (megatron.data.helpers_cpp) for speed", size)
    return build_blending_indices_numpy(weights, size)
