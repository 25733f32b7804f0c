"""Command-line flags: the parser generated from the config fields, and the one resolve() of a launch line.

Every flag that sets a config field is declared once, on that field in megatron/config.py (flag(): spellings
with Megatron's name first and the BLOOM document's as aliases, help, choices, DeepSpeed JSON keys); build_parser()
turns FLAG_SECTIONS into argparse options whose defaults are the fields' defaults and whose help ends with the
default. To add a flag, add the field there (megatron/flags.py says how); nothing here changes. Only the launcher's
own flags, which set no field (--local_rank, --deepspeed), and upstream's refused flags are declared here.

parse_args() returns the Namespace with `explicit_flags` (the dests given on the command line). resolve() turns
it, the loaded DeepSpeed JSON, the checkpoint's saved model section and the tokenizer's vocabulary size into the
typed, frozen Config and the DeepSpeed dict without changing the Namespace or reading anything;
load_and_resolve() does that reading for pretrain_bloom.py and the tools, merging the JSON into the flags once.
Nothing after resolve reads argparse. Required flags may also come from the DeepSpeed JSON (as `lr`,
`micro_batch_size`, ...), so they are checked after it is read (check_required).

Errors raise ConfigError (a ValueError) carrying one line; the parser does not exit. The entry point decides:
pretrain_bloom.py and the tools print it once per host and exit 2 (megatron.initialize.exit_before_distributed).
Imports: config, flags, deepspeed_config (which never imports this module).
"""
import argparse
import dataclasses
import difflib
import logging
import os

from megatron import upstream_compat
from megatron.config import (CheckpointConfig, Config, ConfigError, DataConfig, EvalHarnessConfig, LoggingConfig,
                             ModelConfig, MonitoringConfig, OptimizerConfig, ParallelConfig, PrecisionConfig,
                             TrainingConfig, UpstreamConfig, flag_specs, pad_vocab_size)
from megatron.deepspeed_config import (build_deepspeed_config, load_user_config, log_notes, merge_json_flags,
                                       reconcile)
from megatron.flags import REQUIRED_TEXT

logger = logging.getLogger(__name__)

# Flags that set no config field: the launchers' (spellings, argparse options with their help).
LAUNCHER_FLAGS = (
    (("--deepspeed",), dict(action="store_true", help="accepted for compatibility: DeepSpeed is the engine "
                                                      "(default: off)")),
    (("--local_rank", "--local-rank"), dict(type=int, default=None, help="set by the deepspeed launcher (default: "
                                                                         "none)")),
    (("--deepspeed-activation-checkpointing",),
     dict(action="store_true", help="accepted for compatibility (DeepSpeed's checkpointing is used with "
                                    "--partition-activations) (default: off)")),
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises ConfigError with a bad command line in one line ending in `see --help` (no usage
    block; the caller prints it once per job), and prints --help once: launchers start one copy per GPU."""

    def error(self, message):
        raise ConfigError(f"{message}; see {self.prog} --help")

    def print_help(self, file=None):
        from megatron.initialize import is_first_local_rank
        if is_first_local_rank():
            super().print_help(file)


def required_flags():
    """The dests a run needs, from the command line or the DeepSpeed JSON."""
    return tuple(spec.dest for spec in flag_specs() if spec.required)


def _help(spec):
    text = spec.help + ("; " + REQUIRED_TEXT if spec.required else f" (default: {spec.shown_default})")
    return text.replace("%", "%%")


def _add_flag(group, spec, defaults):
    default = spec.default if defaults else argparse.SUPPRESS
    if spec.is_switch:
        group.add_argument(*spec.spellings, dest=spec.dest, action="store_true", default=default, help=_help(spec))
        if spec.negation:
            group.add_argument(spec.negation, dest=spec.dest, action="store_false", default=default,
                               help=f"turns --{spec.dest.replace('_', '-')} off")
        return
    options = dict(dest=spec.dest, type=spec.type, default=default, help=_help(spec))
    options.update({k: getattr(spec, k) for k in ("choices", "nargs", "metavar") if getattr(spec, k) is not None})
    group.add_argument(*spec.spellings, **options)


def build_parser(defaults=True):
    """pretrain_bloom.py's parser; defaults=False leaves every unset flag out of the Namespace."""
    parser = ArgumentParser(description="Pretrain a BLOOM-architecture model with DeepSpeed", allow_abbrev=False)
    groups = {}
    for spec in flag_specs():
        if spec.section not in groups:
            groups[spec.section] = parser.add_argument_group(spec.section)
        _add_flag(groups[spec.section], spec, defaults)
    launcher = parser.add_argument_group("launcher (set no config field)")
    for spellings, options in LAUNCHER_FLAGS:
        options = dict(options, default=options.get("default", False) if defaults else argparse.SUPPRESS)
        launcher.add_argument(*spellings, **options)
    for flag in upstream_compat.NOT_SUPPORTED.values():  # BLOOM tr11's, refused in one line when given
        launcher.add_argument(flag, default=None if defaults else argparse.SUPPRESS,
                              help="upstream's; not supported (one line says why) (default: none)")
    return parser


def parse_args(argv=None):
    """The Namespace of the command line, plus `explicit_flags`: the dests given on it (not defaulted), which
    a DeepSpeed JSON key naming the same flag must agree with. Raises ConfigError on a bad command line."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(_unrecognized(parser, unknown))
    given = build_parser(defaults=False).parse_known_args(argv)[0]  # unset flags are absent
    args.explicit_flags = frozenset(vars(given))
    return args


def _unrecognized(parser, unknown):
    spellings = [s for action in parser._actions for s in action.option_strings]
    flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")]
    close = [match for flag in flags for match in difflib.get_close_matches(flag, spellings, n=1, cutoff=0.8)]
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return f"unrecognized arguments: {' '.join(unknown)}{hint}"


def check_required(values):
    """Required flags come from the command line or the DeepSpeed JSON; raises ConfigError naming the missing."""
    missing = [dest for dest in required_flags() if values.get(dest) is None]
    if missing:
        flags = ", ".join("--" + dest.replace("_", "-") for dest in missing)
        raise ConfigError(f"missing required flags: {flags}; pass them on the command line (or as "
                          f"{', '.join(missing)} in the --deepspeed_config JSON)")


def world_size_from_env():
    return int(os.environ.get("WORLD_SIZE", "1"))


def _section(cls, values, **derived):
    """cls from the flag values named like its fields; a None (flag unset) leaves the field's default."""
    names = {field.name for field in dataclasses.fields(cls)}
    chosen = {**{k: v for k, v in values.items() if k in names}, **derived}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in chosen.items() if v is not None})


