"""The parameter spec: every parameter of the BLOOM network described once; layout tables derive from it.

One row per parameter (PARAMS, in BloomModel's parameter order):

    name            canonical name, the BloomModel state-dict key ("{n}": the layer index)
    shape           full (unsplit) shape in config symbols: V padded vocabulary, H hidden, 3H fused QKV, F MLP
    partition_dim   the dim tensor parallelism splits (rank r of p holds slice r of p along it); None: every TP
                    rank holds the whole tensor
    hf_name         Hugging Face BloomForCausalLM's name
    holder          the pipeline layer that holds it (PIPE_LAYERS): "embedding", "block" or "final_norm"

What derives from the rows: checkpoint/format.py's expected_shapes and partition_dim, model/hf_bloom.py's name
table, ModelConfig.num_parameters, pipeline.canonical_name (PipelineModule names -> canonical names), the
PipelineModule's layer order (pipeline.build_pipeline_model) and the stage map of checkpoint conversions
(stage_names: DeepSpeed's own partition function over the weights each partition method gives these layers).
bloom.py builds the parameters; tests/unit/model/test_spec.py checks a built TP-2 model against every row
(names, shapes, `partition_dim` / `tensor_model_parallel` attributes) and the stage map against real
PipelineModules.

Megatron-core describes sharding by asking each built layer (sharded_state_dict: ShardedTensors with a global
shape and offsets), which needs the model and its process groups; here the description is plain data, so
offline tools (conversion, export, the planner) use it without building anything, and the test ties it to the
built model. Pure: no torch; DeepSpeed's partition function is imported when a stage map is asked for.
"""
import functools
import math
import re
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple
    partition_dim: Optional[int]
    hf_name: str
    holder: str
    only_if: Optional[str] = None  # a ModelConfig flag the parameter exists under (embed_layernorm)


_EMB, _LN = "embedding.word_embeddings", "embedding.word_embeddings_layernorm"
_ATT, _MLP = "layers.{n}.self_attention", "layers.{n}.mlp"
_HF_ATT, _HF_MLP = "transformer.h.{n}.self_attention", "transformer.h.{n}.mlp"

PARAMS = (
    Param(f"{_EMB}.weight", ("V", "H"), 0, "transformer.word_embeddings.weight", "embedding"),
    Param(f"{_LN}.weight", ("H",), None, "transformer.word_embeddings_layernorm.weight", "embedding",
          "embed_layernorm"),
    Param(f"{_LN}.bias", ("H",), None, "transformer.word_embeddings_layernorm.bias", "embedding", "embed_layernorm"),
    Param("layers.{n}.input_layernorm.weight", ("H",), None, "transformer.h.{n}.input_layernorm.weight", "block"),
    Param("layers.{n}.input_layernorm.bias", ("H",), None, "transformer.h.{n}.input_layernorm.bias", "block"),
    Param(f"{_ATT}.query_key_value.weight", ("3H", "H"), 0, f"{_HF_ATT}.query_key_value.weight", "block"),
    Param(f"{_ATT}.query_key_value.bias", ("3H",), 0, f"{_HF_ATT}.query_key_value.bias", "block"),
    Param(f"{_ATT}.dense.weight", ("H", "H"), 1, f"{_HF_ATT}.dense.weight", "block"),
    Param(f"{_ATT}.dense.bias", ("H",), None, f"{_HF_ATT}.dense.bias", "block"),  # row parallel: added once, whole
    Param("layers.{n}.post_attention_layernorm.weight", ("H",), None,
          "transformer.h.{n}.post_attention_layernorm.weight", "block"),
    Param("layers.{n}.post_attention_layernorm.bias", ("H",), None,
          "transformer.h.{n}.post_attention_layernorm.bias", "block"),
    Param(f"{_MLP}.dense_h_to_4h.weight", ("F", "H"), 0, f"{_HF_MLP}.dense_h_to_4h.weight", "block"),
    Param(f"{_MLP}.dense_h_to_4h.bias", ("F",), 0, f"{_HF_MLP}.dense_h_to_4h.bias", "block"),
    Param(f"{_MLP}.dense_4h_to_h.weight", ("H", "F"), 1, f"{_HF_MLP}.dense_4h_to_h.weight", "block"),
    Param(f"{_MLP}.dense_4h_to_h.bias", ("H",), None, f"{_HF_MLP}.dense_4h_to_h.bias", "block"),  # row parallel
    Param("final_layernorm.weight", ("H",), None, "transformer.ln_f.weight", "final_norm"),
    Param("final_layernorm.bias", ("H",), None, "transformer.ln_f.bias", "final_norm"),
)
HF_TIED_HEAD = "lm_head.weight"  # HF's LM head: the word embeddings (tied), so no row of its own


