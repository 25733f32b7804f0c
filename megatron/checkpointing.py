"""Checkpoints: atomic folders with a manifest, our canonical weight shards and each rank's optimizer state.

Layout of <save>/iter_0000100/ (written under <save>/.tmp_iter_0000100/ and renamed when complete):

    model_tp00_pp000.pt     weights of (TP rank, PP stage) under BloomModel's names, with each tensor's
                            partition dim; what tools/merge_mp_partitions.py, --finetune and resuming read
    optimizer_tp00_pp000_dp00000.pt
                            the engine state of (TP rank, PP stage, DP rank): DeepSpeed's optimizer wrapper's
                            state_dict() (fp32 master weights under bf16/fp16, Adam's moments, the loss scaler;
                            a ZeRO partition per DP rank, one file for the DP group when the state is replicated),
                            the LR schedule's position and the engine's step counters. No model weights.
    index_tp00_pp000_dp00000.json
                            beside each optimizer file: where each parameter's state (fp32 master, Adam's
                            moments) lies in it, under BloomModel's names, with the partition dim its
                            tensor-parallel layer sets (megatron/checkpoint_format.py); no tensors
    rng_rank00000.pt        per-rank CPU/CUDA/model-parallel RNG states
    tokenizer/              the tokenizer, saved with save_pretrained
    config.json             the resolved run config
    meta.json               iteration, consumed samples, topology, precision
    manifest.json           written last: every file's size and CRC32

Every tensor is stored once (megatron/engine_state.py): the weights only in the model shards (DeepSpeed's
engine.save_checkpoint would write them a second time, and under bf16 with pipeline parallelism the optimizer
state twice, then fail to load it); in fp32, ZeRO's fp32 partitions (equal to the weights) are rebuilt from the
loaded weights; with PP > 1 the optimizer state of the last stage's copy of the tied word embedding is sent from
the first stage on load. Per parameter: 4 + 8 bytes (fp32 weights + Adam's two moments) or 2 + 4 + 8 (bf16/fp16
weights + fp32 master weights + Adam), plus ZeRO's alignment padding and the files' headers.
Checkpoints written before this layout (meta.json without "engine_state_version") hold DeepSpeed's own files and
still load through engine.load_checkpoint.

Resuming on another layout (TP, PP, DP or ZeRO stage differ; same precision): the weights are merged along each
tensor's partition dim and re-split for this run's TP rank; the optimizer state is read per parameter through
the index files, whatever wrapper wrote it, and written into this run's wrapper (engine_state.
restore_from_parameters); the step count, LR schedule, step counters, fp16 loss scale and consumed samples carry
over; the per-rank RNG states do not (they belong to the old ranks). One warning names both layouts. The same
layout keeps the exact path (each rank's optimizer file loaded into the same wrapper). Checkpoints without index
files (written before it), or a precision change, load the weights alone and restart the optimizer (a warning).

<save>/latest holds the tag of the newest complete checkpoint (DeepSpeed's format) and is replaced atomically.

Crash safety (docs/FAULTS.md): every rank fsyncs what it wrote before rank 0 writes the manifest, so a folder
named iter_* is complete unless the disk itself lost data, which the manifest's sizes and CRC32s then catch on
--load. A .tmp_* folder left by a crash is never loaded and is removed by the next save. A save that fails
(disk full, permissions) removes its .tmp_* folder and raises CheckpointError; `latest` and the older
checkpoints are untouched.
"""
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
import zlib

import torch
import torch.distributed as dist

from megatron import checkpoint_format, engine_state
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import get_rng_tracker

