"""Optimizer state for checkpoints: each parameter's state saved by name and region, restored into any wrapper.

A rank's optimizer file holds, for every parameter whose state it holds (megatron/checkpoint/adapters.py: one
adapter per DeepSpeed optimizer wrapper), the region of the parameter's flattened TP slice that it holds: Adam's
moments and, where the wrapper keeps them apart from the weights (bf16/fp16), the fp32 master weights; plus the
fp16 loss scaler's fields, the LR schedule position and the step counters. Its index file names the same
parameters and regions (megatron/checkpoint/saved_optimizer.py), so a checkpoint is read the same way whatever
wrapper wrote it and whatever layout reads it:

    {"optimizer": {"params": {canonical name: {"exp_avg": 1-D, "exp_avg_sq": 1-D, "fp32": 1-D (bf16/fp16)}},
                   "cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis" (fp16: the loss scaler)},
     "wrapper": the adapter's kind, "lr_scheduler", "global_steps", "global_samples", "skipped_steps"}

Every tensor is stored once: the weights only in the model shards (in fp32 they are the master weights: nothing
more is saved, and the wrappers' fp32 copies are rebuilt from the loaded weights); state replicated over DP only by
DP rank 0; the pipeline's tied word embedding only by the first stage (the last stage's copy is updated exactly as
the first stage's, and reads its state from the first stage's files on load).

Restoring, on the same layout or another, is one loop (restore_from_parameters): each of this rank's slots reads
its region from the saved files, on any TP size only the saved elements that overlap it (SavedOptimizer.window),
and the adapter writes it into the wrapper. Checkpoints of FORMAT 2 (DeepSpeed's
state_dict per rank, indexed by paths into it) restore through the same loop; FORMAT 1 (DeepSpeed's own files)
through engine.load_checkpoint (megatron/checkpoint/load.py).
"""
import torch

from megatron.checkpoint.adapters import KEYS, adapter_for
from megatron.checkpoint.saved_optimizer import SavedOptimizer, index_entry, index_text, target_slice

