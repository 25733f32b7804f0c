"""Checkpoint saving: the collective save of one atomic iter_* folder, pruning, stale .tmp_* removal, --save checks.

Every tensor is stored once (megatron/checkpoint/optimizer_state.py): the weights only in the model shards
(DeepSpeed's engine.save_checkpoint would write them a second time, and under bf16 with pipeline parallelism the
optimizer state twice, then fail to load it); the optimizer state per parameter and region, without the fp32
master in fp32 runs (the weights are the master) and without the last stage's copy of the tied word embedding
(read from the first stage's files on load). The folder's files are described in megatron/checkpoint/format.py.

Crash safety (docs/FAULTS.md): every rank fsyncs what it wrote before rank 0 writes the manifest, so a folder
named iter_* is complete unless the disk itself lost data, which the manifest's sizes and CRC32s then catch on
--load. A .tmp_* folder left by a crash is never loaded and is removed by the next save. A save that fails
(disk full, permissions) removes its .tmp_* folder and raises CheckpointError; `latest` and the older
checkpoints are untouched.
"""
import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from megatron.checkpoint import optimizer_state
from megatron.checkpoint.format import (TMP_PREFIX, CheckpointError, index_name, iteration_of, list_checkpoints,
                                        optimizer_name, read_latest, rng_name, shard_name, tag_for)
from megatron.checkpoint.io import (fsync_dir, fsync_tree, torch_save_synced, write_json_atomic, write_manifest,
                                    write_text_atomic, write_text_synced)
from megatron.core.parallel_state import comm_device
from megatron.core.tensor_parallel.random import get_rng_tracker

logger = logging.getLogger(__name__)


