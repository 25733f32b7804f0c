"""Spawns gloo worker processes for multi-process tests (plain pytest, CPU, free port)."""
import os
import socket
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
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size, *args):
    """Runs fn(rank, world_size, *args) in world_size gloo processes; a failure in any re-raises here.

    fn must be a module-level function (it is pickled into the workers).
    """
    mp.spawn(_worker, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)
