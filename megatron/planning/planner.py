"""The layout planner: every (TP, PP, DP, ZeRO stage, micro batch, activation checkpointing, CPU offload) for a
number of GPUs, each validated by the same resolve() pretrain_bloom.py runs, with its predicted per-GPU peak
memory (memory.py) and step time (speed.py); what fits sorted by predicted speed, and one recommendation.

tools/plan_layout.py is the command line; pretrain_bloom.py asks best_fitting() for its out-of-memory advice.
"""
import argparse
import copy
import dataclasses
import itertools
from typing import Optional

from megatron.planning import memory, speed

# DeepSpeed JSON keys and top-level flag keys that fix a layout choice the planner varies itself.
_LAYOUT_JSON_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "micro_batch_size",
                     "tensor_model_parallel_size", "model_parallel_size", "pipeline_model_parallel_size",
                     "pipe_parallel_size", "zero_stage", "checkpoint_activations", "cpu_offload")
_LAYOUT_DESTS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size", "zero_stage",
                 "cpu_offload", "checkpoint_activations", "global_batch_size")


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    zero_stage: int
    micro_batch: int
    checkpoint_activations: bool
    cpu_offload: bool

    def flags(self):
        """The pretrain_bloom.py flags of this layout."""
        out = [f"--tensor-model-parallel-size {self.tp}", f"--pipeline-model-parallel-size {self.pp}",
               f"--zero-stage {self.zero_stage}", f"--micro-batch-size {self.micro_batch}"]
        return " ".join(out + (["--checkpoint-activations"] if self.checkpoint_activations else [])
                        + (["--cpu-offload"] if self.cpu_offload else []))

    def short(self):
        return (f"TP {self.tp} x PP {self.pp} x DP {self.dp}, ZeRO {self.zero_stage}, micro batch {self.micro_batch}"
                + (", activation checkpointing" if self.checkpoint_activations else "")
                + (", CPU offload" if self.cpu_offload else ""))


@dataclasses.dataclass(frozen=True)
class Plan:
    layout: Layout
    config: object  # the resolved megatron Config
    stages: list  # [memory.StageMemory]
    time: speed.StepTime
    fits: bool

    @property
    def peak(self):
        return max(stage.peak for stage in self.stages)


@dataclasses.dataclass(frozen=True)
class Hardware:
    num_gpus: int
    gpu_memory_gib: float
    peak_tflops: float
    efficiency: float
    bandwidths: speed.Bandwidths
    memory_margin: float = 0.1  # allocator fragmentation and the CUDA context, outside max_memory_allocated
    cuda: bool = True

    @property
    def usable_bytes(self):
        return self.gpu_memory_gib * (1 - self.memory_margin) * memory.GIB


def layout_free(user_json):
    """The DeepSpeed JSON without the keys that pin a layout choice (train_batch_size, the global batch, stays)."""
    free = {k: copy.deepcopy(v) for k, v in (user_json or {}).items() if k not in _LAYOUT_JSON_KEYS}
    zero = dict(free.get("zero_optimization", {}))
    zero.pop("stage", None)
    zero.pop("offload_optimizer", None)
    if zero:
        free["zero_optimization"] = zero
    else:
        free.pop("zero_optimization", None)
    ac = dict(free.get("activation_checkpointing", {}))
    if ac.pop("partition_activations", None) is not None:
        free["activation_checkpointing"] = ac
    return free


def pinned_json_keys(user_json, best, own):
    """The keys of the DeepSpeed JSON that pin a choice where layout `best` differs from `own` (flags for `best`
    would contradict them)."""
    user_json, zero = user_json or {}, (user_json or {}).get("zero_optimization", {})
    differs = {"micro": best.micro_batch != own.micro_batch, "tp": best.tp != own.tp, "pp": best.pp != own.pp,
               "zero": best.zero_stage != own.zero_stage, "offload": best.cpu_offload != own.cpu_offload,
               "ckpt": best.checkpoint_activations != own.checkpoint_activations}
    which = {"train_micro_batch_size_per_gpu": "micro", "gradient_accumulation_steps": "micro",
             "micro_batch_size": "micro", "tensor_model_parallel_size": "tp", "model_parallel_size": "tp",
             "pipeline_model_parallel_size": "pp", "pipe_parallel_size": "pp", "zero_stage": "zero",
             "cpu_offload": "offload", "checkpoint_activations": "ckpt"}
    keys = [k for k, choice in which.items() if k in user_json and differs[choice]]
    keys += [f"zero_optimization.{k}" for k, choice in (("stage", "zero"), ("offload_optimizer", "offload"))
             if k in zero and differs[choice]]
    return keys


