"""Phase timers of a training run (--timing-log-level, --timing-log-option): where each iteration's time goes,
the exposed communication share and the pipeline bubble.

How it measures without slowing the run. An iteration is a sequence of phases; the loop (and hooks on
DeepSpeed's engine) call PhaseClock.mark(phase) at each phase boundary. On CUDA a mark records a CUDA event on
the current stream and never synchronizes: the time of a phase is the GPU-timeline gap between its event and the
next one, read once per log window after the loop's own synchronize. On CPU (gloo) every op runs on the host, so
a mark reads the host clock. A phase's time is therefore what it cost the compute stream: data loading the device
did not have to wait for shows up as ~0, a collective the stream waited on shows up in full.

    batch-generator     next micro batch from the loader (and its copy to the device)
    forward-compute     the forward pass (including the TP collectives inside it)
    backward-compute    the backward pass (including its TP collectives), without the DP gradient reduction
    grads-all-reduce    DeepSpeed's data-parallel gradient reduction (engine.allreduce_gradients; the pipeline
                        engine's ReduceGrads / ReduceTiedGrads instructions); absent at one data-parallel rank
                        and ZeRO 0, where the reduction is an identity and is skipped (training/engine.py)
    pipeline-send-recv  the pipeline engine's Send/Recv Activation/Grad instructions: transfers and the waits for
                        the neighbouring stage (the bubble)
    optimizer           engine.step (ZeRO's partition all-gather included)
    loss-sync           the loss's average over data-parallel ranks (PP: broadcast from the last stage) and the
                        all-ranks finite check

Exposed communication = grads-all-reduce + pipeline-send-recv + loss-sync + the TP collectives (each bracketed by
its own pair of events through megatron.core.tensor_parallel.comm_timing). Level 2 adds per-micro-batch
forward/backward times and per-layer forward times. Evaluation and checkpoint saves are not phases: the clock is
paused around them, as the throughput window leaves them out.
"""
import time

import torch
import torch.distributed as dist

from megatron.core.parallel_state import comm_device

PHASES = ("batch-generator", "forward-compute", "backward-compute", "grads-all-reduce", "pipeline-send-recv",
          "optimizer", "loss-sync")
COMM_PHASES = ("grads-all-reduce", "pipeline-send-recv", "loss-sync")
TP_COMM = "tp-collectives"
_PER_MICRO_BATCH = ("forward-compute", "backward-compute")


def pipeline_bubble_fraction(pipeline_stages, micro_batches):
    """The 1F1B / GPipe schedule's idle share of each stage: (p - 1) / (m + p - 1) for p stages and m micro
    batches per iteration (Narayanan et al. 2021, section 2.2.1); 0 without pipeline parallelism."""
    if pipeline_stages <= 1:
        return 0.0
    return (pipeline_stages - 1) / (micro_batches + pipeline_stages - 1)


