"""Reconciles the DeepSpeed JSON with the flags: missing values come from the flags, contradictions stop the run.

Pure functions of the loaded JSON dict (load_user_config is the one that reads the file): merge_json_flags
lets top-level keys that name our flags (BLOOM's published ds_config has lr, min_lr, warmup_iters,
micro_batch_size, ...; the keys are declared with the flags, megatron.config.json_flags) set those flags and notes
the keys neither DeepSpeed's nor ours; reconcile takes the JSON's batch, precision, ZeRO and clipping values;
build_deepspeed_config writes the resolved Config back.

Imports: megatron.config and megatron.flags only; arguments.py imports this module, never the reverse.

DeepSpeed's batch rule is train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps
x data-parallel size; every message below spells that arithmetic out with the numbers involved.
"""
import copy
import difflib
import functools
import json
import logging
import math
import os

from megatron.config import ConfigError, batch_fit_hint, flag_specs, json_flags
from megatron.flags import json_value, shown

logger = logging.getLogger(__name__)


def load_user_config(path):
    """The user's --deepspeed_config JSON as a dict ({} when no file is given)."""
    if path is None:
        return {}
    if not os.path.isfile(path):
        raise ConfigError(f"--deepspeed_config {path}: file not found; pass an existing JSON file or omit the "
                         "flag (the flags alone configure DeepSpeed)")
    try:
        with open(path) as f:
            user = json.load(f)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--deepspeed_config {path}: not valid JSON ({err}); fix the file") from None
    if not isinstance(user, dict):
        raise ConfigError(f"--deepspeed_config {path}: holds a JSON {type(user).__name__}, not an object of keys; "
                         "fix the file")
    return user


def _disagree(key, json_value, flag, flag_value, fix):
    return ConfigError(f"DeepSpeed config {key}={json_value} contradicts {flag} {flag_value}; {fix}")


class _KeyRecorder(dict):
    """An empty DeepSpeed config that notes every top-level key DeepSpeed's parser looks up."""

    def __init__(self):
        super().__init__()
        self.read = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def keys(self):
        return self  # `key in d.keys()` is recorded by __contains__; iteration yields nothing


@functools.lru_cache(maxsize=None)
def deepspeed_keys():
    """DeepSpeed's top-level config keys: those its own parser (DeepSpeedConfig._initialize_params) reads from
    an empty config, plus the few read elsewhere (autotuning, vocabulary_size, deepspeed.initialize's
    mesh sizes) and the removed sections it rejects. Falls back to deepspeed.runtime.constants' key names
    when that parser's shape has changed."""
    from deepspeed.autotuning.constants import AUTOTUNING
    from deepspeed.runtime import config as ds_config, constants
    recorder = _KeyRecorder()
    parser = ds_config.DeepSpeedConfig.__new__(ds_config.DeepSpeedConfig)
    parser.global_rank, parser.world_size, parser._param_dict = 0, 1, recorder
    try:
        parser._initialize_params(recorder)
        keys = set(recorder.read)
    except (AttributeError, KeyError, TypeError, ValueError):
        keys = {value for name, value in vars(constants).items()
                if name.isupper() and isinstance(value, str) and value.isidentifier()}
    return frozenset(keys | {AUTOTUNING, constants.VOCABULARY_SIZE, "sequence_parallel_size", "data_parallel_size"}
                     | set(removed_deepspeed_keys()))


def removed_deepspeed_keys():
    """{key: DeepSpeed's own message} for the sections this DeepSpeed rejects (it would stop on every rank)."""
    from deepspeed.runtime import config as ds_config
    return getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})