def resolve(args, world_size, user_json, saved_meta, tokenizer_vocab_size, cuda_available=True, merged=None):
    """pretrain_bloom.py's resolve() (megatron.arguments), the one validation of a launch line."""
    from megatron.arguments import resolve as resolve_flags
    return resolve_flags(args, world_size, user_json, saved_meta, tokenizer_vocab_size, cuda_available, merged)


def resolve_layout(args, user_json, layout, global_batch, tokenizer_vocab_size):
    """(Config, DeepSpeed dict) of `args` with this layout's flags, through pretrain_bloom.py's resolve();
    raises its ValueError for a layout it refuses."""
    values = dict(vars(args))
    values.update(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                  micro_batch_size=layout.micro_batch, zero_stage=layout.zero_stage, cpu_offload=layout.cpu_offload,
                  checkpoint_activations=layout.checkpoint_activations, global_batch_size=global_batch,
                  partition_activations=False)
    values["explicit_flags"] = frozenset(args.explicit_flags) | set(_LAYOUT_DESTS)
    return resolve(argparse.Namespace(**values), layout.tp * layout.pp * layout.dp, layout_free(user_json), None,
                   tokenizer_vocab_size, cuda_available=True)


def evaluate(config, hardware, ds_config=None):
    """Plan of a resolved Config (and its DeepSpeed dict: ZeRO's bucket sizes) on this hardware."""
    par, training = config.parallel, config.training
    tp, pp, dp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.data_parallel_size
    layout = Layout(tp, pp, dp, training.zero_stage, training.micro_batch_size, config.model.checkpoint_activations,
                    training.cpu_offload)
    stages = memory.layout_memory(config.model, tp, pp, dp, training.micro_batch_size,
                                  training.gradient_accumulation_steps, config.precision.name, training.zero_stage,
                                  config.model.checkpoint_activations, training.cpu_offload, hardware.cuda,
                                  buckets=memory.zero_buckets(ds_config))
    rank_params = max(sum(n for n, _ in memory.rank_tensors(config.model, tp, pp, stage)[0]) for stage in range(pp))
    time = speed.step_time(config.model, tp, pp, dp, training.micro_batch_size, training.gradient_accumulation_steps,
                           config.precision.name, training.zero_stage, config.model.checkpoint_activations,
                           training.cpu_offload, hardware.peak_tflops, hardware.efficiency, hardware.bandwidths,
                           rank_params)
    fits = max(stage.peak for stage in stages) <= hardware.usable_bytes
    return Plan(layout, config, stages, time, fits)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(num_gpus, global_batch, max_micro_batch=64):
    for tp in _divisors(num_gpus):
        for pp in _divisors(num_gpus // tp):
            dp = num_gpus // (tp * pp)
            per_rank = global_batch // dp if global_batch % dp == 0 else 0
            micros = [m for m in _divisors(per_rank) if m <= max_micro_batch] if per_rank else [1]
            for zero, micro, ckpt, offload in itertools.product((0, 1, 2, 3), micros, (False, True), (False, True)):
                yield Layout(tp, pp, dp, zero, micro, ckpt, offload)


def plan_all(args, user_json, hardware, global_batch, tokenizer_vocab_size):
    """(plans sorted: what fits by predicted tokens/s, then the rest by memory; {refusal message: count})."""
    plans, refused = [], {}
    for layout in candidates(hardware.num_gpus, global_batch):
        try:
            config, ds_config = resolve_layout(args, user_json, layout, global_batch, tokenizer_vocab_size)
        except ValueError as err:
            refused[str(err)] = refused.get(str(err), 0) + 1
            continue
        plans.append(evaluate(config, hardware, ds_config))
    plans.sort(key=lambda p: (not p.fits, -p.time.tokens_per_second if p.fits else p.peak, p.peak))
    return plans, refused


def why_slower(best, other):
    """The part of `other`'s predicted step that grows most against `best`'s, in words."""
    parts = {
        "its tensor-parallel all-reduces": other.time.tp_comm - best.time.tp_comm,
        "the pipeline bubble and sends": (other.time.bubble * other.time.seconds + other.time.pp_comm)
        - (best.time.bubble * best.time.seconds + best.time.pp_comm),
        "data-parallel gradient traffic": other.time.dp_comm - best.time.dp_comm,
        "the CPU optimizer step": other.time.offload - best.time.offload,
        "recomputing activations": other.time.compute - best.time.compute,
    }
    name, seconds = max(parts.items(), key=lambda kv: kv[1])
    return f"{name} (+{seconds:.2f} s per step)" if seconds > 0 else "the same work, scheduled worse"


def recommendation(plans, hardware, own=None) -> Optional[str]:
    """One sentence on the fastest layout that fits, against the fastest one of other parallel sizes or ZeRO
    stage and against the launch line's own (`own`, a Plan) when that is another layout (None: nothing fits)."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return None
    best = fitting[0]
    sentence = (f"Recommended: {best.layout.short()} ({best.layout.flags()}): predicted "
                f"{best.peak / memory.GIB:.1f} of {hardware.gpu_memory_gib:g} GiB per GPU and "
                f"{best.time.tokens_per_second:,.0f} tokens/s, the fastest of {len(fitting)} layouts that fit")
    shape = (best.layout.tp, best.layout.pp, best.layout.zero_stage)
    others = [p for p in fitting if (p.layout.tp, p.layout.pp, p.layout.zero_stage) != shape]
    compared = [(others[0], "the fastest other layout")] if others else []
    if own is not None and own.layout != best.layout:
        compared.append((own, "your launch line"))
    for plan, label in compared:
        slower = 100 * (1 - plan.time.tokens_per_second / best.time.tokens_per_second)
        verdict = f"{slower:.0f}% slower, mostly {why_slower(best, plan)}" if slower > 0.5 else "as fast"
        fits = "" if plan.fits else f", and needs {plan.peak / memory.GIB:.1f} GiB"
        sentence += f"; {label}, {plan.layout.short()}, is {verdict}{fits}"
    return sentence + "."


def best_fitting(config, gpu_memory_bytes, cuda=True, ds_config=None, device_name=None):
    """The fastest layout that fits on config's world size and model with GPUs of gpu_memory_bytes (the published
    figures of the GPU kind device_name names, H100's by default, and the default efficiency), or None. For
    pretrain_bloom.py's warning and out-of-memory hint."""
    spec = speed.spec_for_device(device_name)
    hardware = Hardware(config.parallel.world_size, gpu_memory_bytes / memory.GIB, spec["tflops"],
                        speed.DEFAULT_EFFICIENCY, speed.bandwidths_from(spec), cuda=cuda)
    best = None
    for layout in candidates(config.parallel.world_size, config.training.global_batch_size):
        try:
            candidate = dataclasses.replace(
                config, model=dataclasses.replace(config.model, tensor_model_parallel_size=layout.tp,
                                                  checkpoint_activations=layout.checkpoint_activations),
                parallel=dataclasses.replace(config.parallel, tensor_model_parallel_size=layout.tp,
                                             pipeline_model_parallel_size=layout.pp),
                training=dataclasses.replace(config.training, micro_batch_size=layout.micro_batch,
                                             data_parallel_size=layout.dp, zero_stage=layout.zero_stage,
                                             cpu_offload=layout.cpu_offload, partition_activations=False))
        except ValueError:
            continue
        plan = evaluate(candidate, hardware, ds_config)
        if plan.fits and (best is None or plan.time.tokens_per_second > best.time.tokens_per_second):
            best = plan
    return best
