"""Typed, frozen configs built once from the command line; cross-field checks and derived values live here.

Components receive only the sub-config they need. Each sub-config checks its own fields in __post_init__ and
derives what follows from them (the default global batch, train iterations from samples, warmup fractions);
Config.__post_init__ checks the rules that span two of them. Errors a user can cause raise ValueError naming
the flag, the values and the fix (ConfigError, a ValueError). Pure: no files, no tokenizer, no torch, nothing
else from megatron but megatron.flags.

Each command-line flag is declared here, once, on the field it sets (`= flag(default, help, ...)`: spellings,
help, choices, DeepSpeed JSON keys); arguments.py generates the parser from FLAG_SECTIONS. How to add a flag:
megatron/flags.py's docstring.
"""
import functools
from dataclasses import dataclass
from typing import Optional

from megatron.flags import comma_separated, declared_flags, flag, json_table

ATTENTION_IMPLS = ("auto", "cudnn", "flex", "sdpa", "fused", "torch")
LOG_LEVELS = ("debug", "info", "warning")


class ConfigError(ValueError):
    """A bad command line, DeepSpeed JSON or combination of flags; str() is the one line to print. The parser and
    resolve() raise it; the entry point decides how to exit (pretrain_bloom.py: printed once per host, exit 2)."""


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


def validate_parallel_sizes(world_size, tensor_model_parallel_size, pipeline_model_parallel_size):
    """Returns the data-parallel size, or raises ValueError naming the flags, the values and a fix."""
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) and --pipeline-model-parallel-size ({pp}) "
                         "must be at least 1")
    if world_size % (tp * pp) != 0:
        fits = [f"TP {t} x PP {p}" for t in (1, 2, 4, 8) for p in (1, 2, 4, 8)
                if world_size % (t * p) == 0 and t * p <= world_size and t <= 8]
        raise ValueError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = {tp * pp} processes "
            f"per model replica, which does not divide the {world_size} processes launched; "
            f"launch a multiple of {tp * pp} processes or pick a layout that fits {world_size}: "
            + ", ".join(fits[:6]))
    return world_size // (tp * pp)


