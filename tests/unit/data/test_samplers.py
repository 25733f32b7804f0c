"""MegatronPretrainingSampler and the data loader: DP sharding, resumption equals the uninterrupted stream."""
import numpy as np
import pytest
import torch

from megatron.data.samplers import MegatronPretrainingSampler, build_pretraining_data_loader


class _Dataset:
    def __init__(self, size, seq_length):
        self.size, self.seq_length = size, seq_length

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        return {"text": np.arange(idx, idx + self.seq_length + 1, dtype=np.int64)}


def test_sharding_over_data_parallel_ranks():
    batches = [list(MegatronPretrainingSampler(20, 0, 2, rank, 2)) for rank in range(2)]
    assert batches[0] == [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]]
    assert batches[1] == [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]
    flat = [i for step in zip(*batches) for batch in step for i in batch]
    assert flat == list(range(20))


@pytest.mark.parametrize("micro,dp", [(1, 1), (2, 2), (3, 4)])
def test_resumed_sampler_equals_uninterrupted(micro, dp):
    total = 101
    for rank in range(dp):
        full = list(MegatronPretrainingSampler(total, 0, micro, rank, dp))
        assert len(MegatronPretrainingSampler(total, 0, micro, rank, dp)) == len(full)
        for step in range(len(full)):
            consumed = step * micro * dp
            resumed = list(MegatronPretrainingSampler(total, consumed, micro, rank, dp))
            assert resumed == full[step:]


def test_drop_last_false_yields_the_tail():
    assert list(MegatronPretrainingSampler(7, 0, 2, 0, 2, drop_last=False)) == [[0, 1], [4, 5]]
    assert list(MegatronPretrainingSampler(7, 0, 2, 1, 2, drop_last=False)) == [[2, 3], [6]]
    assert len(MegatronPretrainingSampler(7, 0, 2, 1, 2, drop_last=False)) == 2


def test_sampler_errors():
    with pytest.raises(ValueError, match=r"consumed_samples 10 must be in \[0, 10\)"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match=r"--micro-batch-size 0 must be >= 1"):
        MegatronPretrainingSampler(10, 0, 0, 0, 1)
    with pytest.raises(ValueError, match=r"data_parallel_rank 2 must be in \[0, data_parallel_size=2\)"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)


def test_data_loader_batches_and_resume():
    dataset = _Dataset(50, seq_length=8)
    loader = build_pretraining_data_loader(dataset, 0, micro_batch_size=4, data_parallel_rank=1, data_parallel_size=2)
    batches = [batch["text"] for batch in loader]
    assert len(batches) == 6
    assert batches[0].dtype == torch.int64 and batches[0].shape == (4, 9)
    assert batches[0][:, 0].tolist() == [4, 5, 6, 7]
    resumed = build_pretraining_data_loader(dataset, 24, micro_batch_size=4, data_parallel_rank=1, data_parallel_size=2)
    rest = [batch["text"] for batch in resumed]
    assert len(rest) == 3
    for a, b in zip(rest, batches[3:]):
        assert torch.equal(a, b)
