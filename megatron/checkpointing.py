"""Checkpoints: atomic folders with a manifest, DeepSpeed's engine state, and our canonical weight shards.

Layout of <save>/iter_0000100/ (written under <save>/.tmp_iter_0000100/ and renamed when complete):

    model_tp00_pp000.pt     weights of (TP rank, PP stage) under BloomModel's names, with each tensor's
                            partition dim; what tools/merge_mp_partitions.py and --finetune read
    <DeepSpeed files>       engine.save_checkpoint(): module, optimizer (ZeRO partitions), LR scheduler
    rng_rank00000.pt        per-rank CPU/CUDA/model-parallel RNG states
    tokenizer/              the tokenizer, saved with save_pretrained
    config.json             the resolved run config
    meta.json               iteration, consumed samples, topology, precision
    manifest.json           written last: every file's size and CRC32

<save>/latest holds the tag of the newest complete checkpoint (DeepSpeed's format) and is replaced atomically.
"""
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import zlib

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import get_rng_tracker

logger = logging.getLogger(__name__)
TAG_RE = re.compile(r"^iter_(\d{7,})$")
MANIFEST = "manifest.json"


def tag_for(iteration):
    return f"iter_{iteration:07d}"


def shard_name(tp_rank, pp_rank):
    return f"model_tp{tp_rank:02d}_pp{pp_rank:03d}.pt"


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
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())