logger = logging.getLogger(__name__)
TAG_RE = re.compile(r"^iter_(\d{7,})$")
TMP_PREFIX = ".tmp_"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the folder, the cause and the fix."""


def tag_for(iteration):
    return f"iter_{iteration:07d}"


def shard_name(tp_rank, pp_rank):
    return f"model_tp{tp_rank:02d}_pp{pp_rank:03d}.pt"


def _comm_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _crc32(path, chunk=1 << 24):
    value = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return value
            value = zlib.crc32(block, value)


def _write_json_atomic(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(folder):
    """fsync every file and folder under folder (folders too: a rename or a new entry is only durable then)."""
    for root, dirs, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(root)


def _fsync_dir(folder):
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Checksummed:
    """A write-only file wrapper that keeps the size and CRC32 of what passes through it (torch.save writes a
    file object through write() alone), so that the manifest needs no second pass over the bytes."""

    def __init__(self, f):
        self.f, self.size, self.crc32 = f, 0, 0

    def write(self, data):
        view = memoryview(data)
        self.size += view.nbytes
        self.crc32 = zlib.crc32(view, self.crc32)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def _torch_save_synced(obj, path):
    """torch.save to path, flushed and fsynced; returns the file's manifest entry {"size", "crc32"}."""
    with open(path, "wb") as f:
        stream = _Checksummed(f)
        torch.save(obj, stream)
        f.flush()
        os.fsync(f.fileno())
    return {"size": stream.size, "crc32": stream.crc32}


def _write_text_synced(text, path):
    """text to path, flushed and fsynced; returns the file's manifest entry {"size", "crc32"}."""
    data = text.encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "crc32": zlib.crc32(data)}


def write_manifest(folder, iteration, known=None):
    """manifest.json for every file under folder; known: {relative path: {"size", "crc32"}} computed while the
    files were written (used when the size on disk agrees), the others are read back."""
    known = known or {}
    files = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel == MANIFEST:
                continue
            size = os.path.getsize(path)
            entry = known.get(rel)
            files[rel] = entry if entry and entry["size"] == size else {"size": size, "crc32": _crc32(path)}
    _write_json_atomic(os.path.join(folder, MANIFEST), {"iteration": iteration, "files": files})


def verify_checkpoint(folder):
    """None if the folder is a complete checkpoint, else the reason (a one-line string naming the file)."""
    manifest_path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(manifest_path):
        return f"{manifest_path} is missing (the save did not finish)"
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if not isinstance(files, dict) or not files:
            return f"{manifest_path} lists no files"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        return f"{manifest_path} is unreadable ({type(err).__name__}: {err})"
    for rel, info in files.items():
        path = os.path.join(folder, rel)
        if not isinstance(info, dict) or "size" not in info or "crc32" not in info:
            return f"{manifest_path} has a malformed entry for {rel}"
        if not os.path.isfile(path):
            return f"{path} is missing"
        if os.path.getsize(path) != info["size"]:
            return f"{path} has {os.path.getsize(path)} bytes, the manifest says {info['size']} (truncated?)"
        if _crc32(path) != info["crc32"]:
            return f"{path} does not match its checksum (corrupt)"
    return None


def list_checkpoints(root):
    """Tags under root, newest first."""
    if not os.path.isdir(root):
        return []
    tags = [name for name in os.listdir(root) if TAG_RE.match(name)]
    return sorted(tags, key=lambda t: int(TAG_RE.match(t).group(1)), reverse=True)


