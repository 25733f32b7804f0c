"""Benchmarks GPT index building (doc/sample/shuffle indices, blending) for a synthetic 1-billion-token dataset.

    python benchmarks/index_build.py [--tokens 1e9] [--seq-length 2048]

Writes an .idx of synthetic document sizes (log-normal, mean ~500 tokens) beside a sparse .bin in a temp
folder, then times build_train_valid_test_datasets (cold: indices built; warm: loaded from the cache), the
C++ and numpy sample-index builders, and a blending index. Goal: the cold build under 10 s.
"""
import argparse
import logging
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data import helpers  # noqa: E402
from megatron.data.gpt_dataset import build_train_valid_test_datasets  # noqa: E402
from megatron.data.indexed_dataset import write_index  # noqa: E402


def synthetic_sizes(total_tokens, seed=0):
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(mean=5.6, sigma=1.0, size=int(total_tokens / 300) + 1000).astype(np.int64) + 1
    sizes = np.minimum(sizes, 100_000)
    cut = int(np.searchsorted(np.cumsum(sizes), total_tokens)) + 1
    return sizes[:cut].astype(np.int32)


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=1e9)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--split", default="969,30,1")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sizes = synthetic_sizes(args.tokens)
    tokens = int(sizes.sum(dtype=np.int64))
    print(f"synthetic dataset: {len(sizes):,} documents, {tokens:,} tokens (mean {tokens / len(sizes):.0f}), "
          f"seq_length {args.seq_length}, C++ helpers: {helpers.cpp_helpers_available()}")
    with tempfile.TemporaryDirectory() as folder:
        prefix = os.path.join(folder, "synthetic_text_document")
        write_index(prefix + ".idx", np.uint16, sizes, np.arange(len(sizes) + 1))
        with open(prefix + ".bin", "wb") as f:
            f.truncate(tokens * 2)  # sparse: index building reads only the sizes
        train_samples = int(tokens * 0.969) // args.seq_length
        num_samples = (train_samples, train_samples // 100, train_samples // 1000)
        cache = os.path.join(folder, "cache")
        datasets, cold = timed(build_train_valid_test_datasets, [prefix], args.split, num_samples, args.seq_length,
                               1234, cache_dir=cache)
        _, warm = timed(build_train_valid_test_datasets, [prefix], args.split, num_samples, args.seq_length, 1234,
                        cache_dir=cache)
        train = datasets[0]
        print(f"build_train_valid_test_datasets, cold (indices built and saved): {cold:6.2f} s "
              f"({len(train):,} train samples)")
        print(f"build_train_valid_test_datasets, warm (indices mmap-loaded):      {warm:6.2f} s")
        rng = np.random.default_rng(0)
        picks = rng.integers(0, len(train), 10000)
        _, fetch = timed(lambda: [train[int(i)] for i in picks])
        print(f"random sample reads: {10000 / fetch:,.0f} samples/s")

        doc_idx = np.asarray(train.doc_idx)
        total = (int(sizes[doc_idx].sum(dtype=np.int64)) - 1) // args.seq_length
        if helpers.cpp_helpers_available():
            cpp, t_cpp = timed(helpers.helpers_cpp.build_sample_idx, sizes, doc_idx, args.seq_length, total)
            print(f"sample index ({total:,} samples), C++:   {t_cpp:6.3f} s")
        ref, t_np = timed(helpers.build_sample_idx_numpy, sizes, doc_idx, args.seq_length, total)
        print(f"sample index ({total:,} samples), numpy: {t_np:6.3f} s"
              + (f", identical: {np.array_equal(cpp, ref)}" if helpers.cpp_helpers_available() else ""))
        _, t_blend = timed(helpers.build_blending_indices, np.array([0.5, 0.3, 0.2]), train_samples)
        print(f"blending index, 3 datasets x {train_samples:,} samples: {t_blend:6.3f} s")
        print(f"RESULT cold build for {tokens / 1e9:.2f}B tokens: {cold:.2f} s (goal < 10 s): "
              f"{'PASS' if cold < 10 else 'FAIL'}")


if __name__ == "__main__":
    main()
