"""Faults injected into real training runs (tests only): TestFaults is a training Callback, built from the
MEGATRON_TEST_FAULT environment variable by tests/train_with_faults.py, the launcher the fault tests run."""
import dataclasses
import errno
import logging
import os
import signal
import time

import torch

from megatron.training import Callback

logger = logging.getLogger("megatron.training")


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str  # nan, kill, raise, save_error, slow
    iterations: tuple = ()  # (first, last) pairs, last None for open-ended
    rank: int = None  # None: every rank
    phase: str = None
    seconds: float = 0.0

    def matches(self, iteration, rank):
        return (self.rank is None or self.rank == rank) and any(
            lo <= iteration and (hi is None or iteration <= hi) for lo, hi in self.iterations)


class TestFaults(Callback):
    """Faults named by the environment variable MEGATRON_TEST_FAULT, so that tests can run the real CLI in
    subprocesses (through tests/train_with_faults.py). Faults are separated by ';', options by ':';
    iterations are a comma list of numbers and ranges (3,6-8,10-):

        nan_at=ITERS[:rank=R]                  the model's output times NaN (loss and gradients non-finite)
        kill_at=N[:rank=R][:phase=P]           SIGKILL this process; P: forward (default), backward, step, save
        raise_at=N[:rank=R]                    RuntimeError in the forward of iteration N
        save_error_at=N[:rank=R]               OSError(ENOSPC) while writing the checkpoint of iteration N
        slow=SECONDS                           sleep this long every iteration

    Pipelined runs reach only the forward phase (train_batch runs the whole schedule at once).
    """
    __test__ = False  # not a pytest class
    ENV = "MEGATRON_TEST_FAULT"

    def __init__(self, faults=(), rank=0):
        self.faults, self.rank = tuple(faults), rank
        self._nan_hook = None

    @classmethod
    def from_env(cls, rank=0, environ=None):
        spec = (environ if environ is not None else os.environ).get(cls.ENV, "")
        faults = [cls.parse_one(item) for item in spec.split(";") if item.strip()]
        if faults:
            logger.warning("%s=%s: injecting test faults", cls.ENV, spec)
        return cls(faults, rank)

    @staticmethod
    def parse_one(item):
        head, *options = item.strip().split(":")
        key, _, value = head.partition("=")
        kinds = {"nan_at": "nan", "kill_at": "kill", "raise_at": "raise", "save_error_at": "save_error"}
        opts = dict(o.split("=", 1) for o in options)
        if key == "slow":
            return Fault("slow", ((1, None),), seconds=float(value))
        if key not in kinds:
            raise ValueError(f"{TestFaults.ENV}: unknown fault {key!r} in {item!r}; "
                             f"known: {', '.join(kinds)}, slow")
        ranges = []
        for part in value.split(","):
            lo, dash, hi = part.partition("-")
            ranges.append((int(lo), (int(hi) if hi else None) if dash else int(lo)))
        phase = opts.get("phase", "save" if kinds[key] == "save_error" else "forward")
        if phase not in ("forward", "backward", "step", "save"):
            raise ValueError(f"{TestFaults.ENV}: unknown phase {phase!r} in {item!r}")
        return Fault(kinds[key], tuple(ranges), int(opts["rank"]) if "rank" in opts else None, phase)

    def on_train_start(self, trainer):
        self.rank = trainer.state.rank

    def on_iteration_start(self, trainer, iteration):
        """Sleeps, and arms or disarms the NaN output hook."""
        engine = trainer.engine
        for fault in self.faults:
            if fault.kind == "slow":
                time.sleep(fault.seconds)
        want_nan = any(f.kind == "nan" and f.matches(iteration, self.rank) for f in self.faults)
        if want_nan and self._nan_hook is None:
            self._nan_hook = engine.module.register_forward_hook(_times_nan)
        elif not want_nan and self._nan_hook is not None:
            self._nan_hook.remove()
            self._nan_hook = None

    def on_phase(self, trainer, iteration, phase):
        self.fire(iteration, phase)

    def on_checkpoint_written(self, trainer, iteration):
        self.fire(iteration, "save")

    def fire(self, iteration, phase):
        for fault in self.faults:
            if fault.phase != phase or not fault.matches(iteration, self.rank):
                continue
            where = f"iteration {iteration}, phase {phase}, rank {self.rank}"
            if fault.kind == "kill":
                logger.warning("%s: SIGKILL at %s", self.ENV, where)
                logging.shutdown()
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "raise":
                raise RuntimeError(f"injected fault ({self.ENV}) at {where}")
            if fault.kind == "save_error":
                raise OSError(errno.ENOSPC, f"injected fault ({self.ENV}) at {where}: No space left on device")


def _times_nan(module, inputs, output):
    if torch.is_tensor(output) and output.is_floating_point():
        return output * float("nan")
    if isinstance(output, tuple):
        return tuple(o * float("nan") if torch.is_tensor(o) and o.is_floating_point() else o for o in output)
    return output
