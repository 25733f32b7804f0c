"""The training loop: a Trainer that runs iterations on a DeepSpeed engine, logs, evaluates, saves and stops.

Fault handling (docs/FAULTS.md): SIGTERM/SIGINT and the exit flags save at an iteration boundary and return;
a non-finite loss or gradient norm skips that iteration's update (guards.NonFiniteGuard) and
--max-nan-iterations in a row stop the run (NonFiniteError) without saving. Code outside the loop joins a run
through callbacks (callbacks.Callback): the fault-injection tests pass theirs in (tests/faults.py).
"""
import dataclasses
import logging
import math
import os
import time

import torch
import torch.distributed as dist

from megatron.checkpoint import save as checkpoint_save
from megatron.checkpoint.format import tag_for
from megatron.checkpoint.load import ResumeState, set_rng_state
from megatron.training.callbacks import CallbackList
from megatron.core.parallel_state import comm_device
from megatron.training.guards import ExitSignal, NonFiniteError, NonFiniteGuard, any_rank_over
from megatron.training.metrics import (MetricsWriter, format_log_line, loss_scale, measure_matmul_tflops,
                                       model_flops_per_iteration, peak_memory_gib)
from megatron.training.timers import format_detail, format_timing, window_timing

logger = logging.getLogger("megatron.training")

OOM_HINT = ("CUDA out of memory: lower --micro-batch-size (raise gradient accumulation through "
            "--global-batch-size to keep the batch), add --checkpoint-activations, raise --zero-stage, "
            "add --cpu-offload, or use more tensor/pipeline parallelism")


def _split(tokens):
    """(B, S+1) tokens -> inputs (B, S), labels (B, S)."""
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class PipeBatches:
    """Adapts {"text": (B, S+1)} batches to the (inputs, labels) pairs DeepSpeed's pipeline engine reads."""

    def __init__(self, loader_iter):
        self.it = loader_iter

    def __iter__(self):
        return self

    def __next__(self):
        return _split(next(self.it)["text"])


def dp_mean(value, dp_group):
    """The mean of a host float over the data-parallel group (the value itself without one)."""
    if dp_group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=comm_device())
    dist.all_reduce(tensor, group=dp_group)
    return tensor.item() / dist.get_world_size(dp_group)


def _to_device(tokens, device):
    """An asynchronous host-to-device copy: from pageable memory CUDA first waits for all the queued GPU work (a
    host sync every micro batch), from pinned memory (torch's caching host allocator) it does not."""
    if device.type == "cuda" and not tokens.is_cuda:
        tokens = tokens.pin_memory()
    return tokens.to(device, non_blocking=True)


def train_step(engine, data_iter, gradient_accumulation_steps, pipelined, dp_group=None, guard=None,
               on_phase=None, clock=None):
    """One optimizer step over the global batch; returns the mean LM loss (the same on every rank).

    guard: NonFiniteGuard, told whether any micro batch's loss was non-finite before the boundary step.
    on_phase(phase): called before "forward", "backward" and the boundary "step" (callbacks' on_phase).
    clock: a timers.PhaseClock (--timing-log-level >= 1) told each phase boundary; the pipeline engine's
    boundaries are marked by the hooks timers.install_engine_hooks put on it.
    """
    on_phase = on_phase or (lambda phase: None)
    mark = clock.mark if clock is not None else (lambda phase, micro=None: None)
    if pipelined:
        on_phase("forward")
        loss = engine.train_batch(data_iter=data_iter)
        mark("loss-sync")
        return loss.item()
    total = torch.zeros((), dtype=torch.float32, device=engine.device)
    for micro in range(gradient_accumulation_steps):
        mark("batch-generator", micro)
        inputs, labels = _split(_to_device(next(data_iter)["text"], engine.device))
        on_phase("forward")
        mark("forward-compute", micro)
        loss = engine(inputs, labels=labels).mean()
        if guard is not None:
            guard.note_loss(loss)
        on_phase("backward")
        mark("backward-compute", micro)
        engine.backward(loss)
        if micro == gradient_accumulation_steps - 1:
            on_phase("step")
        mark("optimizer")
        engine.step()
        total += loss.detach()  # no host sync inside the accumulation loop
    mark("loss-sync")
    return dp_mean(total.item() / gradient_accumulation_steps, dp_group)