def _padded_vocab(values, tokenizer_vocab_size, saved_meta):
    """(padded vocabulary, the --pad-vocab-size-to in force). Resuming (or fine-tuning) keeps the checkpoint's
    padded vocabulary, which depends on the TP size it was trained with (128 x TP), instead of padding the
    tokenizer again for this run's TP size; --pad-vocab-size-to overrides."""
    if tokenizer_vocab_size is None:
        if not values["mock_data"]:
            raise ConfigError("no tokenizer vocabulary size: build the tokenizer named by --vocab-file/--merge-file "
                              "or --tokenizer-name-or-path and pass its vocab_size, or pass --mock-data")
        tokenizer_vocab_size = values["mock_vocab_size"]
    tp, pad_to = values["tensor_model_parallel_size"], values["pad_vocab_size_to"]
    saved = (saved_meta or {}).get("vocab_size") if values["load"] and pad_to is None else None
    if saved and saved >= tokenizer_vocab_size:
        if saved % tp != 0:
            raise ConfigError(f"--load {values['load']}: its padded vocabulary ({saved}) is not divisible by "
                              f"--tensor-model-parallel-size {tp}; pick a TP size that divides it")
        pad_to = saved
    return pad_vocab_size(tokenizer_vocab_size, values["make_vocab_size_divisible_by"], tp, pad_to), pad_to


def resolve(args, world_size, ds_json=None, saved_meta=None, tokenizer_vocab_size=None, cuda_available=False,
            merged=None):
    """The frozen Config and the DeepSpeed dict from parsed flags, the loaded --deepspeed_config JSON (or None),
    the checkpoint's saved "model" section (or None; its vocab_size is kept when resuming) and the tokenizer's
    vocabulary size (None with --mock-data: --mock-vocab-size). merged: merge_json_flags(args, ds_json, ...)'s
    values when the caller already has them (it is not run again). Pure: args is not changed, no file is read,
    no tokenizer is built, nothing is logged. Raises ValueError (ConfigError) naming the flags of the first
    rule broken."""
    user = ds_json or {}
    values = merged if merged is not None else merge_json_flags(args, user, args.deepspeed_config)[0]
    backend = values["distributed_backend"] or ("nccl" if cuda_available else "gloo")
    parallel = _section(ParallelConfig, values, world_size=world_size, distributed_backend=backend)
    check_required(values)
    values = reconcile(values, user, parallel.data_parallel_size)
    vocab_size, pad_to = _padded_vocab(values, tokenizer_vocab_size, saved_meta)
    model = _section(ModelConfig, values, vocab_size=vocab_size)
    training = _section(TrainingConfig, values, data_parallel_size=parallel.data_parallel_size)
    training, upstream = _upstream_sections(values, training)
    optimizer = _section(OptimizerConfig, values, lr_decay_iters=values["lr_decay_iters"] or training.train_iters)
    metrics_dir = values["tensorboard_dir"] or values["save"]
    config = Config(
        model=model, parallel=parallel, optimizer=optimizer, precision=_section(PrecisionConfig, values),
        training=training, data=_section(DataConfig, values, pad_vocab_size_to=pad_to),
        logging=_section(LoggingConfig, values, metrics_file=values["metrics_file"] or (
            os.path.join(metrics_dir, "metrics.jsonl") if metrics_dir else None)),
        checkpoint=_section(CheckpointConfig, values), deepspeed_config=values["deepspeed_config"],
        upstream=upstream,
        monitoring=_section(MonitoringConfig, values,
                            # upstream's --log-timers-to-tensorboard alone (BLOOM's tr11) asks for the timers
                            timing_log_level=values["timing_log_level"] or int(values["log_timers_to_tensorboard"]),
                            profile_dir=values["profile_dir"] or values["tensorboard_dir"],
                            wandb_save_dir=values["wandb_save_dir"] or metrics_dir),
        eval_harness=_section(EvalHarnessConfig, values))
    return config, build_deepspeed_config(config, user)