def size(symbol, config):
    """The length a shape symbol stands for in a ModelConfig."""
    return {"V": config.vocab_size, "H": config.hidden_size, "3H": 3 * config.hidden_size,
            "F": config.ffn_dim}[symbol]


def full_shape(param, config):
    return tuple(size(symbol, config) for symbol in param.shape)


def local_shape(param, config, tp):
    """The shape one of tp tensor-parallel ranks holds."""
    shape = list(full_shape(param, config))
    if param.partition_dim is not None:
        shape[param.partition_dim] //= tp
    return tuple(shape)


def exists(param, config):
    return param.only_if is None or bool(getattr(config, param.only_if))


def _compile(pattern):
    return re.compile("^" + re.escape(pattern).replace(re.escape("{n}"), r"(?P<n>\d+)") + "$")


_BY_NAME = [(_compile(p.name), p) for p in PARAMS]
_BY_HF_NAME = [(_compile(p.hf_name), p) for p in PARAMS]


def _lookup(name, table):
    for regex, param in table:
        match = regex.match(name)
        if match:
            return param, match.groupdict().get("n")
    return None, None


def find(name):
    """The row of a canonical name (None for a name that is no parameter of the model)."""
    return _lookup(name, _BY_NAME)[0]


def partition_dim(name):
    """The dim TP splits canonical tensor `name` along (None: replicated, or no such parameter)."""
    param = find(name)
    return None if param is None else param.partition_dim


def named_params(config):
    """[(canonical name, row)] of a ModelConfig's parameters, in BloomModel's order (layers in turn)."""
    out = []
    for holder, layers in (("embedding", [None]), ("block", range(config.num_layers)), ("final_norm", [None])):
        for n in layers:
            out += [(p.name.format(n=n), p) for p in PARAMS if p.holder == holder and exists(p, config)]
    return out


def expected_shapes(config):
    """Canonical name -> full shape, in BloomModel's parameter order."""
    return {name: full_shape(param, config) for name, param in named_params(config)}


def num_parameters(config):
    """Trainable parameters of the whole model (the LM head is the word embedding: counted once)."""
    return sum(math.prod(full_shape(p, config)) * (config.num_layers if p.holder == "block" else 1)
               for p in PARAMS if exists(p, config))


def to_hf_name(name):
    param, n = _lookup(name, _BY_NAME)
    if param is None:
        raise KeyError(f"our parameter {name!r} has no entry in the BLOOM name table")
    return param.hf_name.format(n=n)


def from_hf_name(name):
    param, n = _lookup(name, _BY_HF_NAME)
    if param is None:
        raise KeyError(f"Hugging Face parameter {name!r} has no entry in the BLOOM name table")
    return param.name.format(n=n)


# ---------------------------------------------------------------- the pipeline

TIED_KEY = "embed"  # the TiedLayerSpec key of the word embedding (first layer) and the LM head (last)
DEFAULT_PARTITION_METHOD = "type:BloomBlockPipe"