class PhaseClock:
    """Contiguous phase marks plus bracketed spans (TP collectives; at level 2, layers), summed per log window.

    mark(phase, micro=None): from now on the iteration is in `phase` (None: in nothing that is counted). begin() /
    end(token): a span inside a phase (the comm_timing observer interface). collect(): after the device is
    synchronized, {name: seconds} for the window, and a fresh window.
    """

    def __init__(self, cuda, detail=False, host_clock=time.perf_counter):
        self.cuda, self.detail, self.host_clock = cuda, detail, host_clock
        self.paused = False
        self.current = (None, None)
        self.counts = {}  # forward/backward passes so far this iteration (level 2's micro-batch index)
        self._marks, self._spans, self._pool = [], [], []

    def _stamp(self):
        if not self.cuda:
            return self.host_clock()
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, start, end):
        return start.elapsed_time(end) / 1000 if self.cuda else end - start

    def new_iteration(self):
        self.counts = {}

    def next_micro_batch(self, phase):
        """The index of this iteration's next `phase` pass (counted per iteration)."""
        self.counts[phase] = self.counts.get(phase, -1) + 1
        return self.counts[phase]

    def mark(self, phase, micro=None):
        key = (phase, micro if self.detail else None)
        if self.paused or key == self.current:
            return
        self.current = key
        self._marks.append((key, self._stamp()))

    def begin(self):
        return None if self.paused or self.current[0] is None else self._stamp()

    def end(self, token, name=TP_COMM):
        self._spans.append((name, token, self._stamp()))

    def pause(self):
        """Stops counting (evaluation, checkpoint saves) until resume()."""
        self.mark(None)
        self.paused = True

    def resume(self):
        self.paused = False

    def collect(self):
        """({phase: seconds}, {detail name: seconds}) of the window since the last collect; the device must be
        synchronized (the training loop does that before each log line)."""
        phases, detail = dict.fromkeys(PHASES, 0.0), {}
        phases[TP_COMM] = 0.0
        for ((phase, micro), start), (_, end) in zip(self._marks, self._marks[1:]):
            if phase is None:
                continue
            seconds = self._seconds(start, end)
            phases[phase] += seconds
            if micro is not None:
                name = f"{phase} micro-batch {micro}"
                detail[name] = detail.get(name, 0.0) + seconds
        for name, start, end in self._spans:
            seconds = self._seconds(start, end)
            if name == TP_COMM:
                phases[TP_COMM] += seconds
            else:
                detail[name] = detail.get(name, 0.0) + seconds
        last = self._marks[-1] if self._marks and self._marks[-1][0][0] is not None else None
        if self.cuda:
            used = [stamp for _, stamp in self._marks] + [s for _, a, b in self._spans for s in (a, b)]
            self._pool.extend(s for s in used if last is None or s is not last[1])
        self._marks, self._spans = ([last] if last else []), []
        return phases, detail


def install_engine_hooks(engine, clock, pipelined):
    """Marks DeepSpeed's own phase boundaries: its gradient reduction and, for the pipeline engine, each schedule
    instruction (by overriding the engine's instruction map and methods on this instance only). Returns a function
    that removes them."""
    original_reduce = engine.allreduce_gradients

    def allreduce_gradients(*args, **kwargs):
        previous = clock.current
        clock.mark("grads-all-reduce")
        try:
            return original_reduce(*args, **kwargs)
        finally:
            clock.mark(*previous)

    engine.allreduce_gradients = allreduce_gradients
    overridden = ["allreduce_gradients"]

    def uninstall():
        for name in overridden:
            engine.__dict__.pop(name, None)

    if not pipelined:
        return uninstall
    from deepspeed.runtime.pipe import schedule
    phase_of = {schedule.LoadMicroBatch: "batch-generator", schedule.ForwardPass: "forward-compute",
                schedule.BackwardPass: "backward-compute", schedule.SendActivation: "pipeline-send-recv",
                schedule.RecvActivation: "pipeline-send-recv", schedule.SendGrad: "pipeline-send-recv",
                schedule.RecvGrad: "pipeline-send-recv", schedule.ReduceGrads: "grads-all-reduce",
                schedule.ReduceTiedGrads: "grads-all-reduce", schedule.OptimizerStep: "optimizer"}

    def timed(method, phase):
        def run(self, **kwargs):
            micro = clock.next_micro_batch(phase) if phase in _PER_MICRO_BATCH else None
            clock.mark(phase, micro)
            return method(self, **kwargs)
        return run

    engine._INSTRUCTION_MAP = {kind: timed(method, phase_of.get(kind, "forward-compute"))
                               for kind, method in type(engine)._INSTRUCTION_MAP.items()}
    original_aggregate = engine._aggregate_total_loss

    def aggregate_total_loss(*args, **kwargs):
        clock.mark("loss-sync")
        return original_aggregate(*args, **kwargs)

    engine._aggregate_total_loss = aggregate_total_loss
    overridden += ["_INSTRUCTION_MAP", "_aggregate_total_loss"]
    return uninstall


def install_layer_hooks(model, clock):
    """Level 2: the forward time of each transformer block (modules with a `layer_number`), as spans. Returns a
    function that removes the hooks."""
    handles = []
    for module in model.modules():
        number = getattr(module, "layer_number", None)
        if number is None:
            continue
        name = f"layer {number} forward"

        def before(mod, args, _name=name):
            mod._timing_token = clock.begin()

        def after(mod, args, output, _name=name):
            token = getattr(mod, "_timing_token", None)
            if token is not None:
                clock.end(token, _name)
            mod._timing_token = None

        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def uninstall():
        for handle in handles:
            handle.remove()
    return uninstall


