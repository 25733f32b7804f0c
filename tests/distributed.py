"""Spawns gloo worker processes for multi-process tests (plain pytest, CPU, free port)."""
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, fn, world_size, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except Exception:
        traceback.print_exc()
        dist.destroy_process_group()
        raise
    # As a finished run ends (megatron.initialize.shutdown_distributed), then without interpreter finalization: a
    # C++ thread some library left running (gloo's, DeepSpeed's) could still turn a passed rank into SIGABRT at
    # exit ("terminate called without an active exception", seen once in CI in the DeepSpeed training steps of
    # test_grad_accumulation). What each test asserts is what its ranks returned or wrote; how the launched entry
    # points end is asserted by the integration tests that run them.
    from megatron.initialize import shutdown_distributed
    shutdown_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size, *args):
    """Runs fn(rank, world_size, *args) in world_size gloo processes; a failure in any re-raises here.

    fn must be a module-level function (it is pickled into the workers).
    """
    mp.spawn(_worker, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)
