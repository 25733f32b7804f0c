"""When cuDNN's attention may serve (megatron/model/cudnn_attention.py), decided without a GPU: its ALiBi slopes
equal BLOOM's for every head count, a tensor-parallel rank's slice of them does not (so TP ranks keep
FlexAttention), and nothing off CUDA or without the package chooses it. The kernels: tests/gpu/
test_cudnn_attention.py."""
import pytest
import torch

from megatron.model import attention, cudnn_attention
from megatron.model.alibi import get_alibi_slopes_for_rank


def bloom_slopes(n):
    """transformers' build_alibi_tensor slopes (the formula of HF's BLOOM), independent of megatron.model.alibi."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    alibi = build_alibi_tensor(torch.ones(1, 2), n, torch.float32)  # (n, 1, 2): slope_h * position, positions 0 1
    return alibi[:, 0, 1]


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 8, 12, 16, 20, 32, 40, 64, 96, 112])
def test_cudnns_slopes_are_blooms(heads):
    torch.testing.assert_close(cudnn_attention.cudnn_alibi_slopes(heads), bloom_slopes(heads), rtol=1e-6, atol=0)
    assert cudnn_attention.slopes_match(tuple(get_alibi_slopes_for_rank(heads, 0, 1).tolist()))


@pytest.mark.parametrize("heads,tp", [(16, 2), (16, 4), (12, 2), (112, 8)])
def test_a_tensor_parallel_ranks_slopes_are_not_cudnns(heads, tp):
    for rank in range(tp):
        assert not cudnn_attention.slopes_match(tuple(get_alibi_slopes_for_rank(heads, rank, tp).tolist()))


def test_not_chosen_off_cuda_or_without_the_package(monkeypatch):
    core = attention.CoreAttention(get_alibi_slopes_for_rank(16, 0, 1), 128)
    assert core.cudnn_slopes
    assert not core.cudnn_serves(torch.device("cpu"), torch.bfloat16)
    assert attention.block_attention_inputs(core, 256, torch.device("cpu"), torch.bfloat16) != attention.CUDNN
    monkeypatch.setattr(cudnn_attention, "_cudnn", lambda: None)
    assert not cudnn_attention.serves(128 ** -0.5, torch.bfloat16, torch.device("cuda"))
    monkeypatch.setattr(cudnn_attention, "available", lambda: True)
    assert cudnn_attention.serves(128 ** -0.5, torch.bfloat16, torch.device("cuda"))
    assert not cudnn_attention.serves(128 ** -0.5, torch.float32, torch.device("cuda"))
    assert not cudnn_attention.serves(12 ** -0.5, torch.bfloat16, torch.device("cuda"))  # head dim 12
    for impl in ("flex", "sdpa", "torch", "fused"):
        assert not attention.CoreAttention(get_alibi_slopes_for_rank(16, 0, 1), 128, impl=impl).cudnn_serves(
            torch.device("cuda"), torch.bfloat16)
    assert not attention.CoreAttention(get_alibi_slopes_for_rank(16, 0, 2), 128).cudnn_serves(
        torch.device("cuda"), torch.bfloat16)
    dropout = attention.CoreAttention(get_alibi_slopes_for_rank(16, 0, 1), 128, attention_dropout=0.1)
    assert not dropout.cudnn_serves(torch.device("cuda"), torch.bfloat16)
    assert not core.cudnn_serves(torch.device("cuda"), torch.bfloat16, key_padding_mask=torch.ones(1, 4))
