"""Process start-up: logging, torch.distributed through DeepSpeed (NCCL on GPU, gloo on CPU), groups, seeds.

Output policy: our own log lines on rank 0; an error once per job (the first local rank prints, the others exit
with the same code silently); DeepSpeed's logs, stdout prints and known warnings only with --log-level debug.
"""
import contextlib
import datetime
import io
import logging
import os
import signal
import socket
import sys
import time
import warnings

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_manual_seed

logger = logging.getLogger("megatron")


# Warnings raised inside DeepSpeed's own calls that a user can do nothing about (shown with --log-level debug).
KNOWN_WARNINGS = (
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated"),  # ZeRO's all_gather_into_tensor, torch >= 2.13
)
_SILENT_RANK_GRACE_S = 30  # how long a silent rank waits for the launcher to stop it after the reporting rank


def is_first_local_rank():
    """True on the process that reports for its host: LOCAL_RANK (else RANK) is 0 or unset."""
    rank = os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))
    return rank.strip() in ("", "0")


def exit_before_distributed(message, code):
    """Ends the process with `code` before torch.distributed is up, the message printed once per host.

    The first local rank prints `message` (one line) and exits; the other ranks exit with the same code
    without a word, after a grace period: launchers (deepspeed, torchrun) stop the whole job at the first
    failed process, so a silent rank must not end first and have the reporting one killed mid-print.
    """
    if is_first_local_rank():
        logger.error("%s", message)
    else:
        for sig in (signal.SIGTERM, signal.SIGINT):  # stopped by the launcher (or Ctrl-C): same code, no word
            signal.signal(sig, lambda signum, frame: os._exit(code))
        time.sleep(_SILENT_RANK_GRACE_S)
    sys.exit(code)


class _BelowLevel(logging.Filter):
    """Drops DeepSpeed's records below a level; a filter survives DeepSpeed resetting its logger's level."""

    def __init__(self, level):
        super().__init__()
        self.level = level

    def filter(self, record):
        return record.levelno >= self.level


def setup_logging(rank=None, log_level="info"):
    """Our logger: log_level on global rank 0, WARNING elsewhere, one format for every module under `megatron`.

    DeepSpeed (its `DeepSpeed` logger, its stdout prints inside deepspeed_output(), KNOWN_WARNINGS): errors
    only, unless log_level is "debug", which shows all of it. Safe to call again (main calls it before and
    after reading --log-level).
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    level = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}[log_level]
    logging.basicConfig(level=level if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s] [rank {rank}] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)
    ds_logger = logging.getLogger("DeepSpeed")
    for old in [f for f in ds_logger.filters if isinstance(f, _BelowLevel)]:
        ds_logger.removeFilter(old)
    patterns = {pattern for _, pattern in KNOWN_WARNINGS}
    warnings.filters[:] = [f for f in warnings.filters if f[1] is None or f[1].pattern not in patterns]
    if log_level == "debug":
        import deepspeed.utils.logging as ds_logging  # creating the logger sets its level: import first
        ds_logging.set_log_level_from_string("debug")
        return
    ds_logger.addFilter(_BelowLevel(logging.ERROR))
    for category, pattern in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)


def _deepspeed_quiet():
    return any(isinstance(f, _BelowLevel) for f in logging.getLogger("DeepSpeed").filters)


@contextlib.contextmanager
def deepspeed_output():
    """Holds back what DeepSpeed print()s to stdout inside the block (op builds, the pipeline topology, the
    bf16 optimizer's memory dumps) unless --log-level debug; if the block raises, the held text goes to stderr."""
    if not _deepspeed_quiet():
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise


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
    from megatron.fused_kernels.build_env import announce_shm_op_build
    with announce_shm_op_build(), deepspeed_output():  # one ninja per environment; a build says so
        deepspeed.init_distributed(dist_backend=parallel.distributed_backend, auto_mpi_discovery=False,
                                   timeout=timeout)
    _unlink_shm_buffer_once_mapped()
    state = parallel_state.initialize_model_parallel(parallel.tensor_model_parallel_size,
                                                     parallel.pipeline_model_parallel_size, timeout=timeout)
    logger.info("world %d = TP %d x PP %d x DP %d, backend %s", state.world_size,
                state.tensor_model_parallel_size, state.pipeline_model_parallel_size, state.data_parallel_size,
                parallel.distributed_backend)
    return state


def shm_buffer_path(rank=None):
    """The shared-memory file DeepSpeed's CPU all-reduce op makes for a rank when every rank is on this host
    (LOCAL_SIZE == world size; deepspeed/ops/csrc/cpu/comm/shm.cpp, shm_initialize):
    /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, 66 MB, never unlinked there."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    return (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def remove_shm_buffer():
    """Unlinks this process's DeepSpeed shared-memory buffer, if it is still there (idempotent)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(shm_buffer_path())


def _unlink_shm_buffer_once_mapped():
    """Every rank maps every other rank's buffer inside init_distributed; after a barrier no rank opens one
    again, so each unlinks its own name right away. The mappings live on until the processes end, and no way
    of ending (a crash, a kill by the launcher) can leave a file in /dev/shm."""
    from deepspeed import comm
    if getattr(getattr(comm.comm, "cdb", None), "shm_comm_op", None) is None:  # the same on every rank
        return
    torch.distributed.barrier()
    remove_shm_buffer()


def shutdown_distributed():
    """Destroys the process groups after a run that ended normally on every rank.

    Without it gloo's worker threads outlive the interpreter and the process can die with SIGABRT
    ("terminate called without an active exception") after its work is done. Not called on error paths:
    destroying groups while another rank still waits in a collective can hang.
    """
    remove_shm_buffer()
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def exit_after_error(message, code):
    """Logs `message` and ends the process with `code` once torch.distributed is up.

    Skips interpreter finalization (os._exit after flushing), so live gloo work cannot turn the chosen
    exit code into SIGABRT, and skips destroying groups another rank may still be waiting on.
    """
    remove_shm_buffer()
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
