"""Rank layout equals DeepSpeed's PipeModelDataParallelTopology; groups and getters on 4 gloo processes."""
import pytest
import torch.distributed as dist

from megatron.core import parallel_state as ps
from tests.distributed import run_distributed


@pytest.mark.parametrize("world,tp,pp", [(8, 2, 2), (16, 2, 4), (8, 4, 2), (4, 1, 4), (6, 3, 1), (1, 1, 1)])
def test_layout_matches_deepspeed_topology(world, tp, pp):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    dp = world // (tp * pp)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    for rank in range(world):
        coord = topo.get_coord(rank)
        assert ps.rank_of(coord.model, coord.data, coord.pipe, tp, dp) == rank
    layout = ps.group_layout(world, tp, pp)
    assert sorted(layout["tp"]) == sorted(topo.get_axis_comm_lists("model") or [[r] for r in range(world)])
    assert sorted(layout["dp"]) == sorted(topo.get_axis_comm_lists("data") or [[r] for r in range(world)])
    assert sorted(layout["pp"]) == sorted(topo.get_axis_comm_lists("pipe") or [[r] for r in range(world)])


def test_sixteen_gpu_example_from_docstring():
    layout = ps.group_layout(16, 2, 4)
    assert layout["tp"][:2] == [[0, 1], [2, 3]]
    assert layout["dp"][:2] == [[0, 2], [1, 3]]
    assert layout["pp"][0] == [0, 4, 8, 12]
    assert layout["mp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert sorted(layout) == ["dp", "mp", "pp", "tp"]  # the tied embedding is DeepSpeed's PipelineModule's


def test_world_not_divisible_names_flags_and_fix():
    with pytest.raises(ValueError) as err:
        ps.validate_parallel_sizes(4, 4, 2)
    assert str(err.value).startswith(
        "--tensor-model-parallel-size 4 x --pipeline-model-parallel-size 2 = 8 processes per model replica, "
        "which does not divide the 4 processes launched; launch a multiple of 8 processes or pick a layout "
        "that fits 4: TP 1 x PP 1, TP 1 x PP 2, TP 1 x PP 4, TP 2 x PP 1, TP 2 x PP 2, TP 4 x PP 1")


def _check_groups(rank, world):
    state = ps.initialize_model_parallel(2, 2)
    assert (state.tp_rank, state.dp_rank, state.pp_rank) == (rank % 2, 0, rank // 2)
    assert ps.get_tensor_model_parallel_world_size() == 2
    assert ps.get_tensor_model_parallel_rank() == rank % 2
    assert ps.get_pipeline_model_parallel_rank() == rank // 2
    assert ps.get_data_parallel_world_size() == 1
    assert ps.is_pipeline_first_stage() == (rank < 2)
    assert ps.is_pipeline_last_stage() == (rank >= 2)
    assert dist.get_world_size(ps.get_tensor_model_parallel_group()) == 2
    assert dist.get_world_size(ps.get_pipeline_model_parallel_group()) == 2
    assert dist.get_world_size(ps.get_model_parallel_group()) == 4
    assert state.pp_ranks == (rank % 2, rank % 2 + 2) and state.tp_ranks == (rank // 2 * 2, rank // 2 * 2 + 1)
    # A real collective on the TP group: ranks 0+1 and 2+3 sum their global ranks.
    import torch
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    assert t.item() == (1.0 if rank < 2 else 5.0)
    ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_world_size() == 1


def test_groups_on_four_gloo_processes():
    run_distributed(_check_groups, 4)
