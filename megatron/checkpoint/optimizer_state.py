"""Optimizer state for checkpoints: the DeepSpeed engine's training state saved without weights, restored anywhere.

The state is the optimizer wrapper's, the LR schedule position and the step counters, collected without model
weights and with every tensor once, and restored into any optimizer wrapper.

What DeepSpeed wraps our optimizer in, by precision, ZeRO stage and pipeline (each has its own state_dict):

    fp32, ZeRO 0                      torch's AdamW itself                 replicated over DP
    bf16/fp16, ZeRO 0, PP 1           FP16_UnfusedOptimizer                replicated over DP
    fp16, ZeRO 0, PP > 1              FP16_UnfusedOptimizer                replicated over DP
    bf16, ZeRO 0, PP > 1              BF16_Optimizer                       partitioned over DP
    any, ZeRO 1/2                     DeepSpeedZeroOptimizer               partitioned over DP
    any, ZeRO 3                       DeepSpeedZeroOptimizer_Stage3        partitioned over DP

Replicated state is collected on DP rank 0 only. Two things would otherwise be stored twice:
- in fp32, ZeRO's fp32 partitions equal the weights (kept in the model shards): they are left out and rebuilt
  from the loaded weights;
- with PP > 1, DeepSpeed keeps a copy of the tied word embedding on the last stage and updates it exactly as
  the first stage's (its gradient is all-reduced over the pair): the copy's optimizer state (fp32 master,
  Adam moments) is left out of the last stage's file and sent from the first stage after loading
  (megatron/checkpoint/tied.py).

parameter_index() says where each parameter's state lies in the saved dict (megatron/checkpoint/saved_optimizer.py
writes it beside the file); restore_from_parameters() writes per-parameter state read on any layout into any wrapper
(DeepSpeed's safe_set_full_fp32_param / safe_set_full_optimizer_state for ZeRO 1-3 and BF16_Optimizer, whose
Adam state is created first as its first step would; the state dicts of torch's AdamW and FP16_UnfusedOptimizer
directly).

This replaces engine.save_checkpoint/load_checkpoint, which also write the module's weights (a second copy of the
model shards) and, for BF16_Optimizer without ZeRO (bf16 with pipeline parallelism), store its state twice and
then cannot load it: the engine hands BF16_Optimizer.load_state_dict the state of one rank where it indexes a
list of per-DP-rank states (KeyError: 0).
"""
import torch
import torch.distributed as dist

from megatron.checkpoint import tied
from megatron.checkpoint.saved_optimizer import KEYS, target_slice

# Where DeepSpeed's ZeRO optimizers keep their fp32 partitions in state_dict().
FP32_MASTER_KEYS = ("single_partition_of_fp32_groups", "fp32_flat_groups")
FORMAT = 2  # checkpoints' "engine_state_version"; 1 was DeepSpeed's own files (engine.save_checkpoint)


def partitioned(optimizer):
    """True when each DP rank holds its own part of the state (ZeRO 1-3, BF16_Optimizer); False when every DP
    rank holds the same (torch's optimizer, FP16_(Unfused)Optimizer), so DP rank 0's copy serves all."""
    return hasattr(optimizer, "dp_process_group")


def _zero_optimizer(optimizer):
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    return isinstance(optimizer, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3))


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


def _event(optimizer, name):
    """ZeRO-3's checkpoint_event_prologue/epilogue (partition every parameter / regather persistent ones)."""
    hook = getattr(optimizer, f"checkpoint_event_{name}", None)
    if hook is not None:
        hook()


