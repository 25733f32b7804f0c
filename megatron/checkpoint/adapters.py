"""One adapter per DeepSpeed optimizer wrapper: each parameter's optimizer state as plain tensors, read and written.

DeepSpeed wraps our torch optimizer in one of four ways, by precision, ZeRO stage and pipeline, each keeping the
fp32 master weights and Adam's moments in its own structures:

    TorchAdapter    fp32, ZeRO 0: torch's optimizer itself (the weights are the master)     replicated over DP
    UnfusedAdapter  bf16/fp16, ZeRO 0 (bf16 only with PP 1): FP16_UnfusedOptimizer,         replicated over DP
                    an fp32 copy of each parameter
    FlatAdapter     ZeRO 1/2 (DeepSpeedZeroOptimizer) and BF16_Optimizer (bf16, ZeRO 0,     partitioned over DP
                    PP > 1): one flat fp32 partition per parameter group and DP rank
    Zero3Adapter    ZeRO 3 (DeepSpeedZeroOptimizer_Stage3): each parameter partitioned      partitioned over DP
                    over DP on its own

The interface (Adapter), all the rest of megatron/checkpoint uses:
    params()        this rank's Slots: a parameter's canonical (BloomModel) name, the parameter, its shape, and the
                    region (start, numel) of its flattened TP slice whose state this rank holds (all of it where the
                    state is replicated over DP)
    get(slot)       the region's state: "fp32" (the master weights, where the wrapper keeps them apart from the
                    module's weights) and Adam's moments (KEYS), 1-D tensors of slot.numel elements
    set(slot, s)    writes such a state into the wrapper (in place: DeepSpeed's own views of it stay valid);
                    prepare(step) first creates the moments a fresh wrapper has not made yet and sets the step count
    owns_tied(name) whether this rank's state of parameter `name` is the one saved: the last pipeline stage's copy
                    of the tied word embedding is not (DeepSpeed all-reduces its gradient with the first stage's
                    and updates both alike, so the first stage's state serves both)
plus step(), scaler() (the fp16 loss scaler's object) and refresh_master(). What each adapter reads of DeepSpeed
is named in its docstring; nothing else in megatron/checkpoint reads DeepSpeed's optimizer internals.

The unfused wrapper's gradient norm, fp16 loss scaling and host synchronizations are changed by
UnfusedAdapter.install (megatron/optimizer/unfused.py says what and why).

Tested with DeepSpeed 0.19.8 (requirements.txt pins the range; tests/unit/test_checkpointing.py round-trips
every adapter through real engines).
"""
import dataclasses
import logging

import torch

from megatron.optimizer.unfused import TESTED_DEEPSPEED

logger = logging.getLogger(__name__)

KEYS = ("exp_avg", "exp_avg_sq")  # Adam's per-element state, what checkpoints carry besides the fp32 master


@dataclasses.dataclass(frozen=True)
class Slot:
    """The region [start, start + numel) of a parameter's flattened TP slice whose optimizer state a rank holds."""
    name: str
    param: torch.nn.Parameter = dataclasses.field(compare=False, repr=False)
    shape: tuple
    start: int
    numel: int


