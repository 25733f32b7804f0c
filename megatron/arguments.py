"""Command-line flags (Megatron's names, the BLOOM document's spellings as aliases, DeepSpeed's own).

parse_args() returns the argparse Namespace; resolve() turns it, the loaded DeepSpeed JSON, the checkpoint's
saved model section and the tokenizer's vocabulary size into the typed, frozen Config and the DeepSpeed dict,
without changing the Namespace or reading anything; load_and_resolve() does that reading for pretrain_bloom.py
and the tools. Nothing after resolve reads argparse. The flags in REQUIRED may also come from the DeepSpeed
JSON (as `lr`, `micro_batch_size`, ...: see flags_by_json_key), so they are checked after it is read
(check_required). A bad command line is reported once per job on one line (ArgumentParser.error), not once
per process.
"""
import argparse
import dataclasses
import difflib
import functools
import json
import logging
import os

from megatron.config import (ATTENTION_IMPLS, TIMING_LOG_OPTIONS, CheckpointConfig, Config, DataConfig,
                             EvalHarnessConfig, LoggingConfig, ModelConfig, MonitoringConfig, OptimizerConfig,
                             ParallelConfig, PrecisionConfig, TrainingConfig, UpstreamConfig, pad_vocab_size)

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "lr")
_REQUIRED_HELP = "required (here or in the DeepSpeed JSON)"
LOG_LEVELS = ("debug", "info", "warning")
# DeepSpeed JSON keys of BLOOM's published ds_config that name a flag by another spelling.
JSON_ALIASES = {"warmup_iters": "--lr-warmup-iters"}
_NOT_FROM_JSON = {"deepspeed", "deepspeed_config", "local_rank"}  # the launcher's business, not the JSON's
_UNSET = object()
logger = logging.getLogger(__name__)


def _model_flags(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None, help=_REQUIRED_HELP)
    g.add_argument("--hidden-size", type=int, default=None, help=_REQUIRED_HELP)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    g.add_argument("--num-attention-heads", type=int, default=None, help=_REQUIRED_HELP)
    g.add_argument("--seq-length", type=int, default=None, help=_REQUIRED_HELP)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP")
    g.add_argument("--pad-vocab-size-to", type=int, default=None, help="pad the vocabulary to exactly this size")
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true")
    g.add_argument("--embed-layernorm", dest="embed_layernorm", action="store_true", default=True,
                   help="LayerNorm after the word embeddings (BLOOM; on by default)")
    g.add_argument("--no-embed-layernorm", dest="embed_layernorm", action="store_false")
    g.add_argument("--position-embedding-type", default="alibi", choices=["alibi"])
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-impl", default="auto", choices=ATTENTION_IMPLS)
    g.add_argument("--fused-layernorm", action="store_true", help="csrc mixed-precision LayerNorm (CUDA)")
    g.add_argument("--abort-on-unmet-fused-kernel-constraints", action="store_true")
    g.add_argument("--loss-chunk-size", type=int, default=0,
                   help="tokens per chunk of the LM head + loss (0: whole micro batch at once)")


def _parallel_flags(parser):
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", "--model-parallel-size", dest="tensor_model_parallel_size",
                   type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", "--pipe-parallel-size", dest="pipeline_model_parallel_size",
                   type=int, default=1)
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help="set by the deepspeed launcher")


def _training_flags(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None, help=_REQUIRED_HELP)
    g.add_argument("--global-batch-size", "--batch-size", dest="global_batch_size", type=int, default=None,
                   help="default: micro batch x data-parallel size")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true", help="SIGTERM/SIGINT: save and exit 0")
    g.add_argument("--max-nan-iterations", type=int, default=3)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--checkpoint-activations", action="store_true")
    g.add_argument("--partition-activations", action="store_true")

    g = parser.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=None, help=_REQUIRED_HELP)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", "--warmup", dest="lr_warmup_iters", type=float, default=0,
                   help="iterations of linear warmup (a value below 1 is a fraction of --lr-decay-iters)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=None, help="gradient-norm clipping (default 1.0; 0 = off)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)

    g = parser.add_argument_group("precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)


def _deepspeed_flags(parser):
    g = parser.add_argument_group("deepspeed")
    g.add_argument("--deepspeed", action="store_true", help="accepted for compatibility: DeepSpeed is the engine")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None)
    g.add_argument("--zero-stage", type=int, default=None)
    g.add_argument("--cpu-offload", action="store_true", help="ZeRO optimizer state on the CPU")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="accepted for compatibility (DeepSpeed's checkpointing is used with --partition-activations)")


