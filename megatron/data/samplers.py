"""Megatron's pretraining sampler and data loader: sequential global order, sharded over data-parallel ranks.

Global sample order is consumed_samples, consumed_samples + 1, ...; each group of
micro_batch_size * data_parallel_size consecutive indices is one micro batch for every DP rank, rank r
taking the r-th slice. A sampler resumed at consumed_samples = N yields exactly what an uninterrupted
one yields from N on, so resuming a run continues its data stream.
"""
import numpy as np
import torch


class MegatronPretrainingSampler:
    """Yields this DP rank's micro batches (lists of dataset indices) from consumed_samples to total_samples."""

    def __init__(self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size,
                 drop_last=True):
        if total_samples <= 0:
            raise ValueError(f"the dataset has no samples (total_samples={total_samples}); check --data-path "
                             "and --split")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} must be in [0, {total_samples}): the checkpoint "
                             "has consumed the whole dataset; raise --train-samples or use more data")
        if micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size {micro_batch_size} must be >= 1")
        if data_parallel_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} must be in [0, data_parallel_size="
                             f"{data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self):
        """Micro batches this sampler yields."""
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self.micro_batch_times_data_parallel_size)
        last = rest > self.data_parallel_rank * self.micro_batch_size and not self.drop_last
        return full + int(last)

    def _slice(self):
        start = self.data_parallel_rank * self.micro_batch_size
        return start, start + self.micro_batch_size

    def __iter__(self):
        start, end = self._slice()
        step = self.micro_batch_times_data_parallel_size
        index = self.consumed_samples
        while index + step <= self.total_samples:
            yield list(range(index + start, index + end))
            index += step
        if not self.drop_last and index < self.total_samples:
            last = list(range(index, self.total_samples))[start:end]
            if last:
                yield last


def collate_text(samples):
    """[{"text": int64 (seq+1,)}] -> {"text": LongTensor (micro, seq+1)}."""
    text = np.stack([sample["text"] for sample in samples]).astype(np.int64, copy=False)
    return {"text": torch.from_numpy(text)}


def build_pretraining_data_loader(dataset, consumed_samples, micro_batch_size, data_parallel_rank,
                                  data_parallel_size, num_workers=0):
    """A DataLoader over dataset whose batches are this DP rank's micro batches, resumed at consumed_samples."""
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
    )
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       collate_fn=collate_text, pin_memory=False,
                                       persistent_workers=num_workers > 0)
