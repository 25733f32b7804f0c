"""Guards of a training run: the fatal errors pretrain_bloom.py reports in one line, the exit signal (SIGTERM,
SIGINT) agreed on by all ranks, and the NonFiniteGuard that keeps a non-finite update out of the weights."""
import math
import signal

import torch
import torch.distributed as dist

from megatron.core.parallel_state import comm_device


class FatalTrainingError(RuntimeError):
    """Training cannot go on; the message says why and what to change. pretrain_bloom.py exits 1 with it."""


class NonFiniteError(FatalTrainingError):
    """--max-nan-iterations iterations in a row had a non-finite loss or gradient norm."""


def any_rank_over(value, limit):
    """True on every rank when value > limit on any rank (one all-reduce over the world)."""
    flag = torch.tensor([1.0 if value > limit else 0.0], device=comm_device())
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


class ExitSignal:
    """Records SIGTERM/SIGINT; the loop saves at the next iteration boundary (all ranks agree via all-reduce)."""

    def __init__(self, enabled):
        self.received = False
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank(self):
        return any_rank_over(1.0 if self.received else 0.0, 0.5)


class NonFiniteGuard:
    """Keeps the update of an iteration with a non-finite loss or gradient out of the weights (bf16, fp32).

    DeepSpeed's own optimizer wrappers (ZeRO 1-3, BF16_Optimizer, FP16_Optimizer) already skip such a step:
    they set optimizer.overflow, and the engine then counts engine.skipped_steps, zeroes the gradients and
    holds the LR schedule. The bare torch optimizer DeepSpeed uses in fp32 without ZeRO (PP = 1 and the
    PipelineEngine) checks nothing, and DeepSpeed discards the gradient norm it computes there
    (engine.get_global_grad_norm() is None). For that optimizer this class replaces
    engine.clip_fp32_gradients and wraps optimizer.step so that the norm is measured (and logged), and a
    non-finite norm or loss on any rank (one all-reduce over the world) turns the step into the same skip.

    The norm: sqrt(sum of squared gradients), each TP-replicated parameter counted once per TP group and the
    pipeline's tied word embedding once (on the first stage), summed over the TP x PP group.
    """

    def __init__(self, engine, state, clip_grad):
        self.engine, self.clip_grad = engine, clip_grad
        self.last_grad_norm = None
        self.active = isinstance(engine.optimizer, torch.optim.Optimizer)
        self._loss_bad = torch.zeros((), dtype=torch.bool, device=comm_device())
        if not self.active:
            return
        from deepspeed.runtime.utils import is_model_parallel_parameter
        self._params = list(engine.module.parameters())
        self._counted = [p for name, p in engine.module.named_parameters()
                         if (state.tp_rank == 0 or is_model_parallel_parameter(p))
                         and not (state.pp_rank > 0 and name.startswith("tied_modules."))]
        self._mpu = _ModelParallelGroup(state.mp_group) if state.mp_group is not None else None
        self._norm = None
        self._optimizer_step = engine.optimizer.step
        engine.optimizer.overflow = False
        engine.optimizer.step = self._guarded_step
        engine.clip_fp32_gradients = self._clip

    def note_loss(self, loss):
        """Records (on the device, no sync) whether a micro batch's loss was non-finite."""
        self._loss_bad |= ~torch.isfinite(loss.detach()).all()

    def grad_norm(self):
        """The gradient norm of the last step (None where DeepSpeed's optimizer keeps it instead)."""
        if self.active:
            return self.last_grad_norm
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if torch.is_tensor(norm) else norm)

    def _measure(self):
        from deepspeed.runtime.utils import get_global_norm_of_tensors
        grads = [p.grad for p in self._counted if p.grad is not None] or [torch.zeros(1, device=comm_device())]
        value = float(get_global_norm_of_tensors(grads, mpu=self._mpu))
        return value if math.isfinite(value) and value >= 0 else float("inf")  # DeepSpeed masks inf/nan as -1

    def _clip(self):
        """Replaces DeepSpeed's clip_fp32_gradients (which discards the norm): same clipping rule."""
        self._norm = self._measure()
        if math.isfinite(self._norm):
            coef = self.clip_grad / (self._norm + 1e-6)
            if coef < 1.0:
                for p in self._params:
                    if p.grad is not None:
                        p.grad.mul_(coef)

    def _guarded_step(self, *args, **kwargs):
        norm = self._measure() if self._norm is None else self._norm
        self._norm = None
        self.last_grad_norm = norm
        bad = (self._loss_bad | (not math.isfinite(norm))).to(torch.float32).reshape(1)
        self._loss_bad = torch.zeros((), dtype=torch.bool, device=comm_device())
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        optimizer = self.engine.optimizer
        optimizer.overflow = bool(bad.item() > 0)
        if optimizer.overflow:
            return None  # the engine counts a skipped step, zeroes the gradients, holds the LR schedule
        return self._optimizer_step(*args, **kwargs)


class _ModelParallelGroup:
    """The `mpu` deepspeed.runtime.utils' norm helpers read: sums over our TP x PP group."""

    def __init__(self, group):
        self.group = group

    def get_model_parallel_group(self):
        return self.group