def _data_flags(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=[], help="prefix, or weight prefix weight prefix ...")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--data-impl", "--dataset-impl", dest="data_impl", default="mmap", choices=["mmap"])
    g.add_argument("--tokenizer-type", choices=["GPT2BPETokenizer", "PretrainedFromHF"], default=None,
                   help="default: GPT2BPETokenizer with --vocab-file/--merge-file, else PretrainedFromHF")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-name-or-path", default=None)
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--data-cache-dir", default=None, help="where index files go (default: beside the data)")
    g.add_argument("--mock-data", action="store_true", help="synthetic random tokens (benchmarks)")
    g.add_argument("--mock-vocab-size", type=int, default=50257)


def _logging_checkpoint_flags(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--metrics-file", default=None, help="JSON lines of per-iteration metrics (default: "
                   "metrics.jsonl in --tensorboard-dir or --save)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="device bf16 peak for MFU (default: measured once at start-up on CUDA)")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="info: our log lines only; debug: also DeepSpeed's logs, prints and warnings")

    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load weights only; restart iterations at 0")
    g.add_argument("--keep-last-n-checkpoints", type=int, default=None)
    g.add_argument("--strict-load", action="store_true", help="stop instead of falling back to an older checkpoint")
    g.add_argument("--async-save", action="store_true",
                   help="snapshot to host memory and write checkpoints in the background while training continues")
    g.add_argument("--checkpoint-verify-timeout-minutes", type=int, default=60,
                   help="time allowed for the ranks' shared checksum pass on --load (apart from "
                        "--distributed-timeout-minutes)")


def _add_upstream_compat_args(parser):
    """BigScience's Megatron-DeepSpeed flags that BLOOM's tr11 recipe passes (megatron/upstream_compat.py)."""
    g = parser.add_argument_group("upstream Megatron-DeepSpeed (BLOOM tr11 recipe)")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="LR decay over this many consumed samples (sample-based schedule; default --train-samples)")
    g.add_argument("--lr-warmup-samples", type=int, default=None, help="linear LR warmup over this many samples")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="grow the global batch from START by INCREMENT evenly over SAMPLES consumed samples "
                        "(needs --train-samples)")
    g.add_argument("--kill-switch-path", default=None,
                   help="when this file exists (checked before each iteration), exit 0 at once without saving")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="tensorboard events kept in memory before a write")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true",
                   help="the global batch per step as the tensorboard scalar train/global_batch_size (always on here)")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="validation perplexity as the tensorboard scalar valid/ppl (always on here)")
    g.add_argument("--sync-tp-duplicated-parameters", action="store_true",
                   help="after each step, average over TP the parameters every TP rank holds (LayerNorms, "
                        "row-parallel biases) and their fp32 masters")
    g.add_argument("--universal-checkpoint", action="store_true",
                   help="--load an upstream folder's universal checkpoint (latest_universal); this project's own "
                        "checkpoints load on any layout without it")
    g.add_argument("--pp-partition-method", default="type:transformer",
                   help="how layers are split over pipeline stages: type:transformer (default), "
                        "type:transformer|embedding (BLOOM's), parameters, uniform")
    g.add_argument("--override-lr-scheduler", action="store_true",
                   help="on resume take the LR schedule from the flags (this project's default) and say nothing of "
                        "the checkpoint's")
    g.add_argument("--use-checkpoint-lr-scheduler", action="store_true",
                   help="on resume take the LR schedule (lr, min lr, warmup, decay, style) from the checkpoint")
    g.add_argument("--eval-only", action="store_true",
                   help="evaluate --eval-iters batches of the validation split and exit, without training")
    g.add_argument("--checkpoint-num-layers", type=int, default=1,
                   help="transformer layers per activation-checkpoint chunk (with --checkpoint-activations)")
    for flag in ("--train-weighted-split-paths-path", "--valid-weighted-split-paths-path",
                 "--test-weighted-split-paths-path"):
        g.add_argument(flag, default=None, help="not supported (one line says why)")