def gather_rows(values):
    """Every rank's list of floats (the same length on each): [[rank 0's], [rank 1's], ...]. Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=comm_device())
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [row.tolist() for row in rows]


def gather_dicts(mapping):
    """Every rank's {name: float}, merged into {name: [value per rank that has it]}. Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {name: [value] for name, value in mapping.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mapping)
    merged = {}
    for one in every:
        for name, value in one.items():
            merged.setdefault(name, []).append(value)
    return merged


def combine(values, option):
    """A phase's per-rank values as --timing-log-option shows them: max, (min, max), or the list."""
    if option == "max":
        return max(values)
    if option == "minmax":
        return [min(values), max(values)]
    return list(values)


def window_timing(phases, detail, iterations, window_seconds, option, pipeline_stages, micro_batches,
                  gpu_utilization=None):
    """The level >= 1 metrics of a log window from this rank's clock totals (seconds over the window). Collective:
    every rank calls it. Returns {"timers": {phase: ms per iteration, combined over ranks by `option`}, "timers_max":
    the max over ranks, "comm_share", "bubble_share" and "bubble_theory" (PP > 1), "gpu_utilization" (CUDA), and
    "timers_detail" at level 2}. Shares are fractions of this rank's window time, then the max over ranks."""
    names = list(PHASES) + [TP_COMM]
    step = window_seconds or float("nan")
    comm = sum(phases[name] for name in COMM_PHASES) + phases[TP_COMM]
    bubble = phases["pipeline-send-recv"]
    util = -1.0 if gpu_utilization is None else gpu_utilization
    rows = gather_rows([1000 * phases[name] / iterations for name in names] + [comm / step, bubble / step, util])
    world = len(rows)
    per_name = {name: [row[i] for row in rows] for i, name in enumerate(names)}
    shown = [name for name in names if max(per_name[name]) > 0]
    result = {"timers": {name: combine(per_name[name], option) for name in shown},
              "timers_max": {name: max(per_name[name]) for name in shown}}
    if world > 1:
        result["comm_share"] = max(row[len(names)] for row in rows)
    if pipeline_stages > 1:
        result["bubble_share"] = max(row[len(names) + 1] for row in rows)
        result["bubble_theory"] = pipeline_bubble_fraction(pipeline_stages, micro_batches)
    utils = [row[len(names) + 2] for row in rows if row[len(names) + 2] >= 0]
    if utils:
        result["gpu_utilization"] = sum(utils) / len(utils)
    if detail is not None:
        merged = gather_dicts({name: 1000 * seconds / iterations for name, seconds in detail.items()})
        result["timers_detail"] = {name: combine(values, option) for name, values in sorted(merged.items())}
    return result


def _shown(value, option):
    if option == "minmax":
        return "/".join(f"{v:.2f}" for v in value)
    if option == "all":
        return "[" + ", ".join(f"{v:.2f}" for v in value) + "]"
    return f"{value:.2f}"


_OVER = {"max": "max over ranks", "minmax": "min/max over ranks", "all": "per rank"}


def format_timing(m, option):
    """The level >= 1 part of the log line (pure): phase times, communication and bubble shares, utilization."""
    parts = [f"timers (ms per iteration, {_OVER[option]}): "
             + ", ".join(f"{name} {_shown(value, option)}" for name, value in m["timers"].items())]
    if m.get("comm_share") is not None:
        parts.append(f"communication: {100 * m['comm_share']:.1f}%")
    if m.get("bubble_share") is not None:
        parts.append(f"pipeline bubble: {100 * m['bubble_share']:.1f}% (schedule {100 * m['bubble_theory']:.1f}%)")
    if m.get("gpu_utilization") is not None:
        parts.append(f"GPU utilization: {m['gpu_utilization']:.1f}%")
    return " | ".join(parts) + " |"


def format_detail(iteration, detail, option):
    """Level 2's own line: per-micro-batch and per-layer times."""
    return (f"iteration {iteration:8d} timers (level 2, ms per iteration, {_OVER[option]}): "
            + ", ".join(f"{name} {_shown(value, option)}" for name, value in detail.items()))
