"""A dataset that interleaves several datasets so that each takes its weight's share of every prefix of samples."""
import logging

import numpy as np
import torch

from megatron.data.helpers import build_blending_indices

logger = logging.getLogger(__name__)


class BlendableDataset(torch.utils.data.Dataset):
    """size samples drawn from datasets in proportion to weights (greedy, deterministic, no randomness).

    Sample i comes from dataset dataset_index[i], whose dataset_sample_index[i]-th sample it is; after
    any n samples, dataset d has served within one sample of weights[d] * n.
    """

    def __init__(self, datasets, weights, size):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"BlendableDataset needs one weight per dataset, got {len(datasets)} datasets "
                             f"and {len(weights)} weights")
        weights = np.asarray(weights, dtype=np.float64)
        if (weights < 0).any() or weights.sum() <= 0:
            raise ValueError(f"--data-path weights {weights.tolist()} must be >= 0 with a positive sum")
        self.datasets = datasets
        self.weights = weights / weights.sum()
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.size)
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, dataset in enumerate(datasets):
            if counts[d] > len(dataset):
                raise RuntimeError(f"blending needs {counts[d]} samples from dataset {d} but it has "
                                   f"{len(dataset)}; build it with more samples")
        logger.info("blended %d samples from %d datasets: weights %s, counts %s", self.size, len(datasets),
                    np.round(self.weights, 4).tolist(), counts.tolist())

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blended dataset of {self.size} samples")
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]
