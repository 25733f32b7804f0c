"""The BLOOM network as a DeepSpeed PipelineModule: the same layers as BloomModel, split into stages.

    [TiedLayerSpec embed: BloomEmbedding] [BloomBlockPipe x L] [FinalLayerNorm] [TiedLayerSpec embed: LM head]

(the list is spec.pipe_layers; the parameter spec, megatron/model/spec.py, also derives the names and stage maps).

The word embedding lives on the first and the last stage; DeepSpeed all-reduces its gradient over the
embedding group. Between stages only the hidden states (B, S, H) travel. The loss function receives the
vocab-parallel logits and the labels. canonical_name() maps the module's parameter names to the
names BloomModel uses, so checkpoints and tools see one layout whatever the PP size.

The tensor-parallel group is passed in (tp_group, as for BloomModel) and handed to every layer spec and the loss;
it must be this rank's group along the topology's "model" axis.
"""
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from megatron.core import tensor_parallel
from megatron.model import spec
from megatron.model.bloom import BloomBlock, BloomEmbedding, make_layernorm, parallel_lm_logits


class EmbeddingPipe(BloomEmbedding):
    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight


class BloomBlockPipe(BloomBlock):
    def forward(self, hidden):
        return super().forward(hidden)


class FinalLayerNormPipe(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.final_layernorm = make_layernorm(config, config.hidden_size)

    def forward(self, hidden):
        return self.final_layernorm(hidden)


def _lm_head(embedding, hidden):
    words = embedding.word_embeddings
    return parallel_lm_logits(hidden, embedding.word_embeddings_weight, words.tp_group,
                              words.gradient_accumulation_fusion)


class _LossFn:
    """Mean vocab-parallel cross entropy of (logits, labels); picklable for DeepSpeed."""

    def __init__(self, tp_group):
        self.tp_group = tp_group

    def __call__(self, logits, labels):
        return tensor_parallel.vocab_parallel_cross_entropy(logits, labels, self.tp_group,
                                                            inplace_backward=True).mean()


_CLASSES = {"EmbeddingPipe": EmbeddingPipe, "BloomBlockPipe": BloomBlockPipe, "FinalLayerNormPipe": FinalLayerNormPipe}


def _layer_spec(layer, config, tp_group):
    """DeepSpeed's LayerSpec for one entry of spec.pipe_layers (the class it names, the tied embedding by key)."""
    cls = _CLASSES[layer.class_name]
    if layer.kind in ("embedding", "head"):
        return TiedLayerSpec(spec.TIED_KEY, cls, config, tp_group, tied_weight_attr="word_embeddings_weight",
                             forward_fn=_lm_head if layer.kind == "head" else None)
    if layer.kind == "block":
        return LayerSpec(cls, config, layer.layer_number, tp_group)
    return LayerSpec(cls, config)


def build_pipeline_model(config, topology, checkpoint_activations=False, activation_checkpoint_func=None,
                         tp_group=None, partition_method=spec.DEFAULT_PARTITION_METHOD):
    """PipelineModule for config (ModelConfig) over DeepSpeed's PipeModelDataParallelTopology.

    partition_method: DeepSpeed's (type:BloomBlockPipe counts the blocks; type:BloomBlockPipe|EmbeddingPipe
    also the two embedding layers, as BLOOM's --pp-partition-method 'type:transformer|embedding'); activations
    are checkpointed every config.checkpoint_num_layers layers.

    tp_group: this rank's tensor-parallel ProcessGroup (None for TP = 1); its size must be the topology's
    "model" axis.
    """
    tp_size, _ = tensor_parallel.get_group_size_and_rank(tp_group)
    if topology.get_dim("model") != tp_size:
        raise ValueError(f"the pipeline topology has {topology.get_dim('model')} tensor-parallel ranks but "
                         f"tp_group has {tp_size}; pass the tensor-parallel group of this layout")
    specs = [_layer_spec(layer, config, tp_group) for layer in spec.pipe_layers(config.num_layers)]
    return PipelineModule(
        layers=specs, loss_fn=_LossFn(tp_group), topology=topology,
        partition_method=partition_method,
        activation_checkpoint_interval=config.checkpoint_num_layers if checkpoint_activations else 0,
        activation_checkpoint_func=activation_checkpoint_func or tensor_parallel.checkpoint,
        checkpointable_layers=["BloomBlockPipe"])


def canonical_name(name, num_layers):
    """PipelineModule parameter name -> BloomModel name (None for names that are not model weights)."""
    return spec.canonical_name(name, num_layers)


def load_canonical_state_dict(module, state, num_layers):
    """Loads BloomModel-named tensors into a BloomModel or a PipelineModule stage (names via canonical_name)."""
    if not isinstance(module, PipelineModule):
        return module.load_state_dict(state, strict=True)
    own = {name: canonical_name(name, num_layers) for name in module.state_dict()}
    missing = sorted(canonical for canonical in own.values() if canonical is not None and canonical not in state)
    if missing:
        raise KeyError(f"checkpoint lacks weights for {missing[:3]}")
    with torch.no_grad():
        for name, tensor in module.state_dict(keep_vars=True).items():
            if own[name] is not None:
                tensor.copy_(state[own[name]])


def is_pipeline_module(module):
    return isinstance(module, PipelineModule)
