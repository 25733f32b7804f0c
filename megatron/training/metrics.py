"""Training metrics: model FLOPs (Megatron paper eq. 3), the measured GEMM peak for MFU, peak memory, the
per-iteration log line (one pure function) and rank 0's metrics writer (JSON lines, tensorboard)."""
import json
import os
import time

import torch
import torch.distributed as dist

from megatron.core.parallel_state import comm_device


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
    """Rank 0's tensorboard scalars and metrics JSON lines ({"kind": "train" | "valid", ...} per line)."""

    def __init__(self, logging_config, rank, max_queue=1000):
        self.tb = self.jsonl = None
        if rank != 0:
            return
        if logging_config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(logging_config.tensorboard_dir, max_queue=max_queue)  # --tensorboard-queue-size
        if logging_config.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(logging_config.metrics_file)), exist_ok=True)
            self.jsonl = open(logging_config.metrics_file, "a")

    def write(self, kind, metrics):
        if self.jsonl:
            self.jsonl.write(json.dumps({"kind": kind, **metrics}) + "\n")
            self.jsonl.flush()
        if self.tb:
            step = metrics["iteration"]
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and key != "iteration" and value is not None:
                    self.tb.add_scalar(f"{kind}/{key}", value, step)
            self.tb.flush()  # on disk at each log line, like the JSON lines, whatever ends the process

    def close(self):
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