def _agree_on_failure(error, state):
    """Collective: the lowest rank whose step failed (None when none did). Doubles as a barrier."""
    if not dist.is_initialized():
        return None if error is None else state.rank
    flag = torch.tensor([state.rank if error is not None else state.world_size], dtype=torch.int64,
                        device=comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    failed = int(flag.item())
    return None if failed == state.world_size else failed


def _gathered(module, zero_stage):
    """Context in which ZeRO-3 parameters are whole on every rank (a no-op below stage 3)."""
    if zero_stage == 3:
        import deepspeed
        return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


def model_shard(module, num_layers, zero_stage=0, pp_rank=0):
    """{"weights": canonical name -> CPU tensor, "partition_dims": name -> dim or None} for this rank (the dim
    along which the owning tensor-parallel layer splits the tensor, recorded at every TP size). The word
    embedding is kept on the first pipeline stage only (the last stage's tied copy holds the same)."""
    from megatron.model.pipeline import canonical_name, is_pipeline_module
    weights, dims = {}, {}
    split_dims = optimizer_state.partition_dims(module)
    with _gathered(module, zero_stage):
        for name, param in module.named_parameters():
            canonical = canonical_name(name, num_layers) if is_pipeline_module(module) else name
            if canonical is None or (canonical.startswith("embedding.") and pp_rank != 0):
                continue
            weights[canonical] = param.detach().to("cpu", copy=True)
            dims[canonical] = split_dims.get(id(param))
    return {"weights": weights, "partition_dims": dims}


def rng_state():
    """This rank's CPU, CUDA and model-parallel RNG states (load.set_rng_state puts them back)."""
    state = {"cpu": torch.get_rng_state(), "tracker": get_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def remove_stale_tmp(root):
    """Removes .tmp_* folders and files left in root by a save that crashed. Returns their names."""
    stale = sorted(n for n in os.listdir(root) if n.startswith(TMP_PREFIX)) if os.path.isdir(root) else []
    for name in stale:
        path = os.path.join(root, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
        logger.warning("removed %s, left by a save that did not finish", path)
    return stale


def _write_rank_files(engine, config, tmp, state):
    """This rank's files in tmp, each fsynced: its optimizer state and index (unless --no-save-optim), its model
    shard (DP rank 0), its RNG states. Returns {file name: manifest entry}."""
    written = {}
    if not config.checkpoint.no_save_optim:  # --no-save-optim: weights only (our shards), no engine state
        collected = optimizer_state.collect(engine, config.model.num_layers, state.pp_rank, state.dp_rank)
        if collected is not None:
            saved, index = collected
            name = optimizer_name(state.tp_rank, state.pp_rank, state.dp_rank)
            written[name] = torch_save_synced(saved, os.path.join(tmp, name))
            del saved, collected
            name = index_name(state.tp_rank, state.pp_rank, state.dp_rank)
            written[name] = write_text_synced(index, os.path.join(tmp, name))
    shard = model_shard(engine.module, config.model.num_layers, config.training.zero_stage, state.pp_rank)
    if state.dp_rank == 0:
        name = shard_name(state.tp_rank, state.pp_rank)
        written[name] = torch_save_synced(shard, os.path.join(tmp, name))
    del shard
    name = rng_name(state.rank)
    written[name] = torch_save_synced(rng_state(), os.path.join(tmp, name))
    return written


def _publish(root, tmp, tag, meta, config, tokenizer, written):
    """Rank 0: meta, config, tokenizer and the manifest into tmp, then tmp renamed to root/tag and `latest`
    replaced, each step durable before the next."""
    write_json_atomic(os.path.join(tmp, "meta.json"), meta)
    write_json_atomic(os.path.join(tmp, "config.json"), dataclasses.asdict(config))
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
    fsync_tree(tmp)
    write_manifest(tmp, meta["iteration"], written)
    fsync_dir(tmp)
    final = os.path.join(root, tag)
    if os.path.isdir(final):  # an older run's folder of the same iteration: set aside, then replaced
        os.replace(final, os.path.join(root, TMP_PREFIX + "old_" + tag))
    os.replace(tmp, final)
    write_text_atomic(os.path.join(root, "latest"), tag)
    fsync_dir(root)


def save_checkpoint(engine, config, state, iteration, consumed_samples, tokenizer=None, on_written=None):
    """Collective: every rank calls it; state is the run's core.parallel_state.ParallelState. Returns the final
    folder.

    Three steps, each closed by an all-reduce of a failure flag so that every rank raises together:
    rank 0 prepares <save>/.tmp_iter_N; every rank writes and fsyncs its files; rank 0 writes meta, config,
    tokenizer and the manifest, renames the folder to iter_N, replaces `latest`, then prunes.
    on_written(folder), when given, runs on every rank once it has written its files into the temporary folder
    (an OSError it raises fails the save as a write error would).
    """
    root = config.checkpoint.save
    tag = tag_for(iteration)
    tmp = os.path.join(root, TMP_PREFIX + tag)
    previous = read_latest(root) if state.rank == 0 else None

    def fail(step, failed_rank, error):
        if state.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = f"{type(error).__name__}: {error}" if error is not None else f"see rank {failed_rank}'s error"
        raise CheckpointError(
            f"--save {root}: writing checkpoint {tag} failed on rank {failed_rank} while {step} ({cause}); "
            f"the partial folder was removed and `latest` still names {previous or 'the previous checkpoint'}. "
            f"Free space or fix permissions under {root}, then relaunch with --load {root}") from error

    error = None
    if state.rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            remove_stale_tmp(root)
            os.makedirs(tmp)
        except OSError as err:
            error = err
    failed = _agree_on_failure(error, state)
    if failed is not None:
        fail("creating the temporary folder", failed, error)

    error, written = None, {}  # file name -> manifest entry, for the files this rank wrote
    try:
        written = _write_rank_files(engine, config, tmp, state)
        if on_written is not None:
            on_written(tmp)
    except OSError as err:
        error = err
    failed = _agree_on_failure(error, state)
    if failed is not None:
        fail("writing its files", failed, error)
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, written)
        written = {name: entry for part in everyone for name, entry in part.items()}

    error = None
    if state.rank == 0:
        meta = {"iteration": iteration, "consumed_samples": consumed_samples,
                "tensor_model_parallel_size": state.tensor_model_parallel_size,
                "pipeline_model_parallel_size": state.pipeline_model_parallel_size,
                "data_parallel_size": state.data_parallel_size, "zero_stage": config.training.zero_stage,
                "precision": config.precision.name, "deepspeed_state": not config.checkpoint.no_save_optim,
                "engine_state_version": optimizer_state.FORMAT}
        try:
            _publish(root, tmp, tag, meta, config, tokenizer, written)
        except OSError as err:
            error = err
    failed = _agree_on_failure(error, state)
    if failed is not None:
        fail("writing the manifest", failed, error)
    if state.rank == 0:
        shutil.rmtree(os.path.join(root, TMP_PREFIX + "old_" + tag), ignore_errors=True)
        prune(root, config.checkpoint.keep_last_n_checkpoints, tag)
        logger.info("saved checkpoint %s", os.path.join(root, tag))
    if dist.is_initialized():
        dist.barrier()
    return os.path.join(root, tag)


def prune(root, keep, current):
    """Keeps the newest `keep` complete checkpoints up to `current` (the one just saved, never removed).

    Folders numbered above `current` belong to a run that was abandoned (this one resumed from an older
    checkpoint): they are left alone and named in a warning.
    """
    current_iter = iteration_of(current)
    tags = list_checkpoints(root)
    newer = [t for t in tags if iteration_of(t) > current_iter]
    if newer:
        logger.warning("%s holds checkpoints newer than %s from an earlier run (%s); `latest` names %s",
                       root, current, ", ".join(newer), current)
    if not keep:
        return
    older = [t for t in tags if iteration_of(t) <= current_iter]
    for tag in older[keep:]:
        if tag != current:
            shutil.rmtree(os.path.join(root, tag), ignore_errors=True)
            logger.info("pruned checkpoint %s (--keep-last-n-checkpoints %d)", tag, keep)


def check_save_dir(root, needed_bytes):
    """Start-up check of --save: creatable, writable, and with room for one more checkpoint. Returns the free
    bytes. Raises ValueError with a one-line message naming --save."""
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=TMP_PREFIX + "probe_") as f:
            f.write(b"0")
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise ValueError(f"--save {root} is not writable ({type(err).__name__}: {err}); pass a folder this "
                         "user can create and write") from None
    free = shutil.disk_usage(root).free
    if free < needed_bytes:
        raise ValueError(f"--save {root}: {free / 2**30:.2f} GiB free, a checkpoint needs about "
                         f"{needed_bytes / 2**30:.2f} GiB (weights + optimizer state); free space, "
                         "lower --keep-last-n-checkpoints or point --save elsewhere")
    return free