class Adapter:
    """The interface (see the module docstring); subclasses hold one wrapper's specifics."""
    kind = None
    partitioned = False  # True: each DP rank holds its own part of the state; False: DP rank 0's serves all

    def __init__(self, engine, num_layers=None, pp_rank=0):
        self.engine, self.optimizer = engine, engine.optimizer
        self.num_layers, self.pp_rank = num_layers, pp_rank

    @classmethod
    def install(cls):
        """Changes of DeepSpeed's behaviour this wrapper needs, installed when the adapter is chosen."""

    def named_parameters(self):
        """[(canonical name, parameter)] of this rank's module that the optimizer trains."""
        from megatron.model.pipeline import canonical_name, is_pipeline_module
        module = self.engine.module
        pipeline = is_pipeline_module(module)
        found = []
        for name, param in module.named_parameters():
            canonical = canonical_name(name, self.num_layers) if pipeline else name
            if canonical is not None and param.requires_grad:
                found.append((canonical, param))
        return found

    def params(self):
        return [Slot(name, param, tuple(param.shape), 0, param.numel()) for name, param in self.named_parameters()]

    def owns_tied(self, name):
        """False for the copy of the tied word embedding (and its layer norm) held by a later pipeline stage."""
        return self.pp_rank == 0 or not name.startswith("embedding.")

    def get(self, slot):
        raise NotImplementedError

    def set(self, slot, state):
        raise NotImplementedError

    def _entries(self):
        """[(tensor, its state dict, its param group)] of the torch optimizer that takes the steps."""
        inner = self.optimizer.optimizer
        return [(t, inner.state[t], group) for group in inner.param_groups for t in group["params"]]

    def step(self):
        """The optimizer's step count (None before the first step)."""
        for _, entry, group in self._entries():
            step = entry.get("step", group.get("step"))
            if step is not None:
                return float(step)
        return None

    def prepare(self, step):
        """Creates Adam's moments where the wrapper has none yet (zeros, as its first step would) and sets the step
        count everywhere, in the form the optimizer keeps it."""
        for tensor, entry, group in self._entries():
            for key in KEYS:
                if key not in entry:
                    entry[key] = torch.zeros_like(tensor, memory_format=torch.preserve_format)
            if "step" in group:  # DeepSpeed's FusedAdam counts per group
                group["step"] = int(step)
            old = entry.get("step")
            if torch.is_tensor(old):
                old.fill_(step)
            elif old is not None:
                entry["step"] = type(old)(step)
            elif "step" not in group:  # torch's Adam: a float32 scalar, on the device when fused or capturable
                device = tensor.device if group.get("fused") or group.get("capturable") else "cpu"
                entry["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)

    def scaler(self):
        """The object holding the fp16 loss scaler's state (cur_scale, ...), None where there is none."""
        return None

    def refresh_master(self):
        """Copies the module's weights into the fp32 master weights, where the wrapper keeps them."""
        refresh = getattr(self.optimizer, "refresh_fp32_params", None)
        if refresh is not None:
            refresh()


def _moments(entry, like):
    return {key: entry[key] for key in KEYS if key in entry and entry[key].shape == like.shape}


class TorchAdapter(Adapter):
    """fp32 without ZeRO: DeepSpeed hands torch's optimizer through. Reads optimizer.state[param] (torch's API)."""
    kind = "torch"

    def _entries(self):
        return [(p, self.optimizer.state[p], group) for group in self.optimizer.param_groups for p in group["params"]]

    def get(self, slot):
        return {key: value.view(-1) for key, value in _moments(self.optimizer.state[slot.param], slot.param).items()}

    def set(self, slot, state):
        entry = self.optimizer.state[slot.param]
        for key, value in state.items():  # "fp32": a bf16/fp16 checkpoint's master, better than its rounded weights
            target = slot.param.data if key == "fp32" else entry[key]
            target.view(-1).copy_(value.reshape(-1))


class UnfusedAdapter(Adapter):
    """FP16_UnfusedOptimizer: reads fp16_groups and fp32_groups (each parameter's fp32 copy, which the inner torch
    optimizer steps), optimizer (that torch optimizer) and loss_scale_config (the loss scaler's state); install
    also reads custom_loss_scaler, fused_lamb_legacy and _global_grad_norm."""
    kind = "unfused"

    @classmethod
    def install(cls):
        """The changes megatron/optimizer/unfused.py makes to FP16_UnfusedOptimizer (its true gradient norm, its loss
        scaling in fp16, one host sync per step), each installed once."""
        from megatron.optimizer import unfused
        unfused.install()

    def _masters(self):
        return {id(p): master for low, high in zip(self.optimizer.fp16_groups, self.optimizer.fp32_groups)
                for p, master in zip(low, high)}

    def get(self, slot):
        master = self._masters()[id(slot.param)]
        moments = _moments(self.optimizer.optimizer.state[master], master)
        return {"fp32": master.detach().view(-1), **{key: value.view(-1) for key, value in moments.items()}}

    def set(self, slot, state):
        master = self._masters()[id(slot.param)]
        entry = self.optimizer.optimizer.state[master]
        for key, value in state.items():
            (master.data if key == "fp32" else entry[key]).view(-1).copy_(value.reshape(-1))

    def scaler(self):
        return self.optimizer.loss_scale_config


class FlatAdapter(Adapter):
    """DeepSpeedZeroOptimizer (ZeRO 1/2) and BF16_Optimizer: each parameter group is one flat fp32 partition per DP
    rank, the inner torch optimizer's only parameter of that group. Reads each parameter's `_hp_mapping` (DeepSpeed's
    tensor_fragment: its group, the fragment's place in the parameter and in the flat partition; None where this
    DP rank holds none of it), optimizer (the inner torch optimizer) and loss_scaler."""
    kind = "flat"
    partitioned = True

    def params(self):
        slots = []
        for name, param in self.named_parameters():
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is not None:
                slots.append(Slot(name, param, tuple(param.shape), mapping.lp_fragment_address.start,
                                  mapping.lp_fragment_address.numel))
        return slots

    def _place(self, slot):
        """(the flat fp32 partition holding slot, the offset of slot's fragment in it): the inner optimizer's
        tensor whose storage the fragment's fp32 view (hp_fragment) lies in."""
        fragment = slot.param._hp_mapping.hp_fragment
        for group in self.optimizer.optimizer.param_groups:
            for flat in group["params"]:
                offset = fragment.storage_offset() - flat.storage_offset()
                if flat.untyped_storage().data_ptr() == fragment.untyped_storage().data_ptr() and \
                        0 <= offset and offset + slot.numel <= flat.numel():
                    return flat, offset
        raise AssertionError(f"{slot.name}: no flat fp32 partition of {type(self.optimizer).__name__} holds it")

    def get(self, slot):
        flat, offset = self._place(slot)
        state = {} if slot.param.dtype == torch.float32 else {"fp32": flat.detach().narrow(0, offset, slot.numel)}
        for key, value in _moments(self.optimizer.optimizer.state[flat], flat).items():
            state[key] = value.narrow(0, offset, slot.numel)
        return state

    def set(self, slot, state):
        flat, offset = self._place(slot)
        entry = self.optimizer.optimizer.state[flat]
        for key, value in state.items():
            (flat.data if key == "fp32" else entry[key]).narrow(0, offset, slot.numel).copy_(value.reshape(-1))

    def scaler(self):
        return getattr(self.optimizer, "loss_scaler", None)


class Zero3Adapter(Adapter):
    """DeepSpeedZeroOptimizer_Stage3: each parameter is cut into DP-size equal parts (the last one padded), part r
    on DP rank r (zero3.part_of: the same parts as the weights' under ZeRO-3). Reads the parameters' ds_shape,
    ds_numel, ds_tensor.ds_numel and ds_process_group (ZeRO-3's public parameter attributes), DeepSpeed's
    local-partition API (deepspeed.utils.safe_{get,set}_local_*), fp32_partitioned_groups_flat (the tensors the
    inner optimizer steps), optimizer and loss_scaler."""
    kind = "zero3"
    partitioned = True

    def params(self):
        from megatron.checkpoint.zero3 import part_of
        slots = []
        for name, param in self.named_parameters():
            start, numel = part_of(param, self.optimizer.dp_process_group)
            if numel:
                slots.append(Slot(name, param, tuple(param.ds_shape), start, numel))
        return slots

    def _entries(self):
        inner = self.optimizer.optimizer
        return [(flat, inner.state[flat], {}) for flat in self.optimizer.fp32_partitioned_groups_flat]

    def get(self, slot):
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state
        state = {} if slot.param.dtype == torch.float32 else \
            {"fp32": safe_get_local_fp32_param(slot.param).narrow(0, 0, slot.numel)}
        if all(key in entry for _, entry, _ in self._entries() for key in KEYS):
            for key in KEYS:
                state[key] = safe_get_local_optimizer_state(slot.param, key).narrow(0, 0, slot.numel)
        return state

    def set(self, slot, state):
        from deepspeed.utils import (safe_get_local_fp32_param, safe_get_local_optimizer_state,
                                     safe_set_local_fp32_param, safe_set_local_optimizer_state)
        for key, value in state.items():
            local = (safe_get_local_fp32_param(slot.param) if key == "fp32" else
                     safe_get_local_optimizer_state(slot.param, key)).clone()  # the padded partition
            local.narrow(0, 0, slot.numel).copy_(value.reshape(-1))
            if key == "fp32":
                safe_set_local_fp32_param(slot.param, local)
            else:
                safe_set_local_optimizer_state(slot.param, local, key)

    def scaler(self):
        return getattr(self.optimizer, "loss_scaler", None)


def adapter_class(optimizer):
    """The adapter for DeepSpeed's optimizer wrapper `optimizer`; RuntimeError naming it when none fits."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    for wrappers, adapter in ((DeepSpeedZeroOptimizer_Stage3, Zero3Adapter),
                              ((DeepSpeedZeroOptimizer, BF16_Optimizer), FlatAdapter),
                              (FP16_UnfusedOptimizer, UnfusedAdapter), (torch.optim.Optimizer, TorchAdapter)):
        if isinstance(optimizer, wrappers):
            return adapter
    raise RuntimeError(f"DeepSpeed wrapped the optimizer in {type(optimizer).__name__}, which checkpoints do not "
                       f"support (tested: torch's optimizer, FP16_UnfusedOptimizer, BF16_Optimizer, ZeRO 1-3 with "
                       f"deepspeed{TESTED_DEEPSPEED}); use a torch optimizer (--optimizer adam/sgd)")


def adapter_for(engine, num_layers=None, pp_rank=0):
    """The adapter of `engine`'s optimizer wrapper (installing what it changes in DeepSpeed). num_layers and
    pp_rank name the parameters (BloomModel names) and the tied copies; engine set-up passes neither."""
    cls = adapter_class(engine.optimizer)
    cls.install()
    return cls(engine, num_layers, pp_rank)
