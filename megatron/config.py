"""Typed, frozen configs built once from the command line; cross-field checks and derived values live here.

Components receive only the sub-config they need. Each sub-config checks its own fields in __post_init__ and
derives what follows from them (the default global batch, train iterations from samples, warmup fractions);
Config.__post_init__ checks the rules that span two of them. Errors a user can cause raise ValueError naming
the flag, the values and the fix. Pure: no files, no tokenizer, no torch.
"""
from dataclasses import dataclass
from typing import Optional

ATTENTION_IMPLS = ("auto", "flex", "sdpa", "fused", "torch")


def pad_vocab_size(orig_vocab_size, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
                   pad_vocab_size_to=None):
    """Vocab size of the embedding: orig rounded up to a multiple of make_vocab_size_divisible_by * TP.

    BLOOM: 250680 -> 250880 for 128 with TP 2, 4 or 8 (250752 with TP 1: BLOOM was trained at TP 4). With
    pad_vocab_size_to the caller picks the size; it must hold every token and split evenly over the TP ranks.
    """
    if make_vocab_size_divisible_by < 1:
        raise ValueError(f"--make-vocab-size-divisible-by {make_vocab_size_divisible_by} must be >= 1 "
                         "(128 is the usual value)")
    if tensor_model_parallel_size < 1:
        raise ValueError(f"--tensor-model-parallel-size {tensor_model_parallel_size} must be >= 1")
    if pad_vocab_size_to is not None:
        if pad_vocab_size_to < orig_vocab_size:
            raise ValueError(f"--pad-vocab-size-to {pad_vocab_size_to} is smaller than the tokenizer's "
                             f"vocabulary of {orig_vocab_size} tokens; pass a value >= {orig_vocab_size} "
                             "or leave it unset")
        if pad_vocab_size_to % tensor_model_parallel_size != 0:
            fixed = -(-pad_vocab_size_to // tensor_model_parallel_size) * tensor_model_parallel_size
            raise ValueError(f"--pad-vocab-size-to {pad_vocab_size_to} is not divisible by "
                             f"--tensor-model-parallel-size {tensor_model_parallel_size}; pass a multiple of "
                             f"{tensor_model_parallel_size} (for example {fixed})")
        return pad_vocab_size_to
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-orig_vocab_size // multiple) * multiple


def _derive(config, **values):
    """Sets derived fields of a frozen dataclass from its own __post_init__."""
    for name, value in values.items():
        object.__setattr__(config, name, value)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a BLOOM network (vocab_size is the padded size the embedding holds)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int = 2048
    max_position_embeddings: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    layernorm_epsilon: float = 1e-5
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    embed_layernorm: bool = True
    position_embedding_type: str = "alibi"
    apply_residual_connection_post_layernorm: bool = False
    attention_impl: str = "auto"
    checkpoint_activations: bool = False
    fused_layernorm: bool = False
    abort_on_unmet_fused_kernel_constraints: bool = False
    loss_chunk_size: int = 0
    tensor_model_parallel_size: int = 1
    seed: int = 1234
    checkpoint_num_layers: int = 1  # upstream compatibility (issue 21): layers per activation-checkpoint chunk

    def __post_init__(self):
        if self.checkpoint_num_layers < 1:
            raise ValueError(f"--checkpoint-num-layers {self.checkpoint_num_layers} must be at least 1")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; choose a head count that divides the hidden size")
        tp = self.tensor_model_parallel_size
        if self.num_attention_heads % tp != 0:
            raise ValueError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}; choose a TP size that divides the head count")
        if self.ffn_dim % tp != 0:
            raise ValueError(f"--ffn-hidden-size {self.ffn_dim} is not divisible by "
                             f"--tensor-model-parallel-size {tp}")
        if self.vocab_size % tp != 0:
            raise ValueError(f"padded vocabulary {self.vocab_size} is not divisible by "
                             f"--tensor-model-parallel-size {tp}; use --make-vocab-size-divisible-by")
        if self.position_embedding_type != "alibi":
            raise ValueError(f"--position-embedding-type {self.position_embedding_type} is not supported: "
                             "BLOOM uses alibi")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"--attention-impl {self.attention_impl} is not one of {', '.join(ATTENTION_IMPLS)}")
        if self.max_position_embeddings is not None and self.seq_length > self.max_position_embeddings:
            raise ValueError(f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                             f"{self.max_position_embeddings}; raise the latter or shorten the sequence")

    @property
    def ffn_dim(self):
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self):
        """Trainable parameters (the LM head is tied to the word embeddings)."""
        h, f, l = self.hidden_size, self.ffn_dim, self.num_layers
        per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        embed = self.vocab_size * h + (2 * h if self.embed_layernorm else 0)
        return embed + l * per_layer + 2 * h


