"""Reconciles the DeepSpeed JSON with the flags: missing values come from the flags, contradictions stop the run.

Top-level keys that name our flags (BLOOM's published ds_config has lr, min_lr, warmup_iters, micro_batch_size,
...) set those flags; keys neither DeepSpeed's nor ours are named in a warning.

DeepSpeed's batch rule is train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps
x data-parallel size; every message below spells that arithmetic out with the numbers involved.
"""
import copy
import difflib
import functools
import json
import logging
import os

logger = logging.getLogger(__name__)


def load_user_config(path):
    """The user's --deepspeed_config JSON as a dict ({} when no file is given)."""
    if path is None:
        return {}
    if not os.path.isfile(path):
        raise ValueError(f"--deepspeed_config {path}: file not found; pass an existing JSON file or omit the "
                         "flag (the flags alone configure DeepSpeed)")
    try:
        with open(path) as f:
            user = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"--deepspeed_config {path}: not valid JSON ({err}); fix the file") from None
    if not isinstance(user, dict):
        raise ValueError(f"--deepspeed_config {path}: holds a JSON {type(user).__name__}, not an object of keys; "
                         "fix the file")
    return user


def _disagree(key, json_value, flag, flag_value, fix):
    return ValueError(f"DeepSpeed config {key}={json_value} contradicts {flag} {flag_value}; {fix}")


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


def apply_flag_keys(args, user, path):
    """Top-level JSON keys that name our flags (lr, min_lr, micro_batch_size, warmup_iters, ...; see
    arguments.flags_by_json_key) set those flags when the command line did not; one that contradicts a flag
    given on the command line stops the run. Warns once per key that is neither DeepSpeed's nor a flag's.
    Raises ValueError on a contradiction or a bad value. Mutates args."""
    from megatron.arguments import flags_by_json_key, json_value_for_flag
    from megatron.initialize import is_first_local_rank
    if not user:
        return args
    ds_keys, removed = deepspeed_keys(), removed_deepspeed_keys()
    flags = flags_by_json_key()
    explicit = getattr(args, "explicit_flags", frozenset())
    from_json, unknown = {}, []
    for key, value in user.items():
        if key in removed:
            raise ValueError(f"--deepspeed_config {path}: {removed[key]}")
        if key in ds_keys:
            continue
        if key not in flags:
            unknown.append(key)
            continue
        action = flags[key]
        flag, dest = action.option_strings[0], action.dest
        converted = json_value_for_flag(action, key, value)
        if dest in explicit:
            if converted != getattr(args, dest):
                raise _disagree(key, json.dumps(value), flag, _shown(getattr(args, dest)),
                                "make them equal or drop the key from the JSON")
            continue
        if dest in from_json and from_json[dest][1] != converted:
            other = from_json[dest][0]
            raise ValueError(f"DeepSpeed config {key}={json.dumps(value)} contradicts its {other}="
                             f"{json.dumps(user[other])} (both set {flag}); keep one")
        from_json[dest] = (key, converted)
        setattr(args, dest, converted)
    if from_json:
        logger.info("DeepSpeed config %s sets %s", path, ", ".join(
            f"{flags[key].option_strings[0]} {_shown(value)}" for key, value in from_json.values()))
    if unknown and is_first_local_rank():
        known = sorted(ds_keys | set(flags))
        for key in unknown:
            close = difflib.get_close_matches(key, known, n=1)
            logger.warning("DeepSpeed config %s: key %s is neither DeepSpeed's nor a flag's; ignored%s", path, key,
                           f" (did you mean {close[0]}?)" if close else "")
    return args


def _shown(value):
    return " ".join(map(str, value)) if isinstance(value, list) else value


