"""Checkpoint loading: resume from --load (same layout or another), weights alone, and the LR-schedule change warning.

Same layout (TP, PP, DP, ZeRO stage, precision): the weights from the model shards, then each parameter's
optimizer state region by region from this rank's files (megatron/checkpoint/optimizer_state.py): the exact path.

Another layout (or precision): of each tensor this rank reads only its new TP slice, from the saved slices that
overlap it; the optimizer state is read per parameter through the index files (megatron/checkpoint/
saved_optimizer.py), whatever wrapper wrote it, only each local slot's region (a ZeRO partition), and written into
this run's wrapper (optimizer_state.restore_from_parameters); the step count, LR schedule, step counters, fp16
loss scale and consumed samples carry over; the per-rank RNG states do not (they belong to the old ranks). One warning names both layouts.
Checkpoints converted offline (tools/convert_checkpoint.py, megatron/checkpoint/universal.py: meta.json's
"optimizer_format": "parameters") always take this path, whatever the layout. Checkpoints without index files
load the weights alone and restart the optimizer (a warning); a precision change takes the per-parameter
path (fp32 moments, and the fp32 master where one was saved). Checkpoints written before
this layout (meta.json without "engine_state_version") hold DeepSpeed's own files and still load through
engine.load_checkpoint. An upstream Megatron-DeepSpeed folder (global_stepN/, megatron/checkpoint/upstream.py) is
resumed by upstream_resume.py.

Reads are proportional to what a rank holds, on any layout (megatron/checkpoint/reads.py): files are memory-mapped
and only the elements a rank needs are copied out; the index files are read once, by rank 0, and broadcast over the
verification's gloo group. The load-time log line gives the most bytes any rank read.
"""
import dataclasses
import functools
import logging
import math
import os
import time

import torch
import torch.distributed as dist

from megatron.checkpoint import optimizer_state
from megatron.checkpoint import reads, verify, zero3
from megatron.checkpoint.format import (CheckpointError, converted, has_parameter_index,
                                        layout_text, optimizer_name, partitioned_shard_name, read_meta,
                                        read_saved_config, rng_name, saved_layout_text)
from megatron.checkpoint.saved_optimizer import SavedOptimizer, read_indexes
from megatron.core.tensor_parallel.random import get_rng_tracker

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ResumeState:
    """Where training continues: the RNG states are applied by the loop once its data iterators exist
    (creating a DataLoader iterator draws from the default generator)."""
    iteration: int = 0
    consumed_samples: int = 0
    rng_state: dict = None
    finished: bool = False  # the checkpoint is the run's last: nothing was loaded, nothing is to be trained
    verify_seconds: float = None  # the ranks' shared checksum pass
    load_seconds: float = None  # reading the files into the engine, after verification
    load_bytes: int = None  # the most bytes any rank read to load (reads.py's count)


def set_rng_state(state):
    """Puts back save.rng_state()'s dict."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_rng_tracker().set_states(state["tracker"])


def _warn_once(message, *args):
    """A warning from global rank 0 only (every rank reaches the same conclusion)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning(message, *args)


def finished_message(meta, config):
    """One line when the checkpoint already holds the whole run (--train-iters, or --train-samples consumed),
    else None: relaunching a finished run writes nothing. Not asked with --finetune or --eval-only."""
    training, upstream = config.training, config.upstream
    if meta["iteration"] >= training.train_iters:
        return (f"--load {config.checkpoint.load}: the run is finished (checkpoint at iteration {meta['iteration']}, "
                f"--train-iters {training.train_iters}); nothing to train or save")
    if upstream.train_samples and meta["consumed_samples"] >= upstream.train_samples:
        return (f"--load {config.checkpoint.load}: the run is finished (checkpoint at {meta['consumed_samples']} "
                f"consumed samples, --train-samples {upstream.train_samples}); nothing to train or save")
    return None


