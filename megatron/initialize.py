"""Process start-up: logging, torch.distributed through DeepSpeed (NCCL on GPU, gloo on CPU), groups, seeds."""
import datetime
import logging
import os
import socket
import sys

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_manual_seed

logger = logging.getLogger("megatron")


def setup_logging(rank=None):
    """INFO on global rank 0, WARNING elsewhere; one format for every module under `megatron`."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s] [rank {rank}] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def _single_process_env():
    """`python pretrain_bloom.py` with no launcher: a world of one on a free local port."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))


def initialize_distributed(parallel):
    """parallel: ParallelConfig (already validated against WORLD_SIZE). Returns the ParallelState."""
    import deepspeed

    _single_process_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
    deepspeed.init_distributed(dist_backend=parallel.distributed_backend, auto_mpi_discovery=False, timeout=timeout)
    state = parallel_state.initialize_model_parallel(parallel.tensor_model_parallel_size,
                                                     parallel.pipeline_model_parallel_size, timeout=timeout)
    logger.info("world %d = TP %d x PP %d x DP %d, backend %s", state.world_size,
                state.tensor_model_parallel_size, state.pipeline_model_parallel_size, state.data_parallel_size,
                parallel.distributed_backend)
    return state


def shutdown_distributed():
    """Destroys the process groups after a run that ended normally on every rank.

    Without it gloo's worker threads outlive the interpreter and the process can die with SIGABRT
    ("terminate called without an active exception") after its work is done. Not called on error paths:
    destroying groups while another rank still waits in a collective can hang.
    """
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def exit_after_error(message, code):
    """Logs `message` and ends the process with `code` once torch.distributed is up.

    Skips interpreter finalization (os._exit after flushing), so live gloo work cannot turn the chosen
    exit code into SIGABRT, and skips destroying groups another rank may still be waiting on.
    """
    logger.error("%s", message)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def load_kernels(model_config):
    """Builds the csrc kernels once (rank 0 first) when the model asks for them; see megatron/fused_kernels."""
    if model_config.attention_impl == "fused" or model_config.fused_layernorm:
        from megatron.fused_kernels import load_fused_kernels
        load_fused_kernels(model_config.abort_on_unmet_fused_kernel_constraints)


def set_random_seeds(seed, state):
    """Default generators: seed + 100 x pipeline rank (shared by a stage's TP and DP ranks); the tracked
    model-parallel generator additionally differs per TP rank."""
    model_parallel_manual_seed(seed + 100 * state.pp_rank, tp_rank=state.tp_rank)
