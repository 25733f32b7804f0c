"""Universal checkpoint conversion: a trained checkpoint rewritten for another TP x PP with its optimizer state.

Used by tools/convert_checkpoint.py; one process, CPU, no torch.distributed. The source is any checkpoint whose
optimizer files carry per-parameter index files (megatron/checkpoint/saved_optimizer.py: any TP, PP, DP, ZeRO
stage and precision), or one this module wrote. It is read through the same code training uses to resume on
another layout: CheckpointReader for the weights, SavedOptimizer for the optimizer state.

The output is a checkpoint folder for TP x PP (megatron/checkpoint/format.py) that `pretrain_bloom.py --load`
resumes on any DP size and ZeRO stage (and on any other layout), with the optimizer state:

    model_tp{t}_pp{p}.pt            the weights, as training writes them (the source's dtype)
    optimizer_tp{t}_pp{p}_dp00000.pt
                                    {"optimizer": {"params": {name: {"exp_avg", "exp_avg_sq", "fp32" (where the
                                    source keeps an fp32 master)}}, + the fp16 loss scaler's state},
                                     "optimizer_format": "parameters", "global_steps", "global_samples",
                                     "skipped_steps", "lr_scheduler"}: TP rank t's slice of every parameter of
                                    stage p, in fp32; the counters are the source's (layout-independent)
    index_tp{t}_pp{p}_dp00000.json  the per-parameter index of that file: one piece per parameter (offset 0,
                                    start 0, the slice's numel); the tied word embedding on stage 0 only
    meta.json                       the source's iteration, consumed samples, precision, engine_state_version;
                                    the new TP and PP; "data_parallel_size": null, "zero_stage": null,
                                    "optimizer_format": "parameters", "converted_from": the source folder
    config.json, tokenizer/, manifest.json

load.load_checkpoint never takes its same-layout path (a DeepSpeed wrapper's state dict) for such a folder but
always the per-parameter one. The RNG states are not carried (they belong to the old ranks; a layout change
restarts them). Memory: the weights are read a window at a time from the mapped shards, the optimizer state one
parameter at a time from the mapped optimizer files; the most held is one output optimizer file.
"""
import json
import os
import shutil

import torch

from megatron.checkpoint.convert import CheckpointReader, read_shard_for, stage_names
from megatron.checkpoint.format import (OPTIMIZER_FORMAT_PARAMETERS, CheckpointError, index_name, is_tag_folder,
                                        optimizer_name, partition_dim, read_meta, shard_name, tag_for,
                                        verify_checkpoint)
from megatron.checkpoint.io import atomic_folder, fsync_tree, torch_save_synced, write_manifest, write_text_synced
from megatron.checkpoint.optimizer_state import SCALER_FIELDS
from megatron.checkpoint.saved_optimizer import KEYS, SavedOptimizer, index_text, target_slice
from megatron.file_modes import apply_umask

COUNTERS = ("global_steps", "global_samples", "skipped_steps", "lr_scheduler")  # optimizer_state.restore_counters
SCALER_KEYS = ("loss_scaler",) + SCALER_FIELDS  # what optimizer_state.restore_loss_scale reads


def saved_optimizer(folder, meta):
    """SavedOptimizer of a checkpoint folder, also one written here (no DP size: one file per TP x PP)."""
    return SavedOptimizer(folder, {**meta, "data_parallel_size": meta.get("data_parallel_size") or 1})


def engine_counters(folder):
    """(the step counters and LR schedule position, the fp16 loss scaler's state) from TP 0 / PP 0 / DP 0's
    optimizer file: what restore_counters and restore_loss_scale read, the same on every rank of any layout."""
    saved = torch.load(os.path.join(folder, optimizer_name(0, 0, 0)), map_location="cpu", weights_only=False,
                       mmap=True)
    state = saved.get("optimizer")
    scaler = {key: state[key] for key in SCALER_KEYS if isinstance(state, dict) and key in state}
    return {key: saved[key] for key in COUNTERS}, scaler


