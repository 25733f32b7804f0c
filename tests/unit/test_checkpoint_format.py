"""The per-parameter optimizer format (megatron/checkpoint/saved_optimizer.py): pieces spread over TP and DP ranks
make the whole parameter again, any TP size's slice is cut from it, and a rank's region of it is read alone
(megatron/checkpoint/reads.py: exactly its elements read, whatever the saved and the new TP and DP sizes)."""
import json
import os

import pytest
import torch

from megatron.checkpoint import reads
from megatron.checkpoint import saved_optimizer as fmt


def write_rank(folder, tp_rank, dp_rank, step, params, state):
    torch.save({"optimizer": state}, os.path.join(folder, fmt.optimizer_name(tp_rank, 0, dp_rank)))
    with open(os.path.join(folder, fmt.index_name(tp_rank, 0, dp_rank)), "w") as f:
        f.write(fmt.index_text(step, params))


def test_pieces_over_tp_and_dp_ranks_make_the_whole_parameter(tmp_path):
    """A 6x4 weight split along dim 1 over TP 2 (6x2 slices of 12 elements), each slice's state in ZeRO-like flat
    partitions of 8 elements over DP 2 (after a 3-element neighbour on DP rank 0), plus a replicated bias."""
    torch.manual_seed(0)
    whole = {key: torch.randn(6, 4) for key in ("fp32", "exp_avg", "exp_avg_sq")}
    bias = {key: torch.randn(5) for key in whole}
    for t in range(2):
        piece = {key: value.chunk(2, 1)[t].reshape(-1) for key, value in whole.items()}
        flats = [{k: torch.cat([torch.full((3,), -1.0), v[:5]]) for k, v in piece.items()},
                 {k: torch.cat([v[5:], bias[k]] if t == 0 else [v[5:], torch.zeros(5)]) for k, v in piece.items()}]
        for d, flat in enumerate(flats):
            state = {"fp32_groups": [flat["fp32"]],
                     "base": {"state": {0: {"exp_avg": flat["exp_avg"], "exp_avg_sq": flat["exp_avg_sq"],
                                            "step": torch.tensor(7.0)}}}}
            entry = {"shape": [6, 2], "partition_dim": 1, "pieces": [
                {"state": ["base", "state", 0], "fp32": ["fp32_groups", 0], "offset": 3 if d == 0 else 0,
                 "start": 0 if d == 0 else 5, "numel": 5 if d == 0 else 7}]}
            params = {"w": entry}
            if d == 1:
                params["b"] = {"shape": [5], "partition_dim": None, "pieces": [
                    {"state": ["base", "state", 0], "fp32": ["fp32_groups", 0], "offset": 7, "start": 0,
                     "numel": 5}]}
            write_rank(tmp_path, t, d, 7.0, params, state)
    meta = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "data_parallel_size": 2}
    source = fmt.SavedOptimizer(str(tmp_path), meta)
    assert source.names() == ["b", "w"] and source.step == 7.0 and source.has_fp32()
    for key in whole:
        assert torch.equal(source.full("w", key), whole[key])
        assert torch.equal(source.full("b", key), bias[key])
        for tp in (1, 2, 4):
            for rank in range(tp):
                target = whole[key][:, rank * 4 // tp:(rank + 1) * 4 // tp]
                assert torch.equal(fmt.target_slice(source.full("w", key), 1, tp, rank), target)
                for start, numel in ((0, target.numel()), (3, target.numel() - 4)):  # a slot, not the slice
                    reads.reset()
                    got = source.window("w", key, tp, rank, start, numel)
                    assert torch.equal(got, target.reshape(-1)[start:start + numel]), (key, tp, rank, start)
                    assert reads.bytes_read() == numel * 4  # only the slot's elements, from both saved slices
    with pytest.raises(ValueError, match="size 4 along dim 1 is not divisible by 3 tensor-parallel ranks"):
        fmt.target_slice(whole["fp32"], 1, 3, 0)


def test_missing_pieces_are_named(tmp_path):
    state = {"state": {0: {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}}}
    write_rank(tmp_path, 0, 0, 1.0, {"w": {"shape": [6], "partition_dim": None, "pieces": [
        {"state": ["state", 0], "fp32": None, "offset": 0, "start": 0, "numel": 4}]}}, state)
    source = fmt.SavedOptimizer(str(tmp_path), {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                                "data_parallel_size": 1})
    with pytest.raises(ValueError, match="the optimizer files hold 4 of 6 elements of w's exp_avg for TP rank 0"):
        source.full("w", "exp_avg")
    assert json.loads(fmt.index_text(1.0, {}))["version"] == fmt.VERSION


@pytest.mark.parametrize("shape,dim", [((12, 8), 0), ((12, 8), 1), ((16,), 0), ((6, 4, 8), 1), ((4, 6, 8), 2),
                                       ((12, 8), None)])
def test_read_slice_reads_exactly_a_ranks_range_on_any_tp_size(shape, dim):
    """Saved on TP 1, 2, 4 with each slice in three flat regions (ZeRO-like), read on TP 1, 2, 4: every rank's
    whole slice and a range inside it equal the slice cut from the whole tensor, and the bytes counted are the
    range's (a full read shows up as the full slice)."""
    torch.manual_seed(0)
    whole = torch.randn(*shape)
    for saved_tp in (1, 2, 4):
        saved = [whole.chunk(saved_tp, dim)[t].contiguous() if dim is not None else whole.clone()
                 for t in range(saved_tp)]
        regions = {t: [(b, s.reshape(-1)[b:e]) for b, e in ((0, 2), (2, s.numel() - 2), (s.numel() - 2, s.numel()))]
                   for t, s in enumerate(saved)}

        def pieces(t, lo, hi):
            return [(begin, flat) for begin, flat in regions[t] if begin < hi and begin + flat.numel() > lo]
        for tp in (1, 2, 4):
            for rank in range(tp):
                target = (whole.chunk(tp, dim)[rank] if dim is not None else whole).reshape(-1)
                for start, numel in ((0, target.numel()), (1, target.numel() // 2)):
                    reads.reset()
                    got, found = reads.read_slice(pieces, list(saved[0].shape), dim, saved_tp, tp, rank, start,
                                                  numel, torch.float64)
                    assert found == numel and got.dtype == torch.float64
                    assert torch.equal(got, target[start:start + numel].double()), (saved_tp, tp, rank, start)
                    assert reads.bytes_read() == numel * 4