FORMAT = 3  # meta.json's "engine_state_version": 1 DeepSpeed's files, 2 its state_dicts + paths, 3 this module's
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def compact(obj):
    """obj with every tensor that views a larger storage copied out (torch.save writes a view's whole storage)."""
    if torch.is_tensor(obj):
        if obj.untyped_storage().nbytes() <= obj.numel() * obj.element_size():
            return obj
        return obj.detach().cpu() if obj.device.type != "cpu" else obj.detach().clone()  # no device memory
    if isinstance(obj, dict) and type(obj).__name__ in ("dict", "OrderedDict"):
        return type(obj)((k, compact(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(compact(v) for v in obj)
    return obj


def partition_dims(module):
    """{id(param): the dim along which the tensor-parallel layer owning param splits it, None where every TP rank
    holds all of it}, whatever this run's TP size: the layers set `partition_dim` on their split parameters
    (megatron/core/tensor_parallel/layers.py; `tensor_model_parallel` only when TP > 1). RowParallelLinear's
    bias carries a `partition_dim` too but is whole on every rank. The one place checkpoints learn a parameter's
    TP split (a parameter spec can replace its body)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    dims = {}
    for layer in module.modules():
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            for name, param in layer.named_parameters(recurse=False):
                replicated = isinstance(layer, RowParallelLinear) and name == "bias"
                dims[id(param)] = None if replicated else param.partition_dim
    return dims


def canonical_partition_dims(module, num_layers):
    """{canonical name: partition dim} of this rank's module (partition_dims under BloomModel's names)."""
    from megatron.model.pipeline import canonical_name, is_pipeline_module
    dims = partition_dims(module)
    out = {}
    for name, param in module.named_parameters():
        canonical = canonical_name(name, num_layers) if is_pipeline_module(module) else name
        if canonical is not None:
            out[canonical] = dims.get(id(param))
    return out


def collect(engine, num_layers, pp_rank, dp_rank):
    """(this rank's optimizer file dict, its index's JSON), or None where DP rank 0's holds the same. Local."""
    adapter = adapter_for(engine, num_layers, pp_rank)
    if not adapter.partitioned and dp_rank != 0:
        return None
    dims = partition_dims(engine.module)
    params, index = {}, {}
    for slot in adapter.params():
        if not adapter.owns_tied(slot.name):
            continue
        state = adapter.get(slot)
        if not all(key in state for key in KEYS):  # no step taken yet: nothing but the weights to save
            continue
        params[slot.name] = {key: compact(value.detach()) for key, value in state.items()}
        index[slot.name] = index_entry(slot.shape, dims.get(id(slot.param)), slot.start, slot.numel,
                                       "fp32" in state)
    scaler = adapter.scaler()
    fields = {f: getattr(scaler, f) for f in SCALER_FIELDS if hasattr(scaler, f)} if scaler is not None else {}
    lr_scheduler = getattr(engine, "lr_scheduler", None)
    saved = {"optimizer": {"params": params, **fields}, "wrapper": adapter.kind,
             "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
             "global_steps": engine.global_steps, "global_samples": engine.global_samples,
             "skipped_steps": engine.skipped_steps}
    return saved, index_text(adapter.step(), index)


def _region(source, slot, key, dim, tp, tp_rank):
    """slot's region of the saved state `key`, as 1-D fp32: from our checkpoints only the saved elements that
    overlap it (SavedOptimizer.window, on any TP size); from upstream.py's readers, the whole parameter re-split."""
    if isinstance(source, SavedOptimizer):
        return source.window(slot.name, key, tp, tp_rank, slot.start, slot.numel, dim)
    whole = target_slice(source.full(slot.name, key, dim), dim, tp, tp_rank)
    return whole.reshape(-1)[slot.start:slot.start + slot.numel]


def restore_from_parameters(engine, source, num_layers, pp_rank, tp, tp_rank):
    """Writes a checkpoint's per-parameter optimizer state (saved_optimizer.SavedOptimizer, or upstream.py's
    readers, any layout) into this rank's optimizer wrapper: each local slot's region of Adam's moments and of the
    fp32 master weights where they were saved (else taken from the loaded weights), and the step count. The module
    must hold the checkpoint's weights already. Local, no collective. Returns how many slots were set."""
    adapter = adapter_for(engine, num_layers, pp_rank)
    adapter.refresh_master()  # the fp32 master from the loaded weights; replaced below where saved
    if source.step is None:  # saved before any optimizer step: nothing but the weights to carry
        return 0
    missing = sorted(name for name, _ in adapter.named_parameters() if name not in source.entries)
    if missing:
        raise ValueError(f"its optimizer index holds no state for {', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''} (a checkpoint of another model?)")
    live_dims = canonical_partition_dims(engine.module, num_layers)
    adapter.prepare(source.step)
    slots = adapter.params()
    for slot in slots:
        dim = source.partition_dim(slot.name)
        dim = live_dims.get(slot.name) if dim is None else dim  # checkpoints that recorded no dim at TP 1
        keys = (("fp32",) if source.has_fp32(slot.name) else ()) + KEYS
        adapter.set(slot, {key: _region(source, slot, key, dim, tp, tp_rank) for key in keys})
    return len(slots)


def refresh_master_weights(engine):
    """Copies the module's (just loaded) weights into the optimizer's fp32 master weights where it keeps them
    (bf16/fp16, ZeRO); without it the first step would continue from the master weights of initialization."""
    adapter_for(engine).refresh_master()


def restore_counters(engine, saved):
    """The engine's step counters and the LR schedule's position from a saved file's dict (layout-independent)."""
    engine.global_steps = saved["global_steps"]
    engine.global_samples = saved["global_samples"]
    engine.skipped_steps = saved["skipped_steps"]
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and saved["lr_scheduler"] is not None:
        scheduler.load_state_dict(saved["lr_scheduler"])


def restore_loss_scale(engine, saved):
    """The dynamic loss scaler's position (scale, iterations since the last overflow) from a saved file's dict,
    written by any fp16 wrapper (FORMAT 2 files hold ZeRO's scaler object or the unfused wrapper's fields) into this
    run's. Returns the scale set, or None where there is nothing to carry (fp32, bf16)."""
    target = adapter_for(engine).scaler()
    state = saved["optimizer"]
    source = state.get("loss_scaler") if isinstance(state, dict) else None
    values = {f: getattr(source, f) for f in SCALER_FIELDS if hasattr(source, f)} if source is not None else \
        {f: state[f] for f in SCALER_FIELDS if isinstance(state, dict) and f in state}
    if target is None or not hasattr(target, "cur_scale") or "cur_scale" not in values:
        return None
    for field, value in values.items():
        if hasattr(target, field):
            setattr(target, field, value)
    return values["cur_scale"]
