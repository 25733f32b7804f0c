"""Tensor, pipeline and data parallel process groups, held in one validated ParallelState object.

Ranks are laid out tensor-parallel fastest, then data-parallel, then pipeline-parallel, which is the
order of DeepSpeed's PipeModelDataParallelTopology (axes pipe, data, model). For 16 processes with
TP=2, PP=4 (so DP=2):

    global rank = pp_rank * (DP * TP) + dp_rank * TP + tp_rank

    TP groups (8):  [0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]
    DP groups (8):  [0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]
    PP groups (4):  [0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]
    model-parallel groups (TP x PP, 2): [0,1,4,5,8,9,12,13] [2,3,6,7,10,11,14,15]

The tied embedding of the first and last pipeline stages is kept in step by DeepSpeed's PipelineModule (its tied
layer groups), so no embedding group is built here.

The getters keep Megatron's names (get_tensor_model_parallel_rank, ...) and read the single state.
Without torch.distributed (one process, e.g. a parity test) everything reports size 1, rank 0.

The module global exists for DeepSpeed's `mpu` protocol (DeepSpeedMPU) and for the code that sets up a run.
The model, the tensor-parallel layers, the mappings and the cross entropy never read it: they take the group
explicitly (tp_group=state.tp_group, None meaning no tensor parallelism), so what is built depends only on the
arguments, not on whether or in what order initialize_model_parallel ran.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron.config import validate_parallel_sizes  # pure; re-exported (Megatron's place for it)


def comm_device():
    """The device this process's collectives run on: its current CUDA device (NCCL), else the CPU (gloo)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class ParallelState:
    """Sizes, this process's coordinates and its process groups (None when world size is 1)."""
    world_size: int = 1
    rank: int = 0
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    data_parallel_size: int = 1
    tp_group: Optional[object] = None
    pp_group: Optional[object] = None
    dp_group: Optional[object] = None
    mp_group: Optional[object] = None
    pp_ranks: tuple = (0,)
    dp_ranks: tuple = (0,)
    tp_ranks: tuple = (0,)

    @property
    def tp_rank(self):
        return self.rank % self.tensor_model_parallel_size

    @property
    def dp_rank(self):
        return (self.rank // self.tensor_model_parallel_size) % self.data_parallel_size

    @property
    def pp_rank(self):
        return self.rank // (self.tensor_model_parallel_size * self.data_parallel_size)


def rank_of(tp_rank, dp_rank, pp_rank, tp_size, dp_size):
    """Global rank of the process at (tp, dp, pp) in the TP-fastest, then DP, then PP layout."""
    return pp_rank * dp_size * tp_size + dp_rank * tp_size + tp_rank


def group_layout(world_size, tp, pp):
    """All group memberships as lists of global-rank lists: {"tp": [...], "dp": [...], ...}."""
    dp = validate_parallel_sizes(world_size, tp, pp)
    layout = {
        "tp": [[rank_of(t, d, p, tp, dp) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank_of(t, d, p, tp, dp) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank_of(t, d, p, tp, dp) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "mp": [[rank_of(t, d, p, tp, dp) for p in range(pp) for t in range(tp)] for d in range(dp)],
    }
    return layout


_STATE = ParallelState()
_INITIALIZED = False


def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, timeout=None):
    """Builds every group for the current torch.distributed world (NCCL or gloo); idempotent per layout.

    Every rank must call this: torch.distributed.new_group is collective over the world. timeout (a
    datetime.timedelta) bounds every collective on these groups, as --distributed-timeout-minutes does for the
    world group.
    """
    global _STATE, _INITIALIZED
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    dp = validate_parallel_sizes(world_size, tp, pp)
    layout = group_layout(world_size, tp, pp)
    mine = {}
    for kind, groups in layout.items():
        for ranks in groups:
            # new_group is collective: every rank creates every group in the same order.
            group = dist.new_group(ranks, timeout=timeout) if dist.is_initialized() else None
            if rank in ranks:
                mine[kind] = (group, tuple(ranks))
    _STATE = ParallelState(
        world_size=world_size, rank=rank, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        data_parallel_size=dp, tp_group=mine["tp"][0], pp_group=mine["pp"][0], dp_group=mine["dp"][0],
        mp_group=mine["mp"][0], pp_ranks=mine["pp"][1], dp_ranks=mine["dp"][1], tp_ranks=mine["tp"][1])
    _INITIALIZED = True
    return _STATE


def destroy_model_parallel():
    """Forgets the groups (the process group itself is destroyed by whoever created it)."""
    global _STATE, _INITIALIZED
    _STATE = ParallelState()
    _INITIALIZED = False


def get_parallel_state():
    return _STATE


def model_parallel_is_initialized():
    return _INITIALIZED


def get_tensor_model_parallel_group():
    return _STATE.tp_group


def get_tensor_model_parallel_world_size():
    return _STATE.tensor_model_parallel_size


def get_tensor_model_parallel_rank():
    return _STATE.tp_rank


def get_pipeline_model_parallel_group():
    return _STATE.pp_group


def get_pipeline_model_parallel_world_size():
    return _STATE.pipeline_model_parallel_size


def get_pipeline_model_parallel_rank():
    return _STATE.pp_rank


def is_pipeline_first_stage():
    return _STATE.pp_rank == 0


def is_pipeline_last_stage():
    return _STATE.pp_rank == _STATE.pipeline_model_parallel_size - 1


def get_data_parallel_group():
    return _STATE.dp_group


def get_data_parallel_world_size():
    return _STATE.data_parallel_size


def get_data_parallel_rank():
    return _STATE.dp_rank


def get_model_parallel_group():
    """The TP x PP group of this data-parallel replica (Megatron's meaning)."""
    return _STATE.mp_group


# DeepSpeed's `mpu` protocol: it asks for the model-parallel rank/size/group meaning tensor parallel.
class DeepSpeedMPU:
    """The object passed as `mpu=` to deepspeed.initialize (tensor parallel is DeepSpeed's model parallel)."""

    get_data_parallel_group = staticmethod(get_data_parallel_group)
    get_data_parallel_world_size = staticmethod(get_data_parallel_world_size)
    get_data_parallel_rank = staticmethod(get_data_parallel_rank)
    get_model_parallel_group = staticmethod(get_tensor_model_parallel_group)
    get_model_parallel_world_size = staticmethod(get_tensor_model_parallel_world_size)
    get_model_parallel_rank = staticmethod(get_tensor_model_parallel_rank)
    get_tensor_model_parallel_group = staticmethod(get_tensor_model_parallel_group)
    get_tensor_model_parallel_world_size = staticmethod(get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_rank = staticmethod(get_tensor_model_parallel_rank)
    get_pipeline_model_parallel_group = staticmethod(get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_world_size = staticmethod(get_pipeline_model_parallel_world_size)
    get_pipeline_model_parallel_rank = staticmethod(get_pipeline_model_parallel_rank)