def _owned(tensor):
    """tensor, copied out where it views a larger storage (torch.save writes a view's whole storage)."""
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size() or not tensor.is_contiguous():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _has_fp32(source, name):
    return all(piece["fp32"] is not None for places in source.locations[name].values() for _, piece in places)


def optimizer_file(source, names, tp, tp_rank, counters, scaler, flag="--load"):
    """(the optimizer file's dict, its index's JSON) holding TP rank tp_rank's slice (of tp) of the state of
    `names` (canonical names of one stage), read one parameter at a time from source (a SavedOptimizer)."""
    params, index = {}, {}
    for name in names:
        if name not in source.entries:
            if source.step is None:  # saved before the first optimizer step: no state to carry
                continue
            raise CheckpointError(f"{flag} {source.folder}: its optimizer index holds no state for {name}; the "
                                  "checkpoint is not one of this model (load another one)")
        dim = source.partition_dim(name)
        dim = partition_dim(name) if dim is None else dim  # indexes of TP-1 runs may record no dim
        keys = (("fp32",) if _has_fp32(source, name) else ()) + KEYS
        entry = {key: _owned(target_slice(source.full(name, key, dim), dim, tp, tp_rank)) for key in keys}
        params[name] = entry
        index[name] = {"shape": list(entry[KEYS[0]].shape), "partition_dim": dim, "pieces": [{
            "state": ["params", name], "fp32": ["params", name, "fp32"] if "fp32" in entry else None,
            "offset": 0, "start": 0, "numel": entry[KEYS[0]].numel()}]}
    saved = {"optimizer": {"params": params, **scaler}, "optimizer_format": OPTIMIZER_FORMAT_PARAMETERS, **counters}
    return saved, index_text(source.step, index)


def check_layout(config, tp, pp):
    """The canonical names of each stage of a TP x PP layout; ValueError naming the flag when the model does not
    fit it."""
    for flag, value in (("--target-tensor-parallel-size", tp), ("--target-pipeline-parallel-size", pp)):
        if value < 1:
            raise ValueError(f"{flag} {value} must be at least 1")
    return stage_names(config, tp, pp)


def check_output(dst, src, force):
    """CheckpointError when --save exists (without force) or would replace the source."""
    out = os.path.realpath(dst)
    source = os.path.realpath(src)
    if out == source or source.startswith(out + os.sep):
        raise CheckpointError(f"--save {dst} holds the checkpoint to convert ({src}); replacing it would delete "
                              "it, choose another folder")
    if os.path.lexists(dst) and not force:
        raise CheckpointError(f"--save {dst} already exists; pass --force to replace it or choose another folder")


def check_source(folder, meta, flag="--load"):
    """CheckpointError unless the folder holds the optimizer state with per-parameter index files."""
    if not (meta.get("deepspeed_state") and meta.get("engine_state_version") and
            os.path.isfile(os.path.join(folder, index_name(0, 0, 0)))):
        raise CheckpointError(f"{flag} {folder}: the checkpoint holds no per-parameter optimizer state (saved with "
                              f"--no-save-optim, by a conversion of the weights alone, or before {index_name(0, 0, 0)}"
                              " existed); reshard its weights with tools/merge_mp_partitions.py --output-format "
                              "megatron instead")


def output_config(run_config, tp, pp):
    """config.json for the new layout: the source's, with the new TP and PP sizes."""
    config = json.loads(json.dumps(run_config, default=str))
    config.setdefault("model", {})["tensor_model_parallel_size"] = tp
    parallel = config.setdefault("parallel", {})
    parallel.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    for key in ("world_size", "data_parallel_size"):
        if key in parallel:
            parallel[key] = tp * pp if key == "world_size" else 1
    return config