def _monitoring_flags(parser):
    """Timers, profiles and Weights & Biases (Megatron-LM's names); MonitoringConfig holds them."""
    g = parser.add_argument_group("timers and profiles")
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0,
                   help="0: the log line only; 1: + per-phase times, communication share, pipeline bubble, GPU "
                   "utilization; 2: + per-micro-batch and per-layer times")
    g.add_argument("--timing-log-option", choices=TIMING_LOG_OPTIONS, default="max",
                   help="how phase times of the ranks are combined: max, min and max, or every rank's")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="also write the phase times to tensorboard (and W&B) as timers/<phase> (alone, as in "
                   "BLOOM's tr11 recipe, it turns on --timing-log-level 1)")
    g.add_argument("--profile", action="store_true", help="torch profiler trace of the iterations after "
                   "--profile-step-start up to --profile-step-end")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="ranks that write a trace")
    g.add_argument("--profile-dir", default=None, help="where traces go (default: --tensorboard-dir)")

    g = parser.add_argument_group("weights and biases")
    g.add_argument("--wandb-project", default=None, help="log the tensorboard scalars to this W&B project")
    g.add_argument("--wandb-exp-name", default=None, help="the W&B run's name")
    g.add_argument("--wandb-save-dir", default=None, help="W&B's local folder (default: --tensorboard-dir or "
                   "--save); WANDB_MODE=offline keeps the run there")


def _eval_harness_flags(parser):
    g = parser.add_argument_group("lm-evaluation-harness during training")
    g.add_argument("--eval-harness-tasks", default=None,
                   help="comma-separated lm-eval tasks run on the live model every --eval-harness-interval")
    g.add_argument("--eval-harness-interval", type=int, default=None, help="iterations between harness runs")
    g.add_argument("--eval-harness-limit", type=float, default=None,
                   help="documents per task (a fraction below 1.0; default: all)")
    g.add_argument("--eval-harness-include-path", default=None, help="a folder of extra lm-eval task YAML files")
    g.add_argument("--eval-harness-batch-size", type=int, default=16,
                   help="contexts per forward pass (each with its continuations)")
    g.add_argument("--eval-harness-num-fewshot", type=int, default=None)


def _eval_harness_section(values):
    tasks = tuple(t.strip() for t in (values["eval_harness_tasks"] or "").split(",") if t.strip())
    return _section(EvalHarnessConfig, values, eval_harness_tasks=tasks)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad command line once per job, in one line ending in `see --help` (no usage
    block), and prints --help once: launchers start one copy of the script per GPU."""

    def error(self, message):
        from megatron.initialize import exit_before_distributed
        exit_before_distributed(f"{message}; see {self.prog} --help", 2)

    def print_help(self, file=None):
        from megatron.initialize import is_first_local_rank
        if is_first_local_rank():
            super().print_help(file)


def build_parser():
    parser = ArgumentParser(description="Pretrain a BLOOM-architecture model with DeepSpeed", allow_abbrev=False)
    for add in (_model_flags, _parallel_flags, _training_flags, _deepspeed_flags, _data_flags,
                _logging_checkpoint_flags, _add_upstream_compat_args, _monitoring_flags,
                _eval_harness_flags):
        add(parser)
    return parser


def parse_args(argv=None):
    """The Namespace of the command line, plus `explicit_flags`: the dests given on it (not defaulted), which
    a DeepSpeed JSON key naming the same flag must agree with."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(_unrecognized(parser, unknown))
    probe = build_parser()  # the same flags, every default replaced by a marker no command line can produce
    probe.set_defaults(**{dest: _UNSET for dest in vars(args)})
    given = vars(probe.parse_known_args(argv)[0])
    args.explicit_flags = frozenset(dest for dest, value in given.items() if value is not _UNSET)
    return args


def _unrecognized(parser, unknown):
    spellings = [s for action in parser._actions for s in action.option_strings]
    flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")]
    close = [match for flag in flags for match in difflib.get_close_matches(flag, spellings, n=1, cutoff=0.8)]
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return f"unrecognized arguments: {' '.join(unknown)}{hint}"


