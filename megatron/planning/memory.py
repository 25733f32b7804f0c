"""Per-GPU memory of a training layout, predicted from the model's shapes: what each rank of each pipeline stage
holds (weights, gradients, optimizer state, activations, communication buffers) and its peak.

Pure arithmetic: no torch, no DeepSpeed. The model-state rules are DeepSpeed 0.19's wrappers as our engine set-up
(megatron/training/engine.py) configures them, checked to the byte against real 4-process engines on CPU
(tests/integration/test_plan_memory.py); the activation rules are what each op of megatron/model saves for
backward, checked against torch's saved-tensor hooks (tests/unit/planning/test_activation_memory.py). Symbols:
b micro batch, s sequence, h hidden, f FFN, a heads, V padded vocabulary, t TP, w bytes of a weight (2 bf16/fp16,
4 fp32), N the elements of this rank's parameters, dp the data-parallel size.

Model states by DeepSpeed wrapper (bytes of one rank, measured at the optimizer step, where gradients peak):

    wrapper                        weights    gradients                 optimizer (Adam)
    fp32, ZeRO 0                   4N         4N                        8N + 4 per tensor (step counters)
    bf16/fp16, ZeRO 0, PP 1        2N         2N + 4N fp32 master grad  12N + 4 per tensor
    bf16/fp16, ZeRO 0, PP > 1      2N         8N (bf16 + fp32 flat)     12N + 4 per group
    ZeRO 1/2                       wN         w N/dp + 4 G0/dp          12 N/dp + 4 per group
    ZeRO 3                         w N/dp     w N/dp + 4 G0/dp          12 N/dp + 4 per group

G0 is the largest parameter group (the weight matrices, which decay): ZeRO steps one group at a time and makes
its fp32 gradient partition only then (for fp32 weights it is a view, no copy, when this rank's partition of the
group is one whole tensor). Flat ZeRO buffers are padded to a multiple of 2 x dp elements per group; ZeRO 3
partitions each tensor to ceil(numel / dp). The last pipeline stage's copy of the embedding LayerNorm gets no
gradient (its forward skips it).

The peak of a rank is the larger of
    forward/backward: weights + gradients being accumulated + optimizer + ZeRO's reduction bucket (reduce_bucket_size
        elements of w, made in every backward; ZeRO 3 also its gathered weights and prefetch bucket) + what forward
        saves for the micro batches in flight + the most backward adds on top (the head's GEMMs, a recomputed layer)
    the optimizer step: weights + the gradients above + optimizer, and with ZeRO 1/2 below fp32 a flat copy of the
        group's gradient partition, alive beside its fp32 cast for a moment.
On one H200 the first run's measured torch.cuda.max_memory_allocated of the 1.72B model is within 0.2% of this
model, after the corrections that run prompted (benchmarks/results/h200_memory_prediction_2026-12-03.md); a
second run is the check.
"""
import dataclasses
import math

from megatron.model import spec

GIB = 2 ** 30
ZERO_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)
ZERO3_PREFETCH_ELEMENTS = 50_000_000  # DeepSpeed's default stage3_prefetch_bucket_size
CUDA_CONTEXT_BYTES = 0  # torch.cuda.max_memory_allocated does not see the CUDA context; nvidia-smi does


