"""The pipeline's tied word embedding in the optimizer state: the last stage's copy left out on save, sent on load.

With PP > 1, DeepSpeed keeps a copy of the tied word embedding on the last stage and updates it exactly as the
first stage's (its gradient is all-reduced over the pair): the copy's optimizer state (fp32 master, Adam moments)
is cut out of the last stage's saved state (drop_copies), zeros or the current values are put in its place on
load (restore_placeholders), and the first stage's state is then broadcast to it (sync_copies). How the state is
cut depends on DeepSpeed's wrapper: flat fp32 partitions (BF16_Optimizer, ZeRO 1/2), torch's state dict (fp32
without ZeRO), or per-parameter fp32 copies (FP16_UnfusedOptimizer).
"""
import torch
import torch.distributed as dist

from megatron.core.parallel_state import comm_device


def _tied_weights(engine):
    """[(name, param, comm)] for the pipeline's tied weights on this rank (DeepSpeed's PipelineModule.tied_comms);
    the first stage of each group (its lowest rank) owns the state, the others hold copies."""
    module = engine.module
    comms = getattr(module, "tied_comms", None) or {}
    names = {id(p): n for n, p in module.named_parameters()}
    found = []
    for key in sorted(comms):
        comm = comms[key]
        for attr in comm["weight_attr"]:
            param = module._recursive_getattr(comm["module"], attr)
            found.append((names[id(param)], param, comm))
    return found


def _copies(engine):
    return [(name, param) for name, param, comm in _tied_weights(engine) if dist.get_rank() != min(comm["ranks"])]


def param_index(optimizer_params, param):
    """Position of param in torch's state_dict numbering (parameters of all groups, in order)."""
    flat = [p for group in optimizer_params for p in group]
    return next(i for i, p in enumerate(flat) if p is param)


def _kind(optimizer):
    """How the tied copies' state is left out for this optimizer wrapper (the same answer on every rank), or None
    where it is kept (another wrapper; ZeRO's elastic checkpoints, where every rank reads all partitions)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if getattr(optimizer, "elastic_checkpoint", False):
        return None
    if isinstance(optimizer, (BF16_Optimizer, DeepSpeedZeroOptimizer)):
        return "flat"
    if isinstance(optimizer, torch.optim.Optimizer):
        return "torch"
    if isinstance(optimizer, FP16_UnfusedOptimizer):
        return "unfused"
    return None


def drop_copies(engine, state):
    """Removes the tied copies' optimizer state from state (in place). Returns what load must put back."""
    optimizer = engine.optimizer
    copies = _copies(engine)
    kind = _kind(optimizer) if copies else None
    if kind == "flat":
        # BF16_Optimizer, ZeRO 1/2: flat fp32 partitions; cut each copy's fragment out of every flat tensor
        ranges = {}
        for group, mapping in enumerate(state["param_slice_mappings"]):
            spans = sorted((mapping[name].start, mapping[name].numel) for name, _ in copies if name in mapping)
            if spans:
                ranges[group] = spans
        cut = []
        base = state["base_optimizer_state"] = {**state["base_optimizer_state"],
                                                "state": dict(state["base_optimizer_state"]["state"])}
        fp32 = state.get("single_partition_of_fp32_groups")
        if fp32 is not None:
            state["single_partition_of_fp32_groups"] = fp32 = list(fp32)
        for group, spans in ranges.items():
            end = max(start + numel for start, numel in spans)
            if fp32 is not None:
                cut.append(("fp32", group, None, fp32[group].numel()))
                fp32[group] = _cut(fp32[group], spans)
            if group not in base["state"]:  # no step taken yet (every fp16 step skipped, say): no moments
                continue
            entry = base["state"][group] = dict(base["state"][group])
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() >= end:
                    cut.append(("state", group, key, value.numel()))
                    entry[key] = _cut(value, spans)
        return {"kind": "flat", "ranges": ranges, "cut": cut}
    if kind == "torch":
        params = [group["params"] for group in optimizer.param_groups]
        indices = [param_index(params, param) for _, param in copies]
        state["state"] = {i: s for i, s in state["state"].items() if i not in indices}
        return {"kind": "torch", "indices": indices}
    if kind == "unfused":  # per-parameter fp32 copies, torch's state over them
        groups = optimizer.fp16_groups
        places = [next((g, j) for g, group in enumerate(groups) for j, p in enumerate(group) if p is param)
                  for _, param in copies]
        indices = [param_index(groups, param) for _, param in copies]
        state["fp32_groups"] = [list(group) for group in state["fp32_groups"]]
        for g, j in places:
            state["fp32_groups"][g][j] = torch.empty(0)
        inner = state["optimizer_state_dict"] = dict(state["optimizer_state_dict"])
        inner["state"] = {i: s for i, s in inner["state"].items() if i not in indices}
        return {"kind": "unfused", "places": places, "indices": indices}
    return None


