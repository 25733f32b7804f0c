"""Checkpoint saving: the collective save of one atomic iter_* folder, pruning, crash leftovers, --save checks.

Every tensor is stored once (megatron/checkpoint/optimizer_state.py): the weights only in the model shards
(DeepSpeed's engine.save_checkpoint would write them a second time, and under bf16 with pipeline parallelism the
optimizer state twice, then fail to load it); the optimizer state per parameter and region, without the fp32
master in fp32 runs (the weights are the master) and without the last stage's copy of the tied word embedding
(read from the first stage's files on load). Under ZeRO-3 every rank writes its own parts of the weights beside its
part of the optimizer state, nothing gathered (megatron/checkpoint/zero3.py); otherwise DP rank 0 alone copies and
writes the weights. The folder's files are described in megatron/checkpoint/format.py.

A save is two halves: snapshot() takes this rank's objects at the iteration boundary (for --async-save, copies in
host memory, megatron/checkpoint/async_save.py); write_and_publish() writes them, in the calling thread or in the
background. Its order, each step durable before the next (docs/FAULTS.md):
  1. rank 0 removes what a crash left (.tmp_* folders, .trash_* folders), creates <save>/.tmp_iter_N;
  2. every rank writes and fsyncs its files and reports each file's size and CRC32 (computed as the bytes pass);
  3. rank 0 gathers the reports, writes meta, config, tokenizer and the manifest (exactly the reported files),
     renames the folder to iter_N (io.replace_folder: if an iter_N is already there, it is swapped, never removed
     first), replaces `latest` atomically, then prunes (each old folder renamed to .trash_* before deletion).
A crash at any point leaves `latest` naming a complete, verified folder; the previous checkpoint is never moved.
A save that fails (disk full, permissions) removes its .tmp_* folder and raises CheckpointError on every rank;
`latest` and the older checkpoints are untouched.
"""
import contextlib
import copy
import dataclasses
import logging
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from megatron.checkpoint import optimizer_state, zero3
from megatron.checkpoint.format import (TMP_PREFIX, TRASH_PREFIX, CheckpointError, index_name, iteration_of,
                                        list_checkpoints, optimizer_name, partitioned_shard_name, read_latest,
                                        rng_name, shard_name, tag_for)
from megatron.checkpoint.io import (crash_point, file_entry, fsync_dir, remove_durably, replace_folder,
                                    torch_save_synced, write_json_atomic, write_manifest, write_text_atomic,
                                    write_text_synced)
from megatron.core.parallel_state import comm_device
from megatron.core.tensor_parallel.random import get_rng_tracker

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Comm:
    """Where a save's collectives run: the world on the training device (a save in the training thread), or a
    gloo group of its own on the host (a background save, async_save.py)."""
    group: object = None
    device: object = None


def _agree_on_failure(error, state, comm=None):
    """Collective: the lowest rank whose step failed (None when none did). Doubles as a barrier."""
    if not dist.is_initialized():
        return None if error is None else state.rank
    comm = comm or Comm()
    flag = torch.tensor([state.rank if error is not None else state.world_size], dtype=torch.int64,
                        device=comm.device or comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=comm.group)
    failed = int(flag.item())
    return None if failed == state.world_size else failed


def model_shard(module, num_layers, pp_rank=0, host=None):
    """{"weights": canonical name -> CPU tensor, "partition_dims": name -> dim or None} for this rank (the dim
    along which the owning tensor-parallel layer splits the tensor, recorded at every TP size). The word
    embedding is kept on the first pipeline stage only (the last stage's tied copy holds the same). Under ZeRO-3,
    this rank's parts of the weights instead (zero3.partition_shard: nothing gathered).
    host: an async_save.HostBuffers to copy into (pinned, reused across saves); None: fresh copies."""
    from megatron.model.pipeline import canonical_name, is_pipeline_module
    named = []
    split_dims = optimizer_state.partition_dims(module)
    for name, param in module.named_parameters():
        canonical = canonical_name(name, num_layers) if is_pipeline_module(module) else name
        if canonical is not None and not (canonical.startswith("embedding.") and pp_rank != 0):
            named.append((canonical, param))
    dims = {canonical: split_dims.get(id(param)) for canonical, param in named}
    if named and zero3.is_zero3_parameter(named[0][1]):
        return zero3.partition_shard(named, dims, host)
    weights = {canonical: host.copy(("weights", canonical), param.detach()) if host is not None else
               param.detach().to("cpu", copy=True) for canonical, param in named}
    return {"weights": weights, "partition_dims": dims}


