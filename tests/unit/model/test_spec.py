"""The parameter spec (megatron/model/spec.py) against what it describes, each from an independent source.

- A BloomModel built at TP 2 (both ranks) holds exactly the spec's rows: names, local shapes, the partition_dim and
  tensor_model_parallel attributes, and its two slices concatenated along the row's dim equal the TP 1 model's
  tensor (the same seed builds the same full weights), replicated ones equal on both ranks.
- The HF names and shapes equal those of a transformers BloomForCausalLM; num_parameters is the built model's count.
- The stage map equals the partition DeepSpeed's PipelineModule computes for the real layer specs, over layer
  counts, PP sizes and every partition method (and the planner's closed form for the default method); in 4 gloo
  processes, real PipelineModules hold exactly the parameters the stage map gives their stage.
"""
import dataclasses
import os

import pytest
import torch
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megatron.config import ModelConfig
from megatron.model import BloomModel, spec
from megatron.planning import memory
from tests.distributed import run_distributed

CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, ffn_hidden_size=48,
                     seq_length=8, attention_impl="torch")
METHODS = ["type:BloomBlockPipe", "type:BloomBlockPipe|EmbeddingPipe", "uniform", "parameters"]


class StandInGroup:
    """What building a model asks of its TP group (size and rank); building communicates nothing."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("embed_layernorm", [True, False])
def test_a_tp2_model_is_what_the_spec_says(embed_layernorm):
    config = dataclasses.replace(CONFIG, embed_layernorm=embed_layernorm)
    full = dict(BloomModel(config).named_parameters())
    tp2 = dataclasses.replace(config, tensor_model_parallel_size=2)
    ranks = [dict(BloomModel(tp2, tp_group=StandInGroup(2, r)).named_parameters()) for r in range(2)]
    rows = dict(spec.named_params(config))
    assert list(rows) == list(full) == list(ranks[0]) == list(ranks[1])  # same names, same order
    assert len(rows) == 2 * embed_layernorm + 1 + 12 * config.num_layers + 2
    assert spec.num_parameters(config) == config.num_parameters() == sum(p.numel() for p in full.values())
    split = set()
    for name, row in rows.items():
        dim = row.partition_dim
        assert tuple(full[name].shape) == spec.full_shape(row, config), name
        for params in ranks:
            param = params[name]
            assert tuple(param.shape) == spec.local_shape(row, config, 2), name
            assert getattr(param, "partition_dim", None) == dim, name
            assert getattr(param, "tensor_model_parallel", False) == (dim is not None), name
        pieces = [params[name].detach() for params in ranks]
        whole = pieces[0] if dim is None else torch.cat(pieces, dim)
        if dim is None:
            assert torch.equal(pieces[0], pieces[1]), name
        torch.testing.assert_close(whole, full[name].detach(), atol=0, rtol=0, msg=name)
        if dim is not None:
            split.add(name.split(".", 2)[-1] if name.startswith("layers.") else name)
    assert split == {"embedding.word_embeddings.weight", "self_attention.query_key_value.weight",
                     "self_attention.query_key_value.bias", "self_attention.dense.weight",
                     "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias", "mlp.dense_4h_to_h.weight"}


def test_hf_names_and_shapes_are_those_of_transformers():
    from transformers import BloomForCausalLM

    from megatron.model.hf_bloom import to_hf_config
    config = dataclasses.replace(CONFIG, ffn_hidden_size=None)  # HF fixes the MLP at 4h
    hf = {name: tuple(t.shape) for name, t in BloomForCausalLM(to_hf_config(config)).state_dict().items()}
    assert hf.pop(spec.HF_TIED_HEAD) == hf["transformer.word_embeddings.weight"]
    ours = {spec.to_hf_name(name): shape for name, shape in spec.expected_shapes(config).items()}
    assert ours == hf
    assert [spec.from_hf_name(name) for name in ours] == list(spec.expected_shapes(config))
    with pytest.raises(KeyError, match="'transformer.h.0.mlp.gate.weight' has no entry in the BLOOM name table"):
        spec.from_hf_name("transformer.h.0.mlp.gate.weight")


def deepspeed_partition(config, pp, method, tp=1):
    """PipelineModule._partition_layers (DeepSpeed's own method) over our real layer specs, without the process
    groups the rest of PipelineModule.__init__ needs: the boundaries `parts` it computes."""
    from deepspeed.pipe import PipelineModule
    from torch import nn

    from megatron.model.pipeline import _layer_spec
    config = dataclasses.replace(config, tensor_model_parallel_size=tp)
    group = StandInGroup(tp, 0) if tp > 1 else None
    module = PipelineModule.__new__(PipelineModule)
    nn.Module.__init__(module)
    module.num_stages, module.global_rank = pp, 1  # rank 1 (pp 0, dp 1): prints nothing
    module._topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=1, num_dp=2)
    module._layer_specs = [_layer_spec(layer, config, group) for layer in spec.pipe_layers(config.num_layers)]
    module._partition_layers(method)
    return [int(b) for b in module.parts]


@pytest.mark.parametrize("method", METHODS)
def test_stage_map_is_deepspeeds_partition(method):
    cases = [(layers, pp) for layers in range(1, 10) for pp in range(1, min(layers, 6) + 1)]
    for layers, pp in cases:
        config = dataclasses.replace(CONFIG, num_layers=layers)
        for tp in ((1, 2) if method == "parameters" else (1,)):
            expected = deepspeed_partition(config, pp, method, tp)
            assert spec.stage_bounds(config, pp, method, tp) == expected, (layers, pp, tp)
            if method == spec.DEFAULT_PARTITION_METHOD:  # the planner's closed form (no DeepSpeed import)
                blocks = [len(range(max(a, 1), min(b, layers + 1))) for a, b in zip(expected, expected[1:])]
                assert memory.stage_layers(layers, pp) == blocks, (layers, pp)
            stages = spec.stage_names(config, pp, method, tp)
            assert sum(stages, []) == list(spec.expected_shapes(config))  # every name once, in order
            for stage, names in enumerate(stages):
                for name in names:
                    index = 0 if name.startswith("embedding.") else \
                        int(name.split(".")[1]) + 1 if name.startswith("layers.") else layers + 1
                    assert expected[stage] <= index < expected[stage + 1], (layers, pp, tp, name)
    with pytest.raises(ValueError, match="^partition method type:attention matches none of the pipeline's layers"):
        spec.stage_bounds(CONFIG, 2, "type:attention")


# (layers, PP, partition method) built as real PipelineModules in 4 processes (TP 1 x PP 4, or TP 2 x PP 2)
PIPELINES = [(5, 4, "type:BloomBlockPipe"), (6, 4, "type:BloomBlockPipe|EmbeddingPipe"), (7, 4, "uniform"),
             (3, 2, "parameters"), (4, 2, "type:BloomBlockPipe|EmbeddingPipe")]


def _pipelines_hold_their_stage(rank, world):
    import deepspeed

    from megatron.core import parallel_state as ps
    from megatron.initialize import _unlink_shm_buffer_once_mapped
    from megatron.model.pipeline import build_pipeline_model, canonical_name
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # over run_distributed's world
    _unlink_shm_buffer_once_mapped()
    for layers, pp, method in PIPELINES:
        tp = world // pp
        state = ps.initialize_model_parallel(tp, pp)
        config = dataclasses.replace(CONFIG, num_layers=layers, tensor_model_parallel_size=tp)
        topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=1)
        with torch.no_grad():
            module = build_pipeline_model(config, topology, tp_group=state.tp_group, partition_method=method)
        stage = topology.get_coord(rank).pipe
        assert [int(b) for b in module.parts] == spec.stage_bounds(config, pp, method, tp), (layers, pp, method)
        held = {canonical_name(name, layers): tuple(p.shape) for name, p in module.named_parameters()}
        rows = dict(spec.named_params(config))
        expected = spec.stage_names(config, pp, method, tp)[stage]
        if stage == pp - 1:  # the tied embedding's copy on the last stage
            expected = expected + [name for name in rows if name.startswith("embedding.")]
        assert held == {name: spec.local_shape(rows[name], config, tp) for name in expected}, (layers, pp, method)
        ps.destroy_model_parallel()


def test_real_pipeline_modules_hold_the_stage_maps_parameters():
    run_distributed(_pipelines_hold_their_stage, 4)


def test_a_conversion_stages_as_the_run_that_resumes_it(tmp_path):
    """A converted checkpoint's stage files hold what the saved run's --pp-partition-method gives each stage (the
    stages a run with the same flags loads), not the default method's."""
    from megatron.checkpoint import convert
    config = dataclasses.replace(CONFIG, num_layers=4)
    method = "type:BloomBlockPipe|EmbeddingPipe"
    assert spec.stage_bounds(config, 3, method) == [0, 2, 4, 7] != spec.stage_bounds(config, 3)
    weights = {name: torch.zeros(shape) for name, shape in spec.expected_shapes(config).items()}
    run_config = {"upstream": {"pp_partition_method": "type:transformer|embedding"}}
    for run, expected in ((run_config, spec.stage_names(config, 3, method)), (None, spec.stage_names(config, 3))):
        out = convert.write_megatron_checkpoint(str(tmp_path / f"iter_000000{bool(run):d}"), weights, config, 1, 3,
                                                run_config=run)
        held = [list(convert.read_shard(os.path.join(out, f"model_tp00_pp{p:03d}.pt"))["weights"]) for p in range(3)]
        assert held == expected
        assert held[1][0] == ("layers.1.input_layernorm.weight" if run else "layers.2.input_layernorm.weight")


def test_pipeline_names_without_a_weight_map_to_none():
    names = ("0.weight", "5.weight", "6.weight", "loss_fn.x", "tied_modules.x")  # 5: the head, 6: past the list
    assert [spec.canonical_name(name, 3) for name in names] == [None] * 5
