"""BigScience tr11 flags (megatron/upstream_compat.py, declared on config.UpstreamConfig) and the upstream checkpoint
name mapping (megatron/checkpoint/upstream.py): pure rules, values worked by hand in the comments."""
import argparse

import pytest
import torch

from megatron import upstream_compat
from megatron.arguments import parse_args, resolve
from megatron.checkpoint.format import CheckpointError
from megatron.checkpoint.upstream import canonical_from_layers, canonical_param_name, classify_load
from megatron.optimizer import AnnealingLR
from tests.distributed import run_distributed

BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data"]


def resolved(*flags, world=1):
    return resolve(parse_args(BASE + list(flags)), world, tokenizer_vocab_size=100)[0]


def error_of(*flags, world=1):
    with pytest.raises(ValueError) as err:
        resolved(*flags, world=world)
    return str(err.value)


def test_rampup_batch_follows_upstreams_formula():
    # tr11: 192 16 9_765_625 to 2048: (2048 - 192) / 16 = 116 increments of 9765625 / 116 = 84186.42 samples
    batch = lambda consumed: upstream_compat.rampup_global_batch(consumed, 192, 16, 9_765_625, 2048)  # noqa: E731
    assert [batch(0), batch(84186), batch(84187), batch(168373), batch(9_765_625), batch(9_765_626)] == \
        [192, 192, 208, 224, 2048, 2048]
    # 2 2 8 to 6: 2 increments of 4 samples; steps take 2 (c=2), 2 (c=4), 4 (c=8), 6 (c=14 > 8): 4 steps of
    # ramp-up, then (30 - 14) // 6 = 2 full ones
    assert upstream_compat.rampup_train_iters(30, 2, 2, 8, 6) == 6


def test_rampup_flags_resolve_and_are_checked():
    config = resolved("--global-batch-size", "6", "--train-samples", "30", "--rampup-batch-size", "2", "2", "8")
    assert (config.training.train_iters, config.training.train_samples) == (6, None)
    assert (config.upstream.rampup_batch_size, config.upstream.train_samples) == ((2, 2, 8), 30)
    assert error_of("--global-batch-size", "6", "--train-iters", "5", "--rampup-batch-size", "2", "2", "8") == (
        "--rampup-batch-size 2 2 8 needs --train-samples (upstream ramps the batch size only in sample-based runs); "
        "pass --train-samples instead of --train-iters")
    assert error_of("--global-batch-size", "8", "--train-samples", "30", "--rampup-batch-size", "2", "4", "8") == (
        "--rampup-batch-size 2 4 8: --global-batch-size 8 minus the start batch is not a multiple of the increment 4")
    assert error_of("--global-batch-size", "8", "--train-samples", "30", "--rampup-batch-size", "3", "1", "8") == (
        "--rampup-batch-size 3 1 8: the start batch 3 is not a multiple of --micro-batch-size 2 x data-parallel "
        "size 1 = 2")


def test_sample_based_schedule_lengths_and_steps():
    config = resolved("--train-samples", "40", "--lr-warmup-samples", "4")
    assert upstream_compat.schedule_lengths(config.upstream, config.optimizer, config.training) == (4, 40, "samples")
    config = resolved("--train-iters", "10", "--lr-decay-samples", "12")
    assert upstream_compat.schedule_lengths(config.upstream, config.optimizer, config.training) == (0, 12, "samples")
    assert error_of("--train-iters", "10", "--lr-warmup-samples", "4", "--lr-warmup-iters", "2") == (
        "--lr-warmup-iters and --lr-warmup-samples/--lr-decay-samples are both set: the schedule counts iterations "
        "or samples, not both; pass one form")
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    schedule = AnnealingLR(optimizer, 1e-3, 1e-4, 4, 12, "linear", increment=2)
    schedule.step()
    assert schedule.num_steps == 2 and optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 2 / 4)
    schedule.increment = 4
    schedule.step()  # 6 samples: 2 of the 8 decay samples past the warmup
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 + 9e-4 * (1 - 2 / 8))