def collect(engine, precision, dp_rank):
    """This rank's engine state to save, or None where DP rank 0's holds the same. CPU or device tensors."""
    optimizer = engine.optimizer
    if not partitioned(optimizer) and dp_rank != 0:
        return None
    _event(optimizer, "prologue")
    try:
        state = dict(optimizer.state_dict())
    finally:
        _event(optimizer, "epilogue")
    dropped = None
    if precision == "fp32" and _zero_optimizer(optimizer) and not getattr(optimizer, "elastic_checkpoint", False):
        dropped = next((key for key in FP32_MASTER_KEYS if key in state), None)
        state.pop(dropped, None)
    tied_removed = tied.drop_copies(engine, state)
    scheduler = getattr(engine, "lr_scheduler", None)
    return {"optimizer": compact(state), "optimizer_class": type(optimizer).__name__,
            "fp32_master_from_weights": dropped, "tied_removed": tied_removed,
            "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps}


def restore(engine, saved, read_dp_rank=None):
    """Loads collect()'s dict into an engine whose module already holds the checkpoint's weights.

    read_dp_rank(r) returns DP rank r's saved dict (needed only with ZeRO's elastic_checkpoint). Raises ValueError
    when the state comes from another optimizer wrapper. Collective over the pipeline's tied-weight groups.
    """
    optimizer = engine.optimizer
    if saved["optimizer_class"] != type(optimizer).__name__:
        raise ValueError(f"the optimizer state was written by DeepSpeed's {saved['optimizer_class']}, this run uses "
                         f"{type(optimizer).__name__}")
    state = tied.restore_placeholders(engine, dict(saved["optimizer"]), saved["tied_removed"])
    dropped = saved["fp32_master_from_weights"]
    _event(optimizer, "prologue")
    if dropped == "fp32_flat_groups":  # ZeRO-3 always restores its partitions from the state: give it the weights
        state[dropped] = [t.detach().clone() for t in optimizer.fp16_partitioned_groups_flat]
    if partitioned(optimizer):
        dp_rank = dist.get_rank(group=optimizer.dp_process_group)
        dp_size = dist.get_world_size(group=optimizer.dp_process_group)
        if getattr(optimizer, "elastic_checkpoint", False):  # merges every partition's state, as DeepSpeed does
            state_list = [state if r == dp_rank else read_dp_rank(r)["optimizer"] for r in range(dp_size)]
        else:
            state_list = [None] * dp_size
            state_list[dp_rank] = state
        optimizer.load_state_dict(state_dict_list=state_list, load_optimizer_states=True,
                                  load_from_fp32_weights=dropped is None, checkpoint_folder=None)
    elif isinstance(optimizer, torch.optim.Optimizer):
        optimizer.load_state_dict(state)
    else:  # FP16_UnfusedOptimizer / FP16_Optimizer
        optimizer.load_state_dict(state, load_optimizer_states=True)
    _event(optimizer, "epilogue")
    tied.sync_copies(engine)
    restore_counters(engine, saved)


def refresh_master_weights(engine):
    """Copies the module's (just loaded) weights into the optimizer's fp32 master weights where it keeps them
    (bf16/fp16, ZeRO); without it the first step would continue from the master weights of initialization."""
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if refresh is not None:
        refresh()


# ---------------------------------------------------------------- per-parameter index, resuming on another layout


def _canonical_params(engine, num_layers, pp_rank, include_tied_copies):
    """[(canonical name, param)] of this rank's module (BloomModel names); the last stage's tied embedding copy
    only with include_tied_copies (it holds the first stage's state)."""
    from megatron.model.pipeline import canonical_name, is_pipeline_module
    module = engine.module
    found = []
    for name, param in module.named_parameters():
        canonical = canonical_name(name, num_layers) if is_pipeline_module(module) else name
        if canonical is None:
            continue
        if canonical.startswith("embedding.") and pp_rank != 0 and not include_tied_copies:
            continue
        found.append((canonical, param))
    return found


def partition_dims(module):
    """{id(param): the dim along which the tensor-parallel layer owning param splits it, None where every TP rank
    holds all of it}, whatever this run's TP size: the layers set `partition_dim` on their split parameters
    (megatron/core/tensor_parallel/layers.py; `tensor_model_parallel` only when TP > 1). RowParallelLinear's
    bias carries a `partition_dim` too but is whole on every rank."""
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


def _step_of(states):
    for entry in states:
        step = entry.get("step") if isinstance(entry, dict) else None
        if step is not None:
            return float(step)
    return None


def parameter_index(engine, saved, num_layers, pp_rank):
    """(step, {canonical name: entry}) saying where each parameter's state lies in collect()'s dict `saved`
    (megatron/checkpoint/saved_optimizer.py describes the entries). Local, no collective."""
    optimizer = engine.optimizer
    state = saved["optimizer"]
    dropped = saved["fp32_master_from_weights"]
    removed = saved["tied_removed"] or {}
    params = {}

    dims = partition_dims(engine.module)

    def add(name, param, shape, piece):
        entry = params.setdefault(name, {"shape": list(shape), "partition_dim": dims.get(id(param)), "pieces": []})
        entry["pieces"].append(piece)

    named = _canonical_params(engine, num_layers, pp_rank, include_tied_copies=False)
    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3: each parameter partitioned on its own
        inner = optimizer.optimizer
        optimizer._set_fp32_optimizer_param_groups()
        try:
            flats = [p for group in inner.param_groups for p in group["params"]]
        finally:
            optimizer._clear_fp32_optimizer_param_groups()
        numbers = {id(flat): i for i, flat in enumerate(flats)}
        for name, param in named:
            sub, offset, count = optimizer.grad_position[optimizer.get_param_id(param)]
            start = optimizer._get_param_partition_rank(param) * count
            numel = max(0, min(count, param.ds_numel - start))
            if numel == 0:
                continue
            number = numbers[id(optimizer.fp32_partitioned_groups_flat[sub])]
            add(name, param, param.ds_shape, {
                "state": ["optimizer_state_dict", "state", number],
                "fp32": None if dropped else ["fp32_flat_groups", sub],
                "offset": offset, "start": start, "numel": numel})
        step = _step_of(state["optimizer_state_dict"]["state"].values())
    elif any(hasattr(p, "_hp_mapping") for _, p in named):  # BF16_Optimizer, ZeRO 1/2: flat partitions
        spans = removed.get("ranges", {}) if removed.get("kind") == "flat" else {}
        for name, param in named:
            mapping = param._hp_mapping
            if mapping is None:  # no fragment of param in this DP rank's partition
                continue
            group = mapping.param_group_index
            offset = mapping.hp_fragment_address.start
            offset -= sum(numel for begin, numel in spans.get(group, ()) if begin < offset)  # the tied copy's cut
            add(name, param, param.shape, {
                "state": ["base_optimizer_state", "state", group],
                "fp32": None if dropped else ["single_partition_of_fp32_groups", group],
                "offset": offset, "start": mapping.lp_fragment_address.start,
                "numel": mapping.lp_fragment_address.numel})
        step = _step_of(state["base_optimizer_state"]["state"].values())
    elif isinstance(optimizer, torch.optim.Optimizer):  # fp32 without ZeRO: torch's AdamW, weights are the master
        order = [group["params"] for group in optimizer.param_groups]
        for name, param in named:
            number = tied.param_index(order, param)
            if number in state["state"]:
                add(name, param, param.shape, {"state": ["state", number], "fp32": None, "offset": 0, "start": 0,
                                               "numel": param.numel()})
        step = _step_of(state["state"].values())
    else:  # FP16_UnfusedOptimizer: an fp32 copy per parameter
        groups = optimizer.fp16_groups
        inner = state["optimizer_state_dict"]["state"]
        for name, param in named:
            g, j = next((g, j) for g, group in enumerate(groups) for j, p in enumerate(group) if p is param)
            number = tied.param_index(groups, param)
            if number in inner:
                add(name, param, param.shape, {"state": ["optimizer_state_dict", "state", number],
                                               "fp32": ["fp32_groups", g, j], "offset": 0, "start": 0,
                                               "numel": param.numel()})
        step = _step_of(inner.values())
    return step, params


def _fresh_adam_state(inner, tensor, step):
    """Adam's state for tensor in torch's optimizer `inner`, created as its first step would (zero moments)."""
    entry = inner.state[tensor]
    for key in ("exp_avg", "exp_avg_sq"):
        if key not in entry:
            entry[key] = torch.zeros_like(tensor, memory_format=torch.preserve_format)
    entry["step"] = torch.tensor(float(step), dtype=torch.float32)
    return entry


def restore_from_parameters(engine, source, num_layers, pp_rank, tp, tp_rank):
    """Writes a checkpoint's per-parameter optimizer state (saved_optimizer.SavedOptimizer, any layout) into this
    rank's optimizer wrapper: for each local parameter, its new TP slice of the fp32 master weights (where the
    wrapper keeps them; fp32 runs take the loaded weights) and of Adam's moments, and the step count. The module
    must hold the checkpoint's weights already. Local, no collective. Returns how many parameters were set."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    optimizer = engine.optimizer
    step = source.step
    refresh_master_weights(engine)  # the fp32 master from the loaded weights; replaced below where saved
    if step is None:  # saved before any optimizer step: nothing but the weights to carry
        return 0
    named = _canonical_params(engine, num_layers, pp_rank, include_tied_copies=True)
    missing = sorted(n for n, _ in named if n not in source.entries)
    if missing:
        raise ValueError(f"its optimizer index holds no state for {', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''} (a checkpoint of another model?)")
    with_fp32 = source.has_fp32()

    live_dims = canonical_partition_dims(engine.module, num_layers)

    def piece(name, key):
        dim = source.partition_dim(name)
        dim = live_dims.get(name) if dim is None else dim  # checkpoints that recorded no dim at TP 1
        return target_slice(source.full(name, key, dim), dim, tp, tp_rank)

    if hasattr(optimizer, "fp32_partitioned_groups_flat") or hasattr(optimizer, "bit16_groups") or \
            hasattr(optimizer, "bf16_groups"):  # ZeRO-3, ZeRO 1/2, BF16_Optimizer: flat fp32 partitions
        inner = optimizer.optimizer
        flats = getattr(optimizer, "fp32_partitioned_groups_flat", None) or \
            [p for group in inner.param_groups for p in group["params"]]
        for flat in flats:
            _fresh_adam_state(inner, flat, step)
        if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
            optimizer._hp_optimizer_states_linked = False
            optimizer._lazy_init_hp_params_optimizer_state()
        for name, param in named:
            if with_fp32:
                safe_set_full_fp32_param(param, piece(name, "fp32").to(param.device))
            for key in KEYS:
                safe_set_full_optimizer_state(param, piece(name, key).to(param.device), key)
    elif isinstance(optimizer, torch.optim.Optimizer):
        for name, param in named:
            if with_fp32:  # a bf16/fp16 checkpoint resumed in fp32: its master, not the rounded weights
                param.data.copy_(piece(name, "fp32"))
            optimizer.state[param] = {"step": torch.tensor(float(step), dtype=torch.float32),
                                      **{key: piece(name, key).to(param) for key in KEYS}}
    else:  # FP16_UnfusedOptimizer
        masters = {id(p): optimizer.fp32_groups[g][j] for g, group in enumerate(optimizer.fp16_groups)
                   for j, p in enumerate(group)}
        for name, param in named:
            master = masters[id(param)]
            if with_fp32:
                master.data.copy_(piece(name, "fp32"))
            optimizer.optimizer.state[master] = {"step": torch.tensor(float(step), dtype=torch.float32),
                                                 **{key: piece(name, key).to(master) for key in KEYS}}
    return len(named)


def restore_counters(engine, saved):
    """The engine's step counters and the LR schedule's position from a collect() dict (layout-independent)."""
    engine.global_steps = saved["global_steps"]
    engine.global_samples = saved["global_samples"]
    engine.skipped_steps = saved["skipped_steps"]
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and saved["lr_scheduler"] is not None:
        scheduler.load_state_dict(saved["lr_scheduler"])


SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _scaler_of(optimizer):
    """The object holding an fp16 wrapper's loss-scale state (ZeRO's loss_scaler, FP16_(Unfused)Optimizer's
    loss_scale_config), or None (fp32, bf16)."""
    for attr in ("loss_scaler", "loss_scale_config"):
        scaler = getattr(optimizer, attr, None)
        if scaler is not None and hasattr(scaler, "cur_scale"):
            return scaler
    return None


def restore_loss_scale(engine, saved):
    """The dynamic loss scaler's position (scale, iterations since the last overflow) from a collect() dict
    written by any fp16 wrapper into this run's (another layout may use another wrapper). Returns the scale set,
    or None where there is nothing to carry (fp32, bf16)."""
    target = _scaler_of(engine.optimizer)
    state = saved["optimizer"]
    source = state.get("loss_scaler") if isinstance(state, dict) else None
    values = {f: getattr(source, f) for f in SCALER_FIELDS if hasattr(source, f)} if source is not None else \
        {f: state[f] for f in SCALER_FIELDS if isinstance(state, dict) and f in state}
    if target is None or "cur_scale" not in values:
        return None
    for field, value in values.items():
        if hasattr(target, field):
            setattr(target, field, value)
    return values["cur_scale"]