@torch.no_grad()
def evaluate(engine, data_iter, eval_iters, pipelined, dp_group=None):
    """Mean LM loss over eval_iters global batches (eval_iters micro batches per DP rank without PP)."""
    engine.eval()
    losses = []
    for _ in range(eval_iters):
        if pipelined:  # the pipeline engine already averages over DP
            losses.append(engine.eval_batch(data_iter=data_iter).item())
        else:
            inputs, labels = _split(next(data_iter)["text"].to(engine.device))
            losses.append(engine(inputs, labels=labels).mean().item())
    engine.train()
    mean = sum(losses) / len(losses)
    return mean if pipelined else dp_mean(mean, dp_group)


@dataclasses.dataclass
class Progress:
    """Where the run is: counters that a checkpoint restores, and the non-finite streak that it does not."""
    iteration: int = 0
    consumed_samples: int = 0
    nan_streak: int = 0
    nan_total: int = 0
    last_saved: int = None  # iteration of this run's newest save
    last_good: tuple = None  # (iteration, root) of the newest intact checkpoint


class _LogWindow:
    """Losses and wall time since the last log line: `ran` iterations (finite or not) in `seconds()`, which
    leaves out evaluation and checkpoint saves (`excluded`)."""

    def __init__(self):
        self.loss, self.iters, self.ran, self.excluded = 0.0, 0, 0, 0.0
        self.start = time.perf_counter()

    def add(self, loss):
        self.loss += loss
        self.iters += 1

    def mean_loss(self):
        return self.loss / self.iters if self.iters else float("nan")

    def seconds(self):
        return time.perf_counter() - self.start - self.excluded

    def restart_timing(self):
        """Counts time and iterations from now on (the losses so far stay in the window's mean)."""
        self.ran, self.excluded, self.start = 0, 0.0, time.perf_counter()