def merge_json_flags(args, user, path):
    """The flag values once the JSON's top-level keys naming flags (lr, min_lr, micro_batch_size, warmup_iters,
    ...; see megatron.config.json_flags) have set the flags the command line did not give. Pure: returns
    (values, notes): a new {dest: value} dict (args is not changed; lists made tuples) whose "explicit_flags" are
    the dests given on the command line or by such a key, and the (logging level, message) pairs to report, one
    per key that is neither DeepSpeed's nor a flag's. Raises ConfigError on a key that contradicts a flag given on
    the command line, a bad value, or a section this DeepSpeed removed."""
    values = {dest: tuple(v) if isinstance(v, list) else v for dest, v in vars(args).items()}
    explicit = frozenset(values.pop("explicit_flags", frozenset()))
    values["explicit_flags"] = explicit
    if not user:
        return values, []
    ds_keys, removed = deepspeed_keys(), removed_deepspeed_keys()
    flags = json_flags()
    from_json, unknown = {}, []
    for key, value in user.items():
        if key in removed:
            raise ConfigError(f"--deepspeed_config {path}: {removed[key]}")
        if key in ds_keys:
            continue
        if key not in flags:
            unknown.append(key)
            continue
        spec, stored = flags[key]
        try:
            converted = json_value(spec, stored, key, value)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        flag, dest = spec.spellings[0], spec.dest
        if dest in explicit:
            if converted != values[dest]:
                raise _disagree(key, json.dumps(value), flag, shown(values[dest]),
                                "make them equal or drop the key from the JSON")
            continue
        if dest in from_json and from_json[dest][1] != converted:
            other = from_json[dest][0]
            raise ConfigError(f"DeepSpeed config {key}={json.dumps(value)} contradicts its {other}="
                              f"{json.dumps(user[other])} (both set {flag}); keep one")
        from_json[dest] = (key, converted)
        values[dest] = converted
    values["explicit_flags"] = explicit | set(from_json)
    notes = []
    if from_json:
        notes.append((logging.INFO, f"DeepSpeed config {path} sets " + ", ".join(
            f"{flags[key][0].spellings[0]} {shown(value)}" for key, value in from_json.values())))
    known = sorted(ds_keys | set(flags))
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        notes.append((logging.WARNING, f"DeepSpeed config {path}: key {key} is neither DeepSpeed's nor a flag's; "
                      "ignored" + (f" (did you mean {close[0]}?)" if close else "")))
    return values, notes


def log_notes(notes):
    """Logs merge_json_flags' notes; the warnings on the first process of each host only."""
    from megatron.initialize import is_first_local_rank
    for level, message in notes:
        if level < logging.WARNING or is_first_local_rank():
            logger.log(level, message)


