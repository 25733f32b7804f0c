"""--async-save: the state snapshotted into host memory at the iteration boundary, written by a background thread.

Training is blocked only while the tensors are copied to the host (pinned buffers on CUDA, allocated by the first
save and reused); the files, the manifest, the rename and `latest` (save.write_and_publish, the same steps and
crash safety as a synchronous save) follow in a thread whose collectives run on a gloo group of their own, so they
never interleave with training's. One save in flight at a time: the next save, the end of training, an exit
signal or an error waits for it (wait()). A background save that fails leaves `latest` naming the previous
checkpoint and raises its CheckpointError at that wait, on every rank at the same iteration.
"""
import datetime
import logging
import threading
import time

import torch
import torch.distributed as dist

from megatron.checkpoint import save
from megatron.checkpoint.format import CheckpointError

logger = logging.getLogger(__name__)


class HostBuffers:
    """Host copies of tensors, keyed by where they sit in the saved objects: pinned and reused across saves on
    CUDA (cudaHostAlloc is slow; the copies then run at the link's speed), fresh clones on the CPU."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.buffers = {}
        self.bytes = 0

    def copy(self, key, tensor):
        if tensor.device.type != "cuda":
            out = tensor.clone()
            self.bytes += out.numel() * out.element_size()
            return out
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            self.buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=True)
        self.bytes += buffer.numel() * buffer.element_size()
        return buffer

    def synchronize(self):
        if self.cuda and torch.cuda.is_initialized():
            torch.cuda.synchronize()


class AsyncSaver:
    """One background checkpoint write at a time. Collective construction (a gloo group for the writer's
    collectives, bounded by timeout_minutes)."""

    def __init__(self, timeout_minutes):
        group = None
        if dist.is_initialized():
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))
        self.comm = save.Comm(group=group, device="cpu")
        self.host = HostBuffers()
        self.thread = None
        self.iteration = None  # of the save in flight, or of the last one finished
        self.error = None
        self.done = False
        self.seconds = self.written = None  # of the last background write that finished: time, this rank's bytes

    def start(self, engine, config, state, iteration, consumed_samples, tokenizer=None, on_written=None):
        """Snapshots this rank's state into host memory (blocking), then writes it in a thread. The caller has
        waited for the previous save. Returns the bytes copied."""
        assert self.thread is None, "a checkpoint save is still in flight"
        self.host.bytes = 0
        objects = save.snapshot(engine, config, state, self.host)
        self.iteration, self.error, self.done = iteration, None, False

        def write():
            start = time.perf_counter()
            try:
                _, written = save.write_and_publish(objects, config, state, iteration, consumed_samples, tokenizer,
                                                    on_written, self.comm)
            except CheckpointError as err:
                self.error = err
                return
            except Exception as err:  # noqa: BLE001 - reported at the next wait, on the training thread
                self.error = CheckpointError(f"--save {config.checkpoint.save}: the background save of iteration "
                                             f"{iteration} failed ({type(err).__name__}: {err})")
                return
            seconds = time.perf_counter() - start
            self.seconds, self.written = seconds, written
            if state.rank == 0:
                logger.info("checkpoint iteration %d written in the background in %.2f s (rank 0: %.3f GB, "
                            "%.2f GB/s)", iteration, seconds, written / 1e9, written / 1e9 / max(seconds, 1e-9))
            self.done = True

        self.thread = threading.Thread(target=write, name=f"checkpoint-{iteration}", daemon=False)
        self.thread.start()
        return self.host.bytes

    def in_flight(self):
        return self.thread is not None

    def wait(self):
        """Waits for the save in flight (if any). Returns its iteration when it finished, None when none was in
        flight; raises its CheckpointError when it failed."""
        if self.thread is None:
            return None
        self.thread.join()
        self.thread = None
        if self.error is not None:
            raise self.error
        return self.iteration
