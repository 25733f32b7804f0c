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
    index_tp{t}_pp{p}_dp00000.json  the per-parameter index of that file: one region per parameter (start 0,
                                    the slice's numel; the tensors flattened); the tied word embedding on stage 0
                                    only: the format training writes (saved_optimizer.py)
    meta.json                       the source's iteration, consumed samples, precision, engine_state_version;
                                    the new TP and PP; "data_parallel_size": null, "zero_stage": null,
                                    "optimizer_format": "parameters", "converted_from": the source folder
    config.json, tokenizer/, manifest.json

load.load_checkpoint never takes its same-layout path (a DeepSpeed wrapper's state dict) for such a folder but
always the per-parameter one. The RNG states are not carried (they belong to the old ranks; a layout change
restarts them). Memory: the weights are read a window at a time from the mapped shards, the optimizer state one
parameter's state at a time from the mapped optimizer files, streamed into the output file as it is read
(torch_stream.save): the most held is one output model shard, never one output optimizer file.
"""
import functools
import os

import torch

from megatron.checkpoint import torch_stream
from megatron.checkpoint.convert import (CheckpointReader, layout_config, partition_method_of, read_shard_for,
                                         stage_names, write_checkpoint_folder)
from megatron.checkpoint.format import (OPTIMIZER_FORMAT_PARAMETERS, CheckpointError, has_parameter_index,
                                        index_name, optimizer_name, partition_dim, read_meta, shard_name,
                                        verify_checkpoint)
from megatron.checkpoint.io import check_output_path, torch_save_synced, write_text_synced
from megatron.checkpoint.optimizer_state import SCALER_FIELDS
from megatron.checkpoint.saved_optimizer import KEYS, SavedOptimizer, index_entry, index_text, target_slice

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


def optimizer_file(source, shapes, names, tp, tp_rank, counters, scaler, flag="--load"):
    """(the optimizer file's dict, its index's JSON) holding TP rank tp_rank's slice (of tp) of the state of
    `names` (canonical names of one stage; shapes: their whole shapes). Its tensors are torch_stream.Deferred:
    each is read from source (a SavedOptimizer) when torch_stream.save writes it, one parameter's state at a time."""
    params, index = {}, {}
    for name in names:
        if name not in source.entries:
            if source.step is None:  # saved before the first optimizer step: no state to carry
                continue
            raise CheckpointError(f"{flag} {source.folder}: its optimizer index holds no state for {name}; the "
                                  "checkpoint is not one of this model (load another one)")
        dim = source.partition_dim(name)
        dim = partition_dim(name) if dim is None else dim  # indexes of TP-1 runs may record no dim
        shape = list(shapes[name])
        if dim is not None:
            shape[dim] //= tp
        numel = torch.Size(shape).numel()
        keys = (("fp32",) if source.has_fp32(name) else ()) + KEYS

        def make(name=name, key=None, dim=dim):
            return target_slice(source.full(name, key, dim), dim, tp, tp_rank).reshape(-1)

        index[name] = index_entry(shape, dim, 0, numel, "fp32" in keys)
        params[name] = {key: torch_stream.Deferred((numel,), torch.float32, functools.partial(make, key=key))
                        for key in keys}  # a region of the flattened slice
    saved = {"optimizer": {"params": params, **scaler}, "optimizer_format": OPTIMIZER_FORMAT_PARAMETERS, **counters}
    return saved, index_text(source.step, index)


def write_optimizer_file(out, t, p, source, shapes, names, tp, counters, scaler):
    """The optimizer file and index of (TP rank t, stage p) into out, streamed (optimizer_file); their manifest
    entries."""
    saved, index = optimizer_file(source, shapes, names, tp, t, counters, scaler)
    return {optimizer_name(t, p, 0): torch_save_synced(saved, os.path.join(out, optimizer_name(t, p, 0)),
                                                       save=torch_stream.save),
            index_name(t, p, 0): write_text_synced(index, os.path.join(out, index_name(t, p, 0)))}


def check_source(folder, meta, flag="--load"):
    """CheckpointError unless the folder holds the optimizer state with per-parameter index files."""
    if not has_parameter_index(folder, meta):
        raise CheckpointError(f"{flag} {folder}: the checkpoint holds no per-parameter optimizer state (saved with "
                              f"--no-save-optim, by a conversion of the weights alone, or before {index_name(0, 0, 0)}"
                              " existed); reshard its weights with tools/merge_mp_partitions.py --output-format "
                              "megatron instead")


def convert_checkpoint(src, dst, tp, pp, force=False, verify=True):
    """Writes src (a checkpoint folder, or a save root with `latest`) as a TP x PP checkpoint with its optimizer
    state per parameter into dst (a save root, or an iter_XXXXXXX folder itself), atomically. Returns
    (the source's CheckpointReader, closed; its meta; the output checkpoint folder; how many parameters' state
    was carried). Raises CheckpointError / RuntimeError / ValueError with one line naming the flag."""
    check_output_path(dst, force, [src], flag="--save")
    reader = CheckpointReader(src, flag="--load", verify=False)
    try:
        folder = reader.folder
        meta = read_meta(folder)
        check_source(folder, meta)
        # before the checksums: a wrong flag fails at once
        stages = stage_names(reader.config, tp, pp, partition_method=partition_method_of(reader.run_config))
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

        def write_rank(out, t, p, names):  # the model shard, optimizer file and index of (TP rank t, stage p)
            written = {shard_name(t, p): torch_save_synced(read_shard_for(reader, names, t, tp),
                                                           os.path.join(out, shard_name(t, p)))}
            written.update(write_optimizer_file(out, t, p, source, reader.shapes, names, tp, counters, scaler))
            return written

        out = write_checkpoint_folder(dst, reader.iteration, stages, tp, write_rank,
                                      layout_config(reader.run_config, tp, pp), out_meta, reader.tokenizer_dir,
                                      force, flag="--save")
    finally:
        reader.close()
    return reader, meta, out, len(source.names())


def convert_upstream_checkpoint(folder, dst, tp, pp, force=False, with_optimizer=True):
    """Writes the upstream Megatron-DeepSpeed checkpoint in `folder` (a global_stepN folder, upstream.locate) as
    this project's TP x PP checkpoint: the weights (TP slices merged and re-split, a window at a time), and, where
    the upstream files name the optimizer state per parameter (ZeRO's param_slice_mappings, or a universal
    checkpoint), the fp32 master weights, Adam's moments and step in the per-parameter format above, with the
    iteration, consumed samples, step counters and LR schedule position. Returns (the UpstreamCheckpoint, closed;
    the output checkpoint folder; how many parameters' optimizer state was carried, 0 for none)."""
    from megatron.checkpoint.optimizer_state import FORMAT
    from megatron.checkpoint.upstream import UpstreamCheckpoint, ZERO_RE
    from megatron.checkpoint.upstream_resume import schedule_position
    check_output_path(dst, force, [folder], flag="--save")
    checkpoint = UpstreamCheckpoint(folder)
    try:
        stages = stage_names(checkpoint.config, tp, pp)
        source = checkpoint.optimizer() if with_optimizer else None
        bf16_files = any(ZERO_RE.match(n) and n.startswith("bf16_") for n in os.listdir(folder))
        precision = "bf16" if bf16_files or checkpoint.dtype == torch.bfloat16 else \
            "fp16" if checkpoint.dtype == torch.float16 else "fp32"
        counters = {"global_steps": checkpoint.global_steps, "global_samples": checkpoint.consumed_samples,
                    "skipped_steps": checkpoint.skipped_steps,
                    "lr_scheduler": {"num_steps": schedule_position(checkpoint, sample_based=False)}}
        meta = {"iteration": checkpoint.iteration, "consumed_samples": checkpoint.consumed_samples,
                "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "data_parallel_size": None,
                "zero_stage": None, "precision": precision, "deepspeed_state": source is not None,
                "converted_from": os.path.abspath(folder), "converted_from_format": "upstream Megatron-DeepSpeed"}
        if source is not None:
            meta.update(engine_state_version=FORMAT, optimizer_format=OPTIMIZER_FORMAT_PARAMETERS)

        def write_rank(out, t, p, names):
            written = {shard_name(t, p): torch_save_synced(read_shard_for(checkpoint, names, t, tp),
                                                           os.path.join(out, shard_name(t, p)))}
            if source is not None:
                written.update(write_optimizer_file(out, t, p, source, checkpoint.shapes, names, tp, counters,
                                                    {}))
            return written

        out = write_checkpoint_folder(dst, checkpoint.iteration, stages, tp, write_rank,
                                      layout_config(checkpoint.run_config, tp, pp), meta, None, force, flag="--save")
    finally:
        checkpoint.close()
    return checkpoint, out, len(source.names()) if source is not None else 0
