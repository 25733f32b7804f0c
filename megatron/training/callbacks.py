"""Training callbacks: the points where code outside the loop (tests' fault injection, probes, profilers) joins a
run without the loop knowing about it. Every method is optional; the Trainer calls them in this order:

    on_train_start(trainer)
    for each iteration:
        on_iteration_start(trainer, iteration)
        on_phase(trainer, iteration, phase)          phase: "forward", "backward", "step" (PP: "forward" only)
        on_iteration_end(trainer, iteration, loss)
        on_log(trainer, iteration, metrics)          after a log line (metrics: its record), before the next window
        on_checkpoint_written(trainer, iteration)    this rank's files are written, the manifest not yet
    on_train_end(trainer, summary)
"""


class Callback:
    """Base class: override the hooks you need."""

    def on_train_start(self, trainer):
        pass

    def on_iteration_start(self, trainer, iteration):
        pass

    def on_phase(self, trainer, iteration, phase):
        pass

    def on_iteration_end(self, trainer, iteration, loss):
        pass

    def on_log(self, trainer, iteration, metrics):
        pass

    def on_checkpoint_written(self, trainer, iteration):
        pass

    def on_train_end(self, trainer, summary):
        pass


class CallbackList:
    """The run's callbacks; `callbacks(hook, *args)` calls that hook on each, in order."""

    def __init__(self, callbacks=()):
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"{cb!r} is not a megatron.training.Callback")

    def __call__(self, hook, *args):
        for cb in self.callbacks:
            getattr(cb, hook)(*args)