def _read_engine_state(folder, tp_rank, pp_rank, dp_rank, mmap=False):
    """A rank's saved engine state (optimizer_state.collect's dict); mmap: its tensors mapped, not read."""
    path = os.path.join(folder, optimizer_name(tp_rank, pp_rank, dp_rank))
    if not os.path.isfile(path):
        raise CheckpointError(f"--load {folder}: {path} is missing although meta.json records the optimizer "
                              "state; the checkpoint is incomplete (load an older one, or pass --no-load-optim "
                              "to resume from the weights alone)")
    return reads.load_mapped(path) if mmap else torch.load(path, map_location="cpu", weights_only=False)


def shared_indexes(verifier, folder, meta):
    """saved_optimizer.read_indexes' dict, read by global rank 0 alone and broadcast over the verification's gloo
    group (verify.Verifier): each index file opened once, not by every rank (world x world opens on a layout
    change). Collective. An unreadable index raises the same error on every rank."""
    found = None
    if verifier.rank == 0:
        try:
            found = read_indexes(folder, meta)
        except (OSError, ValueError, KeyError) as err:
            found = err
    found = verifier.broadcast(found)
    if isinstance(found, Exception):
        raise found
    return found


def load_engine_state(engine, folder, state, verifier, load_optimizer=True, num_layers=None):
    """Restores each rank's optimizer state, LR schedule position, step counters and loss scale (optimizer_state)
    into an engine whose module holds the checkpoint's weights, saved on this layout: each parameter's region read
    from this TP rank's files of this stage (and the first stage's, for the tied embedding). --no-load-optim
    (load_optimizer=False) keeps the fresh optimizer and schedule and copies the weights into the fp32 master
    weights. Returns the saved LR scheduler state (None when not restored). state: the run's ParallelState;
    verifier: the verification's Verifier (its group shares the index files). Collective."""
    if not load_optimizer:
        optimizer_state.refresh_master_weights(engine)
        return None
    try:
        meta = read_meta(folder)
        source = SavedOptimizer(folder, meta, tp_ranks=[state.tp_rank], pp_ranks=sorted({0, state.pp_rank}),
                                indexes=shared_indexes(verifier, folder, meta))
        optimizer_state.restore_from_parameters(engine, source, num_layers, state.pp_rank,
                                                state.tensor_model_parallel_size, state.tp_rank)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"--load {folder}: its optimizer state is unreadable ({type(err).__name__}: {err}); "
                              "load another checkpoint, or pass --no-load-optim to restart the optimizer from the "
                              "weights") from None
    saved = _read_engine_state(folder, state.tp_rank, state.pp_rank, 0, mmap=True)  # counters, loss scale
    optimizer_state.restore_counters(engine, saved)
    optimizer_state.restore_loss_scale(engine, saved)
    return saved["lr_scheduler"]