@dataclass(frozen=True)
class ParallelConfig:
    """TP x PP x DP = world size; validated once, before anything is built."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    world_size: int = 1
    distributed_backend: str = "gloo"
    distributed_timeout_minutes: int = 10

    def __post_init__(self):
        from megatron.core.parallel_state import validate_parallel_sizes
        validate_parallel_sizes(self.world_size, self.tensor_model_parallel_size, self.pipeline_model_parallel_size)

    @property
    def data_parallel_size(self):
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)


@dataclass(frozen=True)
class OptimizerConfig:
    optimizer: str = "adam"
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int = 0  # a value below 1 is a fraction of lr_decay_iters, made iterations here
    lr_decay_iters: Optional[int] = None
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9

    def __post_init__(self):
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is larger than --lr {self.lr}; lower --min-lr")
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"--lr-decay-style {self.lr_decay_style} is not one of constant, linear, cosine")
        warmup = self.lr_warmup_iters
        if 0 < warmup < 1 and self.lr_decay_iters is None:
            raise ValueError(f"--lr-warmup-iters {warmup} is a fraction of --lr-decay-iters, which is unset; "
                             "pass --lr-decay-iters or a whole number of warmup iterations")
        _derive(self, lr_warmup_iters=int(round(warmup * self.lr_decay_iters)) if 0 < warmup < 1 else int(warmup))


@dataclass(frozen=True)
class PrecisionConfig:
    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None  # None: dynamic
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2

    def __post_init__(self):
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are both set (as flags or as bf16.enabled and fp16.enabled in the "
                             "DeepSpeed JSON); choose one")

    @property
    def name(self):
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


def _one_of(values):
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


def batch_fit_hint(global_batch, micro_batch, data_parallel_size):
    """What satisfies global = micro x accumulation x DP, near the values given: the two global batches that
    fit this micro batch, and (when DP divides the global batch) up to two micro batch sizes either side of
    this one that divide global / DP. For 8, 3, 1: 'use a global batch of 6 or 9, or a micro batch size of
    1, 2, 4 or 8'."""
    per_step = micro_batch * data_parallel_size
    lower = global_batch // per_step * per_step
    hint = f"use a global batch of {_one_of([g for g in (lower, lower + per_step) if g > 0])}"
    if global_batch % data_parallel_size == 0:
        per_rank = global_batch // data_parallel_size
        divisors = sorted({d for i in range(1, int(per_rank ** 0.5) + 1) if per_rank % i == 0
                           for d in (i, per_rank // i)})
        nearby = [d for d in divisors if d < micro_batch][-2:] + [d for d in divisors if d > micro_batch][:2]
        hint += f", or a micro batch size of {_one_of(nearby)}"
    return hint


@dataclass(frozen=True)
class TrainingConfig:
    """Batch arithmetic and loop lengths: global = micro x grad accumulation x DP. global_batch_size defaults
    to micro x DP; train_iters comes from --train-iters or --train-samples // global batch."""
    micro_batch_size: int
    data_parallel_size: int
    global_batch_size: Optional[int] = None
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    eval_interval: int = 1000
    eval_iters: int = 10
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False
    max_nan_iterations: int = 3
    zero_stage: int = 0
    cpu_offload: bool = False
    partition_activations: bool = False

    def __post_init__(self):
        if self.micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size {self.micro_batch_size} must be positive")
        per_step = self.micro_batch_size * self.data_parallel_size
        if self.global_batch_size is None:
            _derive(self, global_batch_size=per_step)
        if self.global_batch_size % per_step != 0:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} is not divisible by --micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {self.data_parallel_size} = {per_step}; "
                + batch_fit_hint(self.global_batch_size, self.micro_batch_size, self.data_parallel_size))
        if self.train_iters is None and self.train_samples is None:
            raise ValueError("pass --train-iters or --train-samples")
        if self.train_iters is not None and self.train_samples is not None:
            raise ValueError("--train-iters and --train-samples are both set; pass one")
        if self.train_iters is None:
            _derive(self, train_iters=self.train_samples // self.global_batch_size)
        if self.train_iters < 1:
            raise ValueError(f"--train-iters {self.train_iters} must be positive (or pass --train-samples)")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage {self.zero_stage} is not one of 0, 1, 2, 3")
        if self.cpu_offload and self.zero_stage not in (1, 2, 3):
            raise ValueError(f"--cpu-offload needs ZeRO stage 1, 2 or 3 (got {self.zero_stage}); "
                             "add --zero-stage 2")

    @property
    def gradient_accumulation_steps(self):
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)


@dataclass(frozen=True)
class DataConfig:
    data_path: tuple = ()
    split: str = "969,30,1"
    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_name_or_path: Optional[str] = None
    make_vocab_size_divisible_by: int = 128
    pad_vocab_size_to: Optional[int] = None
    num_workers: int = 0
    data_cache_dir: Optional[str] = None
    mock_data: bool = False
    mock_vocab_size: int = 50257

    def __post_init__(self):
        """The shape of --data-path (whether its files exist is arguments.check_data_files' business)."""
        if self.mock_data:
            return
        if not self.data_path:
            raise ValueError("--data-path is required (the prefix of a .bin/.idx pair made by "
                             "tools/preprocess_data.py), or pass --mock-data for synthetic tokens")
        if len(self.data_path) > 1:
            if len(self.data_path) % 2 != 0:
                raise ValueError(f"--data-path with several datasets takes weight prefix pairs; got "
                                 f"{len(self.data_path)} values")
            for weight in self.data_path[0::2]:
                try:
                    float(weight)
                except ValueError:
                    raise ValueError(f"--data-path weight {weight!r} is not a number; write "
                                     "--data-path 0.7 prefix_a 0.3 prefix_b") from None

    @property
    def prefixes(self):
        """The dataset prefixes of --data-path (without its weights)."""
        return self.data_path if len(self.data_path) == 1 else self.data_path[1::2]


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    metrics_file: Optional[str] = None
    peak_tflops: Optional[float] = None
    log_level: str = "info"


# ---------------------------------------------------------------- timers, profiles, W&B (issue 22)
TIMING_LOG_OPTIONS = ("max", "minmax", "all")


@dataclass(frozen=True)
class MonitoringConfig:
    """What a run measures about itself beyond the log line: phase timers (Megatron's --timing-log-level and
    --timing-log-option), the torch profiler window and Weights & Biases. profile_dir is resolved (it defaults to
    --tensorboard-dir)."""
    timing_log_level: int = 0
    timing_log_option: str = "max"
    log_timers_to_tensorboard: bool = False
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: tuple = (0,)
    profile_dir: Optional[str] = None
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None

    def __post_init__(self):
        if self.timing_log_level not in (0, 1, 2):
            raise ValueError(f"--timing-log-level {self.timing_log_level} is not one of 0, 1, 2")
        if self.timing_log_option not in TIMING_LOG_OPTIONS:
            raise ValueError(f"--timing-log-option {self.timing_log_option} is not one of "
                             + ", ".join(TIMING_LOG_OPTIONS))
        if self.log_timers_to_tensorboard and self.timing_log_level == 0:
            raise ValueError("--log-timers-to-tensorboard writes the phase timers, which --timing-log-level 0 "
                             "does not measure; add --timing-log-level 1")
        if not self.profile:
            return
        if not 0 <= self.profile_step_start < self.profile_step_end:
            raise ValueError(f"--profile-step-start {self.profile_step_start} and --profile-step-end "
                             f"{self.profile_step_end}: need 0 <= start < end (start 10, end 12 traces "
                             "iterations 11 and 12)")
        if not self.profile_dir:
            raise ValueError("--profile needs a folder for its traces: pass --profile-dir or --tensorboard-dir")
# ---------------------------------------------------------------- end of timers, profiles, W&B


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_save_optim: bool = False
    finetune: bool = False
    keep_last_n_checkpoints: Optional[int] = None
    strict_load: bool = False
    async_save: bool = False
    checkpoint_verify_timeout_minutes: int = 60

    def __post_init__(self):
        if self.checkpoint_verify_timeout_minutes < 1:
            raise ValueError(f"--checkpoint-verify-timeout-minutes {self.checkpoint_verify_timeout_minutes} must "
                             "be at least 1")


# ---------------------------------------------------------------- upstream compatibility (issue 21)
# BigScience's tr11 (BLOOM) recipe flags; arguments._add_upstream_compat_args declares them, megatron/upstream_compat.py
# holds the pure functions (ramp-up, sample-based schedule lengths) and the checks that span sections.


@dataclass(frozen=True)
class UpstreamConfig:
    """The flags of BigScience's Megatron-DeepSpeed that BLOOM's tr11 recipe passes (what each does: --help)."""
    lr_decay_samples: Optional[int] = None
    lr_warmup_samples: Optional[int] = None
    rampup_batch_size: Optional[tuple] = None  # (start, increment, ramp-up samples)
    kill_switch_path: Optional[str] = None
    tensorboard_queue_size: int = 1000
    log_batch_size_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    sync_tp_duplicated_parameters: bool = False
    universal_checkpoint: bool = False
    pp_partition_method: str = "type:transformer"
    override_lr_scheduler: bool = False
    use_checkpoint_lr_scheduler: bool = False
    eval_only: bool = False
    train_samples: Optional[int] = None  # --train-samples (TrainingConfig's is None once a ramp-up fixes the iterations)

    def __post_init__(self):
        if self.rampup_batch_size is not None:
            _derive(self, rampup_batch_size=tuple(int(v) for v in self.rampup_batch_size))
        for name in ("lr_decay_samples", "lr_warmup_samples", "tensorboard_queue_size"):
            value = getattr(self, name)
            if value is not None and value < (1 if name != "lr_warmup_samples" else 0):
                raise ValueError(f"--{name.replace('_', '-')} {value} must be positive")
        if self.override_lr_scheduler and self.use_checkpoint_lr_scheduler:
            raise ValueError("--override-lr-scheduler and --use-checkpoint-lr-scheduler are both set: the first takes "
                             "the LR schedule from the flags, the second from the checkpoint; pass one")

    @property
    def sample_based_schedule(self):
        return self.lr_decay_samples is not None or self.lr_warmup_samples is not None


# ---------------------------------------------------------------- end of upstream compatibility


# ---- lm-evaluation-harness during training (megatron/evaluation/callback.py) -----------------------------------

@dataclass(frozen=True)
class EvalHarnessConfig:
    """--eval-harness-*: lm-eval tasks run on the live model every eval_harness_interval iterations."""
    eval_harness_tasks: tuple = ()
    eval_harness_interval: Optional[int] = None
    eval_harness_limit: Optional[float] = None
    eval_harness_include_path: Optional[str] = None
    eval_harness_batch_size: int = 16
    eval_harness_num_fewshot: Optional[int] = None

    def __post_init__(self):
        if self.eval_harness_interval is not None and self.eval_harness_interval < 1:
            raise ValueError(f"--eval-harness-interval {self.eval_harness_interval} must be at least 1")
        if self.eval_harness_tasks and not self.eval_harness_interval:
            raise ValueError("--eval-harness-tasks needs --eval-harness-interval N (iterations between runs)")
        if self.eval_harness_interval and not self.eval_harness_tasks:
            raise ValueError("--eval-harness-interval is set but --eval-harness-tasks names no task; add "
                             "--eval-harness-tasks TASK[,TASK...] or drop the interval")
        if self.eval_harness_limit is not None and self.eval_harness_limit <= 0:
            raise ValueError(f"--eval-harness-limit {self.eval_harness_limit} must be positive")
        if self.eval_harness_batch_size < 1:
            raise ValueError(f"--eval-harness-batch-size {self.eval_harness_batch_size} must be at least 1")
        if self.eval_harness_num_fewshot is not None and self.eval_harness_num_fewshot < 0:
            raise ValueError(f"--eval-harness-num-fewshot {self.eval_harness_num_fewshot} must be >= 0")

    @property
    def enabled(self):
        return bool(self.eval_harness_tasks)

# ---- end of the lm-evaluation-harness block ------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Everything a run needs, resolved from the flags once (saved beside each checkpoint)."""
    model: ModelConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    precision: PrecisionConfig
    training: TrainingConfig
    data: DataConfig
    logging: LoggingConfig
    checkpoint: CheckpointConfig
    deepspeed_config: Optional[str] = None
    upstream: UpstreamConfig = UpstreamConfig()  # upstream compatibility (issue 21)
    monitoring: MonitoringConfig = MonitoringConfig()
    eval_harness: EvalHarnessConfig = EvalHarnessConfig()

    def __post_init__(self):
        model, parallel, training = self.model, self.parallel, self.training
        pp = parallel.pipeline_model_parallel_size
        if model.tensor_model_parallel_size != parallel.tensor_model_parallel_size:
            raise ValueError(f"the model config's tensor-parallel size {model.tensor_model_parallel_size} differs "
                             f"from --tensor-model-parallel-size {parallel.tensor_model_parallel_size}; build both "
                             "from the same flags")
        if training.data_parallel_size != parallel.data_parallel_size:
            raise ValueError(f"the training config's data-parallel size {training.data_parallel_size} differs from "
                             f"the layout's {parallel.data_parallel_size}; build both from the same flags")
        if pp > model.num_layers:
            raise ValueError(f"--pipeline-model-parallel-size {pp} is larger than --num-layers {model.num_layers}; "
                             "every stage needs at least one layer")
        if training.zero_stage in (2, 3) and pp > 1:
            raise ValueError(f"--zero-stage {training.zero_stage} cannot be combined with "
                             f"--pipeline-model-parallel-size {pp}: DeepSpeed's pipeline engine supports ZeRO 0 and "
                             "1; use --zero-stage 1 or --pipeline-model-parallel-size 1")
        if model.loss_chunk_size > 0 and pp > 1:
            raise ValueError(f"--loss-chunk-size {model.loss_chunk_size} cannot be combined with "
                             f"--pipeline-model-parallel-size {pp}: the pipeline's last stage computes the whole "
                             "logits before its loss function; drop --loss-chunk-size")
        if training.partition_activations and not model.checkpoint_activations:
            raise ValueError("--partition-activations splits the activations that --checkpoint-activations keeps "
                             "across tensor-parallel ranks; add --checkpoint-activations")
        monitoring = self.monitoring  # timers, profiles, W&B (issue 22)
        if monitoring.profile and monitoring.profile_step_end > training.train_iters:
            raise ValueError(f"--profile-step-end {monitoring.profile_step_end} is past the last iteration "
                             f"({training.train_iters}); lower it or raise --train-iters")
        if monitoring.profile and max(monitoring.profile_ranks) >= parallel.world_size:
            raise ValueError(f"--profile-ranks {' '.join(map(str, monitoring.profile_ranks))}: the run has ranks 0 "
                             f"to {parallel.world_size - 1}; name ranks in that range")
        if monitoring.profile and min(monitoring.profile_ranks) < 0:
            raise ValueError("--profile-ranks takes ranks >= 0")
