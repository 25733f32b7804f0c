"""Training metrics: model FLOPs (Megatron paper eq. 3), the measured GEMM peak for MFU, peak memory, the
per-iteration log line (one pure function) and rank 0's metrics writer (JSON lines, tensorboard)."""
import json
import logging
import os
import time

import torch
import torch.distributed as dist

from megatron.core.parallel_state import comm_device

logger = logging.getLogger("megatron.training")


def model_flops_per_iteration(batch_size, seq_length, num_layers, hidden_size, vocab_size,
                              activation_recompute=False):
    """Training FLOPs of one iteration (Narayanan et al. 2021, eq. 3):

        72 B s l h^2 (1 + s / 6h + V / 12lh)          (forward + backward)
        96 B s l h^2 (1 + s / 6h + V / 16lh)          (with full activation recomputation)
    B: global batch, s: sequence, l: layers, h: hidden, V: padded vocabulary.
    """
    b, s, l, h, v = batch_size, seq_length, num_layers, hidden_size, vocab_size
    if activation_recompute:
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def measure_matmul_tflops(device, dtype=None, size=None, iters=None):
    """Achieved dense GEMM rate on this device (bf16 8192^3 on CUDA, fp32 1024^3 on CPU): the MFU denominator."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    size = size or (8192 if cuda else 1024)
    iters = iters or (20 if cuda else 3)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    if cuda:
        torch.cuda.synchronize(device)
    return 2 * size ** 3 * iters / (time.perf_counter() - start) / 1e12


def peak_memory_gib():
    """{"peak_allocated_gib", "peak_reserved_gib"}: torch.cuda.max_memory_allocated/reserved of this process's
    GPU since start, the largest over all ranks (pipeline stages differ); {} without CUDA. Collective when
    torch.distributed is up: every rank calls it."""
    if not torch.cuda.is_available():
        return {}
    peaks = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()],
                         dtype=torch.float64, device=comm_device())
    if dist.is_initialized():
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    allocated, reserved = (peaks / 2 ** 30).tolist()
    return {"peak_allocated_gib": allocated, "peak_reserved_gib": reserved}


def format_log_line(m):
    """One dense line from a dict of iteration metrics (keys as below; absent optional ones are left out:
    loss scale, grad norm, TFLOP/s and MFU (None on CPU, where they mean nothing), peak memory (CUDA only))."""
    parts = [
        f"iteration {m['iteration']:8d}/{m['train_iters']:8d}",
        f"consumed samples: {m['consumed_samples']:12d}",
        f"consumed tokens: {m['consumed_tokens']:14d}",
        f"elapsed time per iteration (ms): {m['ms_per_iteration']:.1f}",
        f"learning rate: {m['lr']:.3E}",
        f"global batch size: {m['global_batch_size']:5d}",
        f"lm loss: {m['lm_loss']:.6E}",
    ]
    if m.get("loss_scale") is not None:
        parts.append(f"loss scale: {m['loss_scale']:.1f}")
    if m.get("grad_norm") is not None:
        parts.append(f"grad norm: {m['grad_norm']:.3f}")
    parts += [
        f"number of skipped iterations: {m['skipped_iterations']:3d}",
        f"number of nan iterations: {m['nan_iterations']:3d}",
        f"samples per second: {m['samples_per_second']:.3f}",
        f"tokens per second: {m['tokens_per_second']:.1f}",
    ]
    if m.get("tflops") is not None:
        parts.append(f"TFLOP/s per GPU: {m['tflops']:.2f}")
    if m.get("mfu") is not None:
        parts.append(f"MFU: {100 * m['mfu']:.1f}%")
    if m.get("peak_allocated_gib") is not None:
        parts.append(f"peak allocated (GiB): {m['peak_allocated_gib']:.2f}")
        parts.append(f"peak reserved (GiB): {m['peak_reserved_gib']:.2f}")
    return " | ".join(parts) + " |"


def loss_scale(engine):
    """fp16's current dynamic loss scale; None in bf16/fp32, where there is none."""
    optimizer = getattr(engine, "optimizer", None)
    scale = getattr(optimizer, "cur_scale", None) or getattr(optimizer, "loss_scale", None)
    return float(scale) if isinstance(scale, (int, float)) and engine.fp16_enabled() else None


class MetricsWriter:
    """Rank 0's tensorboard scalars, metrics JSON lines ({"kind": "train" | "valid", ...} per line) and W&B run.

    start_iteration: the iteration the run starts from. Records past it in an existing metrics file belong to an
    abandoned run (interrupted after its last checkpoint) and are dropped, and tensorboard purges its events past
    it, so a resumed run's curves do not join two histories. timers_to_scalars: write the phase timers as
    timers/<phase> scalars (--log-timers-to-tensorboard); the JSON lines always hold them."""

    def __init__(self, logging_config, rank, monitoring=None, start_iteration=0, run_config=None,
                 timers_to_scalars=False, max_queue=1000):
        self.tb = self.jsonl = self.wandb = None
        self.timers_to_scalars = timers_to_scalars
        if rank != 0:
            return
        if logging_config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(logging_config.tensorboard_dir, purge_step=start_iteration + 1,
                                    max_queue=max_queue)  # --tensorboard-queue-size
        if logging_config.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(logging_config.metrics_file)), exist_ok=True)
            drop_records_after(logging_config.metrics_file, start_iteration)
            self.jsonl = open(logging_config.metrics_file, "a")
        if monitoring is not None and monitoring.wandb_project:
            from megatron.training.monitoring import WandbWriter
            self.wandb = WandbWriter(monitoring, run_config)

    def scalars(self, kind, metrics):
        """{name: value} as tensorboard and W&B get them: numbers under kind/, timers under timers/."""
        out = {f"{kind}/{key}": value for key, value in metrics.items()
               if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "iteration"}
        if self.timers_to_scalars:
            out.update({f"timers/{name}": value for name, value in metrics.get("timers_max", {}).items()})
            out.update({f"timers/{name}": value for name, value in metrics.get("timers_detail", {}).items()
                        if isinstance(value, (int, float))})
        return out

    def write(self, kind, metrics):
        if self.jsonl:
            self.jsonl.write(json.dumps({"kind": kind, **metrics}) + "\n")
            self.jsonl.flush()
        if self.tb or self.wandb:
            step, scalars = metrics["iteration"], self.scalars(kind, metrics)
            if self.tb:
                for key, value in scalars.items():
                    self.tb.add_scalar(key, value, step)
                self.tb.flush()  # on disk at each log line, like the JSON lines, whatever ends the process
            if self.wandb:
                self.wandb.log(scalars, step)

    def close(self):
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.close()


def drop_records_after(path, iteration):
    """Rewrites the metrics file `path` (if any) without the records of iterations after `iteration`; returns how
    many were dropped. Lines that are not JSON records are kept as they are."""
    if not os.path.isfile(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                kept.append(line)
                continue
            step = record.get("iteration") if isinstance(record, dict) else None
            if isinstance(step, int) and step > iteration:
                dropped += 1
            else:
                kept.append(line)
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)
        logger.info("%s: dropped %d records after iteration %d (from a run interrupted after that checkpoint)",
                    path, dropped, iteration)
    return dropped