def load_model_weights(module, folder, num_layers, state, zero_stage=0):
    """Loads our canonical shards into this rank's module. With the checkpoint's TP and PP sizes: the stage's own
    file and stage 0's (the tied embedding); with another PP size, every stage's file (the names are the whole
    model's); with another TP size, every TP rank's files. The files are memory-mapped, and of each tensor this
    rank holds only its TP slice is read, straight from the saved slices that overlap it (reads.read_slice): no
    whole tensor is assembled, and tensors of other stages are never read. Under ZeRO-3 each rank fills its own
    parts of the parameters, one parameter at a time, nothing gathered (zero3.load_partitions)."""
    from megatron.model.pipeline import canonical_name, is_pipeline_module, load_canonical_state_dict
    meta = read_meta(folder)
    tp = state.tensor_model_parallel_size
    saved_tp = meta.get("tensor_model_parallel_size") or tp
    saved_pp = meta.get("pipeline_model_parallel_size") or state.pipeline_model_parallel_size
    stages = sorted({0, state.pp_rank}) if saved_pp == state.pipeline_model_parallel_size else range(saved_pp)
    tp_ranks = [state.tp_rank] if saved_tp == tp else range(saved_tp)
    pieces, dims = {}, {}
    for pp in stages:
        for t in tp_ranks:
            shard = zero3.read_weights(folder, t, pp, lambda path: _read_shard(folder, path))
            for name in shard["weights"]:
                pieces.setdefault(name, {})[t] = shard["weights"]
                dims[name] = shard["partition_dims"].get(name)
    names = module.state_dict().keys()
    needed = {canonical_name(n, num_layers) for n in names} if is_pipeline_module(module) else set(names)
    live_dims = optimizer_state.canonical_partition_dims(module, num_layers) if saved_tp != tp else {}

    def weight(name):  # this rank's TP slice of tensor `name`, read when called (only that slice's bytes)
        by_rank = pieces[name]
        dim = dims[name] if dims[name] is not None else live_dims.get(name)  # older TP-1 shards record none
        saved_shape, dtype = zero3.tensor_spec(next(iter(by_rank.values())), name)
        try:
            shape = reads.slice_shape(list(saved_shape), dim, saved_tp, tp)
        except ValueError as err:
            raise CheckpointError(f"--load {folder}: {name} cannot be split for --tensor-model-parallel-size "
                                  f"{tp} ({err}); pick a TP size that divides it") from None
        flat, _ = reads.read_slice(lambda t, lo, hi: [(0, by_rank[t][name].reshape(-1))], list(saved_shape), dim,
                                   saved_tp, tp, state.tp_rank, 0, math.prod(shape), dtype)
        return flat.view(shape)

    wanted = [name for name in pieces if name in needed]
    if zero_stage == 3:
        own = os.path.join(folder, partitioned_shard_name(state.tp_rank, state.pp_rank, state.dp_rank))
        same_parts = saved_tp == tp and meta.get("data_parallel_size") == state.data_parallel_size
        zero3.load_partitions(module, {name: functools.partial(weight, name) for name in wanted},
                              _read_shard(folder, own) if same_parts and os.path.isfile(own) else None)
    else:
        load_canonical_state_dict(module, {name: weight(name) for name in wanted}, num_layers)


def _read_shard(folder, path):
    if not os.path.isfile(path):
        raise CheckpointError(f"--load {folder}: {path} is missing; the checkpoint is incomplete (load another one)")
    return reads.load_mapped(path, weights_only=True)


