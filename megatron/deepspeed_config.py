"""Reconciles the DeepSpeed JSON with the flags: missing values come from the flags, contradictions stop the run.

DeepSpeed's batch rule is train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps
x data-parallel size; every message below spells that arithmetic out with the numbers involved.
"""
import copy
import json
import os


def load_user_config(path):
    """The user's --deepspeed_config JSON as a dict ({} when no file is given)."""
    if path is None:
        return {}
    if not os.path.isfile(path):
        raise ValueError(f"--deepspeed_config {path}: file not found; pass an existing JSON file or omit the "
                         "flag (the flags alone configure DeepSpeed)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"--deepspeed_config {path}: not valid JSON ({err}); fix the file") from None


def _disagree(key, json_value, flag, flag_value, fix):
    return ValueError(f"DeepSpeed config {key}={json_value} contradicts {flag} {flag_value}; {fix}")


def reconcile_args(args, user, data_parallel_size):
    """Fills unset flags from the JSON and raises ValueError on any contradiction. Mutates args."""
    dp = data_parallel_size
    micro = user.get("train_micro_batch_size_per_gpu")
    gas = user.get("gradient_accumulation_steps")
    total = user.get("train_batch_size")
    if None not in (micro, gas, total) and total != micro * gas * dp:
        raise ValueError(
            f"DeepSpeed config contradicts itself: train_batch_size {total} must equal "
            f"train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps {gas} x data-parallel size "
            f"{dp} = {micro * gas * dp}; set train_batch_size to {micro * gas * dp} or "
            f"gradient_accumulation_steps to {total // (micro * dp) if total % (micro * dp) == 0 else '?'}, "
            "or drop the batch keys and let the flags decide")
    if micro is not None and micro != args.micro_batch_size:
        raise _disagree("train_micro_batch_size_per_gpu", micro, "--micro-batch-size", args.micro_batch_size,
                        "make them equal or drop the key from the JSON")
    if total is None and micro is not None and gas is not None:
        total = micro * gas * dp
    if total is None and gas is not None:
        total = args.micro_batch_size * gas * dp
    if total is not None:
        if args.global_batch_size is not None and args.global_batch_size != total:
            raise ValueError(
                f"DeepSpeed config train_batch_size {total} contradicts --global-batch-size "
                f"{args.global_batch_size} (micro batch {args.micro_batch_size} x data-parallel size {dp} x "
                f"gradient accumulation); make them equal or drop the batch keys from the JSON")
        args.global_batch_size = total
    global_batch = args.global_batch_size or args.micro_batch_size * dp
    if gas is not None and gas * args.micro_batch_size * dp != global_batch:
        raise ValueError(
            f"DeepSpeed config gradient_accumulation_steps {gas} x --micro-batch-size {args.micro_batch_size} x "
            f"data-parallel size {dp} = {gas * args.micro_batch_size * dp} differs from the global batch "
            f"{global_batch}; set gradient_accumulation_steps to "
            f"{global_batch // (args.micro_batch_size * dp)} or drop it")

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
    ds = copy.deepcopy(user)
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