def test_lr_scheduler_source_on_resume():
    param = torch.nn.Parameter(torch.zeros(1))
    saved = AnnealingLR(torch.optim.SGD([param], lr=1.0), 5e-3, 5e-4, 2, 20, "cosine")
    saved.step(7)
    flags_first = AnnealingLR(torch.optim.SGD([param], lr=1.0), 1e-3, 1e-4, 4, 10, "linear")
    flags_first.load_state_dict(saved.state_dict())
    assert (flags_first.num_steps, flags_first.lr, flags_first.decay_style) == (7, 1e-3, "linear")
    checkpoint_first = AnnealingLR(torch.optim.SGD([param], lr=1.0), 1e-3, 1e-4, 4, 10, "linear",
                                   use_checkpoint_schedule=True)
    checkpoint_first.load_state_dict(saved.state_dict())
    assert checkpoint_first.get_lr() == saved.get_lr()
    assert error_of("--train-iters", "5", "--override-lr-scheduler", "--use-checkpoint-lr-scheduler") == (
        "--override-lr-scheduler and --use-checkpoint-lr-scheduler are both set: the first takes the LR schedule "
        "from the flags, the second from the checkpoint; pass one")


def test_partition_method_refusals_and_checkpoint_num_layers():
    assert upstream_compat.pipeline_partition_method("type:transformer|embedding") == \
        "type:BloomBlockPipe|EmbeddingPipe"
    assert upstream_compat.pipeline_partition_method("uniform") == "uniform"
    assert error_of("--train-iters", "5", "--pp-partition-method", "type:attention") == (
        "--pp-partition-method type:attention is not one of parameters, uniform, type:transformer, "
        "type:transformer|embedding")
    assert error_of("--train-iters", "5", "--train-weighted-split-paths-path", "splits.txt") == (
        "--train-weighted-split-paths-path is not supported: per-dataset split ranges of upstream's weighted split "
        "paths are not implemented here; blend whole datasets with --data-path W1 PREFIX1 W2 PREFIX2 and one --split "
        "for all")
    assert resolved("--train-iters", "5", "--checkpoint-num-layers", "2").model.checkpoint_num_layers == 2
    assert error_of("--train-iters", "5", "--checkpoint-num-layers", "0") == "--checkpoint-num-layers 0 must be at least 1"


def test_checkpoint_num_layers_chunks_give_the_same_loss_and_gradients(monkeypatch):
    from megatron.config import ModelConfig
    from megatron.core import tensor_parallel
    from megatron.model import BloomModel
    grads, calls, checkpoint = [], [], tensor_parallel.checkpoint
    monkeypatch.setattr(tensor_parallel, "checkpoint", lambda fn, *args: calls.append(fn) or checkpoint(fn, *args))
    for chunk in (1, 2):
        config = ModelConfig(num_layers=3, hidden_size=16, num_attention_heads=2, vocab_size=64, seq_length=8,
                             checkpoint_activations=True, checkpoint_num_layers=chunk, attention_impl="torch")
        model = BloomModel(config).train()
        tokens = torch.arange(18).view(2, 9) % 64
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert len(calls) == 3 + 2  # 3 layers one at a time, then chunks of 2 and 1
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))


def _sync_worker(rank, world_size):
    class Engine:
        module = torch.nn.Linear(2, 2)
    engine = Engine()
    with torch.no_grad():
        engine.module.weight.fill_(rank + 1.0)
        engine.module.bias.fill_(10.0 * (rank + 1))
    engine.module.weight.tensor_model_parallel = True  # a TP slice: left alone
    upstream_compat.sync_tp_duplicated_parameters(engine, torch.distributed.group.WORLD)
    assert torch.equal(engine.module.weight, torch.full((2, 2), rank + 1.0))
    assert torch.equal(engine.module.bias, torch.full((2,), 15.0))  # mean of 10 and 20


def test_sync_tp_duplicated_parameters_averages_the_copies():
    run_distributed(_sync_worker, 2)