def rng_state():
    """This rank's CPU, CUDA and model-parallel RNG states (load.set_rng_state puts them back)."""
    state = {"cpu": torch.get_rng_state(), "tracker": get_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _host_copy(obj, host, key=()):
    """obj with every tensor copied into host memory (host.copy), containers rebuilt, other leaves deep-copied:
    nothing in the result changes when training goes on."""
    if torch.is_tensor(obj):
        return host.copy(key, obj.detach())
    if isinstance(obj, dict):
        return type(obj)((k, _host_copy(v, host, key + (k,))) for k, v in obj.items()) \
            if type(obj).__name__ in ("dict", "OrderedDict") else copy.deepcopy(obj)
    if type(obj) in (list, tuple):
        return type(obj)(_host_copy(v, host, key + (i,)) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def snapshot(engine, config, state, host=None):
    """This rank's files to write, {file name: object} (a str is written as text, anything else with
    torch.save): its optimizer state and index (unless --no-save-optim), its model shard (DP rank 0; under
    ZeRO-3 every rank its parts), its RNG states. host (an async_save.HostBuffers): every tensor copied into host
    memory first, so that training may go on while a background thread writes them."""
    objects = {}
    if not config.checkpoint.no_save_optim:  # --no-save-optim: weights only (our shards), no engine state
        collected = optimizer_state.collect(engine, config.model.num_layers, state.pp_rank, state.dp_rank)
        if collected is not None:
            saved, index = collected
            name = optimizer_name(state.tp_rank, state.pp_rank, state.dp_rank)
            objects[name] = _host_copy(saved, host, (name,)) if host is not None else saved
            objects[index_name(state.tp_rank, state.pp_rank, state.dp_rank)] = index
            del saved, collected
    if config.training.zero_stage == 3:  # every rank its own parts of the weights, nothing gathered
        objects[partitioned_shard_name(state.tp_rank, state.pp_rank, state.dp_rank)] = model_shard(
            engine.module, config.model.num_layers, state.pp_rank, host)
    elif state.dp_rank == 0:  # the weights are whole on every DP rank: DP rank 0's serve all
        objects[shard_name(state.tp_rank, state.pp_rank)] = model_shard(engine.module, config.model.num_layers,
                                                                        state.pp_rank, host)
    name = rng_name(state.rank)
    objects[name] = _host_copy(rng_state(), host, (name,)) if host is not None else rng_state()
    if host is not None:
        host.synchronize()
    return objects


def write_objects(objects, folder):
    """Writes snapshot()'s objects into folder, each fsynced. Returns {file name: {"size", "crc32"}}, computed
    as the bytes pass (what this rank reports for the manifest)."""
    written = {}
    for name in sorted(objects):
        obj, path = objects[name], os.path.join(folder, name)
        written[name] = write_text_synced(obj, path) if isinstance(obj, str) else torch_save_synced(obj, path)
    return written


def clean_root(root):
    """Rank 0, before a save: removes what a crash left in root: .tmp_* (saves that did not finish) and
    .trash_* (folders being deleted). The one exception is a .trash_<tag> whose <tag> is missing while `latest`
    names it (a crash between the two renames of io.replace_folder's fallback): renamed back, never deleted.
    Returns the names removed."""
    if not os.path.isdir(root):
        return []
    latest = read_latest(root)
    removed = []
    for name in sorted(n for n in os.listdir(root) if n.startswith(TRASH_PREFIX)):
        path, tag = os.path.join(root, name), name[len(TRASH_PREFIX):]
        if tag == latest and not os.path.lexists(os.path.join(root, tag)):
            os.replace(path, os.path.join(root, tag))
            fsync_dir(root)
            logger.warning("restored %s (`latest` names it) from %s, left by a crash while replacing it", tag, path)
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
        removed.append(name)
        logger.warning("removed %s, left by a crash while deleting it", path)
    return removed + remove_stale_tmp(root)


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


def _publish(root, tmp, tag, meta, config, tokenizer, written):
    """Rank 0: meta, config, tokenizer and the manifest of `written` (every rank's report, plus these) into
    tmp, then tmp renamed to root/tag and `latest` replaced, each step durable before the next."""
    written = dict(written)
    written["meta.json"] = write_json_atomic(os.path.join(tmp, "meta.json"), meta)
    written["config.json"] = write_json_atomic(os.path.join(tmp, "config.json"), dataclasses.asdict(config))
    if tokenizer is not None:
        folder = os.path.join(tmp, "tokenizer")
        tokenizer.save_pretrained(folder)
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            written[os.path.join("tokenizer", name)] = file_entry(path)
        fsync_dir(folder)
    write_manifest(tmp, meta["iteration"], written)
    crash_point("manifest written")
    replace_folder(tmp, os.path.join(root, tag))
    write_text_atomic(os.path.join(root, "latest"), tag)
    crash_point("latest replaced")


def save_checkpoint(engine, config, state, iteration, consumed_samples, tokenizer=None, on_written=None):
    """Collective: every rank calls it; state is the run's core.parallel_state.ParallelState. Returns the final
    folder. snapshot() then write_and_publish() in this thread."""
    return write_and_publish(snapshot(engine, config, state), config, state, iteration, consumed_samples,
                             tokenizer, on_written)[0]


def write_and_publish(objects, config, state, iteration, consumed_samples, tokenizer=None, on_written=None,
                      comm=None):
    """Collective over comm (the world by default): writes snapshot()'s objects and publishes the folder.

    Three steps, each closed by an all-reduce of a failure flag so that every rank raises together:
    rank 0 prepares <save>/.tmp_iter_N; every rank writes and fsyncs its files; rank 0 gathers every rank's
    report of what it wrote, writes meta, config, tokenizer and the manifest, renames the folder to iter_N,
    replaces `latest`, then prunes. on_written(folder), when given, runs on every rank once it has written its
    files into the temporary folder (an OSError it raises fails the save as a write error would).
    Returns (the final folder, this rank's bytes written).
    """
    comm = comm or Comm()
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
            clean_root(root)
            os.makedirs(tmp)
        except OSError as err:
            error = err
    failed = _agree_on_failure(error, state, comm)
    if failed is not None:
        fail("creating the temporary folder", failed, error)

    error, written = None, {}  # file name -> manifest entry, for the files this rank wrote
    try:
        written = write_objects(objects, tmp)
        crash_point("rank files written")
        if on_written is not None:
            on_written(tmp)
    except OSError as err:
        error = err
    failed = _agree_on_failure(error, state, comm)
    if failed is not None:
        fail("writing its files", failed, error)
    mine = sum(entry["size"] for entry in written.values())
    if dist.is_initialized():  # what every rank reports it wrote, to rank 0
        everyone = [None] * dist.get_world_size() if state.rank == 0 else None
        dist.gather_object(written, everyone, dst=0, group=comm.group)
        if state.rank == 0:
            written = {}
            for part in everyone:
                duplicate = set(written) & set(part)
                assert not duplicate, f"two ranks wrote {sorted(duplicate)}"
                written.update(part)

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
    failed = _agree_on_failure(error, state, comm)
    if failed is not None:
        fail("writing the manifest", failed, error)
    if state.rank == 0:
        prune(root, config.checkpoint.keep_last_n_checkpoints, tag)
        logger.info("saved checkpoint %s", os.path.join(root, tag))
    if dist.is_initialized():
        dist.barrier(group=comm.group)
    return os.path.join(root, tag), mine


def prune(root, keep, current):
    """Keeps the newest `keep` complete checkpoints up to `current` (the one just saved, never removed). Each
    folder removed is first renamed to its .trash_* name (io.remove_durably): never deleted in place.

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
            remove_durably(os.path.join(root, tag))
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