def _upstream_sections(values, training):
    """(training with the ramp-up's iteration count, UpstreamConfig): the tr11 recipe's flags checked."""
    refused = upstream_compat.refused_flag(values)
    if refused is not None:
        raise refused
    upstream = _section(UpstreamConfig, values)
    upstream_compat.pipeline_partition_method(upstream.pp_partition_method)
    if upstream.rampup_batch_size is not None:
        upstream_compat.check_rampup(upstream.rampup_batch_size, training)
        iters = upstream_compat.rampup_train_iters(training.train_samples, *upstream.rampup_batch_size,
                                                   training.global_batch_size)
        training = dataclasses.replace(training, train_iters=iters, train_samples=None)  # UpstreamConfig keeps it
    if upstream.sample_based_schedule:
        given = values.get("explicit_flags", frozenset())
        both = [f"--{d.replace('_', '-')}" for d in ("lr_warmup_iters", "lr_decay_iters") if d in given]
        if both:
            raise ConfigError(f"{both[0]} and --lr-warmup-samples/--lr-decay-samples are both set: the schedule "
                              "counts iterations or samples, not both; pass one form")
    return training, upstream


def check_data_files(data):
    """Each --data-path prefix names an existing .bin/.idx pair (DataConfig checked the flag's shape)."""
    if data.mock_data:
        return
    for prefix in data.prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ConfigError(f"--data-path {prefix}: {prefix + ext} does not exist; run "
                                  "tools/preprocess_data.py first or fix the prefix (no .bin/.idx suffix)")


def load_and_resolve(argv=None, world_size=None):
    """parse_args + the I/O resolve() leaves to its caller: reads the --deepspeed_config JSON, builds the
    tokenizer, reads the --load checkpoint's saved model section, checks the data files. world_size defaults
    to $WORLD_SIZE. Returns (config, DeepSpeed dict, tokenizer or None). Raises ValueError (ConfigError for
    the flags and the JSON) on any bad input."""
    from megatron.tokenizer import build_tokenizer, infer_tokenizer_type
    args = parse_args(argv)
    user = load_user_config(args.deepspeed_config)
    values, notes = merge_json_flags(args, user, args.deepspeed_config)  # once: which tokenizer and checkpoint
    log_notes(notes)
    tokenizer = None
    if not values["mock_data"] or values["vocab_file"] or values["merge_file"] or values["tokenizer_name_or_path"]:
        tokenizer_type = infer_tokenizer_type(values["tokenizer_type"], values["vocab_file"], values["merge_file"],
                                              values["tokenizer_name_or_path"])
        tokenizer = build_tokenizer(tokenizer_type, vocab_file=values["vocab_file"], merge_file=values["merge_file"],
                                    tokenizer_name_or_path=values["tokenizer_name_or_path"])
    saved_meta = None
    if values["load"]:  # this project's format or upstream's; a folder in neither stops here, in one line
        from megatron.checkpoint.upstream import classify_load
        kind, upstream_meta = classify_load(values["load"], values["universal_checkpoint"])
        if kind == "upstream" and values["pad_vocab_size_to"] is None:
            saved_meta = upstream_meta
    if values["load"] and values["pad_vocab_size_to"] is None and saved_meta is None:
        from megatron.checkpoint.format import saved_model_config
        saved_meta = saved_model_config(values["load"])
    import torch
    config, ds_dict = resolve(args, world_size_from_env() if world_size is None else world_size, user, saved_meta,
                              tokenizer.vocab_size if tokenizer is not None else None, torch.cuda.is_available(),
                              merged=values)
    if config.data.pad_vocab_size_to != values["pad_vocab_size_to"]:
        logger.info("keeping the checkpoint's padded vocabulary of %d (--pad-vocab-size-to overrides)",
                    config.model.vocab_size)
    check_data_files(config.data)
    return config, ds_dict, tokenizer
