"""Collective bandwidths the way nccl-tests reports them, with every result's values checked
(tools/check_environment.py --collectives, under torchrun or the deepspeed launcher; NCCL on GPUs, gloo on CPU).

For a message of S bytes per rank and n ranks, algbw = S / t and, as nccl-tests defines the bus bandwidth:
    all_reduce      busbw = algbw x 2(n-1)/n          (S: the buffer each rank reduces)
    all_gather      busbw = algbw x (n-1)/n           (S: the gathered output)
    reduce_scatter  busbw = algbw x (n-1)/n           (S: the input each rank reduces)
    p2p             busbw = algbw                     (each rank sends S to the next rank and receives from the
                                                       previous one, a ring of send/recv pairs)
Inputs are filled from the rank, so each output has one known value per element: all_reduce n(n+1)/2,
all_gather chunk r = r + 1, reduce_scatter (chunk j of rank r' holding (j + 1)(r' + 1)) (r + 1) n(n+1)/2 on rank r, p2p the previous rank's r + 1.
A collective that has not finished within `timeout` seconds is reported in one line and the process ends
(exit 3); a wrong value is one line too (exit 1). The test hook MEGATRON_TEST_BREAK_COLLECTIVE=op:values or
op:hang makes rank 1 corrupt its input of `op` or skip `op`.
"""
import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives (the old names warn); torch 2.11 has only the old ones
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
TEST_HOOK = "MEGATRON_TEST_BREAK_COLLECTIVE"


def bus_factor(op, n):
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "p2p": 1.0}[op]


def sizes(min_bytes, max_bytes, factor=2):
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size)
        size *= factor
    return out


class Watchdog:
    """Ends the process with one line when an operation runs past `timeout` seconds (a hung collective cannot be
    interrupted from Python: the waiting thread is inside the backend)."""

    def __init__(self, timeout, rank):
        self.timeout, self.rank = timeout, rank
        self._what, self._since = None, None
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True).start()

    def start(self, what):
        with self._lock:
            self._what, self._since = what, time.monotonic()

    def stop(self):
        with self._lock:
            self._what = None

    def _watch(self):
        while True:
            time.sleep(0.1)
            with self._lock:
                late = self._what is not None and time.monotonic() - self._since > self.timeout
                what = self._what
            if late:
                sys.stdout.write(f"FAIL {what}: no result within --timeout {self.timeout:g} s on rank {self.rank} "
                                 "(a rank hung or did not join; check the network and NCCL_DEBUG=INFO)\n")
                sys.stdout.flush()
                os._exit(3)


def _broken(op):
    spec = os.environ.get(TEST_HOOK, "")
    if ":" not in spec or dist.get_rank() != 1:
        return None
    name, mode = spec.split(":", 1)
    return mode if name == op else None


def run_op(op, nbytes, device, group_size, rank):
    """(output, expected output) of one op over `nbytes` (rounded to whole fp32 elements divisible by n)."""
    n = group_size
    numel = max(n, nbytes // 4 // n * n)
    broken = _broken(op)
    if broken == "hang":
        return None, None
    value = float(rank + 1) + (0.5 if broken == "values" else 0.0)
    if op == "all_reduce":
        x = torch.full((numel,), value, device=device)
        dist.all_reduce(x)
        return x, torch.full_like(x, n * (n + 1) / 2)
    if op == "all_gather":
        x = torch.full((numel // n,), value, device=device)
        out = torch.empty(numel, device=device)
        _ALL_GATHER(out, x)
        return out, torch.arange(1, n + 1, device=device, dtype=out.dtype).repeat_interleave(numel // n)
    if op == "reduce_scatter":  # chunk j of rank r holds (r + 1)(j + 1): rank r gets (r + 1) n(n + 1)/2
        x = value * torch.arange(1, n + 1, device=device, dtype=torch.float32).repeat_interleave(numel // n)
        out = torch.empty(numel // n, device=device)
        _REDUCE_SCATTER(out, x)
        return out, torch.full_like(out, (rank + 1) * n * (n + 1) / 2)
    x = torch.full((numel,), value, device=device)
    out = torch.empty_like(x)
    if n == 1:
        out.copy_(x)
        return out, x
    ops = [dist.P2POp(dist.isend, x, (rank + 1) % n), dist.P2POp(dist.irecv, out, (rank - 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out, torch.full_like(out, float((rank - 1) % n + 1))


def _timed(op, nbytes, device, n, rank, iters, warmup, sync):
    """(seconds per op, whether the last output has the expected values)."""
    out = want = None
    for _ in range(warmup):
        out, want = run_op(op, nbytes, device, n, rank)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        out, want = run_op(op, nbytes, device, n, rank)
    sync()
    seconds = (time.perf_counter() - start) / max(iters, 1)
    return seconds, out is not None and bool(torch.equal(out, want))


def measure(min_bytes, max_bytes, iters, warmup, timeout, ops=OPS, log=print):
    """Runs every op over every size; returns rows {op, bytes, time_us, algbw_gbps, busbw_gbps, ok} (the slowest
    rank's time) and logs a table on rank 0. Ends the process on a hang (Watchdog) or on wrong values (exit 1)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dog = Watchdog(timeout, rank)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    if rank == 0:
        log(f"{'op':15s} {'size':>10s} {'time us':>10s} {'algbw GB/s':>11s} {'busbw GB/s':>11s} values")
    for op in ops:
        for nbytes in sizes(min_bytes, max_bytes):
            what = f"{op} {nbytes / 2 ** 20:g} MiB over {n} ranks"
            dog.start(what)
            try:
                seconds, good = _timed(op, nbytes, device, n, rank, iters, warmup, sync)
                verdict = torch.tensor([seconds, 0.0 if good else 1.0], dtype=torch.float64, device=device)
                dist.all_reduce(verdict, op=dist.ReduceOp.MAX)  # the slowest rank's time; any rank's wrong value
            except RuntimeError as err:  # the backend's own timeout or a peer that went away
                sys.stdout.write(f"FAIL {what}: {str(err).strip().splitlines()[0][:200]} (rank {rank})\n")
                sys.stdout.flush()
                os._exit(3)
            dog.stop()
            seconds, wrong = verdict.tolist()
            if wrong:
                if rank == 0:
                    log(f"FAIL {what}: wrong values (expected the rank-filled inputs' exact result)")
                sys.stdout.flush()
                dist.barrier()
                os._exit(1)
            algbw = nbytes / seconds / 1e9
            row = dict(op=op, bytes=nbytes, time_us=seconds * 1e6, algbw_gbps=algbw,
                       busbw_gbps=algbw * bus_factor(op, n), ok=True)
            rows.append(row)
            if rank == 0:
                log(f"{op:15s} {nbytes / 2 ** 20:8g}Mi {row['time_us']:10.1f} {algbw:11.2f} {row['busbw_gbps']:11.2f} ok")
    return rows


def init_from_launcher(timeout):
    """torch.distributed from torchrun's / the deepspeed launcher's environment: NCCL with CUDA, gloo without."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # the backend's own timeout later than the watchdog's, so a hang is named by the watchdog
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=2 * timeout + 10))
    return dist.get_backend()