def _derive(config, **values):
    """Sets derived fields of a frozen dataclass from its own __post_init__."""
    for name, value in values.items():
        object.__setattr__(config, name, value)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a BLOOM network (vocab_size is the padded size the embedding holds)."""
    num_layers: int = flag(help="transformer layers", required=True)
    hidden_size: int = flag(help="hidden size h", required=True)
    num_attention_heads: int = flag(help="attention heads (divisible by TP)", required=True)
    vocab_size: int  # the padded vocabulary: from the tokenizer, --make-vocab-size-divisible-by and TP
    # the flag is required; 2048 serves library callers (a BloomConfig has no sequence length)
    seq_length: int = flag(2048, "tokens per sample", required=True)
    max_position_embeddings: Optional[int] = flag(None, "the longest sequence the model is meant for (ALiBi has no "
                                                  "position table; checked against --seq-length)")
    ffn_hidden_size: Optional[int] = flag(None, "MLP inner size", default_text="4 x --hidden-size")
    layernorm_epsilon: float = flag(1e-5, "LayerNorm epsilon")
    hidden_dropout: float = flag(0.0, "dropout after attention and MLP")
    attention_dropout: float = flag(0.0, "dropout of the attention probabilities")
    init_method_std: float = flag(0.02, "standard deviation of the normal weight initialisation")
    embed_layernorm: bool = flag(True, "LayerNorm after the word embeddings (BLOOM)",
                                 negation="--no-embed-layernorm")
    position_embedding_type: str = flag("alibi", "position encoding (BLOOM: ALiBi)", choices=("alibi",))
    apply_residual_connection_post_layernorm: bool = flag(
        False, "the residual branch starts after the input LayerNorm instead of before it")
    attention_impl: str = flag("auto", "attention backend (auto: the fastest that serves; a fallback is logged)",
                               choices=ATTENTION_IMPLS)
    checkpoint_activations: bool = flag(False, "recompute each layer's activations in the backward pass")
    fused_layernorm: bool = flag(False, "csrc mixed-precision LayerNorm (CUDA)")
    fused_elementwise: bool = flag(False, "training on CUDA: the block's bias + GeLU and bias + dropout + residual "
                                   "(+ LayerNorm) as three torch.compile'd fused regions per block (measured "
                                   "slower than off on the H200: host overhead per region call)",
                                   negation="--no-fused-elementwise")
    compile_blocks: bool = flag(False, "training on CUDA at TP 1 without dropout: each transformer block's forward "
                                "(LayerNorms, QKV, FlexAttention/SDPA, dense, MLP, residuals) as one "
                                "torch.compile'd region, reused by every layer; elsewhere the block runs as "
                                "without it (--fused-elementwise's regions if on, else eager)")
    gemm_epilogues: bool = flag(
        True, "training on CUDA: the MLP's GeLU gradient computed in the epilogue of its 4h -> h dgrad GEMM "
        "(cuBLASLt DGELU, csrc), not by a kernel of its own; torch ops where the kernels are not built",
        negation="--no-gemm-epilogues")
    gradient_accumulation_fusion: bool = flag(
        True, "each micro batch's weight gradients are summed into .grad by the weight-gradient GEMM (beta = 1) "
        "and the embedding's index_put_, not by a separate add; serves the parameters without gradient hooks "
        "(ZeRO 0; ZeRO 1/2 without contiguous gradients or overlap; never ZeRO 3), also in --compile-blocks",
        negation="--no-gradient-accumulation-fusion")
    abort_on_unmet_fused_kernel_constraints: bool = flag(
        False, "stop instead of falling back when a fused kernel cannot serve this configuration")
    loss_chunk_size: int = flag(0, "tokens per chunk of the LM head + loss (0: whole micro batch at once; PP 1 "
                                "only)")
    tensor_model_parallel_size: int = 1  # --tensor-model-parallel-size (ParallelConfig's flag)
    seed: int = flag(1234, "random seed of weights, dropout and data order")
    checkpoint_num_layers: int = flag(1, "transformer layers per activation-checkpoint chunk (with "
                                      "--checkpoint-activations)")

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
        """Trainable parameters (the LM head is tied to the word embeddings): the sum over the parameter spec's
        rows (megatron/model/spec.py)."""
        from megatron.model.spec import num_parameters
        return num_parameters(self)


@dataclass(frozen=True)
class ParallelConfig:
    """TP x PP x DP = world size; validated once, before anything is built."""
    tensor_model_parallel_size: int = flag(1, "tensor-parallel size (TP)", aliases=("--model-parallel-size",))
    pipeline_model_parallel_size: int = flag(1, "pipeline stages (PP)", aliases=("--pipe-parallel-size",))
    world_size: int = 1  # $WORLD_SIZE
    distributed_backend: Optional[str] = flag(None, "torch.distributed backend", choices=("nccl", "gloo"),
                                              default_text="nccl with CUDA, gloo without")
    distributed_timeout_minutes: int = flag(10, "timeout of collective operations")

    def __post_init__(self):
        validate_parallel_sizes(self.world_size, self.tensor_model_parallel_size, self.pipeline_model_parallel_size)

    @property
    def data_parallel_size(self):
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = flag(help="peak learning rate", required=True)
    optimizer: str = flag("adam", "optimizer (adam: AdamW with decoupled weight decay)", choices=("adam", "sgd"))
    min_lr: float = flag(0.0, "learning rate at the end of the decay")
    lr_decay_style: str = flag("linear", "how the LR decays after warmup", choices=("constant", "linear", "cosine"))
    # a value below 1 is a fraction of lr_decay_iters, made iterations in __post_init__
    lr_warmup_iters: int = flag(0, "iterations of linear warmup (a value below 1 is a fraction of --lr-decay-iters)",
                                type=float, aliases=("--warmup",), json=("warmup_iters",))
    lr_decay_iters: Optional[int] = flag(None, "iterations over which the LR decays", default_text="--train-iters")
    weight_decay: float = flag(0.01, "decoupled weight decay (not on biases and norms)")
    clip_grad: float = flag(1.0, "gradient-norm clipping (0: off)", deepspeed="gradient_clipping")
    adam_beta1: float = flag(0.9, "Adam beta1")
    adam_beta2: float = flag(0.999, "Adam beta2")
    adam_eps: float = flag(1e-8, "Adam epsilon")
    sgd_momentum: float = flag(0.9, "SGD momentum")

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
    bf16: bool = flag(False, "bfloat16 weights and activations (fp32 master weights)")
    fp16: bool = flag(False, "float16 with loss scaling")
    loss_scale: Optional[float] = flag(None, "static fp16 loss scale", default_text="dynamic")
    initial_loss_scale: float = flag(2.0 ** 32, "first dynamic loss scale")
    min_loss_scale: float = flag(1.0, "lowest dynamic loss scale", deepspeed="fp16.min_loss_scale")
    loss_scale_window: int = flag(1000, "overflow-free iterations before the dynamic scale grows",
                                  deepspeed="fp16.loss_scale_window")
    hysteresis: int = flag(2, "overflows tolerated before the dynamic scale shrinks", deepspeed="fp16.hysteresis")

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
    micro_batch_size: int = flag(help="samples per GPU per forward pass", required=True)
    data_parallel_size: int  # world / (TP x PP)
    global_batch_size: Optional[int] = flag(None, "samples per optimizer step", aliases=("--batch-size",),
                                            default_text="micro batch x data-parallel size")
    train_iters: Optional[int] = flag(None, "iterations to train (or --train-samples)")
    train_samples: Optional[int] = flag(None, "samples to train (or --train-iters)")
    eval_interval: int = flag(1000, "iterations between validation runs")
    eval_iters: int = flag(10, "validation batches per run")
    exit_interval: Optional[int] = flag(None, "save and exit at the first iteration divisible by this")
    exit_duration_in_mins: Optional[float] = flag(None, "save and exit after this many minutes of training")
    exit_signal_handler: bool = flag(False, "SIGTERM/SIGINT: save and exit 0")
    max_nan_iterations: int = flag(3, "consecutive iterations with a NaN/inf loss before the run stops")
    zero_stage: int = flag(0, "ZeRO stage", choices=(0, 1, 2, 3), deepspeed="zero_optimization.stage")
    cpu_offload: bool = flag(False, "ZeRO optimizer state on the CPU")
    partition_activations: bool = flag(False, "split checkpointed activations across tensor-parallel ranks",
                                       deepspeed="activation_checkpointing.partition_activations")

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
    data_path: tuple = flag((), "prefix, or weight prefix weight prefix ...", type=str, nargs="*")
    split: str = flag("969,30,1", "train, validation, test weights of each dataset")
    data_impl: str = flag("mmap", "indexed dataset format", aliases=("--dataset-impl",), choices=("mmap",))
    tokenizer_type: Optional[str] = flag(None, "tokenizer", choices=("GPT2BPETokenizer", "PretrainedFromHF"),
                                         default_text="GPT2BPETokenizer with --vocab-file/--merge-file, else "
                                         "PretrainedFromHF")
    vocab_file: Optional[str] = flag(None, "GPT-2 BPE vocab.json")
    merge_file: Optional[str] = flag(None, "GPT-2 BPE merges.txt")
    tokenizer_name_or_path: Optional[str] = flag(None, "a local Hugging Face tokenizer folder or tokenizer.json")
    make_vocab_size_divisible_by: int = flag(128, "pad the vocabulary to a multiple of this x TP")
    pad_vocab_size_to: Optional[int] = flag(None, "pad the vocabulary to exactly this size")
    num_workers: int = flag(0, "data loader worker processes")
    data_cache_dir: Optional[str] = flag(None, "where index files go", default_text="beside the data")
    mock_data: bool = flag(False, "synthetic random tokens (benchmarks)")
    mock_vocab_size: int = flag(50257, "vocabulary of --mock-data without a tokenizer")

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
    log_interval: int = flag(100, "iterations between log lines")
    tensorboard_dir: Optional[str] = flag(None, "write tensorboard events here")
    metrics_file: Optional[str] = flag(None, "JSON lines of per-iteration metrics",
                                       default_text="metrics.jsonl in --tensorboard-dir or --save")
    peak_tflops: Optional[float] = flag(None, "device bf16 peak for MFU",
                                        default_text="measured once at start-up on CUDA")
    log_level: str = flag("info", "info: our log lines only; debug: also DeepSpeed's logs, prints and warnings",
                          choices=LOG_LEVELS)


# ---------------------------------------------------------------- timers, profiles, W&B (issue 22)
TIMING_LOG_OPTIONS = ("max", "minmax", "all")


@dataclass(frozen=True)
class MonitoringConfig:
    """What a run measures about itself beyond the log line: phase timers (Megatron's --timing-log-level and
    --timing-log-option), the torch profiler window and Weights & Biases. profile_dir is resolved (it defaults to
    --tensorboard-dir)."""
    timing_log_level: int = flag(0, "0: the log line only; 1: + per-phase times, communication share, pipeline "
                                 "bubble, GPU utilization; 2: + per-micro-batch and per-layer times",
                                 choices=(0, 1, 2))
    timing_log_option: str = flag("max", "how phase times of the ranks are combined: max, min and max, or every "
                                  "rank's", choices=TIMING_LOG_OPTIONS)
    log_timers_to_tensorboard: bool = flag(False, "also write the phase times to tensorboard (and W&B) as "
                                           "timers/<phase> (alone, as in BLOOM's tr11 recipe, it turns on "
                                           "--timing-log-level 1)")
    profile: bool = flag(False, "torch profiler trace of the iterations after --profile-step-start up to "
                         "--profile-step-end")
    profile_step_start: int = flag(10, "the iteration after which the trace starts")
    profile_step_end: int = flag(12, "the last traced iteration")
    profile_ranks: tuple = flag((0,), "ranks that write a trace", type=int, nargs="+")
    profile_dir: Optional[str] = flag(None, "where traces go", default_text="--tensorboard-dir")
    wandb_project: Optional[str] = flag(None, "log the tensorboard scalars to this W&B project")
    wandb_exp_name: Optional[str] = flag(None, "the W&B run's name")
    wandb_save_dir: Optional[str] = flag(None, "W&B's local folder (WANDB_MODE=offline keeps the run there)",
                                         default_text="--tensorboard-dir or --save")

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
    save: Optional[str] = flag(None, "checkpoint folder to save to")
    load: Optional[str] = flag(None, "checkpoint folder to resume from (this project's or upstream's)")
    save_interval: Optional[int] = flag(None, "iterations between checkpoints", default_text="at the end only")
    no_load_optim: bool = flag(False, "resume without the optimizer state")
    no_load_rng: bool = flag(False, "resume without the random-number generator states")
    no_save_optim: bool = flag(False, "save weights without the optimizer state")
    finetune: bool = flag(False, "load weights only; restart iterations at 0")
    keep_last_n_checkpoints: Optional[int] = flag(None, "delete older checkpoints beyond this many",
                                                  default_text="keep all")
    strict_load: bool = flag(False, "stop instead of falling back to an older checkpoint")
    async_save: bool = flag(False, "write checkpoints in the background: the state is copied to host memory and "
                            "training goes on while a thread writes it (one save in flight)")
    checkpoint_verify_timeout_minutes: int = flag(60, "time budget of the parallel checksum of a checkpoint before "
                                                  "it is loaded (apart from --distributed-timeout-minutes)")

    def __post_init__(self):
        if self.checkpoint_verify_timeout_minutes < 1:
            raise ConfigError(f"--checkpoint-verify-timeout-minutes {self.checkpoint_verify_timeout_minutes} must "
                              "be at least 1")


# ---------------------------------------------------------------- upstream compatibility (issue 21)
# BigScience's tr11 (BLOOM) recipe flags, declared on UpstreamConfig; megatron/upstream_compat.py holds the pure
# functions (ramp-up, sample-based schedule lengths) and the checks that span sections.


@dataclass(frozen=True)
class UpstreamConfig:
    """The flags of BigScience's Megatron-DeepSpeed that BLOOM's tr11 recipe passes (what each does: --help)."""
    lr_decay_samples: Optional[int] = flag(None, "LR decay over this many consumed samples (sample-based "
                                           "schedule)", default_text="--train-samples")
    lr_warmup_samples: Optional[int] = flag(None, "linear LR warmup over this many samples")
    rampup_batch_size: Optional[tuple] = flag(  # (start, increment, ramp-up samples)
        None, "grow the global batch from START by INCREMENT evenly over SAMPLES consumed samples (needs "
        "--train-samples)", type=int, nargs=3, metavar=("START", "INCREMENT", "SAMPLES"))
    kill_switch_path: Optional[str] = flag(None, "when this file exists (checked before each iteration), exit 0 at "
                                           "once without saving")
    tensorboard_queue_size: int = flag(1000, "tensorboard events kept in memory before a write")
    log_batch_size_to_tensorboard: bool = flag(False, "the global batch per step as the tensorboard scalar "
                                               "train/global_batch_size (always on here)")
    log_validation_ppl_to_tensorboard: bool = flag(False, "validation perplexity as the tensorboard scalar "
                                                   "valid/ppl (always on here)")
    sync_tp_duplicated_parameters: bool = flag(False, "after each step, average over TP the parameters every TP "
                                               "rank holds (LayerNorms, row-parallel biases) and their fp32 "
                                               "masters")
    universal_checkpoint: bool = flag(False, "--load an upstream folder's universal checkpoint (latest_universal); "
                                      "this project's own checkpoints load on any layout without it")
    pp_partition_method: str = flag("type:transformer", "how layers are split over pipeline stages: "
                                    "type:transformer, type:transformer|embedding (BLOOM's), parameters, uniform")
    override_lr_scheduler: bool = flag(False, "on resume take the LR schedule from the flags (this project's "
                                       "default) and say nothing of the checkpoint's")
    use_checkpoint_lr_scheduler: bool = flag(False, "on resume take the LR schedule (lr, min lr, warmup, decay, "
                                             "style) from the checkpoint")
    eval_only: bool = flag(False, "evaluate --eval-iters batches of the validation split and exit, without "
                           "training")
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
    eval_harness_tasks: tuple = flag((), "comma-separated lm-eval tasks run on the live model every "
                                     "--eval-harness-interval", type=comma_separated)
    eval_harness_interval: Optional[int] = flag(None, "iterations between harness runs")
    eval_harness_limit: Optional[float] = flag(None, "documents per task (a fraction below 1.0)",
                                               default_text="all")
    eval_harness_include_path: Optional[str] = flag(None, "a folder of extra lm-eval task YAML files")
    eval_harness_batch_size: int = flag(16, "contexts per forward pass (each with its continuations)")
    eval_harness_num_fewshot: Optional[int] = flag(None, "few-shot examples per context",
                                                   default_text="each task's own")

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
    deepspeed_config: Optional[str] = flag(None, "DeepSpeed JSON: its keys fill in flags not given; a key that "
                                           "contradicts a flag stops the run", spelling="--deepspeed_config",
                                           aliases=("--deepspeed-config",), json=False)
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


# The sections whose fields declare flags, in --help order (title, class); arguments.py builds the parser from them.
FLAG_SECTIONS = (("model", ModelConfig), ("parallelism", ParallelConfig), ("training", TrainingConfig),
                 ("optimizer", OptimizerConfig), ("precision", PrecisionConfig), ("deepspeed", Config),
                 ("data", DataConfig), ("logging", LoggingConfig), ("checkpointing", CheckpointConfig),
                 ("upstream Megatron-DeepSpeed (BLOOM tr11 recipe)", UpstreamConfig),
                 ("timers, profiles, weights and biases", MonitoringConfig),
                 ("lm-evaluation-harness during training", EvalHarnessConfig))


@functools.lru_cache(maxsize=None)
def flag_specs():
    """Every declared flag (megatron.flags.FlagSpec), in --help order."""
    return declared_flags(FLAG_SECTIONS)


@functools.lru_cache(maxsize=None)
def json_flags():
    """{top-level DeepSpeed JSON key: (FlagSpec, value a true switch key stores)}: each long spelling with
    underscores (lr, min_lr, micro_batch_size, model_parallel_size, no_embed_layernorm, ...) and the extra keys
    declared with json= (warmup_iters)."""
    return json_table(flag_specs())