class Trainer:
    """Runs config.training.train_iters iterations of `engine` from `start` (a checkpoint's ResumeState).

    The parallel layout comes in as `state` (core.parallel_state.ParallelState); `datasets` is (train, valid,
    test); `callbacks` are megatron.training.Callback objects. train() returns {"iteration", "consumed_samples",
    "losses" (iteration -> loss), "exit_reason"}.
    """

    def __init__(self, config, state, engine, scheduler, datasets, tokenizer=None, start=None, callbacks=()):
        self.config, self.state, self.engine, self.scheduler = config, state, engine, scheduler
        self.tokenizer = tokenizer
        self.callbacks = CallbackList(callbacks)
        self.pipelined = state.pipeline_model_parallel_size > 1
        start = start or ResumeState()
        ckpt = config.checkpoint
        self.progress = Progress(start.iteration, start.consumed_samples,
                                 last_good=(start.iteration, ckpt.load) if ckpt.load and start.iteration else None)
        if ckpt.save and ckpt.load and start.iteration and _same_folder(ckpt.save, ckpt.load):
            self.progress.last_saved = start.iteration  # that checkpoint is in --save already: never written again
        self.finished = start.finished  # the checkpoint holds the whole run: train() does nothing
        self.saver = None
        if ckpt.save and ckpt.async_save:
            from megatron.checkpoint.async_save import AsyncSaver
            self.saver = AsyncSaver(config.parallel.distributed_timeout_minutes)
        self.train_ds, self.valid_ds, _ = datasets
        self.data_iter = self._batches(self.train_ds, start.consumed_samples, config.data.num_workers)
        if start.rng_state is not None:
            set_rng_state(start.rng_state)  # after iter(loader), which draws from the generator
        self.guard = NonFiniteGuard(engine, state, config.optimizer.clip_grad)
        self.losses = {}
        self.global_batch = config.training.global_batch_size  # the current one, below it during a ramp-up
        self.clock = self.gpu_util = self.timing_level = None
        self._timer_hooks, self._training = [], False
        self.set_timing_level(config.monitoring.timing_log_level)
        if config.monitoring.profile:
            from megatron.training.monitoring import ProfilerWindow
            self.callbacks.callbacks.append(ProfilerWindow(config.monitoring, self.state.rank))

    def set_timing_level(self, level):
        """Puts the phase timers at `level` (--timing-log-level): hooks on the engine, on the TP collectives and, at
        level 2, on the layers. Called at construction, and by callbacks between log windows (on_log) to compare
        levels within one run (benchmarks/timers_overhead.py)."""
        from megatron.core.tensor_parallel import comm_timing
        from megatron.training.monitoring import GpuUtilization
        from megatron.training.timers import PhaseClock, install_engine_hooks, install_layer_hooks
        for uninstall in self._timer_hooks:
            uninstall()
        self._timer_hooks, self.timing_level, self.clock = [], level, None
        if level >= 1:
            self.clock = PhaseClock(torch.cuda.is_available(), detail=level >= 2)
            self._timer_hooks.append(install_engine_hooks(self.engine, self.clock, self.pipelined))
            if level >= 2:
                self._timer_hooks.append(install_layer_hooks(self.engine.module, self.clock))
            if self.gpu_util is None:
                self.gpu_util = GpuUtilization(warn=self.state.rank == 0)
        if self._training:
            comm_timing.set_collective_observer(self.clock)

    def _batches(self, dataset, consumed, num_workers):
        from megatron.data.samplers import build_pretraining_data_loader
        loader = build_pretraining_data_loader(dataset, consumed, self.config.training.micro_batch_size,
                                               self.state.dp_rank, self.state.data_parallel_size, num_workers)
        return PipeBatches(iter(loader)) if self.pipelined else iter(loader)

    def train(self):
        from megatron.core.tensor_parallel import comm_timing
        training, monitoring, upstream = self.config.training, self.config.monitoring, self.config.upstream
        if self.finished:  # load.finished_message said so, once: nothing to train, evaluate or save
            return {"iteration": self.progress.iteration, "consumed_samples": self.progress.consumed_samples,
                    "losses": {}, "exit_reason": "already finished"}
        self.writer = MetricsWriter(self.config.logging, self.state.rank, monitoring, self.progress.iteration,
                                    dataclasses.asdict(self.config), monitoring.log_timers_to_tensorboard,
                                    max_queue=upstream.tensorboard_queue_size)
        self.exit_signal = ExitSignal(training.exit_signal_handler)
        self.start_time = time.time()
        self._peak = self._peak_tflops()
        self.callbacks("on_train_start", self)
        self._new_window()
        if upstream.eval_only or self._kill_switch():
            return self._stop_without_training("--eval-only" if upstream.eval_only else "kill switch")
        previous_observer = comm_timing.set_collective_observer(self.clock)
        self._training = True
        start_iteration = self.progress.iteration
        exit_reason = "finished"
        try:
            while self.progress.iteration < training.train_iters:
                nonfinite = self._iteration()
                iteration = self.progress.iteration
                if iteration % self.config.logging.log_interval == 0 or iteration == training.train_iters:
                    self._log()
                elif self.window.ran == self.progress.iteration - start_iteration == 1:
                    self._leave_out_first_iteration()
                self._stop_if_nonfinite_too_long()
                if training.eval_interval and iteration % training.eval_interval == 0:
                    self._evaluate()
                if self.config.checkpoint.save_interval and iteration % self.config.checkpoint.save_interval == 0:
                    if nonfinite:
                        logger.warning("iteration %d: not saving a checkpoint after a non-finite iteration",
                                       iteration)
                    else:
                        self.save()
                exit_reason = self._exit_reason()
                if exit_reason != "finished":
                    break
                if self._kill_switch():
                    exit_reason = "kill switch"
                    break
            if exit_reason == "kill switch":  # upstream's semantics: exit at once, no evaluation, no save
                self.wait_for_save()
                self.writer.close()
                return self._summary(exit_reason)
            evaluated_last = training.eval_interval and self.progress.iteration % training.eval_interval == 0
            if exit_reason == "finished" and training.eval_iters > 0 and not evaluated_last:
                self._evaluate()
            self.save(final=True)
        finally:
            if self.saver is not None and self.saver.in_flight():  # an error left a background save running
                self._wait_quietly()
            self._training = False
            comm_timing.set_collective_observer(previous_observer)
            self.writer.close()
        return self._summary(exit_reason)

    def _summary(self, exit_reason):
        logger.info("training stopped at iteration %d (%s)", self.progress.iteration, exit_reason)
        summary = {"iteration": self.progress.iteration, "consumed_samples": self.progress.consumed_samples,
                   "losses": self.losses, "exit_reason": exit_reason}
        self.callbacks("on_train_end", self, summary)
        return summary

    # ------------------------------------------------------------ upstream compatibility (issue 21)

    def _stop_without_training(self, reason):
        """--eval-only: one evaluation of the validation split; a kill switch present at start: nothing."""
        try:
            if reason == "--eval-only":
                self._evaluate()
            else:
                logger.warning("kill switch %s exists: exiting without training (remove it to run)",
                               self.config.upstream.kill_switch_path)
        finally:
            self.writer.close()
        return self._summary(reason)

    def _kill_switch(self):
        """Whether any rank sees --kill-switch-path (upstream: checked each iteration, exit without saving)."""
        from megatron.upstream_compat import kill_switch_present
        path = self.config.upstream.kill_switch_path
        if not path:
            return False
        found = any_rank_over(1.0 if kill_switch_present(path) else 0.0, 0.5)
        if found and self.progress.iteration:
            logger.warning("kill switch %s exists: exiting at iteration %d without saving", path,
                           self.progress.iteration)
        return found

    def _set_global_batch(self):
        """The global batch of the next step under --rampup-batch-size (DeepSpeed's gradient accumulation and the
        sample-based LR schedule's step follow it)."""
        from megatron.upstream_compat import rampup_global_batch
        rampup = self.config.upstream.rampup_batch_size
        if rampup is None:
            return
        batch = rampup_global_batch(self.progress.consumed_samples, *rampup, self.config.training.global_batch_size)
        if batch != self.global_batch or self.progress.iteration == 0:
            self.engine.set_train_batch_size(batch)
            self.global_batch = batch
        if self.config.upstream.sample_based_schedule:
            self.scheduler.increment = batch

    def _iteration(self):
        """Runs one iteration; returns whether it was non-finite (its update skipped)."""
        progress, engine = self.progress, self.engine
        iteration = progress.iteration + 1
        self.callbacks("on_iteration_start", self, iteration)
        skipped_before = int(getattr(engine, "skipped_steps", 0))
        self._set_global_batch()
        training = self.config.training
        if self.clock is not None:
            self.clock.new_iteration()
        try:
            loss = train_step(engine, self.data_iter,
                              self.global_batch // (training.micro_batch_size * training.data_parallel_size),
                              self.pipelined, self.state.dp_group, self.guard,
                              on_phase=lambda phase: self.callbacks("on_phase", self, iteration, phase),
                              clock=self.clock)
        except torch.cuda.OutOfMemoryError as err:
            from megatron.planning.advice import oom_suggestion
            raise RuntimeError(OOM_HINT + oom_suggestion(self.config)) from err
        if self.config.upstream.sync_tp_duplicated_parameters:
            from megatron.upstream_compat import sync_tp_duplicated_parameters
            sync_tp_duplicated_parameters(engine, self.state.tp_group)
        progress.iteration = iteration
        progress.consumed_samples += self.global_batch
        self.losses[iteration] = loss
        self.window.ran += 1
        self.callbacks("on_iteration_end", self, iteration, loss)
        nonfinite = self._check_finite(loss, int(getattr(engine, "skipped_steps", 0)) - skipped_before)
        if self.clock is not None:
            self.clock.mark(None)
        return nonfinite

    def _check_finite(self, loss, skipped):
        progress = self.progress
        nonfinite = any_rank_over(0.0 if math.isfinite(loss) else 1.0, 0.5) or \
            (skipped > 0 and not self.config.precision.fp16)  # bf16/fp32 skip only a non-finite gradient
        if not nonfinite:
            progress.nan_streak = 0
            self.window.add(loss)
            return False
        progress.nan_total += 1
        progress.nan_streak += 1
        if skipped == 0:
            raise NonFiniteError(
                f"lm loss is {loss} at iteration {progress.iteration} and the optimizer applied the update (is "
                "bf16.check_grad_overflow false in the DeepSpeed config?); stopping without saving. "
                + self._where_to_resume())
        logger.warning("iteration %d: lm loss %s, gradient norm %s: update skipped (%d in a row)",
                       progress.iteration, loss, self.guard.grad_norm(), progress.nan_streak)
        return True

    def _stop_if_nonfinite_too_long(self):
        training, precision, progress = self.config.training, self.config.precision, self.progress
        at_min_scale = precision.fp16 and (loss_scale(self.engine) or 0) <= precision.min_loss_scale
        if progress.nan_streak >= training.max_nan_iterations and (not precision.fp16 or at_min_scale):
            raise NonFiniteError(
                f"lm loss or gradient norm not finite at iteration {progress.iteration}, {progress.nan_streak} "
                f"iterations in a row (--max-nan-iterations {training.max_nan_iterations}); their updates were "
                "skipped. Usual causes: learning rate too high (--lr, --lr-warmup-iters), precision (fp16 "
                "overflows: use --bf16; check --loss-scale), no or loose clipping (--clip-grad), bad data. "
                + self._where_to_resume())

    def _new_window(self):
        self.window = _LogWindow()
        if self.gpu_util is not None:
            self.gpu_util.start_window()

    def _leave_out_first_iteration(self):
        """The first iteration of a process does one-time work (allocations, communicators, optimizer state); when
        more iterations follow in its log window, it is reported on its own line and left out of the window's
        throughput and timers, so that the first log line after a (re)start shows the run's true speed."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        logger.info("iteration %d: first iteration of this process took %.1f ms (start-up work: not counted in the "
                    "throughput window)", self.progress.iteration, 1000 * self.window.seconds())
        if self.clock is not None:
            self.clock.collect()
        self.window.restart_timing()
        if self.gpu_util is not None:
            self.gpu_util.start_window()

    def _log(self):
        config, training, progress = self.config, self.config.training, self.progress
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        window_seconds = self.window.seconds()
        per_iter = window_seconds / self.window.ran  # the iterations this window ran (not iteration % interval)
        flops = model_flops_per_iteration(self.global_batch, config.model.seq_length,
                                          config.model.num_layers, config.model.hidden_size,
                                          config.model.vocab_size, config.model.checkpoint_activations)
        # per GPU; without CUDA (tests, the quickstart on a laptop) a TFLOP/s figure means nothing: left out
        tflops = flops / per_iter / self.state.world_size / 1e12 if torch.cuda.is_available() else None
        metrics = dict(
            iteration=progress.iteration, train_iters=training.train_iters,
            consumed_samples=progress.consumed_samples,
            consumed_tokens=progress.consumed_samples * config.model.seq_length, ms_per_iteration=1000 * per_iter,
            window_iterations=self.window.ran, timing_log_level=self.timing_level,
            lr=self.scheduler.get_lr(), global_batch_size=self.global_batch,
            lm_loss=self.window.mean_loss(), loss_scale=loss_scale(self.engine), grad_norm=self.guard.grad_norm(),
            skipped_iterations=int(getattr(self.engine, "skipped_steps", 0)), nan_iterations=progress.nan_total,
            samples_per_second=self.global_batch / per_iter,
            tokens_per_second=self.global_batch * config.model.seq_length / per_iter,
            tflops=tflops, mfu=tflops / self._peak if self._peak and tflops is not None else None,
            **peak_memory_gib())
        line = format_log_line(metrics)
        if self.clock is not None:
            metrics.update(self._window_timing(window_seconds))
            line += " " + format_timing(metrics, config.monitoring.timing_log_option)
        logger.info(line)
        if metrics.get("timers_detail"):
            logger.info(format_detail(progress.iteration, metrics["timers_detail"],
                                      config.monitoring.timing_log_option))
        self.writer.write("train", metrics)
        self.callbacks("on_log", self, progress.iteration, metrics)
        self._new_window()

    def _window_timing(self, window_seconds):
        """Level >= 1: the window's phase times, shares and utilization (collective)."""
        phases, detail = self.clock.collect()
        return window_timing(phases, detail if self.clock.detail else None, self.window.ran, window_seconds,
                             self.config.monitoring.timing_log_option, self.state.pipeline_model_parallel_size,
                             self.config.training.gradient_accumulation_steps,
                             self.gpu_util.window_mean() if self.gpu_util is not None else None)

    def _timed_apart(self, work):
        """Runs work() outside the throughput window and the phase timers; returns (its result, seconds)."""
        if self.clock is not None:
            self.clock.pause()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            result = work()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        finally:
            seconds = time.perf_counter() - start
            self.window.excluded += seconds
            if self.clock is not None:
                self.clock.resume()
        return result, seconds

    def _peak_tflops(self):
        if self.config.logging.peak_tflops:
            return self.config.logging.peak_tflops
        return measure_matmul_tflops(comm_device()) if torch.cuda.is_available() else None

    def _evaluate(self):
        if self.valid_ds is None:
            return
        iteration = self.progress.iteration
        loss, seconds = self._timed_apart(lambda: evaluate(
            self.engine, self._batches(self.valid_ds, 0, 0), self.config.training.eval_iters, self.pipelined,
            self.state.dp_group))
        ppl = math.exp(min(20.0, loss))
        logger.info("validation at iteration %d | lm loss: %.6E | lm loss PPL: %.6E | time (ms): %.1f |", iteration,
                    loss, ppl, 1000 * seconds)
        self.writer.write("valid", {"iteration": iteration, "lm_loss": loss, "ppl": ppl, "ms": 1000 * seconds})

    def save(self, final=False):
        """Saves the current iteration to --save (once per iteration; nothing without --save). With --async-save
        the state is copied to host memory and written in the background (the previous background save waited for
        first); the final save of a run is written before returning."""
        progress, ckpt = self.progress, self.config.checkpoint
        if self.saver is not None:
            self.wait_for_save()
        if not ckpt.save or progress.last_saved == progress.iteration:
            return
        iteration = progress.iteration
        on_written = lambda folder: self.callbacks("on_checkpoint_written", self, iteration)  # noqa: E731
        if self.saver is None or final:
            _, seconds = self._timed_apart(lambda: checkpoint_save.save_checkpoint(
                self.engine, self.config, self.state, iteration, progress.consumed_samples, self.tokenizer,
                on_written=on_written))
            logger.info("checkpoint save at iteration %d | time (ms): %.1f | (not counted in the throughput)",
                        iteration, 1000 * seconds)
            progress.last_good = (iteration, ckpt.save)
        else:
            copied, seconds = self._timed_apart(lambda: self.saver.start(
                self.engine, self.config, self.state, iteration, progress.consumed_samples, self.tokenizer,
                on_written))
            logger.info("checkpoint snapshot at iteration %d | time (ms): %.1f | %.3f GB copied to host memory on "
                        "rank 0, written in the background", iteration, 1000 * seconds, copied / 1e9)
        progress.last_saved = iteration

    def wait_for_save(self):
        """Waits for the background save in flight (--async-save); its failure raises here (CheckpointError),
        on every rank at the same iteration. The time waited is left out of the throughput window."""
        if self.saver is None or not self.saver.in_flight():
            return
        done, seconds = self._timed_apart(self.saver.wait)
        if seconds > 0.001:
            logger.info("waited %.1f ms for the background save of iteration %d", 1000 * seconds, done)
        self.progress.last_good = (done, self.config.checkpoint.save)

    def _wait_quietly(self):
        """On the way out after an error: the background save finishes (or fails, logged) before the process
        exits, so its folder is either complete or a .tmp_* that the next save removes."""
        try:
            self.saver.wait()
        except Exception as err:  # noqa: BLE001 - the error already propagating is the one to report
            logger.error("%s", err)

    def _exit_reason(self):
        training, iteration = self.config.training, self.progress.iteration
        if training.exit_interval and iteration % training.exit_interval == 0:
            return f"--exit-interval {training.exit_interval}"
        if training.exit_duration_in_mins and any_rank_over(time.time() - self.start_time,
                                                            60 * training.exit_duration_in_mins):
            return f"--exit-duration-in-mins {training.exit_duration_in_mins}"
        if training.exit_signal_handler and self.exit_signal.any_rank():
            return "exit signal"
        return "finished"

    def _where_to_resume(self):
        ckpt, last_good = self.config.checkpoint, self.progress.last_good
        if last_good is None:
            return f"No checkpoint was saved{' in ' + ckpt.save if ckpt.save else ''} yet."
        iteration, root = last_good
        return (f"The last good checkpoint, {tag_for(iteration)} in {root}, is intact: fix the "
                f"cause and relaunch with --load {root}.")


def _same_folder(a, b):
    return os.path.realpath(a) == os.path.realpath(b)