def load_checkpoint(engine, config, state):
    """Resumes from --load. Returns a ResumeState (all zero when there is nothing to load).

    Same layout (TP, PP, DP, ZeRO stage, precision) and an engine state: weights from the model shards, then each
    rank's optimizer state and LR schedule position (load_engine_state). Another layout with per-parameter index
    files: the weights and the optimizer state re-split (_restore_on_new_layout). Otherwise, or with --finetune,
    the weights alone. Checkpoints from before this layout (no "engine_state_version") go through DeepSpeed's
    engine.load_checkpoint.
    """
    ckpt = config.checkpoint
    from megatron.checkpoint.upstream import locate
    upstream_folder = locate(ckpt.load, universal=config.upstream.universal_checkpoint)
    if upstream_folder is not None:  # BigScience / Microsoft Megatron-DeepSpeed's layout
        from megatron.checkpoint import upstream_resume
        return ResumeState(*upstream_resume.resume(engine, config, state, upstream_folder))
    verifier = verify.Verifier(ckpt.checkpoint_verify_timeout_minutes)
    folder, verify_seconds = verify.choose_checkpoint(ckpt.load, ckpt.strict_load,
                                                      ckpt.checkpoint_verify_timeout_minutes, verifier)
    if folder is None:
        if ckpt.strict_load or ckpt.finetune:
            raise CheckpointError(f"--load {ckpt.load}: no complete checkpoint found")
        _warn_once("--load %s: no checkpoint found, starting from scratch", ckpt.load)
        return ResumeState()
    meta = read_meta(folder)
    message = None if ckpt.finetune or config.upstream.eval_only else finished_message(meta, config)
    if message:
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info("%s", message)
        return ResumeState(meta["iteration"], meta["consumed_samples"], finished=True)
    start = time.perf_counter()
    reads.reset()
    same_layout = (meta.get("deepspeed_state") and not converted(meta) and
                   meta["tensor_model_parallel_size"] == state.tensor_model_parallel_size and
                   meta["pipeline_model_parallel_size"] == state.pipeline_model_parallel_size and
                   meta["data_parallel_size"] == state.data_parallel_size and
                   meta.get("zero_stage", config.training.zero_stage) == config.training.zero_stage and
                   meta.get("precision", config.precision.name) == config.precision.name)
    layout_change = not ckpt.finetune and not same_layout and not ckpt.no_load_optim and \
        has_parameter_index(folder, meta)  # a precision change too: the index holds fp32 moments (and master)
    if layout_change:
        load_model_weights(engine.module, folder, config.model.num_layers, state, config.training.zero_stage)
        _restore_on_new_layout(engine, folder, meta, config, state, verifier)
        _warn_schedule_change(engine, folder, config)
    elif ckpt.finetune or not same_layout:
        load_model_weights(engine.module, folder, config.model.num_layers, state, config.training.zero_stage)
        optimizer_state.refresh_master_weights(engine)
        if ckpt.finetune:
            logger.info("loaded weights from %s for fine-tuning (iteration and optimizer restart)", folder)
            return ResumeState()
        _warn_once("loaded weights from %s; its layout (%s) differs or has no engine state, so the optimizer and "
                   "LR schedule restart", folder, saved_layout_text(meta))
    else:
        if "engine_state_version" not in meta:  # written by DeepSpeed's engine.save_checkpoint
            root, tag = os.path.split(os.path.normpath(folder))
            engine.load_checkpoint(root, tag=tag, load_optimizer_states=not ckpt.no_load_optim,
                                   load_lr_scheduler_states=not ckpt.no_load_optim)
            schedule_restored = not ckpt.no_load_optim
        else:
            load_model_weights(engine.module, folder, config.model.num_layers, state, config.training.zero_stage)
            schedule_restored = load_engine_state(engine, folder, state, verifier, not ckpt.no_load_optim,
                                                  config.model.num_layers) is not None
        if schedule_restored:
            _warn_schedule_change(engine, folder, config)
    rng_path = os.path.join(folder, rng_name(state.rank))
    rng = None
    if not ckpt.no_load_rng and not layout_change and os.path.isfile(rng_path):
        rng = reads.load_whole(rng_path)
    load_seconds = time.perf_counter() - start
    reads.write_report(state.rank, folder)
    load_bytes = verifier.maximum(reads.bytes_read())
    if verifier.rank == 0:
        logger.info("resumed from %s at iteration %d (verified in %.2f s, loaded in %.2f s, at most %.3f GB read "
                    "by one rank)", folder, meta["iteration"], verify_seconds, load_seconds, load_bytes / 1e9)
    return ResumeState(meta["iteration"], meta["consumed_samples"], rng, verify_seconds=verify_seconds,
                       load_seconds=load_seconds, load_bytes=load_bytes)


def _restore_on_new_layout(engine, folder, meta, config, state, verifier):
    """The optimizer state, step count, LR schedule position and step counters of a checkpoint saved on another
    layout (TP, PP, DP, ZeRO stage), per parameter through its index files (read once, shared_indexes); each
    rank reads only its slots' regions of its TP slices. The module holds the weights. Collective."""
    any_dp = converted(meta)  # one file per TP x PP rank, for any DP size and ZeRO stage
    before = saved_layout_text(meta)
    now = layout_text(state.tensor_model_parallel_size, state.pipeline_model_parallel_size,
                      state.data_parallel_size, config.training.zero_stage, config.precision.name)
    try:
        saved_meta = {**meta, "data_parallel_size": 1} if any_dp else meta
        source = SavedOptimizer(folder, saved_meta, indexes=shared_indexes(verifier, folder, saved_meta))
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"--load {folder}: its per-parameter optimizer index is unreadable ({err}); load "
                              "another checkpoint, or pass --no-load-optim to resume from the weights alone") from None
    try:
        optimizer_state.restore_from_parameters(engine, source, config.model.num_layers, state.pp_rank,
                                                state.tensor_model_parallel_size, state.tp_rank)
    except ValueError as err:
        raise CheckpointError(f"--load {folder}: {err}") from None
    saved = _read_engine_state(folder, 0, 0, 0, mmap=True)  # for the counters only: nothing read but them
    optimizer_state.restore_counters(engine, saved)
    optimizer_state.restore_loss_scale(engine, saved)
    _warn_once("resuming on another layout: the checkpoint was trained on %s, this run is %s (weights, optimizer "
               "state, LR schedule, loss scale and data position carried over; RNG states restart)", before, now)


