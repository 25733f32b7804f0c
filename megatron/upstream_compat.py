"""BigScience's Megatron-DeepSpeed (BLOOM's tr11 recipe) flags: the pure rules behind them, and the TP sync.

    batch-size ramp-up (--rampup-batch-size START INCREMENT RAMP_SAMPLES, upstream's semantics):
        increments = (global - START) / INCREMENT,   samples per increment = RAMP_SAMPLES / increments
        batch(consumed) = START + floor(consumed / samples per increment) * INCREMENT   while consumed <= RAMP_SAMPLES,
                          global                                                        after
    iterations of a --train-samples run with ramp-up: one per step while consumed <= RAMP_SAMPLES, then
        (train samples - consumed) // global
    sample-based LR schedule (--lr-warmup-samples, --lr-decay-samples): the schedule of megatron/optimizer/
        lr_schedule.py over consumed samples instead of iterations (each step advances it by its global batch);
        --lr-decay-samples defaults to --train-samples (or train iterations x global batch).

Pure except sync_tp_duplicated_parameters (torch.distributed), which averages over the tensor-parallel group the
parameters every TP rank holds a copy of (LayerNorms, the row-parallel biases), as upstream's
--sync-tp-duplicated-parameters does against bf16 drift.
"""
import os

# --pp-partition-method: upstream's layer class names -> this project's PipelineModule classes
_PARTITION_TYPES = {"transformer": "BloomBlockPipe", "embedding": "EmbeddingPipe"}
# upstream's flags refused in one line when given; arguments.py declares them from this table (they set no field)
NOT_SUPPORTED = {
    "train_weighted_split_paths_path": "--train-weighted-split-paths-path",
    "valid_weighted_split_paths_path": "--valid-weighted-split-paths-path",
    "test_weighted_split_paths_path": "--test-weighted-split-paths-path",
}


def rampup_global_batch(consumed_samples, start, increment, ramp_samples, global_batch):
    """The global batch of the step that begins after consumed_samples (upstream's ramp-up)."""
    if consumed_samples > ramp_samples:
        return global_batch
    increments = (global_batch - start) // increment
    if increments == 0:
        return global_batch
    per_increment = ramp_samples / increments
    return min(global_batch, start + int(consumed_samples / per_increment) * increment)


def rampup_train_iters(train_samples, start, increment, ramp_samples, global_batch):
    """Iterations of a --train-samples run with ramp-up (the ramp's steps, then full batches)."""
    iterations = consumed = 0
    while consumed <= ramp_samples:
        consumed += rampup_global_batch(consumed, start, increment, ramp_samples, global_batch)
        iterations += 1
    return iterations + max(0, train_samples - consumed) // global_batch


def check_rampup(rampup, training):
    """ValueError naming --rampup-batch-size when its values do not fit the batch arithmetic."""
    start, increment, ramp_samples = rampup
    per_step = training.micro_batch_size * training.data_parallel_size
    flag = f"--rampup-batch-size {start} {increment} {ramp_samples}"
    if training.train_samples is None:
        raise ValueError(f"{flag} needs --train-samples (upstream ramps the batch size only in sample-based runs); "
                         "pass --train-samples instead of --train-iters")
    if start < 1 or increment < 1 or ramp_samples < 0:
        raise ValueError(f"{flag}: start and increment must be positive, the ramp-up samples not negative")
    if start > training.global_batch_size:
        raise ValueError(f"{flag}: the start batch is larger than --global-batch-size {training.global_batch_size}")
    if (training.global_batch_size - start) % increment:
        raise ValueError(f"{flag}: --global-batch-size {training.global_batch_size} minus the start batch is not a "
                         f"multiple of the increment {increment}")
    for name, value in (("start batch", start), ("increment", increment)):
        if value % per_step:
            raise ValueError(f"{flag}: the {name} {value} is not a multiple of --micro-batch-size "
                             f"{training.micro_batch_size} x data-parallel size {training.data_parallel_size} = "
                             f"{per_step}")


def schedule_lengths(upstream, optimizer, training):
    """(warmup, decay, unit) of the LR schedule: in iterations from OptimizerConfig, or in samples with
    --lr-warmup-samples / --lr-decay-samples (decay default: --train-samples, else iterations x global batch)."""
    if not upstream.sample_based_schedule:
        return optimizer.lr_warmup_iters, optimizer.lr_decay_iters, "iterations"
    decay = upstream.lr_decay_samples or upstream.train_samples or training.train_samples or \
        training.train_iters * training.global_batch_size
    return upstream.lr_warmup_samples or 0, decay, "samples"


def pipeline_partition_method(value):
    """DeepSpeed's PipelineModule partition_method for upstream's --pp-partition-method value (type:transformer,
    type:transformer|embedding, parameters, uniform)."""
    if value in ("parameters", "uniform"):
        return value
    if value.startswith("type:"):
        names = value[len("type:"):].split("|")
        unknown = [n for n in names if n.lower() not in _PARTITION_TYPES]
        if not unknown:
            return "type:" + "|".join(_PARTITION_TYPES[n.lower()] for n in names)
    raise ValueError(f"--pp-partition-method {value} is not one of parameters, uniform, type:transformer, "
                     "type:transformer|embedding")


def refused_flag(values):
    """The one-line ConfigError for a given flag this project does not implement, or None."""
    from megatron.config import ConfigError
    for dest, flag in NOT_SUPPORTED.items():
        if values.get(dest):
            return ConfigError(f"{flag} is not supported: per-dataset split ranges of upstream's weighted split "
                               "paths are not implemented here; blend whole datasets with --data-path W1 PREFIX1 "
                               "W2 PREFIX2 and one --split for all")
    return None


def kill_switch_present(path):
    return bool(path) and os.path.exists(path)


def sync_tp_duplicated_parameters(engine, tp_group):
    """Averages over tp_group every parameter that each TP rank holds whole (no tensor_model_parallel attribute),
    and the fp32 master copy where the optimizer keeps one (ZeRO, BF16_Optimizer), so the copies cannot drift."""
    import torch
    import torch.distributed as dist
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    size = dist.get_world_size(tp_group)
    with torch.no_grad():
        for param in engine.module.parameters():
            if getattr(param, "tensor_model_parallel", False):
                continue
            if hasattr(param, "_hp_mapping"):  # collective over DP (also where this rank holds no fragment)
                from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param
                master = safe_get_full_fp32_param(param)
                dist.all_reduce(master, group=tp_group)
                safe_set_full_fp32_param(param, master / size)
            data = param.data.float()
            dist.all_reduce(data, group=tp_group)
            param.data.copy_(data / size)