def write_manifest(folder, iteration):
    files = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel != MANIFEST:
                files[rel] = {"size": os.path.getsize(path), "crc32": _crc32(path)}
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
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return f"{manifest_path} is unreadable ({err})"
    for rel, info in files.items():
        path = os.path.join(folder, rel)
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

    With strict=True any problem with `latest` raises RuntimeError instead of falling back.
    """
    if TAG_RE.match(os.path.basename(os.path.normpath(root))) and os.path.isdir(root):
        reason = verify_checkpoint(root)
        if reason:
            raise RuntimeError(f"--load {root}: checkpoint is incomplete or corrupt: {reason}")
        return root
    latest = read_latest(root)
    candidates = ([latest] if latest else []) + [t for t in list_checkpoints(root) if t != latest]
    for tag in candidates:
        folder = os.path.join(root, tag)
        reason = verify_checkpoint(folder) if os.path.isdir(folder) else f"{folder} does not exist"
        if reason is None:
            return folder
        if strict:
            raise RuntimeError(f"--load {root}: checkpoint {tag} is incomplete or corrupt: {reason} "
                               "(--strict-load is set; drop it to fall back to an older checkpoint)")
        logger.warning("skipping checkpoint %s: %s", tag, reason)
    return None


def _gathered(module, zero_stage):
    """Context in which ZeRO-3 parameters are whole on every rank (a no-op below stage 3)."""
    if zero_stage == 3:
        import deepspeed
        return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


def model_shard(module, num_layers, zero_stage=0):
    """{"weights": canonical name -> CPU tensor, "partition_dims": name -> dim or None} for this rank."""
    from megatron.model.pipeline import canonical_name, is_pipeline_module
    state = parallel_state.get_parallel_state()
    weights, dims = {}, {}
    with _gathered(module, zero_stage):
        for name, param in module.named_parameters():
            canonical = canonical_name(name, num_layers) if is_pipeline_module(module) else name
            if canonical is None or (canonical.startswith("embedding.") and state.pp_rank != 0):
                continue
            weights[canonical] = param.detach().to("cpu", copy=True)
            dims[canonical] = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
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


def save_checkpoint(engine, config, iteration, consumed_samples, tokenizer=None):
    """Collective: every rank calls it. Returns the final folder."""
    root = config.checkpoint.save
    state = parallel_state.get_parallel_state()
    tag = tag_for(iteration)
    tmp_tag = "." + "tmp_" + tag
    tmp = os.path.join(root, tmp_tag)
    if state.rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()

    engine.save_checkpoint(root, tag=tmp_tag, save_latest=False,
                           exclude_frozen_parameters=False)
    shard = model_shard(engine.module, config.model.num_layers, config.training.zero_stage)
    if state.dp_rank == 0:
        torch.save(shard, os.path.join(tmp, shard_name(state.tp_rank, state.pp_rank)))
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{state.rank:05d}.pt"))
    _barrier()

    final = os.path.join(root, tag)
    if state.rank == 0:
        meta = {"iteration": iteration, "consumed_samples": consumed_samples,
                "tensor_model_parallel_size": state.tensor_model_parallel_size,
                "pipeline_model_parallel_size": state.pipeline_model_parallel_size,
                "data_parallel_size": state.data_parallel_size, "zero_stage": config.training.zero_stage,
                "precision": config.precision.name, "deepspeed_state": True}
        _write_json_atomic(os.path.join(tmp, "meta.json"), meta)
        _write_json_atomic(os.path.join(tmp, "config.json"), dataclasses.asdict(config))
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
        _fsync_tree(tmp)
        write_manifest(tmp, iteration)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        _prune(root, config.checkpoint.keep_last_n_checkpoints)
        logger.info("saved checkpoint %s", final)
    _barrier()
    return final


def _prune(root, keep):
    if not keep:
        return
    for tag in list_checkpoints(root)[keep:]:
        shutil.rmtree(os.path.join(root, tag), ignore_errors=True)
        logger.info("pruned checkpoint %s (--keep-last-n-checkpoints %d)", tag, keep)


def read_meta(folder):
    with open(os.path.join(folder, "meta.json")) as f:
        return json.load(f)


def load_model_weights(module, folder, num_layers, zero_stage=0):
    """Loads our canonical shards (this TP rank; the stage's own file and stage 0's for tied embeddings)."""
    from megatron.model.pipeline import load_canonical_state_dict
    state = parallel_state.get_parallel_state()
    weights = {}
    for pp in sorted({0, state.pp_rank}):
        path = os.path.join(folder, shard_name(state.tp_rank, pp))
        if not os.path.isfile(path):
            raise RuntimeError(f"--load {folder}: {path} is missing; the checkpoint was saved with another "
                               "tensor/pipeline layout (reshard it with tools/merge_mp_partitions.py "
                               "--output-format megatron)")
        weights.update(torch.load(path, map_location="cpu", weights_only=True)["weights"])
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
    """Resumes from --load. Returns a ResumeState (all zero when there is nothing to load)."""
    ckpt = config.checkpoint
    folder = find_checkpoint(ckpt.load, strict=ckpt.strict_load)
    if folder is None:
        if ckpt.strict_load or ckpt.finetune:
            raise RuntimeError(f"--load {ckpt.load}: no complete checkpoint found")
        logger.warning("--load %s: no checkpoint found, starting from scratch", ckpt.load)
        return ResumeState()
    meta = read_meta(folder)
    state = parallel_state.get_parallel_state()
    same_layout = (meta.get("deepspeed_state") and
                   meta["tensor_model_parallel_size"] == state.tensor_model_parallel_size and
                   meta["pipeline_model_parallel_size"] == state.pipeline_model_parallel_size and
                   meta["data_parallel_size"] == state.data_parallel_size)
    if ckpt.finetune or not same_layout:
        load_model_weights(engine.module, folder, config.model.num_layers, config.training.zero_stage)
        if ckpt.finetune:
            logger.info("loaded weights from %s for fine-tuning (iteration and optimizer restart)", folder)
            return ResumeState()
        logger.warning("loaded weights from %s; its layout (TP %s, PP %s, DP %s) differs or has no engine state, "
                       "so the optimizer and LR schedule restart", folder, meta["tensor_model_parallel_size"],
                       meta["pipeline_model_parallel_size"], meta["data_parallel_size"])
    else:
        root, tag = os.path.split(os.path.normpath(folder))
        engine.load_checkpoint(root, tag=tag, load_optimizer_states=not ckpt.no_load_optim,
                               load_lr_scheduler_states=not ckpt.no_load_optim)
    rng_path = os.path.join(folder, f"rng_rank{state.rank:05d}.pt")
    rng = None
    if not ckpt.no_load_rng and os.path.isfile(rng_path):
        rng = torch.load(rng_path, map_location="cpu", weights_only=False)
    logger.info("resumed from %s at iteration %d", folder, meta["iteration"])
    return ResumeState(meta["iteration"], meta["consumed_samples"], rng)