def _cut(tensor, spans):
    keep, position = [], 0
    for start, numel in spans:
        keep.append(tensor[position:start])
        position = start + numel
    keep.append(tensor[position:])
    return torch.cat(keep)


def _paste_zeros(tensor, spans, numel):
    """The inverse of _cut: a tensor of numel elements, tensor's elements in order, zeros in the spans."""
    out = torch.zeros(numel, dtype=tensor.dtype, device=tensor.device)
    taken = position = 0
    for start, length in spans:
        out[position:start] = tensor[taken:taken + start - position]
        taken += start - position
        position = start + length
    out[position:] = tensor[taken:]
    return out


def restore_placeholders(engine, state, removed):
    """Puts placeholders where drop_copies cut (the values come from the first stage afterwards)."""
    if not removed:
        return state
    if removed["kind"] == "flat":
        base = state["base_optimizer_state"] = {**state["base_optimizer_state"],
                                                "state": dict(state["base_optimizer_state"]["state"])}
        if "single_partition_of_fp32_groups" in state:
            state["single_partition_of_fp32_groups"] = list(state["single_partition_of_fp32_groups"])
        for where, group, key, numel in removed["cut"]:
            spans = removed["ranges"][group]
            if where == "fp32":
                fp32 = state["single_partition_of_fp32_groups"]
                fp32[group] = _paste_zeros(fp32[group], spans, numel)
            else:
                entry = base["state"][group] = dict(base["state"][group])
                entry[key] = _paste_zeros(entry[key], spans, numel)
    elif removed["kind"] == "unfused":
        state["fp32_groups"] = [list(group) for group in state["fp32_groups"]]
        for g, j in removed["places"]:
            state["fp32_groups"][g][j] = engine.optimizer.fp32_groups[g][j].detach().clone()
    return state


def _live_state(optimizer, param):
    """name -> tensor of param's full (unpartitioned) optimizer state, fp32 master included; collective over the
    DP group for partitioned optimizers."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    if hasattr(param, "_hp_mapping"):
        # every DP rank asks for the same keys (each call all-reduces), also one holding no fragment of param
        keys = sorted({key for flat in optimizer.optimizer.state.values() for key, value in flat.items()
                       if torch.is_tensor(value) and value.dim() == 1})
        state = {"fp32": safe_get_full_fp32_param(param)}
        for key in keys:
            state[key] = safe_get_full_optimizer_state(param, key)
        return state
    if isinstance(optimizer, torch.optim.Optimizer):
        return dict(optimizer.state[param])
    for g, group in enumerate(optimizer.fp16_groups):  # FP16_UnfusedOptimizer
        for j, p in enumerate(group):
            if p is param:
                master = optimizer.fp32_groups[g][j]
                return {"fp32": master, **optimizer.optimizer.state[master]}
    raise AssertionError(f"tied parameter not found in {type(optimizer).__name__}")


def sync_copies(engine):
    """Sends the first stage's optimizer state of each tied weight to the stages holding copies."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    optimizer = engine.optimizer
    device = comm_device()
    tied = _tied_weights(engine) if _kind(optimizer) else []
    if tied and hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        # load_state_dict re-created the fragment mappings without their views of the Adam moments, which
        # DeepSpeed links only after the first step: link them now, to the loaded moments.
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    for _, param, comm in tied:
        src = min(comm["ranks"])
        own = dist.get_rank() == src
        state = _live_state(optimizer, param) if own else None
        layout = [[(k, tuple(v.shape), v.dtype, v.device.type) for k, v in state.items()] if own else None]
        dist.broadcast_object_list(layout, src=src, group=comm["group"])
        received = {}
        for key, shape, dtype, device_type in layout[0]:
            tensor = state[key].detach().to(device).contiguous() if own else \
                torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=src, group=comm["group"])
            received[key] = (tensor, device_type)
        if own:
            continue
        if hasattr(param, "_hp_mapping"):  # BF16_Optimizer, ZeRO 1/2: each rank writes its own fragment
            safe_set_full_fp32_param(param, received.pop("fp32")[0])
            for key, (value, _) in received.items():
                safe_set_full_optimizer_state(param, value, key)
            continue
        place = {k: v if kind != "cpu" else v.cpu() for k, (v, kind) in received.items()}
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer.state[param] = place
        else:  # FP16_UnfusedOptimizer
            master = _live_state(optimizer, param)["fp32"]
            master.data.copy_(place.pop("fp32"))
            optimizer.optimizer.state[master] = place