def reconcile(values, user, data_parallel_size):
    """DeepSpeed's own keys against the flag values (merge_json_flags' output, required flags present): a new
    dict in which unset flags take the JSON's batch, precision, ZeRO and clipping values. Raises ConfigError on
    any contradiction. The rules the values must then obey (batch divisibility, bf16 with fp16, offload
    without ZeRO, ...) are the configs' __post_init__ checks, not repeated here."""
    values = dict(values)
    dp = data_parallel_size
    micro_key = user.get("train_micro_batch_size_per_gpu")
    gas = user.get("gradient_accumulation_steps")
    total = user.get("train_batch_size")
    if None not in (micro_key, gas, total) and total != micro_key * gas * dp:
        fix = f"set train_batch_size to {micro_key * gas * dp}"
        if total % (micro_key * dp) == 0:
            fix += f" or gradient_accumulation_steps to {total // (micro_key * dp)}"
        raise ConfigError(
            f"DeepSpeed config contradicts itself: train_batch_size {total} must equal "
            f"train_micro_batch_size_per_gpu {micro_key} x gradient_accumulation_steps {gas} x data-parallel size "
            f"{dp} = {micro_key * gas * dp}; {fix}, or drop the batch keys and let the flags decide")
    micro = values["micro_batch_size"]
    if micro_key is not None and micro_key != micro:
        raise _disagree("train_micro_batch_size_per_gpu", micro_key, "--micro-batch-size", micro,
                        "make them equal or drop the key from the JSON")
    per_step = micro * dp
    global_batch = values["global_batch_size"]
    global_name = f"--global-batch-size {global_batch}"
    if total is not None:
        if global_batch is not None and global_batch != total:
            raise _disagree("train_batch_size", total, "--global-batch-size", global_batch,
                            "make them equal or drop train_batch_size from the JSON")
        global_name = f"DeepSpeed config train_batch_size {total}"
        if gas is None and total % per_step != 0:  # named as the JSON's key, not as --global-batch-size
            raise ConfigError(f"{global_name} is not divisible by --micro-batch-size {micro} x data-parallel size "
                             f"{dp} = {per_step}; {batch_fit_hint(total, micro, dp)}")
        global_batch = total
    if gas is not None:
        if global_batch is None:
            global_batch = gas * per_step
        elif gas * per_step != global_batch:
            if global_batch % per_step == 0:
                fix = f"set gradient_accumulation_steps to {global_batch // per_step} or drop it"
            else:
                fix = (f"{global_batch} is not divisible by --micro-batch-size {micro} x data-parallel size {dp} = "
                       f"{per_step}: {batch_fit_hint(global_batch, micro, dp)}; then drop "
                       "gradient_accumulation_steps (it follows from the two)")
            raise ConfigError(
                f"DeepSpeed config gradient_accumulation_steps {gas} x --micro-batch-size {micro} x data-parallel "
                f"size {dp} = {gas * per_step} differs from {global_name}; {fix}")
    values["global_batch_size"] = global_batch

    for name in ("bf16", "fp16"):  # the JSON's enabled (true/false; "auto" follows the flag) or the flag
        enabled = user.get(name, {}).get("enabled", "auto")
        if enabled is False and values[name]:
            raise _disagree(f"{name}.enabled", "false", f"--{name}", "(set)", f"drop --{name} or set {name}.enabled "
                            "to true (or remove it) in the JSON")
        values[name] = values[name] or enabled is True

    given = values.get("explicit_flags", frozenset())  # on the command line or by a JSON key naming the flag
    for key, spec, from_json in _same_settings():
        found, value = _lookup(user, key)
        if not found or value == "auto":
            continue
        if spec.dest in given:
            if from_json(value) != values[spec.dest]:
                flag_value = "(set)" if spec.is_switch else shown(values[spec.dest])
                raise _disagree(key, json.dumps(value), spec.spellings[0], flag_value, "make them equal or drop one")
        else:
            values[spec.dest] = from_json(value)

    zero = user.get("zero_optimization", {})
    device = zero.get("offload_optimizer", {}).get("device")
    if device == "nvme":
        raise ConfigError("DeepSpeed config zero_optimization.offload_optimizer.device=nvme is not supported: the "
                         "optimizer is built from the flags (torch's AdamW), which ZeRO can offload to the CPU only; "
                         "set the device to cpu (or pass --cpu-offload and drop offload_optimizer)")
    if device == "none" and values["cpu_offload"]:
        raise _disagree("zero_optimization.offload_optimizer.device", "none", "--cpu-offload", "(set)",
                        "drop --cpu-offload or set the device to cpu")
    values["cpu_offload"] = values["cpu_offload"] or device == "cpu"

    kind = user.get("optimizer", {}).get("type")
    if kind is not None:  # DeepSpeed's optimizer names for --optimizer's choices
        ours = {"adam": "adam", "adamw": "adam", "sgd": "sgd"}.get(str(kind).lower())
        if ours is None or ("optimizer" in given and ours != values["optimizer"]):
            raise _disagree("optimizer.type", kind, "--optimizer", values["optimizer"], "the optimizer is built "
                            "from the flags (adam: AdamW, sgd): make them equal or drop the optimizer section")
        values["optimizer"] = ours
    params = user.get("optimizer", {}).get("params", {})
    flag_values = {"lr": ("--lr", values["lr"]), "weight_decay": ("--weight-decay", values["weight_decay"]),
                   "eps": ("--adam-eps", values["adam_eps"]),
                   "betas": ("--adam-beta1/2", [values["adam_beta1"], values["adam_beta2"]])}
    for key, value in params.items():
        if key not in flag_values:
            continue
        flag, flag_value = flag_values[key]
        if (list(value) if key == "betas" else value) != flag_value:
            raise _disagree(f"optimizer.params.{key}", value, flag, flag_value,
                            "the optimizer is built from the flags: make them equal or drop the optimizer section")
    if "scheduler" in user:
        raise ConfigError("DeepSpeed config has a scheduler section; the LR schedule comes from --lr, --min-lr, "
                         "--lr-decay-style, --lr-warmup-iters: remove the section")
    return values