def reconcile_args(args, user, data_parallel_size):
    """Fills unset flags from DeepSpeed's keys in the JSON and raises ValueError on any contradiction (call
    apply_flag_keys first: the JSON's keys naming flags count as those flags). Mutates args."""
    from megatron.arguments import check_required
    from megatron.config import batch_fit_hint
    check_required(args)
    dp = data_parallel_size
    micro_key = user.get("train_micro_batch_size_per_gpu")
    gas = user.get("gradient_accumulation_steps")
    total = user.get("train_batch_size")
    if None not in (micro_key, gas, total) and total != micro_key * gas * dp:
        fix = f"set train_batch_size to {micro_key * gas * dp}"
        if total % (micro_key * dp) == 0:
            fix += f" or gradient_accumulation_steps to {total // (micro_key * dp)}"
        raise ValueError(
            f"DeepSpeed config contradicts itself: train_batch_size {total} must equal "
            f"train_micro_batch_size_per_gpu {micro_key} x gradient_accumulation_steps {gas} x data-parallel size "
            f"{dp} = {micro_key * gas * dp}; {fix}, or drop the batch keys and let the flags decide")
    if micro_key is not None and micro_key != args.micro_batch_size:
        raise _disagree("train_micro_batch_size_per_gpu", micro_key, "--micro-batch-size", args.micro_batch_size,
                        "make them equal or drop the key from the JSON")
    micro = args.micro_batch_size
    per_step = micro * dp
    global_name = f"--global-batch-size {args.global_batch_size}"
    if total is not None:
        if args.global_batch_size is not None and args.global_batch_size != total:
            raise _disagree("train_batch_size", total, "--global-batch-size", args.global_batch_size,
                            "make them equal or drop train_batch_size from the JSON")
        global_name = f"DeepSpeed config train_batch_size {total}"
        if gas is None and total % per_step != 0:
            raise ValueError(f"{global_name} is not divisible by --micro-batch-size {micro} x data-parallel size "
                             f"{dp} = {per_step}; {batch_fit_hint(total, micro, dp)}")
        args.global_batch_size = total
    if gas is not None:
        if args.global_batch_size is None:
            args.global_batch_size = gas * per_step
        elif gas * per_step != args.global_batch_size:
            global_batch = args.global_batch_size
            if global_batch % per_step == 0:
                fix = f"set gradient_accumulation_steps to {global_batch // per_step} or drop it"
            else:
                fix = (f"{global_batch} is not divisible by --micro-batch-size {micro} x data-parallel size {dp} = "
                       f"{per_step}: {batch_fit_hint(global_batch, micro, dp)}; then drop "
                       "gradient_accumulation_steps (it follows from the two)")
            raise ValueError(
                f"DeepSpeed config gradient_accumulation_steps {gas} x --micro-batch-size {micro} x data-parallel "
                f"size {dp} = {gas * per_step} differs from {global_name}; {fix}")

    bf16 = user.get("bf16", {}).get("enabled", False)
    fp16 = user.get("fp16", {}).get("enabled", False)
    if bf16 and args.fp16:
        raise _disagree("bf16.enabled", True, "--fp16", "", "pick one precision")
    if fp16 and args.bf16:
        raise _disagree("fp16.enabled", True, "--bf16", "", "pick one precision")
    args.bf16 = args.bf16 or bf16
    args.fp16 = args.fp16 or fp16

    zero = user.get("zero_optimization", {})
    stage = zero.get("stage")
    if stage is not None and args.zero_stage is not None and stage != args.zero_stage:
        raise _disagree("zero_optimization.stage", stage, "--zero-stage", args.zero_stage,
                        "make them equal or drop one")
    if args.zero_stage is None:
        args.zero_stage = stage or 0
    offload = zero.get("offload_optimizer", {}).get("device", "none") in ("cpu", "nvme")
    args.cpu_offload = args.cpu_offload or offload
    if args.cpu_offload and args.zero_stage not in (1, 2, 3):
        raise ValueError(f"--cpu-offload needs ZeRO stage 1, 2 or 3 (got {args.zero_stage}); "
                         "add --zero-stage 2")
    if args.zero_stage in (2, 3) and args.pipeline_model_parallel_size > 1:
        raise ValueError(f"--zero-stage {args.zero_stage} cannot be combined with --pipeline-model-parallel-size "
                         f"{args.pipeline_model_parallel_size}: DeepSpeed's pipeline engine supports ZeRO 0 and 1; "
                         "use --zero-stage 1 or --pipeline-model-parallel-size 1")

    params = user.get("optimizer", {}).get("params", {})
    flag_values = {"lr": ("--lr", args.lr), "weight_decay": ("--weight-decay", args.weight_decay),
                   "eps": ("--adam-eps", args.adam_eps), "betas": ("--adam-beta1/2", [args.adam_beta1,
                                                                                   args.adam_beta2])}
    for key, value in params.items():
        if key not in flag_values:
            continue
        flag, flag_value = flag_values[key]
        if (list(value) if key == "betas" else value) != flag_value:
            raise _disagree(f"optimizer.params.{key}", value, flag, flag_value,
                            "the optimizer is built from the flags: make them equal or drop the optimizer section")
    if "scheduler" in user:
        raise ValueError("DeepSpeed config has a scheduler section; the LR schedule comes from --lr, --min-lr, "
                         "--lr-decay-style, --lr-warmup-iters: remove the section")

    clip = user.get("gradient_clipping")
    if clip is not None and args.clip_grad is not None and clip != args.clip_grad:
        raise _disagree("gradient_clipping", clip, "--clip-grad", args.clip_grad, "make them equal or drop one")
    if args.clip_grad is None:
        args.clip_grad = 1.0 if clip is None else clip
    return args


def build_deepspeed_config(config, user):
    """The dict passed to deepspeed.initialize: the user's JSON with every reconciled value written in."""
    from megatron.arguments import flags_by_json_key
    flag_keys = flags_by_json_key()
    ds = {key: copy.deepcopy(value) for key, value in user.items()  # our flags' keys (lr, ...) went into config
          if key not in flag_keys or key in deepspeed_keys()}
    training, precision = config.training, config.precision
    ds["train_batch_size"] = training.global_batch_size
    ds["train_micro_batch_size_per_gpu"] = training.micro_batch_size
    ds["gradient_accumulation_steps"] = training.gradient_accumulation_steps
    ds["gradient_clipping"] = config.optimizer.clip_grad
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": precision.bf16}
    fp16 = {**ds.get("fp16", {}), "enabled": precision.fp16}
    if precision.fp16:
        fp16.setdefault("loss_scale", precision.loss_scale or 0)
        fp16.setdefault("initial_scale_power", int(round(__import__("math").log2(precision.initial_loss_scale))))
        fp16.setdefault("loss_scale_window", precision.loss_scale_window)
        fp16.setdefault("hysteresis", precision.hysteresis)
        fp16.setdefault("min_loss_scale", precision.min_loss_scale)
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
    ds.pop("optimizer", None)  # checked against the flags in reconcile_args; we build the optimizer
    ds.pop("scheduler", None)
    return ds