# ---------------------------------------------------------------- the LR schedule's flags changed on resume


def _warn_schedule_change(engine, folder, config):
    if config.upstream.override_lr_scheduler or config.upstream.use_checkpoint_lr_scheduler or \
            config.upstream.sample_based_schedule:
        return  # the user chose where the schedule comes from; a sample-based one is not in iterations
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        message = schedule_change_message(read_saved_config(folder), config, scheduler.num_steps)
        if message:
            _warn_once("%s", message)


# The LR schedule's inputs (OptimizerConfig fields) and their flags. lr_decay_iters is --train-iters unless
# --lr-decay-iters is given, so a changed --train-iters moves the end of the decay.
_SCHEDULE_FLAGS = {"lr": "--lr", "min_lr": "--min-lr", "lr_decay_style": "--lr-decay-style",
                   "lr_decay_iters": "--lr-decay-iters", "lr_warmup_iters": "--lr-warmup-iters"}


def _short(value):
    """1.04e-4, 1e-6, 0, 20, cosine: values the way a command line spells them."""
    if isinstance(value, (str, int)):
        return str(value)
    if value == 0:
        return "0"
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


class _NoGroups:
    """An optimizer without parameter groups, to evaluate a schedule with AnnealingLR alone."""
    param_groups = ()


def schedule_change_message(saved_config, config, iteration):
    """One line naming the LR schedule flags whose values differ from the checkpoint's and what that does at the
    resume iteration; None when the schedule is the same (or the checkpoint has no config.json).

    The LR scheduler restores only its position (AnnealingLR.load_state_dict); its shape comes from the flags.
    """
    from megatron.optimizer import AnnealingLR
    if not saved_config or "optimizer" not in saved_config:
        return None
    new = dataclasses.asdict(config.optimizer)
    old = {**new, **{k: v for k, v in saved_config["optimizer"].items() if k in _SCHEDULE_FLAGS}}
    old_iters, new_iters = saved_config.get("training", {}).get("train_iters"), config.training.train_iters
    changed = [field for field in _SCHEDULE_FLAGS if old[field] != new[field]]
    if not changed:
        return None
    changes = []
    for field in changed:
        if field == "lr_decay_iters" and old_iters != new_iters and (old[field], new[field]) == (old_iters, new_iters):
            changes.append(f"--train-iters {old_iters} -> {new_iters}")  # the decay follows --train-iters
        else:
            changes.append(f"{_SCHEDULE_FLAGS[field]} {_short(old[field])} -> {_short(new[field])}")

    def lr_at(opt, step):
        return AnnealingLR(_NoGroups(), opt["lr"], opt["min_lr"], opt["lr_warmup_iters"], opt["lr_decay_iters"],
                           opt["lr_decay_style"]).get_lr(step)

    effects = []
    if "lr_warmup_iters" in changed:
        effects.append(f"the warmup now ends at iteration {new['lr_warmup_iters']}")
    if new["lr_decay_style"] == "constant":
        if "lr_decay_style" in changed:
            effects.append("the lr is now constant after the warmup")
    elif "lr_decay_iters" in changed or "lr_decay_style" in changed:
        effects.append(f"the {new['lr_decay_style']} decay now ends at iteration {new['lr_decay_iters']}")
    old_lr, new_lr = lr_at(old, iteration), lr_at(new, iteration)
    if old_lr != new_lr:
        effects.append(f"lr at iteration {iteration} is {_short(new_lr)} instead of {_short(old_lr)}")
    else:
        effects.append(f"lr at iteration {iteration} is still {_short(new_lr)}; later iterations differ")
    return f"resume: {', '.join(changes)} (checkpoint's value -> now): {'; '.join(effects)}"