def test_upstream_names_map_to_ours():
    keys = {1: ["word_embeddings.weight", "word_embeddings.norm.weight", "word_embeddings.norm.bias"],
            3: ["input_layernorm.weight", "mlp.dense_4h_to_h.bias"], 4: ["input_layernorm.weight"],
            6: ["weight", "bias"]}
    mapping = canonical_from_layers(keys)
    assert mapping[1]["word_embeddings.norm.bias"] == "embedding.word_embeddings_layernorm.bias"
    assert (mapping[3]["mlp.dense_4h_to_h.bias"], mapping[4]["input_layernorm.weight"], mapping[6]["weight"]) == \
        ("layers.0.mlp.dense_4h_to_h.bias", "layers.1.input_layernorm.weight", "final_layernorm.weight")
    assert canonical_param_name("tied_modules.embed.word_embeddings.weight", mapping) == \
        "embedding.word_embeddings.weight"
    assert canonical_param_name("4.input_layernorm.weight", mapping) == "layers.1.input_layernorm.weight"
    with pytest.raises(CheckpointError) as err:
        canonical_from_layers({5: ["rotary.inv"]})
    assert str(err.value) == ("layer_05: keys ['rotary.inv'] are not those of a BLOOM layer in the upstream "
                              "Megatron-DeepSpeed layout (embedding, transformer block, final LayerNorm)")


def test_load_folders_that_hold_nothing_yet_start_from_scratch(tmp_path):
    assert classify_load(str(tmp_path / "missing")) == ("ours", None)
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "tensorboard").mkdir()
    assert classify_load(str(tmp_path)) == ("ours", None)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as err:
        classify_load(str(hf))
    assert str(err.value) == (
        f"--load {hf} is a Hugging Face model folder, not a training checkpoint; convert it first: python "
        f"tools/convert_hf_to_megatron.py --hf-model-path {hf} --output-path {hf}_megatron, then --load "
        f"{hf}_megatron --finetune")


def test_a_non_pipeline_upstream_checkpoint_reads_and_converts(tmp_path):
    """mp_rank_XX_model_states.pt holding GPTModel's nested `module` per TP rank (a run without a PipelineModule):
    merged along the partition dims, TP copies averaged, converted to this project's format (weights alone)."""
    from megatron.checkpoint import universal
    from megatron.checkpoint.convert import CheckpointReader
    from megatron.checkpoint.format import expected_shapes, partition_dim
    from megatron.checkpoint.upstream import UpstreamCheckpoint, locate
    from megatron.config import ModelConfig
    config = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=32, seq_length=8)
    generator = torch.Generator().manual_seed(0)
    whole = {name: torch.randn(shape, generator=generator) for name, shape in expected_shapes(config).items()}
    copies = {}  # the replicated tensors' second TP copy: it drifted by +1
    folder = tmp_path / "global_step7"
    folder.mkdir()
    (tmp_path / "latest").write_text("global_step7")
    for t in (0, 1):
        embedding, encoder = {}, {}
        for name, tensor in whole.items():
            dim = partition_dim(name)
            piece = tensor.chunk(2, dim)[t].clone() if dim is not None else tensor + t
            if dim is None and t:
                copies[name] = piece
            if name == "embedding.word_embeddings.weight":
                embedding["word_embeddings"] = {"weight": piece}
            elif name.startswith("embedding."):
                embedding.setdefault("word_embeddings", {}).setdefault("norm", {})[name.rsplit(".", 1)[1]] = piece
            else:
                encoder[name] = piece  # layers.N.* and final_layernorm.*: Megatron's flat encoder keys
        args = argparse.Namespace(num_attention_heads=2, seq_length=8, consumed_train_samples=56,
                                  tensor_model_parallel_size=2)
        torch.save({"module": {"language_model": {"embedding": embedding, "encoder": encoder}}, "args": args,
                    "iteration": 7}, folder / f"mp_rank_{t:02d}_model_states.pt")
    assert locate(str(tmp_path)) == str(folder)
    assert classify_load(str(tmp_path)) == ("upstream", {"vocab_size": 32})
    checkpoint = UpstreamCheckpoint(str(folder))
    assert (checkpoint.iteration, checkpoint.consumed_samples, checkpoint.config.num_layers) == (7, 56, 2)
    for name, tensor in whole.items():
        expected = tensor + 0.5 if name in copies else tensor  # the mean of the copies
        assert torch.allclose(checkpoint.read(name), expected, rtol=0, atol=1e-6), name
    assert checkpoint.optimizer() is None
    _, out, count = universal.convert_upstream_checkpoint(str(folder), str(tmp_path / "ours"), 1, 2)
    reader = CheckpointReader(out)
    assert count == 0 and reader.iteration == 7
    for name, tensor in whole.items():
        assert torch.allclose(reader.read(name), checkpoint.read(name), rtol=0, atol=0), name