def convert_checkpoint(src, dst, tp, pp, force=False, verify=True):
    """Writes src (a checkpoint folder, or a save root with `latest`) as a TP x PP checkpoint with its optimizer
    state per parameter into dst (a save root, or an iter_XXXXXXX folder itself), atomically. Returns
    (the source's CheckpointReader, closed; its meta; the output checkpoint folder; how many parameters' state
    was carried). Raises CheckpointError / RuntimeError / ValueError with one line naming the flag."""
    check_output(dst, src, force)
    reader = CheckpointReader(src, flag="--load", verify=False)
    try:
        folder = reader.folder
        meta = read_meta(folder)
        check_source(folder, meta)
        stages = check_layout(reader.config, tp, pp)  # before the checksums: a wrong flag fails at once
        reason = verify_checkpoint(folder) if verify else None
        if reason:
            raise CheckpointError(f"--load {src}: checkpoint is incomplete or corrupt: {reason}")
        try:
            source = saved_optimizer(folder, meta)
        except (OSError, ValueError, KeyError) as err:
            raise CheckpointError(f"--load {folder}: its per-parameter optimizer index is unreadable ({err}); "
                                  "convert another checkpoint") from None
        counters, scaler = engine_counters(folder)
        out_meta = {"iteration": reader.iteration, "consumed_samples": reader.consumed_samples,
                    "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                    "data_parallel_size": None, "zero_stage": None, "precision": meta.get("precision"),
                    "deepspeed_state": True, "engine_state_version": meta["engine_state_version"],
                    "optimizer_format": OPTIMIZER_FORMAT_PARAMETERS, "converted_from": os.path.abspath(folder)}
        is_tag = is_tag_folder(dst)
        tag = tag_for(reader.iteration)
        try:
            with atomic_folder(dst, force) as tmp:
                out = tmp if is_tag else os.path.join(tmp, tag)
                os.makedirs(out, exist_ok=True)
                written = {}
                for p, names in enumerate(stages):
                    for t in range(tp):
                        written.update(_write_rank(out, reader, source, names, tp, t, p, counters, scaler))
                _write_text(out, "config.json", json.dumps(output_config(reader.run_config, tp, pp), indent=2,
                                                           default=str), written)
                _write_text(out, "meta.json", json.dumps(out_meta, indent=2), written)
                if reader.tokenizer_dir is not None:
                    shutil.copytree(reader.tokenizer_dir, os.path.join(out, "tokenizer"))
                apply_umask(tmp)  # the copied tokenizer files keep their source's mode otherwise
                fsync_tree(out)
                write_manifest(out, reader.iteration, written)
                if not is_tag:
                    with open(os.path.join(tmp, "latest"), "w") as f:
                        f.write(tag)
        except RuntimeError as err:  # atomic_folder names the conversions' --output-path flag; ours is --save
            message = str(err)
            if message.startswith("--output-path "):
                raise CheckpointError("--save " + message[len("--output-path "):]) from None
            raise
    finally:
        reader.close()
    final = os.path.abspath(dst)
    return reader, meta, (final if is_tag else os.path.join(final, tag)), len(source.names())


def _write_rank(out, reader, source, names, tp, t, p, counters, scaler):
    """The model shard, optimizer file and index of (TP rank t, stage p); returns their manifest entries."""
    written = {}
    shard = read_shard_for(reader, names, t, tp)
    shard["partition_dims"] = {name: partition_dim(name) for name in names}  # recorded at every TP size
    written[shard_name(t, p)] = torch_save_synced(shard, os.path.join(out, shard_name(t, p)))
    del shard
    saved, index = optimizer_file(source, names, tp, t, counters, scaler)
    written[optimizer_name(t, p, 0)] = torch_save_synced(saved, os.path.join(out, optimizer_name(t, p, 0)))
    del saved
    written[index_name(t, p, 0)] = write_text_synced(index, os.path.join(out, index_name(t, p, 0)))
    return written


def _write_text(out, name, text, written):
    written[name] = write_text_synced(text, os.path.join(out, name))
