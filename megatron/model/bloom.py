"""The BLOOM network: vocab-parallel embedding + embedding LayerNorm, pre-LN ALiBi blocks, final norm, tied head.

Shapes are batch-first: hidden states (B, S, H). Tensor parallelism splits heads (fused QKV, in BLOOM's
per-head q,k,v layout, so a contiguous column block is a block of whole heads), the MLP's 4h dimension and
the vocabulary. Canonical parameter names (what checkpoints and the HF name table use):

    embedding.word_embeddings.weight              (V/p, H)   split on dim 0
    embedding.word_embeddings_layernorm.{weight,bias}
    layers.N.input_layernorm.{weight,bias}
    layers.N.self_attention.query_key_value.{weight (3H/p, H), bias (3H/p)}
    layers.N.self_attention.dense.{weight (H, H/p), bias (H)}
    layers.N.post_attention_layernorm.{weight,bias}
    layers.N.mlp.dense_h_to_4h.{weight (F/p, H), bias (F/p)}
    layers.N.mlp.dense_4h_to_h.{weight (H, F/p), bias (H)}
    final_layernorm.{weight,bias}

Parallel state is explicit: every module takes `tp_group`, the tensor-parallel ProcessGroup (None: no tensor
parallelism, one rank), and resolves its size and rank once in __init__. No module reads
megatron.core.parallel_state, so the same call builds the same model whatever was initialised before it.
Communication per block (p > 1): forward all-reduces the attention and MLP outputs (row-parallel layers),
backward all-reduces the gradient of their inputs (column-parallel layers); the embedding all-reduces its
output, the LM head its input gradient, and the loss three (tokens,) fp32 tensors.
"""
import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import fused_mlp
from megatron.fused_kernels import elementwise
from megatron.model import attention, cudnn_attention
from megatron.model.alibi import get_alibi_slopes_for_rank
from megatron.model.attention import CoreAttention