@dataclass(frozen=True)
class PipeLayer:
    """One entry of the PipelineModule's layer list. class_name is what DeepSpeed's "type:" partition methods
    match; canonical_prefix / module_prefix: its parameters' name prefix in BloomModel / in the PipelineModule
    (DeepSpeed names a layer's module by its index, a tied module tied_modules.<key>)."""
    kind: str               # "embedding", "block", "final_norm" or "head" (the tied embedding again)
    class_name: str
    index: int              # position in the layer list
    layer_number: Optional[int] = None  # blocks: n of layers.{n}

    @property
    def canonical_prefix(self):
        return {"embedding": "embedding.", "block": f"layers.{self.layer_number}.", "final_norm": "",
                "head": "embedding."}[self.kind]

    @property
    def module_prefix(self):
        return f"tied_modules.{TIED_KEY}." if self.kind in ("embedding", "head") else f"{self.index}."


@functools.lru_cache(maxsize=8)
def pipe_layers(num_layers):
    """(embedding, block x num_layers, final norm, head): the PipelineModule's layer list."""
    return ((PipeLayer("embedding", "EmbeddingPipe", 0),)
            + tuple(PipeLayer("block", "BloomBlockPipe", n + 1, n) for n in range(num_layers))
            + (PipeLayer("final_norm", "FinalLayerNormPipe", num_layers + 1),
               PipeLayer("head", "EmbeddingPipe", num_layers + 2)))


def canonical_name(module_name, num_layers):
    """A PipelineModule parameter name -> canonical name (None for names that are not model weights)."""
    layers = pipe_layers(num_layers)
    tied = layers[0]
    if module_name.startswith(tied.module_prefix):
        return tied.canonical_prefix + module_name[len(tied.module_prefix):]
    index, dot, rest = module_name.partition(".")
    if not (dot and index.isdigit() and int(index) < len(layers)) or layers[int(index)].kind in ("embedding", "head"):
        return None
    return layers[int(index)].canonical_prefix + rest


def _layer_weights(config, method, tp):
    """The weight of each pipeline layer that DeepSpeed's partition_balanced balances under `method`."""
    layers = pipe_layers(config.num_layers)
    if method == "parameters":  # what PipelineModule._count_layer_params counts: each built layer's local numel
        def count(holder):
            return sum(math.prod(local_shape(p, config, tp)) for p in PARAMS
                       if p.holder == holder and exists(p, config))
        return [count("embedding" if layer.kind == "head" else layer.kind) for layer in layers]
    if method.lower().startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if pattern.search(layer.class_name) else 0 for layer in layers]
        if not any(weights):
            raise ValueError(f"partition method {method} matches none of the pipeline's layers "
                             f"({', '.join(sorted({layer.class_name for layer in layers}))})")
        return weights
    raise ValueError(f"partition method {method} is not one of parameters, uniform, type:<layer class regex>")


def stage_bounds(config, pp, method=DEFAULT_PARTITION_METHOD, tp=None):
    """[start of stage 0, ..., start of stage pp - 1, number of layers] over pipe_layers: what DeepSpeed's
    PipelineModule computes for `method` (its partition functions run on the weights the spec gives)."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    if method.lower() == "uniform":
        bounds = partition_uniform(num_items=config.num_layers + 3, num_parts=pp)
    else:
        tp = config.tensor_model_parallel_size if tp is None else tp
        bounds = partition_balanced(weights=_layer_weights(config, method.lower(), tp), num_parts=pp)
    return [int(b) for b in bounds]


def stage_names(config, pp, method=DEFAULT_PARTITION_METHOD, tp=None):
    """[canonical names of stage 0, ...] in BloomModel's order. A parameter belongs to the stage of its pipeline
    layer; the tied embedding to the first stage that holds it (DeepSpeed's owner of the tied module; the last
    stage's copy is not stored)."""
    bounds = stage_bounds(config, pp, method, tp)
    stage_of = {}
    for layer in pipe_layers(config.num_layers):
        stage = next(s for s in range(pp) if bounds[s] <= layer.index < bounds[s + 1])
        key = layer.layer_number if layer.kind == "block" else layer.kind
        stage_of.setdefault("embedding" if layer.kind == "head" else key, stage)
    stages = [[] for _ in range(pp)]
    for name, param in named_params(config):
        key = int(name.split(".")[1]) if param.holder == "block" else param.holder
        stages[stage_of[key]].append(name)
    return stages