@functools.lru_cache(maxsize=None)
def flags_by_json_key():
    """{DeepSpeed JSON key: argparse action} for the flags a top-level JSON key may set: each long spelling
    with underscores (lr, min_lr, micro_batch_size, model_parallel_size, ...) and JSON_ALIASES."""
    by_spelling = {s: action for action in build_parser()._actions for s in action.option_strings}
    actions = {spelling[2:].replace("-", "_"): action for spelling, action in by_spelling.items()
               if spelling.startswith("--") and action.dest not in _NOT_FROM_JSON and action.dest != "help"}
    actions.update({key: by_spelling[flag] for key, flag in JSON_ALIASES.items()})
    return actions


def json_value_for_flag(action, key, value):
    """The value `action`'s dest takes from JSON key `key` (typed and checked as on the command line)."""
    flag = action.option_strings[0]

    def bad(expected):
        return ValueError(f"DeepSpeed config {key}={json.dumps(value)} is not a valid {flag}: expected "
                          f"{expected}; fix the value or drop the key")
    if action.nargs == 0:  # a switch (--bf16, --no-embed-layernorm): true/false
        if not isinstance(value, bool):
            raise bad("true or false")
        return action.const if value else not action.const
    if action.nargs in ("*", "+"):
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in values):
            raise bad("a list of strings")
        return [str(v) for v in values]
    kind = action.type or str
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise bad(f"a{'n integer' if kind is int else ' number' if kind is float else ' string'}")
    if kind is int and isinstance(value, float):
        if not value.is_integer():
            raise bad("an integer")
        value = int(value)
    try:
        converted = kind(value)
    except ValueError:
        raise bad(f"a{'n integer' if kind is int else ' number' if kind is float else ' string'}") from None
    if action.choices is not None and converted not in action.choices:
        raise bad("one of " + ", ".join(map(str, action.choices)))
    return converted


def check_required(values):
    """REQUIRED flags come from the command line or the DeepSpeed JSON; raises ValueError naming the missing."""
    missing = [dest for dest in REQUIRED if values.get(dest) is None]
    if missing:
        flags = ", ".join("--" + dest.replace("_", "-") for dest in missing)
        raise ValueError(f"missing required flags: {flags}; pass them on the command line (or as "
                         f"{', '.join(missing)} in the --deepspeed_config JSON)")


def world_size_from_env():
    return int(os.environ.get("WORLD_SIZE", "1"))


def _section(cls, values, **derived):
    """cls from the flag values named like its fields; a None (flag unset) leaves the field's default."""
    names = {field.name for field in dataclasses.fields(cls)}
    chosen = {**{k: v for k, v in values.items() if k in names}, **derived}
    return cls(**{k: v for k, v in chosen.items() if v is not None})


def _padded_vocab(values, tokenizer_vocab_size, saved_meta):
    """(padded vocabulary, the --pad-vocab-size-to in force). Resuming (or fine-tuning) keeps the checkpoint's
    padded vocabulary, which depends on the TP size it was trained with (128 x TP), instead of padding the
    tokenizer again for this run's TP size; --pad-vocab-size-to overrides."""
    if tokenizer_vocab_size is None:
        if not values["mock_data"]:
            raise ValueError("no tokenizer vocabulary size: build the tokenizer named by --vocab-file/--merge-file "
                             "or --tokenizer-name-or-path and pass its vocab_size, or pass --mock-data")
        tokenizer_vocab_size = values["mock_vocab_size"]
    tp, pad_to = values["tensor_model_parallel_size"], values["pad_vocab_size_to"]
    saved = (saved_meta or {}).get("vocab_size") if values["load"] and pad_to is None else None
    if saved and saved >= tokenizer_vocab_size:
        if saved % tp != 0:
            raise ValueError(f"--load {values['load']}: its padded vocabulary ({saved}) is not divisible by "
                             f"--tensor-model-parallel-size {tp}; pick a TP size that divides it")
        pad_to = saved
    return pad_vocab_size(tokenizer_vocab_size, values["make_vocab_size_divisible_by"], tp, pad_to), pad_to