def stage_layers(num_layers, pp):
    """Transformer layers of each pipeline stage: DeepSpeed's partition_balanced over the BloomBlockPipe layers
    gives the first num_layers % pp stages one more (spec.stage_names without importing DeepSpeed; tests/unit/model/
    test_spec.py compares the two)."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if stage < extra else 0) for stage in range(pp)]


def rank_tensors(model, tp, pp, stage):
    """[(numel, is_matrix)] of the parameters one TP rank of `stage` holds, in the module's order, and the
    elements that get no gradient (the last stage's copy of the embedding LayerNorm, which its forward skips).

    model: ModelConfig (vocab_size padded). The shapes and TP splits are the parameter spec's (megatron/model/
    spec.py): column- and vocab-parallel tensors are split by t; the row-parallel biases and the LayerNorms are
    whole on every TP rank. The tied word embedding lives on the first and on the
    last stage (DeepSpeed's TiedLayerSpec builds the whole EmbeddingPipe there, its LayerNorm included).
    """
    def held(holder):  # the parameter spec's rows of one pipeline layer, as this TP rank holds them
        return [(math.prod(spec.local_shape(p, model, tp)), len(p.shape) == 2) for p in spec.PARAMS
                if p.holder == holder and spec.exists(p, model)]
    embedding, layer = held("embedding"), held("block")
    tensors, unused = [], 0
    if stage == 0:
        tensors += embedding
    tensors += layer * stage_layers(model.num_layers, pp)[stage]
    if stage == pp - 1:
        tensors += held("final_norm")
        if pp > 1:
            tensors += embedding
            unused = sum(numel for numel, matrix in embedding if not matrix)  # its LayerNorm
    return tensors, unused


def _aligned(numel, dp):
    multiple = 2 * dp  # DeepSpeed's nccl_start_alignment_factor x dp
    return -(-numel // multiple) * multiple


def _partition_is_one_tensor(sizes, dp, dp_rank):
    """Whether dp_rank's partition of a flat group (tensors of `sizes` in order, padded) is exactly one tensor."""
    part = _aligned(sum(sizes), dp) // dp
    start, end, offset = dp_rank * part, (dp_rank + 1) * part, 0
    for size in sizes:
        if offset == start and offset + size == end:
            return True
        offset += size
    return False


@dataclasses.dataclass(frozen=True)
class ModelStates:
    """Bytes of one rank's weights, gradients (at the optimizer step and while accumulating) and optimizer."""
    weights: int
    gradients: int
    optimizer: int
    accumulating_gradients: int  # held through forward and backward of the micro batches
    comm_buffers: int  # held through backward (ZeRO's reduction bucket; ZeRO 3's gathered weights)
    step_transient: int = 0  # on top of `gradients` for a moment of the optimizer step


def zero_buckets(ds_config=None):
    """(reduce_bucket_size, stage3_prefetch_bucket_size) in elements from a DeepSpeed dict (its defaults if absent)."""
    zero = (ds_config or {}).get("zero_optimization", {})
    return (int(zero.get("reduce_bucket_size", ZERO_BUCKET_ELEMENTS)),
            int(zero.get("stage3_prefetch_bucket_size", zero.get("prefetch_bucket_size", ZERO3_PREFETCH_ELEMENTS))))


def model_state_bytes(tensors, precision, zero_stage, dp, pp, dp_rank=0, cpu_offload=False, unused=0,
                      buckets=(ZERO_BUCKET_ELEMENTS, ZERO3_PREFETCH_ELEMENTS)):
    """ModelStates of a rank holding `tensors` ([(numel, is_matrix)], rank_tensors) under DeepSpeed; `unused`
    elements get no gradient in backward (BF16_Optimizer then holds no bf16 gradient for them, ZeRO 1/2 a
    zero-filled one beside its flat partition).

    precision: "fp32", "bf16" or "fp16". With cpu_offload the fp32 master, its gradient and Adam's state live in
    host memory (not counted here).
    """
    w = 4 if precision == "fp32" else 2
    n = sum(numel for numel, _ in tensors)
    groups = [[numel for numel, matrix in tensors if matrix], [numel for numel, matrix in tensors if not matrix]]
    groups = [g for g in groups if g]
    adam_steps = 4 * len(groups)
    if zero_stage == 0:
        if precision == "fp32":
            return ModelStates(4 * n, 4 * n, 8 * n + 4 * len(tensors), 4 * n, 0)
        if pp == 1:
            return ModelStates(2 * n, 6 * n, 12 * n + 4 * len(tensors), 2 * n, 0)
        return ModelStates(2 * n, 8 * n - 2 * unused, 12 * n + adam_steps, 6 * n, 0)
    padded = [_aligned(sum(g), dp) for g in groups]
    partition = sum(padded) // dp
    largest = max(range(len(groups)), key=lambda i: padded[i])
    master_grad = 4 * padded[largest] // dp
    if precision == "fp32" and zero_stage < 3 and _partition_is_one_tensor(groups[largest], dp, dp_rank):
        master_grad = 0
    # the gradient reduction bucket: reduce_bucket_size elements of w, allocated in every micro batch's backward
    bucket = buckets[0] * w
    optimizer = 0 if cpu_offload else 12 * partition + adam_steps
    if cpu_offload:
        master_grad = 0
    if zero_stage == 3:  # + the gathered weights of the module running (the largest: the word embedding) and
        shard = sum(-(-numel // dp) for numel, _ in tensors)  # the prefetch bucket
        gathered = w * (max(numel for numel, _ in tensors) + buckets[1])
        return ModelStates(w * shard, w * shard + master_grad, optimizer, w * shard, bucket + gathered)
    weights = w * sum(padded)
    # ZeRO 1 accumulates the micro batches' gradients in the weights' .grad and reduces them at the last one;
    # ZeRO 2 reduces each micro batch's gradients into its flat partition as backward produces them
    accumulating = w * n if zero_stage == 1 else w * partition
    # ZeRO 1/2 flatten the group's gradient partition (a copy in w) and cast that to fp32: below fp32 both are
    # alive for a moment (measured on the H200: the whole step peak, to 0.01 GiB, at DP 1)
    flat_copy = 2 * padded[largest] // dp if w == 2 and master_grad else 0
    return ModelStates(weights, w * partition + master_grad + w * unused, optimizer, accumulating, bucket,
                       flat_copy)


def layer_activation_bytes(b, s, h, f, a, tp, w, attention="flex"):
    """Bytes one BloomBlock saves for backward (per TP rank, one micro batch), op by op:

        input LayerNorm: its input x and fp32 mean, rstd (b s each)        b s h w + 8 b s
        QKV linear: its input (the LayerNorm output)                        b s h w
        attention: q, k, v (views of the QKV output)                        3 b s h/t w
                   flex: fp32 logsumexp (b a/t s)                           4 b s a/t
                   torch (CPU, reference): the (b, a/t, s, s) scores        see attention_bytes
        dense linear: its input (the context; flex: a view of its output)   b s h/t w
        post-attention LayerNorm: input, fp32 mean, rstd                    b s h w + 8 b s
        h -> 4h linear: its input                                           b s h w
        GeLU: its input; 4h -> h linear: its input                          2 b s f/t w
    Dropout with p = 0 and the residual adds save nothing.
    """
    tokens = b * s
    common = tokens * (4 * h * w + 16 + 2 * f // tp * w + 4 * h // tp * w)
    return common + attention_bytes(b, s, h, a, tp, w, attention)


def attention_bytes(b, s, h, a, tp, w, attention):
    """What the attention backend saves beyond q, k, v and the context the dense layer saves:
    FlexAttention (CUDA) its fp32 logsumexp (b, a/t, s); its output is laid out like the query (b, s, a/t, d), so
    the context's transpose and reshape are views of it and the dense layer's saved input is that same storage
    (H200: this accounts for 24 x b s h w of the 1.72B model exactly). The torch reference (CPU) saves the fp32
    softmax of the (b, a/t, s, s) scores and, below fp32, its cast to w for the second matmul; its output is
    contiguous (b, a/t, s, d), so the context is a copy (the one counted in the layer)."""
    heads = a // tp
    if attention == "flex":
        return 4 * b * heads * s
    if attention == "torch":
        return b * heads * s * s * (4 + (w if w != 4 else 0))
    raise ValueError(f"attention backend {attention!r} has no activation model (flex, torch)")


def embedding_activation_bytes(b, s, h, w, embed_layernorm=True):
    """Token ids (int64) for the embedding's backward; the embedding output and fp32 statistics for its
    LayerNorm."""
    return 8 * b * s + ((b * s * h * w + 8 * b * s) if embed_layernorm else 0)


def head_activation_bytes(b, s, h, v, tp, w, fused_cross_entropy=True):
    """Final LayerNorm (its input, fp32 statistics), the LM head's input, the int64 targets, and the loss's
    saved tensor: with the fused cross entropy (CUDA, any TP; the torch ops at TP > 1) the logits (b s V/t in w,
    whose gradient is written over them) and the (b s) log-sum-exp; with torch's cross entropy (CPU, TP 1)
    the fp32 log-softmax of the logits and a 4-byte total weight instead."""
    tokens = b * s
    saved = 2 * tokens * h * w + 8 * tokens + 8 * tokens
    if fused_cross_entropy:
        return saved + tokens * v // tp * w + 8 * tokens
    return saved + tokens * v // tp * 4 + 4


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Predicted bytes of one rank of one pipeline stage."""
    stage: int
    layers: int
    holds_embedding: bool
    states: ModelStates
    activations: int  # saved by forward, logits included
    transient: int  # the most backward adds on top of them (the head's GEMMs, a recomputed layer, ...)
    peak: int

    @property
    def peak_gib(self):
        return self.peak / GIB


def stage_memory(model, tp, pp, dp, stage, micro_batch, gradient_accumulation, precision, zero_stage,
                 checkpoint_activations, cpu_offload=False, cuda=True, attention=None,
                 fused_cross_entropy=None, dp_rank=0, buckets=(ZERO_BUCKET_ELEMENTS, ZERO3_PREFETCH_ELEMENTS)):
    """StageMemory of one rank of `stage` for this layout (model: ModelConfig, vocab padded). attention and
    fused_cross_entropy default to what serves on CUDA (flex, the fused kernel) or on the CPU (torch's)."""
    attention = attention or ("flex" if cuda else "torch")
    fused_cross_entropy = cuda if fused_cross_entropy is None else fused_cross_entropy
    b, s, h, f, a, v = (micro_batch, model.seq_length, model.hidden_size, model.ffn_dim,
                        model.num_attention_heads, model.vocab_size)
    w = 4 if precision == "fp32" else 2
    tensors, unused = rank_tensors(model, tp, pp, stage)
    states = model_state_bytes(tensors, precision, zero_stage, dp, pp, dp_rank, cpu_offload, unused, buckets)
    layers = stage_layers(model.num_layers, pp)[stage]
    first, last = stage == 0, stage == pp - 1
    per_layer = layer_activation_bytes(b, s, h, f, a, tp, w, attention)
    hidden = b * s * h * w
    saved = layers * (hidden if checkpoint_activations else per_layer)  # checkpointing keeps each layer's input
    if first:
        saved += embedding_activation_bytes(b, s, h, w, model.embed_layernorm)
    in_flight = min(pp - stage, gradient_accumulation) if pp > 1 else 1
    activations = saved * in_flight  # what forward saves: the micro batches in flight on this stage
    if pp > 1:
        activations += 2 * max(2, in_flight) * hidden  # the pipeline's input/output buffers
    head = head_activation_bytes(b, s, h, v, tp, w, fused_cross_entropy) if last else 0
    # On top of that, the largest of: the loss and head at the start of backward (torch's cross entropy makes an
    # fp32 copy of the logits beside its log-softmax; the tied embedding's gradient GEMM writes a new (V/t, h)
    # tensor, added into the held gradient, while the logits' gradient is alive); a layer's backward (the
    # gradients of its 4h activations), which with checkpointing first recomputes the layer's activations, once
    # the head's are gone.
    head_transient = hidden + ((0 if fused_cross_entropy else b * s * v // tp * 4) + (
        v // tp * h * w if gradient_accumulation > 1 else 0) if last else 0)
    layer_transient = 2 * b * s * (f // tp) * w + (per_layer - head if checkpoint_activations else 0)
    transient = max(head_transient, layer_transient)
    forward_backward = (states.weights + states.accumulating_gradients + states.optimizer + states.comm_buffers
                        + activations + head + transient)
    # the reduction bucket is released when backward's last reduction is done, before the step
    at_step = states.weights + states.gradients + states.step_transient + states.optimizer + (
        states.comm_buffers if zero_stage == 3 else 0)
    return StageMemory(stage, layers, first or last, states, activations + head, transient,
                       max(forward_backward, at_step) + CUDA_CONTEXT_BYTES)


def layout_memory(model, tp, pp, dp, micro_batch, gradient_accumulation, precision, zero_stage,
                  checkpoint_activations, cpu_offload=False, cuda=True, attention=None,
                  fused_cross_entropy=None, buckets=(ZERO_BUCKET_ELEMENTS, ZERO3_PREFETCH_ELEMENTS)):
    """[StageMemory per pipeline stage] (TP and DP rank 0 of each)."""
    return [stage_memory(model, tp, pp, dp, stage, micro_batch, gradient_accumulation, precision, zero_stage,
                         checkpoint_activations, cpu_offload, cuda, attention, fused_cross_entropy,
                         buckets=buckets)
            for stage in range(pp)]


def rank_model_states(config, stage, dp_rank=0):
    """ModelStates of the rank at (pipeline `stage`, `dp_rank`) of a resolved megatron Config (any TP rank:
    they hold the same sizes)."""
    par, training = config.parallel, config.training
    tensors, unused = rank_tensors(config.model, par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                                   stage)
    return model_state_bytes(tensors, config.precision.name, training.zero_stage, par.data_parallel_size,
                             par.pipeline_model_parallel_size, dp_rank, training.cpu_offload, unused)
