"""Index builders: the C++ module and the numpy fallback give identical arrays, equal to Megatron's walk."""
import numpy as np
import pytest

from megatron.data import helpers


def _reference_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """Megatron's sample-index walk, written plainly in Python."""
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    position, offset = 0, 0
    for sample in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[position]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                position, offset = position + 1, 0
        out[sample] = (position, offset)
    return out


def _case(seed, num_docs, max_size, seq_length, epochs):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, max_size, num_docs).astype(np.int32)  # includes empty documents
    sizes[0] = max(int(sizes[0]), 1)
    doc_idx = np.concatenate([rng.permutation(num_docs) for _ in range(epochs)]).astype(np.int64)
    num_samples = (int(sizes[doc_idx].sum()) - 1) // seq_length
    return sizes, doc_idx, num_samples


@pytest.mark.parametrize("seed,num_docs,max_size,seq_length,epochs",
                         [(0, 200, 30, 16, 1), (1, 50, 500, 7, 3), (2, 300, 5, 64, 2), (3, 10, 2000, 1, 1)])
def test_sample_idx_numpy_equals_reference(seed, num_docs, max_size, seq_length, epochs):
    sizes, doc_idx, num_samples = _case(seed, num_docs, max_size, seq_length, epochs)
    expected = _reference_sample_idx(sizes, doc_idx, seq_length, num_samples)
    np.testing.assert_array_equal(helpers.build_sample_idx_numpy(sizes, doc_idx, seq_length, num_samples), expected)


@pytest.mark.skipif(not helpers.cpp_helpers_available(), reason="megatron.data.helpers_cpp not built (pip install -e .)")
@pytest.mark.parametrize("seed,num_docs,max_size,seq_length,epochs",
                         [(0, 200, 30, 16, 1), (1, 50, 500, 7, 3), (2, 300, 5, 64, 2), (4, 20000, 1000, 2048, 2)])
def test_sample_idx_cpp_equals_numpy(seed, num_docs, max_size, seq_length, epochs):
    sizes, doc_idx, num_samples = _case(seed, num_docs, max_size, seq_length, epochs)
    cpp = helpers.helpers_cpp.build_sample_idx(sizes, doc_idx, seq_length, num_samples)
    assert cpp.dtype == np.int64 and cpp.shape == (num_samples + 1, 2)
    np.testing.assert_array_equal(cpp, helpers.build_sample_idx_numpy(sizes, doc_idx, seq_length, num_samples))


@pytest.mark.skipif(not helpers.cpp_helpers_available(), reason="megatron.data.helpers_cpp not built (pip install -e .)")
@pytest.mark.parametrize("weights,size", [([0.5, 0.5], 1000), ([0.7, 0.2, 0.1], 5003), ([1 / 3] * 3, 999),
                                          ([0.01, 0.09, 0.3, 0.6], 20000), ([1.0], 10)])
def test_blending_cpp_equals_numpy(weights, size):
    cpp = helpers.helpers_cpp.build_blending_indices(np.asarray(weights), size)
    ref = helpers.build_blending_indices_numpy(weights, size)
    assert cpp[0].dtype == np.uint8 and cpp[1].dtype == np.int64
    np.testing.assert_array_equal(cpp[0], ref[0])
    np.testing.assert_array_equal(cpp[1], ref[1])


def test_blending_index_tracks_weights_at_every_prefix():
    weights = np.array([0.6, 0.3, 0.1])
    index, sample_index = helpers.build_blending_indices(weights, 3000)
    counts = np.zeros(3)
    for i, d in enumerate(index):
        assert sample_index[i] == counts[d]  # each dataset's samples are taken in order
        counts[d] += 1
        assert np.all(np.abs(counts - weights * (i + 1)) <= 1.0 + 1e-9)


def test_fallback_is_used_without_module(monkeypatch):
    sizes, doc_idx, num_samples = _case(5, 100, 50, 9, 2)
    expected = helpers.build_sample_idx(sizes, doc_idx, 9, num_samples)
    expected_blend = helpers.build_blending_indices([0.25, 0.75], 100)
    monkeypatch.setattr(helpers, "helpers_cpp", None)
    np.testing.assert_array_equal(helpers.build_sample_idx(sizes, doc_idx, 9, num_samples), expected)
    np.testing.assert_array_equal(helpers.build_blending_indices([0.25, 0.75], 100)[0], expected_blend[0])