def resolve(args, world_size, ds_json=None, saved_meta=None, tokenizer_vocab_size=None, cuda_available=False):
    """The frozen Config and the DeepSpeed dict from parsed flags, the loaded --deepspeed_config JSON (or None),
    the checkpoint's saved "model" section (or None; its vocab_size is kept when resuming) and the tokenizer's
    vocabulary size (None with --mock-data: --mock-vocab-size). Pure: args is not changed, no file is read, no
    tokenizer is built, nothing is logged. Raises ValueError naming the flags of the first rule broken."""
    from megatron.deepspeed_config import build_deepspeed_config, merge_json_flags, reconcile
    user = ds_json or {}
    values, _ = merge_json_flags(args, user, args.deepspeed_config)
    backend = values["distributed_backend"] or ("nccl" if cuda_available else "gloo")
    parallel = _section(ParallelConfig, values, world_size=world_size, distributed_backend=backend)
    check_required(values)
    values = reconcile(values, user, parallel.data_parallel_size)
    vocab_size, pad_to = _padded_vocab(values, tokenizer_vocab_size, saved_meta)
    model = _section(ModelConfig, values, vocab_size=vocab_size)
    training = _section(TrainingConfig, values, data_parallel_size=parallel.data_parallel_size)
    training, upstream = _upstream_sections(values, training, getattr(args, "explicit_flags", frozenset()))
    optimizer = _section(OptimizerConfig, values, lr_decay_iters=values["lr_decay_iters"] or training.train_iters)
    metrics_dir = values["tensorboard_dir"] or values["save"]
    config = Config(
        model=model, parallel=parallel, optimizer=optimizer, precision=_section(PrecisionConfig, values),
        training=training, data=_section(DataConfig, values, data_path=tuple(values["data_path"]),
                                         pad_vocab_size_to=pad_to),
        logging=_section(LoggingConfig, values, metrics_file=values["metrics_file"] or (
            os.path.join(metrics_dir, "metrics.jsonl") if metrics_dir else None)),
        checkpoint=_section(CheckpointConfig, values), deepspeed_config=values["deepspeed_config"],
        upstream=upstream,
        monitoring=_section(MonitoringConfig, values, profile_ranks=tuple(values["profile_ranks"]),
                            # upstream's --log-timers-to-tensorboard alone (BLOOM's tr11) asks for the timers
                            timing_log_level=values["timing_log_level"] or int(values["log_timers_to_tensorboard"]),
                            profile_dir=values["profile_dir"] or values["tensorboard_dir"],
                            wandb_save_dir=values["wandb_save_dir"] or metrics_dir),
        eval_harness=_eval_harness_section(values))
    return config, build_deepspeed_config(config, user)


def _upstream_sections(values, training, explicit):
    """(training with the ramp-up's iteration count, UpstreamConfig): the tr11 recipe's flags checked."""
    from megatron import upstream_compat
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
        both = [f"--{d.replace('_', '-')}" for d in ("lr_warmup_iters", "lr_decay_iters") if d in explicit]
        if both:
            raise ValueError(f"{both[0]} and --lr-warmup-samples/--lr-decay-samples are both set: the schedule "
                             "counts iterations or samples, not both; pass one form")
    return training, upstream


def check_data_files(data):
    """Each --data-path prefix names an existing .bin/.idx pair (DataConfig checked the flag's shape)."""
    if data.mock_data:
        return
    for prefix in data.prefixes:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ValueError(f"--data-path {prefix}: {prefix + ext} does not exist; run "
                                 "tools/preprocess_data.py first or fix the prefix (no .bin/.idx suffix)")


def load_and_resolve(argv=None, world_size=None):
    """parse_args + the I/O resolve() leaves to its caller: reads the --deepspeed_config JSON, builds the
    tokenizer, reads the --load checkpoint's saved model section, checks the data files. world_size defaults
    to $WORLD_SIZE. Returns (config, DeepSpeed dict, tokenizer or None). Raises ValueError on any bad input."""
    from megatron.deepspeed_config import load_user_config, log_notes, merge_json_flags
    from megatron.tokenizer import build_tokenizer, infer_tokenizer_type
    args = parse_args(argv)
    user = load_user_config(args.deepspeed_config)
    values, notes = merge_json_flags(args, user, args.deepspeed_config)  # which tokenizer and checkpoint
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
                              tokenizer.vocab_size if tokenizer is not None else None, torch.cuda.is_available())
    if config.data.pad_vocab_size_to != values["pad_vocab_size_to"]:
        logger.info("keeping the checkpoint's padded vocabulary of %d (--pad-vocab-size-to overrides)",
                    config.model.vocab_size)
    check_data_files(config.data)
    return config, ds_dict, tokenizer