def read_latest(root):
    path = os.path.join(root, "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def find_checkpoint(root, strict=False):
    """The folder to resume from: `latest` if it verifies, else the newest complete one (logged).

    With strict=True any problem with `latest` raises CheckpointError instead of falling back. Folders
    named .tmp_* (saves that did not finish) are never candidates.
    """
    if TAG_RE.match(os.path.basename(os.path.normpath(root))) and os.path.isdir(root):
        reason = verify_checkpoint(root)
        if reason:
            raise CheckpointError(f"--load {root}: checkpoint is incomplete or corrupt: {reason}")
        return root
    latest = read_latest(root)
    candidates = ([latest] if latest else []) + [t for t in list_checkpoints(root) if t != latest]
    for tag in candidates:
        folder = os.path.join(root, tag)
        reason = verify_checkpoint(folder) if os.path.isdir(folder) else f"{folder} does not exist"
        if reason is None:
            return folder
        if strict:
            raise CheckpointError(f"--load {root}: checkpoint {tag} is incomplete or corrupt: {reason} "
                                  "(--strict-load is set; drop it to fall back to an older checkpoint)")
        logger.warning("skipping checkpoint %s: %s", tag, reason)
    return None


def choose_checkpoint(root, strict=False):
    """find_checkpoint on rank 0 (one pass of CRC32s, not one per rank), its answer or error sent to all."""
    answer = [None, None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            answer[0] = find_checkpoint(root, strict)
        except RuntimeError as err:
            answer[1] = str(err)
    if dist.is_initialized():
        dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise CheckpointError(answer[1])
    return answer[0]


def _gathered(module, zero_stage):
    """Context in which ZeRO-3 parameters are whole on every rank (a no-op below stage 3)."""
    if zero_stage == 3:
        import deepspeed
        return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


def model_shard(module, num_layers, zero_stage=0):
    """{"weights": canonical name -> CPU tensor, "partition_dims": name -> dim or None} for this rank (the dim
    along which the owning tensor-parallel layer splits the tensor, recorded at every TP size)."""
    from megatron.model.pipeline import canonical_name, is_pipeline_module
    state = parallel_state.get_parallel_state()
    weights, dims = {}, {}
    split_dims = engine_state.partition_dims(module)
    with _gathered(module, zero_stage):
        for name, param in module.named_parameters():
            canonical = canonical_name(name, num_layers) if is_pipeline_module(module) else name
            if canonical is None or (canonical.startswith("embedding.") and state.pp_rank != 0):
                continue
            weights[canonical] = param.detach().to("cpu", copy=True)
            dims[canonical] = split_dims.get(id(param))
    return {"weights": weights, "partition_dims": dims}


def rng_state():
    state = {"cpu": torch.get_rng_state(), "tracker": get_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_rng_tracker().set_states(state["tracker"])


def optimizer_state_name(tp_rank, pp_rank, dp_rank):
    return f"optimizer_tp{tp_rank:02d}_pp{pp_rank:03d}_dp{dp_rank:05d}.pt"


def _read_engine_state(folder, tp_rank, pp_rank, dp_rank):
    path = os.path.join(folder, optimizer_state_name(tp_rank, pp_rank, dp_rank))
    if not os.path.isfile(path):
        raise CheckpointError(f"--load {folder}: {path} is missing although meta.json records the optimizer "
                              "state; the checkpoint is incomplete (load an older one, or pass --no-load-optim "
                              "to resume from the weights alone)")
    return torch.load(path, map_location="cpu", weights_only=False)


def load_engine_state(engine, folder, load_optimizer=True):
    """Restores each rank's optimizer state, LR schedule position and step counters (megatron.engine_state) into
    an engine whose module holds the checkpoint's weights. --no-load-optim (load_optimizer=False) keeps the
    fresh optimizer and schedule and copies the weights into the fp32 master weights. Returns the saved LR
    scheduler state (None when not restored)."""
    state = parallel_state.get_parallel_state()
    if not load_optimizer:
        engine_state.refresh_master_weights(engine)
        return None
    dp_rank = state.dp_rank if engine_state.partitioned(engine.optimizer) else 0
    saved = _read_engine_state(folder, state.tp_rank, state.pp_rank, dp_rank)
    try:
        engine_state.restore(engine, saved, lambda r: _read_engine_state(folder, state.tp_rank, state.pp_rank, r))
    except ValueError as err:
        raise CheckpointError(f"--load {folder}: {err}; resume with the checkpoint's --zero-stage and precision, "
                              "or pass --no-load-optim to restart the optimizer from the weights") from None
    return saved["lr_scheduler"]


def _agree_on_failure(error):
    """Collective: the lowest rank whose step failed (None when none did). Doubles as a barrier."""
    state = parallel_state.get_parallel_state()
    if not dist.is_initialized():
        return None if error is None else state.rank
    flag = torch.tensor([state.rank if error is not None else state.world_size], dtype=torch.int64,
                        device=_comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    failed = int(flag.item())
    return None if failed == state.world_size else failed


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


def save_checkpoint(engine, config, iteration, consumed_samples, tokenizer=None, fault_hook=None):
    """Collective: every rank calls it. Returns the final folder.

    Three steps, each closed by an all-reduce of a failure flag so that every rank raises together:
    rank 0 prepares <save>/.tmp_iter_N; every rank writes and fsyncs its files; rank 0 writes meta, config,
    tokenizer and the manifest, renames the folder to iter_N, replaces `latest`, then prunes.
    fault_hook(stage) is the test-only fault injection point (megatron.fault_injection.TestFaults).
    """
    root = config.checkpoint.save
    state = parallel_state.get_parallel_state()
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
    failed = _agree_on_failure(error)
    if failed is not None:
        fail("creating the temporary folder", failed, error)

    error = None
    written = {}  # file name -> manifest entry, for the files this rank wrote
    try:
        if not config.checkpoint.no_save_optim:  # --no-save-optim: weights only (our shards), no engine state
            saved = engine_state.collect(engine, config.precision.name, state.dp_rank)
            if saved is not None:
                name = optimizer_state_name(state.tp_rank, state.pp_rank, state.dp_rank)
                step, params = engine_state.parameter_index(engine, saved, config.model.num_layers, state.pp_rank)
                written[name] = _torch_save_synced(saved, os.path.join(tmp, name))
                del saved
                name = checkpoint_format.index_name(state.tp_rank, state.pp_rank, state.dp_rank)
                written[name] = _write_text_synced(checkpoint_format.index_text(step, params),
                                                   os.path.join(tmp, name))
        shard = model_shard(engine.module, config.model.num_layers, config.training.zero_stage)
        if state.dp_rank == 0:
            name = shard_name(state.tp_rank, state.pp_rank)
            written[name] = _torch_save_synced(shard, os.path.join(tmp, name))
        del shard
        name = f"rng_rank{state.rank:05d}.pt"
        written[name] = _torch_save_synced(rng_state(), os.path.join(tmp, name))
        if fault_hook is not None:
            fault_hook("written")
    except OSError as err:
        error = err
    failed = _agree_on_failure(error)
    if failed is not None:
        fail("writing its files", failed, error)
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, written)
        written = {name: entry for part in everyone for name, entry in part.items()}

    final = os.path.join(root, tag)
    error = None
    if state.rank == 0:
        try:
            meta = {"iteration": iteration, "consumed_samples": consumed_samples,
                    "tensor_model_parallel_size": state.tensor_model_parallel_size,
                    "pipeline_model_parallel_size": state.pipeline_model_parallel_size,
                    "data_parallel_size": state.data_parallel_size, "zero_stage": config.training.zero_stage,
                    "precision": config.precision.name, "deepspeed_state": not config.checkpoint.no_save_optim,
                    "engine_state_version": engine_state.FORMAT}
            _write_json_atomic(os.path.join(tmp, "meta.json"), meta)
            _write_json_atomic(os.path.join(tmp, "config.json"), dataclasses.asdict(config))
            if tokenizer is not None:
                tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
            _fsync_tree(tmp)
            write_manifest(tmp, iteration, written)
            _fsync_dir(tmp)
            if os.path.isdir(final):  # an older run's folder of the same iteration: set aside, then replaced
                os.replace(final, os.path.join(root, TMP_PREFIX + "old_" + tag))
            os.replace(tmp, final)
            _write_text_atomic(os.path.join(root, "latest"), tag)
            _fsync_dir(root)
        except OSError as err:
            error = err
    failed = _agree_on_failure(error)
    if failed is not None:
        fail("writing the manifest", failed, error)
    if state.rank == 0:
        shutil.rmtree(os.path.join(root, TMP_PREFIX + "old_" + tag), ignore_errors=True)
        _prune(root, config.checkpoint.keep_last_n_checkpoints, tag)
        logger.info("saved checkpoint %s", final)
    _barrier()
    return final


def _write_text_atomic(path, text):
    tmp = os.path.join(os.path.dirname(path), TMP_PREFIX + os.path.basename(path))
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prune(root, keep, current):
    """Keeps the newest `keep` complete checkpoints up to `current` (the one just saved, never removed).

    Folders numbered above `current` belong to a run that was abandoned (this one resumed from an older
    checkpoint): they are left alone and named in a warning.
    """
    current_iter = int(TAG_RE.match(current).group(1))
    tags = list_checkpoints(root)
    newer = [t for t in tags if int(TAG_RE.match(t).group(1)) > current_iter]
    if newer:
        logger.warning("%s holds checkpoints newer than %s from an earlier run (%s); `latest` names %s",
                       root, current, ", ".join(newer), current)
    if not keep:
        return
    older = [t for t in tags if int(TAG_RE.match(t).group(1)) <= current_iter]
    for tag in older[keep:]:
        if tag != current:
            shutil.rmtree(os.path.join(root, tag), ignore_errors=True)
            logger.info("pruned checkpoint %s (--keep-last-n-checkpoints %d)", tag, keep)


def checkpoint_bytes(num_parameters, precision, no_save_optim=False):
    """Estimated size of one checkpoint: the weights once (model_tp*_pp*.pt) plus Adam's state (two fp32
    moments, and fp32 master weights under bf16/fp16): 12 bytes per parameter in fp32, 14 in bf16/fp16."""
    weight = 4 if precision == "fp32" else 2
    optimizer = 0 if no_save_optim else (8 if precision == "fp32" else 12)
    return num_parameters * (weight + optimizer)


def check_save_dir(root, needed_bytes):
    """Start-up check of --save: creatable, writable, and with room for one more checkpoint.
    Raises ValueError with a one-line message naming --save."""
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


def read_meta(folder):
    with open(os.path.join(folder, "meta.json")) as f:
        return json.load(f)


def load_model_weights(module, folder, num_layers, zero_stage=0):
    """Loads our canonical shards into this rank's module. With the checkpoint's TP and PP sizes: the stage's own
    file and stage 0's (the tied embedding); with another PP size, every stage's file (the names are the whole
    model's); with another TP size, every TP rank's files, each tensor's slices concatenated along the partition
    dim the shard records and this rank's slice cut out (checkpoint_format.target_slice)."""
    from megatron.model.pipeline import load_canonical_state_dict
    state = parallel_state.get_parallel_state()
    meta = read_meta(folder)
    tp = state.tensor_model_parallel_size
    saved_tp = meta.get("tensor_model_parallel_size") or tp
    saved_pp = meta.get("pipeline_model_parallel_size") or state.pipeline_model_parallel_size
    stages = sorted({0, state.pp_rank}) if saved_pp == state.pipeline_model_parallel_size else range(saved_pp)
    tp_ranks = [state.tp_rank] if saved_tp == tp else range(saved_tp)
    pieces, dims = {}, {}
    for pp in stages:
        for t in tp_ranks:
            path = os.path.join(folder, shard_name(t, pp))
            if not os.path.isfile(path):
                raise CheckpointError(f"--load {folder}: {path} is missing; the checkpoint is incomplete (load "
                                      "another one)")
            shard = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            for name, tensor in shard["weights"].items():
                pieces.setdefault(name, {})[t] = tensor
                dims[name] = shard["partition_dims"].get(name)
    weights = {}
    live_dims = engine_state.canonical_partition_dims(module, num_layers) if saved_tp != tp else {}
    for name, by_rank in pieces.items():
        if saved_tp == tp:
            weights[name] = by_rank[state.tp_rank]
            continue
        dim = dims[name] if dims[name] is not None else live_dims.get(name)  # older TP-1 shards record none
        whole = torch.cat([by_rank[t] for t in range(saved_tp)], dim) if dim is not None else by_rank[0]
        try:
            weights[name] = checkpoint_format.target_slice(whole, dim, tp, state.tp_rank)
        except ValueError as err:
            raise CheckpointError(f"--load {folder}: {name} cannot be split for --tensor-model-parallel-size "
                                  f"{tp} ({err}); pick a TP size that divides it") from None
    if zero_stage == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
            load_canonical_state_dict(module, weights, num_layers)
    else:
        load_canonical_state_dict(module, weights, num_layers)


@dataclasses.dataclass
class ResumeState:
    """Where training continues: the RNG states are applied by the loop once its data iterators exist
    (creating a DataLoader iterator draws from the default generator)."""
    iteration: int = 0
    consumed_samples: int = 0
    rng_state: dict = None


def load_checkpoint(engine, config):
    """Resumes from --load. Returns a ResumeState (all zero when there is nothing to load).

    Same layout (TP, PP, DP, ZeRO stage, precision) and an engine state: weights from the model shards, then each
    rank's optimizer state and LR schedule position (load_engine_state). Otherwise, or with --finetune, the
    weights alone. Checkpoints from before this layout (no "engine_state_version") go through DeepSpeed's
    engine.load_checkpoint.
    """
    ckpt = config.checkpoint
    folder = choose_checkpoint(ckpt.load, strict=ckpt.strict_load)
    if folder is None:
        if ckpt.strict_load or ckpt.finetune:
            raise CheckpointError(f"--load {ckpt.load}: no complete checkpoint found")
        _warn_once("--load %s: no checkpoint found, starting from scratch", ckpt.load)
        return ResumeState()
    meta = read_meta(folder)
    state = parallel_state.get_parallel_state()
    same_layout = (meta.get("deepspeed_state") and
                   meta["tensor_model_parallel_size"] == state.tensor_model_parallel_size and
                   meta["pipeline_model_parallel_size"] == state.pipeline_model_parallel_size and
                   meta["data_parallel_size"] == state.data_parallel_size and
                   meta.get("zero_stage", config.training.zero_stage) == config.training.zero_stage and
                   meta.get("precision", config.precision.name) == config.precision.name)
    layout_change = not ckpt.finetune and not same_layout and not ckpt.no_load_optim and \
        _has_parameter_index(folder, meta, config)
    if layout_change:
        load_model_weights(engine.module, folder, config.model.num_layers, config.training.zero_stage)
        _restore_on_new_layout(engine, folder, meta, config)
        _warn_schedule_change(engine, folder, config)
    elif ckpt.finetune or not same_layout:
        load_model_weights(engine.module, folder, config.model.num_layers, config.training.zero_stage)
        engine_state.refresh_master_weights(engine)
        if ckpt.finetune:
            logger.info("loaded weights from %s for fine-tuning (iteration and optimizer restart)", folder)
            return ResumeState()
        _warn_once("loaded weights from %s; its layout (TP %s, PP %s, DP %s, ZeRO %s, %s) differs or has no engine "
                   "state, so the optimizer and LR schedule restart", folder, meta["tensor_model_parallel_size"],
                   meta["pipeline_model_parallel_size"], meta["data_parallel_size"], meta.get("zero_stage"),
                   meta.get("precision"))
    else:
        if "engine_state_version" not in meta:  # written by DeepSpeed's engine.save_checkpoint
            root, tag = os.path.split(os.path.normpath(folder))
            engine.load_checkpoint(root, tag=tag, load_optimizer_states=not ckpt.no_load_optim,
                                   load_lr_scheduler_states=not ckpt.no_load_optim)
            schedule_restored = not ckpt.no_load_optim
        else:
            load_model_weights(engine.module, folder, config.model.num_layers, config.training.zero_stage)
            schedule_restored = load_engine_state(engine, folder, load_optimizer=not ckpt.no_load_optim) is not None
        if schedule_restored:
            _warn_schedule_change(engine, folder, config)
    rng_path = os.path.join(folder, f"rng_rank{state.rank:05d}.pt")
    rng = None
    if not ckpt.no_load_rng and not layout_change and os.path.isfile(rng_path):
        rng = torch.load(rng_path, map_location="cpu", weights_only=False)
    logger.info("resumed from %s at iteration %d", folder, meta["iteration"])
    return ResumeState(meta["iteration"], meta["consumed_samples"], rng)


def _warn_schedule_change(engine, folder, config):
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and parallel_state.get_parallel_state().rank == 0:
        message = schedule_change_message(_read_saved_config(folder), config, scheduler.num_steps)
        if message:
            _warn_once("%s", message)


def layout_text(tp, pp, dp, zero, precision):
    return f"TP {tp}, PP {pp}, DP {dp}, ZeRO {zero}, {precision}"


def _has_parameter_index(folder, meta, config):
    """True when the checkpoint can resume on this run's layout with its optimizer state: it holds the engine
    state with per-parameter index files (checkpoint_format) and was trained in the same precision."""
    return bool(meta.get("deepspeed_state") and meta.get("engine_state_version") and
                meta.get("precision") == config.precision.name and
                os.path.isfile(os.path.join(folder, checkpoint_format.index_name(0, 0, 0))))


def _restore_on_new_layout(engine, folder, meta, config):
    """The optimizer state, step count, LR schedule position and step counters of a checkpoint saved on another
    layout (TP, PP, DP, ZeRO stage), per parameter through its index files. The module holds the weights."""
    state = parallel_state.get_parallel_state()
    before = layout_text(meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"],
                         meta["data_parallel_size"], meta.get("zero_stage"), meta.get("precision"))
    now = layout_text(state.tensor_model_parallel_size, state.pipeline_model_parallel_size,
                      state.data_parallel_size, config.training.zero_stage, config.precision.name)
    try:
        source = checkpoint_format.SavedOptimizer(folder, meta)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"--load {folder}: its per-parameter optimizer index is unreadable ({err}); load "
                              "another checkpoint, or pass --no-load-optim to resume from the weights alone") from None
    try:
        engine_state.restore_from_parameters(engine, source, config.model.num_layers, state.pp_rank,
                                             state.tensor_model_parallel_size, state.tp_rank)
    except ValueError as err:
        raise CheckpointError(f"--load {folder}: {err}") from None
    saved = _read_engine_state(folder, 0, 0, 0)
    engine_state.restore_counters(engine, saved)
    engine_state.restore_loss_scale(engine, saved)
    _warn_once("resuming on another layout: the checkpoint was trained on %s, this run is %s (weights, optimizer "
               "state, LR schedule, loss scale and data position carried over; RNG states restart)", before, now)


def _warn_once(message, *args):
    """A warning from global rank 0 only (every rank reaches the same conclusion)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning(message, *args)


def _read_saved_config(folder):
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


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


class _NoGroups:
    """An optimizer without parameter groups, to evaluate a schedule with AnnealingLR alone."""
    param_groups = ()


def saved_model_config(root):
    """The "model" section of the config saved with the checkpoint --load would pick first (None if none)."""
    folder = root if TAG_RE.match(os.path.basename(os.path.normpath(root))) else None
    if folder is None:
        latest = read_latest(root) if os.path.isdir(root) else None
        tags = ([latest] if latest else []) + list_checkpoints(root)
        folder = next((os.path.join(root, t) for t in tags if os.path.isfile(os.path.join(root, t, "config.json"))),
                      None)
    path = os.path.join(folder, "config.json") if folder else None
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f).get("model")
    except (OSError, json.JSONDecodeError):
        return None