# DeepSpeed's own keys that hold a flag's setting in another unit: {dotted key: (dest, JSON value -> flag value)}.
_CONVERTED_SETTINGS = {"fp16.loss_scale": ("loss_scale", lambda v: v or None),  # 0: dynamic (the flag unset)
                       "fp16.initial_scale_power": ("initial_loss_scale", lambda power: 2.0 ** power)}


def _same_settings():
    """(dotted DeepSpeed key, FlagSpec, JSON value -> flag value) of every flag whose setting DeepSpeed's JSON may
    also hold: those declared with deepspeed="..." and _CONVERTED_SETTINGS."""
    specs = {spec.dest: spec for spec in flag_specs()}
    same = [(spec.deepspeed, spec, lambda v: v) for spec in specs.values() if spec.deepspeed]
    return same + [(key, specs[dest], convert) for key, (dest, convert) in _CONVERTED_SETTINGS.items()]


def _lookup(user, dotted):
    """(found, value) of a dotted key ("zero_optimization.stage") in the JSON."""
    node = user
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def build_deepspeed_config(config, user):
    """The dict passed to deepspeed.initialize: the user's JSON with every reconciled value written in."""
    flag_keys = json_flags()
    ds = {key: copy.deepcopy(value) for key, value in user.items()  # our flags' keys (lr, ...) went into config
          if key not in flag_keys or key in deepspeed_keys()}
    training, precision = config.training, config.precision
    ds["train_batch_size"] = training.global_batch_size
    ds["train_micro_batch_size_per_gpu"] = training.micro_batch_size
    ds["gradient_accumulation_steps"] = training.gradient_accumulation_steps
    ds["gradient_clipping"] = config.optimizer.clip_grad
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": precision.bf16}
    fp16 = {**ds.get("fp16", {}), "enabled": precision.fp16}
    if precision.fp16:  # reconcile() made the JSON's values and the flags one
        fp16.update(loss_scale=precision.loss_scale or 0,
                    initial_scale_power=int(round(math.log2(precision.initial_loss_scale))),
                    loss_scale_window=precision.loss_scale_window, hysteresis=precision.hysteresis,
                    min_loss_scale=precision.min_loss_scale)
    ds["fp16"] = fp16
    zero = {**ds.get("zero_optimization", {}), "stage": training.zero_stage}
    if training.cpu_offload:
        zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": "cpu"}
        zero["offload_optimizer"].setdefault("pin_memory", False)
    ds["zero_optimization"] = zero
    ds.setdefault("zero_allow_untested_optimizer", True)
    ds.setdefault("zero_force_ds_cpu_optimizer", False)
    ds.setdefault("steps_per_print", 2 ** 31 - 1)
    ds.setdefault("wall_clock_breakdown", False)
    if training.partition_activations:
        ds["activation_checkpointing"] = {**ds.get("activation_checkpointing", {}), "partition_activations": True}
    ds.pop("optimizer", None)  # checked against the flags in reconcile(); we build the optimizer
    ds.pop("scheduler", None)
    return ds
