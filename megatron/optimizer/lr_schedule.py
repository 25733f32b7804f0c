"""Learning-rate schedule: linear warmup to lr, then constant, linear or cosine decay to min_lr.

    step <= warmup:                 lr * step / warmup
    warmup < step <= decay_iters:   min_lr + (lr - min_lr) * f(progress),  progress = (step - warmup) / (decay - warmup)
                                    f = 1 (constant), 1 - progress (linear), (1 + cos(pi * progress)) / 2 (cosine)
    step > decay_iters:             min_lr (lr for constant)

`step` counts optimizer steps, or consumed samples for upstream's sample-based schedule (--lr-warmup-samples,
--lr-decay-samples): then each optimizer step advances it by `increment`, the step's global batch, which the
trainer updates during a batch-size ramp-up.
"""
import math


class AnnealingLR:
    """Stateful scheduler that DeepSpeed steps once per optimizer step (state saved in checkpoints)."""

    def __init__(self, optimizer, lr, min_lr, warmup_iters, decay_iters, decay_style, increment=1,
                 use_checkpoint_schedule=False):
        self.optimizer = optimizer
        self.increment = increment  # what one optimizer step adds to num_steps (1, or the global batch in samples)
        self.use_checkpoint_schedule = use_checkpoint_schedule  # --use-checkpoint-lr-scheduler
        self.lr, self.min_lr = lr, min_lr
        self.warmup_iters, self.decay_iters = warmup_iters, max(decay_iters, 1)
        self.decay_style = decay_style
        self.num_steps = 0
        self._apply()

    def get_lr(self, step=None):
        step = self.num_steps if step is None else step
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.lr * step / self.warmup_iters
        if self.decay_style == "constant":
            return self.lr
        if step > self.decay_iters:
            return self.min_lr
        span = max(self.decay_iters - self.warmup_iters, 1)
        progress = (step - self.warmup_iters) / span
        factor = 1.0 - progress if self.decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * factor

    def get_last_lr(self):
        return [self.get_lr()]

    def _apply(self):
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, increment=None):
        self.num_steps += self.increment if increment is None else increment
        self._apply()

    def state_dict(self):
        return {"num_steps": self.num_steps, "lr": self.lr, "min_lr": self.min_lr,
                "warmup_iters": self.warmup_iters, "decay_iters": self.decay_iters, "decay_style": self.decay_style}

    def load_state_dict(self, state):
        # The schedule's shape comes from this run's flags (upstream's --override-lr-scheduler), only the position
        # is restored; with --use-checkpoint-lr-scheduler the shape comes from the checkpoint too.
        if self.use_checkpoint_schedule:
            for key, attr in (("lr", "lr"), ("min_lr", "min_lr"), ("warmup_iters", "warmup_iters"),
                              ("decay_iters", "decay_iters"), ("decay_style", "decay_style")):
                if state.get(key) is not None:
                    setattr(self, attr, state[key])
        self.num_steps = state["num_steps"]
        self._apply()
