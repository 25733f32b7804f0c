"""Synthetic token samples for benchmarks and smoke tests (--mock-data): the same sample for the same index."""
import numpy as np


class MockGPTDataset:
    def __init__(self, num_samples, seq_length, vocab_size, seed=1234):
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self):
        return self.num_samples

    def __getitem__(self, idx):
        rng = np.random.default_rng((self.seed, int(idx)))
        return {"text": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}