@contextlib.contextmanager
def init_seed(seed, component):
    """Seeds the CPU RNG for one component's initialisation and restores it afterwards.

    Each component (embedding = 0, layer N = N + 1) draws from its own stream, so the full weights are the
    same whatever the TP or PP layout that builds them.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + component)
        yield


def normal_init(std):
    return lambda tensor: nn.init.normal_(tensor, mean=0.0, std=std)


def make_layernorm(config, size):
    if config.fused_layernorm:
        from megatron.fused_kernels import MixedFusedLayerNorm
        return MixedFusedLayerNorm(size, eps=config.layernorm_epsilon)
    return nn.LayerNorm(size, eps=config.layernorm_epsilon)


class BloomEmbedding(nn.Module):
    """Word embeddings (vocab-parallel) -> embedding LayerNorm -> dropout.

    Communicates (p > 1): forward all-reduces the partial (B, S, H) lookups over tp_group; backward nothing.
    """

    def __init__(self, config, tp_group=None):
        super().__init__()
        with init_seed(config.seed, 0):
            self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, init_method=normal_init(config.init_method_std),
                tp_group=tp_group, gradient_accumulation_fusion=config.gradient_accumulation_fusion)
        self.word_embeddings_layernorm = (make_layernorm(config, config.hidden_size)
                                          if config.embed_layernorm else None)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids):
        x = self.word_embeddings(input_ids)  # (B, S, H)
        if self.word_embeddings_layernorm is not None:
            x = self.word_embeddings_layernorm(x)
        return self.dropout(x)


class ParallelAttention(nn.Module):
    """Fused QKV (column parallel) -> ALiBi attention over this rank's nh/p heads -> dense (row parallel).

    out = sum_r softmax(q_r k_r^T / sqrt(d) + ALiBi_r) v_r W_dense,r + b over the p ranks of tp_group.
    Communicates (p > 1): forward all-reduces the (B, S, H) dense output; backward all-reduces the gradient of
    the (B, S, H) input. Attention itself is local (each rank's heads and ALiBi slopes).
    """

    def __init__(self, config, tp_group=None):
        super().__init__()
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = tp_size, tp_rank = tensor_parallel.get_group_size_and_rank(tp_group)
        if config.num_attention_heads % tp_size != 0:
            raise ValueError(f"--num-attention-heads {config.num_attention_heads} is not divisible by the "
                             f"tensor-parallel size {tp_size}; choose a TP size that divides the head count")
        self.heads_per_partition = config.num_attention_heads // tp_size
        self.head_dim = config.head_dim
        std, fuse = config.init_method_std, config.gradient_accumulation_fusion
        self.query_key_value = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, 3 * config.hidden_size, init_method=normal_init(std), tp_group=tp_group,
            gradient_accumulation_fusion=fuse)
        self.dense = tensor_parallel.RowParallelLinear(
            config.hidden_size, config.hidden_size, input_is_parallel=True,
            init_method=normal_init(std / math.sqrt(2.0 * config.num_layers)), tp_group=tp_group,
            gradient_accumulation_fusion=fuse)
        slopes = get_alibi_slopes_for_rank(config.num_attention_heads, tp_rank, tp_size)
        self.core_attention = CoreAttention(slopes, config.head_dim, config.attention_dropout,
                                            config.attention_impl, config.abort_on_unmet_fused_kernel_constraints)

    def forward(self, x, key_padding_mask=None, layer_cache=None, add_bias=True, graph_attention=None):
        """add_bias=False: the dense output without its bias (self.dense.bias), for the block's fused region.
        graph_attention: attention.block_attention_inputs(...) inside a block compiled as a whole."""
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, self.heads_per_partition, 3, self.head_dim)
        core = self.core_attention
        if (graph_attention == attention.CUDNN if graph_attention is not None
                else layer_cache is None and core.cudnn_serves(x.device, x.dtype, key_padding_mask)):
            context = cudnn_attention.attention(qkv, core.scale)  # (B, S, nh/p, hd), q k v read in place
            return self.dense(context.view(b, s, self.heads_per_partition * self.head_dim), add_bias=add_bias)
        # unbind, not three selects: its backward stacks the three gradients in one kernel, where each select's
        # backward would write a zero-filled full-size qkv gradient and autograd would add the three.
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # each (B, nh/p, S, hd)
        if graph_attention is not None:
            context = attention.attend_in_graph(q, k, v, self.core_attention.scale, *graph_attention)
        elif layer_cache is not None:  # the cache stores k, v and attends over everything it holds
            context = layer_cache.attend(q, k, v, self.core_attention, key_padding_mask)
        else:
            context = self.core_attention(q, k, v, key_padding_mask)  # (B, nh/p, S, hd)
        context = context.transpose(1, 2).reshape(b, s, self.heads_per_partition * self.head_dim)
        return self.dense(context, add_bias=add_bias)


class ParallelMLP(nn.Module):
    """h -> 4h (column parallel) -> tanh GeLU -> h (row parallel): sum_r GeLU(x A_r + a_r) B_r + b.

    Communicates (p > 1): forward all-reduces the (B, S, H) output; backward the gradient of the input.
    With config.gemm_epilogues, training on CUDA: through tensor_parallel.fused_mlp (GeLU's gradient in the
    epilogue of the 4h -> h dgrad GEMM, cuBLASLt).
    """

    def __init__(self, config, tp_group=None):
        super().__init__()
        std, fuse = config.init_method_std, config.gradient_accumulation_fusion
        self.gemm_epilogues = config.gemm_epilogues
        self.dense_h_to_4h = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, config.ffn_dim, init_method=normal_init(std), tp_group=tp_group,
            gradient_accumulation_fusion=fuse)
        self.dense_4h_to_h = tensor_parallel.RowParallelLinear(
            config.ffn_dim, config.hidden_size, input_is_parallel=True,
            init_method=normal_init(std / math.sqrt(2.0 * config.num_layers)), tp_group=tp_group,
            gradient_accumulation_fusion=fuse)

    def forward(self, x, fused=False):
        """fused: the output without its bias (self.dense_4h_to_h.bias, for the block's fused region), h -> 4h's
        bias added inside the fused bias + GeLU."""
        if self.gemm_epilogues and self.training and x.is_cuda:
            y = self.forward_epilogues(x, add_bias=not fused)
            if y is not None:
                return y
        if fused:
            h = self.dense_h_to_4h(x, add_bias=False)  # (B, S, F/p)
            return self.dense_4h_to_h(elementwise.bias_gelu(h, self.dense_h_to_4h.bias), add_bias=False)
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))

    def forward_epilogues(self, x, add_bias=True):
        """The MLP through fused_mlp.gelu_mlp, or None where it cannot serve (fused_mlp.serves; ZeRO-3 parameters,
        gathered only inside their own module's forward)."""
        up, down = self.dense_h_to_4h, self.dense_4h_to_h
        if hasattr(up.weight, "ds_id") or up.bias is None or not fused_mlp.serves(x, up.weight, up.bias, down.weight):
            return None
        if up.tp_size > 1:
            x = tensor_parallel.copy_to_tensor_model_parallel_region(x, up.tp_group)
        y = fused_mlp.gelu_mlp(x, up.weight, up.bias, down.weight, up.gradient_accumulation_fusion)
        if down.tp_size > 1:
            y = tensor_parallel.reduce_from_tensor_model_parallel_region(y, down.tp_group)
        return y + down.bias if add_bias and down.bias is not None else y


class BloomBlock(nn.Module):
    """Pre-LN transformer block: x + drop(attn(ln(x))), then + drop(mlp(ln(.))).

    Training on CUDA (no KV cache, no ZeRO-3 partitioned parameters, which are gathered only inside their own
    module's forward), two optional compiled paths:
      config.compile_blocks     the whole forward below as one torch.compile'd region (one graph shared by every
                                layer: one compiled call per layer forward and one backward), at TP 1 without
                                dropout, padding mask or the csrc LayerNorm, attention flex or sdpa;
      config.fused_elementwise  the elementwise work between the GEMMs in three compiled regions
                                (megatron.fused_kernels.elementwise) with the dense layers' biases folded in: dense
                                bias + dropout + residual + post-attention LayerNorm, h -> 4h bias + GeLU, and
                                4h -> h bias + dropout + residual.
    compile_blocks serves where it can, then fused_elementwise; elsewhere (CPU, evaluation, generation) the eager
    ops below run.
    """

    def __init__(self, config, layer_number, tp_group=None):
        super().__init__()
        self.layer_number = layer_number
        self.post_ln_residual = config.apply_residual_connection_post_layernorm
        with init_seed(config.seed, layer_number + 1):
            self.input_layernorm = make_layernorm(config, config.hidden_size)
            self.self_attention = ParallelAttention(config, tp_group)
            self.post_attention_layernorm = make_layernorm(config, config.hidden_size)
            self.mlp = ParallelMLP(config, tp_group)
        self.hidden_dropout = config.hidden_dropout
        self.fused_elementwise = config.fused_elementwise
        self.compile_blocks = config.compile_blocks

    def forward(self, x, key_padding_mask=None, layer_cache=None):
        if (self.training and x.is_cuda and layer_cache is None
                and not hasattr(self.post_attention_layernorm.weight, "ds_id")):
            graph_attention = self.compiled_block_inputs(x, key_padding_mask)
            if graph_attention is not None:
                return compiled_block()(self, x, graph_attention)
            if self.fused_elementwise:
                return self.forward_fused(x, key_padding_mask)
        return self.forward_eager(x, key_padding_mask, layer_cache)

    def compiled_block_inputs(self, x, key_padding_mask=None):
        """The attention inputs of the compiled block (attention.block_attention_inputs), or None where
        config.compile_blocks is off or cannot serve this call."""
        if not self.compile_blocks or key_padding_mask is not None or self.self_attention.tp_size > 1:
            return None  # TP > 1: the all-reduces are autograd functions outside what dynamo traces whole
        if self.hidden_dropout > 0 or not isinstance(self.input_layernorm, nn.LayerNorm):
            return None  # inductor's dropout RNG is not the eager stream; the csrc LayerNorm is not traceable
        return attention.block_attention_inputs(self.self_attention.core_attention, x.shape[1], x.device, x.dtype)

    def _dropout(self, t):
        return F.dropout(t, p=self.hidden_dropout, training=True) if self.training and self.hidden_dropout else t

    def forward_eager(self, x, key_padding_mask=None, layer_cache=None, graph_attention=None):
        ln = self.input_layernorm(x)
        residual = ln if self.post_ln_residual else x
        attn = self.self_attention(ln, key_padding_mask, layer_cache, graph_attention=graph_attention)
        x = residual + self._dropout(attn)
        ln = self.post_attention_layernorm(x)
        residual = ln if self.post_ln_residual else x
        return residual + self._dropout(self.mlp(ln))

    def forward_fused(self, x, key_padding_mask=None):
        p, training = self.hidden_dropout, self.training
        ln = self.input_layernorm(x)
        residual = ln if self.post_ln_residual else x
        attn = self.self_attention(ln, key_padding_mask, add_bias=False)  # (B, S, H), after the TP all-reduce
        norm = self.post_attention_layernorm
        x, ln = elementwise.bias_dropout_add_layer_norm(attn, self.self_attention.dense.bias, residual, norm.weight,
                                                        norm.bias, norm.eps, p, training)
        residual = ln if self.post_ln_residual else x
        return elementwise.bias_dropout_add(self.mlp(ln, fused=True), self.mlp.dense_4h_to_h.bias, residual, p,
                                            training)


def _block_forward(block, x, graph_attention):
    return block.forward_eager(x, graph_attention=graph_attention)


@functools.lru_cache(maxsize=None)
def compiled_block():
    """BloomBlock.forward_eager as one torch.compile'd region (fixed shapes). The block is an argument, so its
    parameters are graph inputs and one compiled graph (forward and backward) serves every layer of the same
    structure; compiled at the first call, again under no_grad (activation checkpointing's first forward)."""
    return torch.compile(_block_forward, dynamic=False)


def parallel_lm_logits(hidden, word_embeddings_weight, tp_group, gradient_accumulation_fusion=False):
    """Logits of this rank's vocabulary slice: (B, S, H) @ (V/p, H)^T -> (B, S, V/p); with
    gradient_accumulation_fusion the weight gradient is summed into word_embeddings_weight.grad by its GEMM.

    Communicates (p > 1): nothing forward; backward all-reduces the gradient of hidden over tp_group.
    """
    hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, tp_group)
    return tensor_parallel.linear_with_grad_accumulation(hidden, word_embeddings_weight, None,
                                                         gradient_accumulation_fusion)


def lm_loss(hidden, word_embeddings_weight, labels, tp_group, chunk_size=0, gradient_accumulation_fusion=False):
    """Per-token fp32 loss of the tied LM head + vocab-parallel cross entropy.

    With chunk_size > 0 the tokens are processed in chunks whose logits are recomputed in backward, so at
    most chunk_size x V/p logits are alive at a time instead of B x S x V/p.
    """
    if chunk_size <= 0 or hidden.shape[0] * hidden.shape[1] <= chunk_size:
        logits = parallel_lm_logits(hidden, word_embeddings_weight, tp_group, gradient_accumulation_fusion)
        return tensor_parallel.vocab_parallel_cross_entropy(logits, labels, tp_group, inplace_backward=True)
    b, s, h = hidden.shape
    flat_hidden, flat_labels = hidden.reshape(b * s, h), labels.reshape(b * s)

    def chunk_loss(hid, lab, weight):
        logits = parallel_lm_logits(hid, weight, tp_group, gradient_accumulation_fusion)
        return tensor_parallel.vocab_parallel_cross_entropy(logits, lab, tp_group, inplace_backward=True)

    losses = [tensor_parallel.checkpoint(chunk_loss, flat_hidden[i:i + chunk_size], flat_labels[i:i + chunk_size],
                                         word_embeddings_weight)
              for i in range(0, b * s, chunk_size)]
    return torch.cat(losses).view(b, s)


class InferenceCache:
    """Per-layer key/value tensors that grow by concatenation: the simple reference cache.

    A layer cache is any object with attend(q, k, v, core_attention, key_padding_mask) -> context: it stores the
    new keys and values and attends over all it holds. megatron.inference.StaticKVCache is the fast one.
    """

    class _Layer:
        def __init__(self):
            self.k = self.v = None

        def attend(self, q, k, v, core_attention, key_padding_mask=None):  # (B, nh/p, s_new, hd)
            self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
            self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
            return core_attention(q, self.k, self.v, key_padding_mask)

    def __init__(self, num_layers):
        self.layers = [self._Layer() for _ in range(num_layers)]

    @property
    def seq_len(self):
        return 0 if self.layers[0].k is None else self.layers[0].k.shape[2]


def _run_layers(layers):
    """A function running `layers` in turn: one activation-checkpoint chunk (--checkpoint-num-layers)."""
    if len(layers) == 1:
        return layers[0]

    def run(x):
        for layer in layers:
            x = layer(x)
        return x
    return run


class BloomModel(nn.Module):
    """The whole network on one pipeline stage (used when PP = 1; pipeline.py splits it for PP > 1).

    forward(input_ids) -> logits (vocab-parallel unless parallel_output=False);
    forward(input_ids, labels) -> per-token fp32 loss (B, S).

    tp_group: the tensor-parallel ProcessGroup this rank belongs to (e.g. ParallelState.tp_group), or None for
    one rank. The model depends only on (config, tp_group), never on what was initialised globally.
    """

    def __init__(self, config, parallel_output=True, tp_group=None):
        super().__init__()
        self.config = config
        self.parallel_output = parallel_output
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = tensor_parallel.get_group_size_and_rank(tp_group)
        self.embedding = BloomEmbedding(config, self.tp_group)
        self.layers = nn.ModuleList(BloomBlock(config, i, self.tp_group) for i in range(config.num_layers))
        self.final_layernorm = make_layernorm(config, config.hidden_size)

    def forward(self, input_ids, labels=None, attention_mask=None, cache=None):
        x = self.hidden_states(input_ids, attention_mask, cache)
        if labels is not None:
            return lm_loss(x, self.embedding.word_embeddings.weight, labels, self.tp_group,
                           self.config.loss_chunk_size, self.config.gradient_accumulation_fusion)
        return self.lm_logits(x)

    def hidden_states(self, input_ids, attention_mask=None, cache=None):
        """(B, S) token ids -> (B, S, H) after the final LayerNorm."""
        x = self.embedding(input_ids)
        if self.config.checkpoint_activations and self.training and attention_mask is None and cache is None:
            chunk = self.config.checkpoint_num_layers  # layers recomputed together in backward
            for start in range(0, len(self.layers), chunk):
                x = tensor_parallel.checkpoint(_run_layers(self.layers[start:start + chunk]), x)
            return self.final_layernorm(x)
        for i, layer in enumerate(self.layers):
            layer_cache = cache.layers[i] if cache is not None else None
            x = layer(x, attention_mask, layer_cache)
        return self.final_layernorm(x)

    def lm_logits(self, hidden):
        """(B, S, H) -> logits through the tied head (this rank's vocabulary slice unless parallel_output=False)."""
        logits = parallel_lm_logits(hidden, self.embedding.word_embeddings.weight, self.tp_group,
                                    self.config.gradient_accumulation_fusion)
        if not self.parallel_output:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits, self.tp_group)
        return logits
