"""tools/convert_checkpoint.py: a checkpoint converted to another TP x PP keeps its optimizer state bit for bit.

Fabricated checkpoints (no training, fast): a TP 2 x PP 2 x DP 2 fp16 checkpoint whose optimizer state lies in
ZeRO-like flat partitions (pieces cut across DP ranks, with an fp32 master and an fp16 loss scaler) goes through
TP 1 x PP 1 and back, and to TP 4 x PP 1; every parameter's state reads back equal (torch.equal) to what was
written, with the step, counters and loss scale. The errors are one line each.

Real checkpoints (tests/conftest.py's training runs, shared with test_layout_change.py): the fp32 TP 2 x PP 2
run's iteration-10 checkpoint A -> B (TP 1 x PP 1) -> A' (TP 2 x PP 2): A' equals A bit for bit (model shards,
every parameter's optimizer state, step, counters), B's weights and state equal A's merged; the same for a bf16
ZeRO-1 checkpoint (fp32 master present) through TP 2 x PP 2. Training from B on TP 1 x PP 1 x DP 2 ZeRO-1 gives
the same losses, LRs and gradient norms as resuming A directly on that layout: exactly equal (measured: both
runs start from the same bits and the same data position).
"""
import importlib.util
import json
import os

import pytest
import torch

from megatron.checkpoint import convert, universal
from megatron.checkpoint.format import (expected_shapes, index_name, optimizer_name, partition_dim, read_meta,
                                        shard_name, verify_checkpoint)
from megatron.checkpoint.io import write_manifest
from megatron.checkpoint.saved_optimizer import index_text, target_slice
from megatron.config import ModelConfig
from tests.integration.test_layout_change import LAYOUTS, args, records
from tests.launch import ROOT, run_pretrain, run_tool

STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")
COUNTERS = {"global_steps": 5, "global_samples": 40, "skipped_steps": 1, "lr_scheduler": {"num_steps": 5}}
SCALER = {"cur_scale": 512.0, "cur_iter": 5, "last_overflow_iter": 2, "cur_hysteresis": 2}


def tool_main():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def convert_to(src, dst, tp, pp):
    return universal.convert_checkpoint(str(src), str(dst), tp, pp)[2]


# ---------------------------------------------------------------- a fabricated checkpoint (no training)


def fabricate(root, tp=2, pp=2, dp=2):
    """A save root holding a TP x PP x DP fp16 checkpoint (iteration 5) with ZeRO-like optimizer files; returns
    (its folder, the whole weights, {name: {key: whole state}})."""
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=16)
    generator = torch.Generator().manual_seed(0)
    shapes = expected_shapes(config)
    weights = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    whole = {name: {key: torch.randn(shape, generator=generator) for key in STATE_KEYS}
             for name, shape in shapes.items()}
    folder = convert.write_megatron_checkpoint(str(root), weights, config, tp, pp, iteration=5, consumed_samples=40,
                                               precision="fp16", dtype=torch.float16)
    for p, names in enumerate(convert.stage_names(config, tp, pp)):
        for t in range(tp):
            slices = {n: {k: target_slice(whole[n][k], partition_dim(n), tp, t) for k in STATE_KEYS} for n in names}
            flat = {k: torch.cat([torch.full((3,), -1.0)] + [slices[n][k].reshape(-1) for n in names])
                    for k in STATE_KEYS}  # 3 elements of padding first: the pieces' offsets are not their starts
            size = -(-flat["fp32"].numel() // dp)
            for d in range(dp):
                begin, end = d * size, min((d + 1) * size, flat["fp32"].numel())
                params, at = {}, 3
                for n in names:
                    shape, numel = list(slices[n]["fp32"].shape), slices[n]["fp32"].numel()
                    lo, hi = max(at, begin), min(at + numel, end)
                    if lo < hi:
                        params[n] = {"shape": shape, "partition_dim": partition_dim(n), "pieces": [{
                            "state": ["base", "state", 0], "fp32": ["fp32_groups", 0], "offset": lo - begin,
                            "start": lo - at, "numel": hi - lo}]}
                    at += numel
                part = {k: v[begin:end].clone() for k, v in flat.items()}
                optimizer = {"fp32_groups": [part["fp32"]], "base": {"state": {0: {
                    "exp_avg": part["exp_avg"], "exp_avg_sq": part["exp_avg_sq"], "step": torch.tensor(7.0)}}},
                    **SCALER}
                torch.save({"optimizer": optimizer, **COUNTERS}, os.path.join(folder, optimizer_name(t, p, d)))
                with open(os.path.join(folder, index_name(t, p, d)), "w") as f:
                    f.write(index_text(7.0, params))
    meta = read_meta(folder)
    meta.update(data_parallel_size=dp, zero_stage=1, deepspeed_state=True, engine_state_version=2)
    del meta["converted_from"]
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)
    write_manifest(folder, 5)
    return folder, weights, whole


@pytest.fixture(scope="module")
def fabricated(tmp_path_factory):
    return fabricate(tmp_path_factory.mktemp("fabricated") / "ckpt")


def saved(folder):
    return universal.saved_optimizer(folder, read_meta(folder))


@pytest.mark.parametrize("path", [((1, 1), (2, 2)), ((4, 1),)], ids=["tp1pp1-and-back", "tp4pp1"])
def test_fabricated_state_survives_any_layout_bit_for_bit(fabricated, tmp_path, path):
    folder, weights, whole = fabricated
    for i, (tp, pp) in enumerate(path):
        folder = convert_to(folder, tmp_path / f"step{i}", tp, pp)
        meta = read_meta(folder)
        assert {k: meta[k] for k in ("iteration", "consumed_samples", "tensor_model_parallel_size",
                                     "pipeline_model_parallel_size", "data_parallel_size", "zero_stage",
                                     "precision", "deepspeed_state", "engine_state_version", "optimizer_format")} == {
            "iteration": 5, "consumed_samples": 40, "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp, "data_parallel_size": None, "zero_stage": None,
            "precision": "fp16", "deepspeed_state": True, "engine_state_version": 2, "optimizer_format": "parameters"}
        assert verify_checkpoint(folder) is None
        assert open(tmp_path / f"step{i}" / "latest").read() == "iter_0000005"
        config = json.load(open(os.path.join(folder, "config.json")))
        assert config["parallel"]["tensor_model_parallel_size"] == config["model"]["tensor_model_parallel_size"] == tp
        assert config["parallel"]["pipeline_model_parallel_size"] == pp
        for t in range(tp):
            for p in range(pp):
                index = json.load(open(os.path.join(folder, index_name(t, p, 0))))
                for name, entry in index["params"].items():
                    assert p == 0 or not name.startswith("embedding.")  # the tied embedding: first stage only
                    assert (entry["start"], entry["numel"], entry["fp32"]) == (
                        0, torch.Size(entry["shape"]).numel(), True)
                file = torch.load(os.path.join(folder, optimizer_name(t, p, 0)), weights_only=False)
                assert {k: file[k] for k in COUNTERS} == COUNTERS
                assert {k: file["optimizer"][k] for k in SCALER} == SCALER
        source = saved(folder)
        assert source.step == 7.0 and source.names() == sorted(whole)
        for name, states in whole.items():
            for key, tensor in states.items():
                assert torch.equal(source.full(name, key), tensor), (name, key)
        merged = convert.load_merged_checkpoint(folder)
        assert merged.dtype == torch.float16
        for name, tensor in weights.items():
            assert torch.equal(merged.weights[name], tensor.to(torch.float16)), name


def test_a_tp_size_the_model_cannot_split_is_one_line_and_leaves_nothing(fabricated, tmp_path):
    folder = fabricated[0]
    proc = run_tool("tools/convert_checkpoint.py", ["--load", folder, "--save", tmp_path / "out",
                                                    "--target-tensor-parallel-size", "3",
                                                    "--target-pipeline-parallel-size", "1"], check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr == (
        "error: --target-tensor-parallel-size 3 does not fit this model: --num-attention-heads 4 is not divisible "
        "by --tensor-model-parallel-size 3; choose a TP size that divides the head count\n"), proc.stderr
    assert os.listdir(tmp_path) == []  # no output, no temporary sibling


@pytest.mark.parametrize("flags, message", [
    (["--target-pipeline-parallel-size", "3"], "--target-pipeline-parallel-size 3 exceeds the 2 layers; use at most 2"),
    (["--target-tensor-parallel-size", "0"], "--target-tensor-parallel-size 0 must be at least 1"),
], ids=["pp-over-layers", "tp-zero"])
def test_layouts_that_cannot_hold_the_model_name_the_flag(fabricated, tmp_path, capsys, flags, message):
    main = tool_main()
    argv = ["--load", fabricated[0], "--save", str(tmp_path / "out"), "--target-tensor-parallel-size", "1",
            "--target-pipeline-parallel-size", "1"]
    argv[argv.index(flags[0]) + 1] = flags[1]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert os.listdir(tmp_path) == []


def test_an_existing_output_needs_force(fabricated, tmp_path, capsys):
    main = tool_main()
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    argv = ["--load", fabricated[0], "--save", str(out), "--target-tensor-parallel-size", "1",
            "--target-pipeline-parallel-size", "1"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"error: --save {out} already exists; pass --force to replace it or choose "
                                       "another folder\n")
    assert os.listdir(out) == ["keep"]
    assert main(argv + ["--force"]) == 0
    assert sorted(os.listdir(out)) == ["iter_0000005", "latest"]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary sibling left


def test_a_checkpoint_without_optimizer_state_points_to_the_weights_tool(fabricated, tmp_path, capsys):
    main = tool_main()
    weights_only = convert_to_weights_only(fabricated[0], tmp_path / "w")
    assert main(["--load", weights_only, "--save", str(tmp_path / "out"), "--target-tensor-parallel-size", "1",
                 "--target-pipeline-parallel-size", "1"]) == 2
    assert capsys.readouterr().err == (
        f"error: --load {weights_only}: the checkpoint holds no per-parameter optimizer state (saved with "
        "--no-save-optim, by a conversion of the weights alone, or before index_tp00_pp000_dp00000.json existed); "
        "reshard its weights with tools/merge_mp_partitions.py --output-format megatron instead\n")


def test_optimizer_state_streams_into_the_output_one_tensor_at_a_time(fabricated, tmp_path, monkeypatch):
    """TP 2 x PP 2 -> TP 1 x PP 1: the one output optimizer file holds every parameter's state, yet the most state
    alive at once is one tensor (each SavedOptimizer.full result followed by weakref until freed). Measured: 32768
    bytes (one tensor) of the file's 404736; before torch_stream the whole file was built first (399360 alive)."""
    import weakref
    tracked = {"live": 0, "peak": 0}
    full = universal.SavedOptimizer.full

    def freed(nbytes):
        tracked["live"] -= nbytes

    def counted(self, *args, **kwargs):
        tensor = full(self, *args, **kwargs)
        nbytes = tensor.numel() * tensor.element_size()
        tracked["live"] += nbytes
        tracked["peak"] = max(tracked["peak"], tracked["live"])
        weakref.finalize(tensor, freed, nbytes)
        return tensor

    monkeypatch.setattr(universal.SavedOptimizer, "full", counted)
    folder, _, whole = fabricated
    out = convert_to(folder, tmp_path / "out", 1, 1)
    file = torch.load(os.path.join(out, optimizer_name(0, 0, 0)), weights_only=False, mmap=True)
    file_bytes = sum(t.numel() * t.element_size() for state in file["optimizer"]["params"].values()
                     for t in state.values())
    largest = max(t.numel() * 4 for states in whole.values() for t in states.values())
    assert file_bytes == sum(t.numel() * 4 for states in whole.values() for t in states.values())
    assert tracked["peak"] == largest < file_bytes / 10, (tracked["peak"], largest, file_bytes)
    for name, states in whole.items():
        for key, tensor in states.items():
            assert torch.equal(file["optimizer"]["params"][name][key], tensor.reshape(-1)), (name, key)


def convert_to_weights_only(folder, out):
    reader = convert.CheckpointReader(folder)
    try:
        return convert.write_megatron_checkpoint(str(out), reader, reader.config, 1, 1, iteration=5)
    finally:
        reader.close()


# ---------------------------------------------------------------- real checkpoints written by training


def assert_same_checkpoint(a, b):
    """Model shards and every parameter's optimizer state, step and counters of folders a and b equal bit for
    bit (the shards' files and dtypes too)."""
    meta_a, meta_b = read_meta(a), read_meta(b)
    tp, pp = meta_a["tensor_model_parallel_size"], meta_a["pipeline_model_parallel_size"]
    assert (meta_b["tensor_model_parallel_size"], meta_b["pipeline_model_parallel_size"]) == (tp, pp)
    for key in ("iteration", "consumed_samples", "precision", "engine_state_version"):
        assert meta_a[key] == meta_b[key], key
    for t in range(tp):
        for p in range(pp):
            x, y = (torch.load(os.path.join(f, shard_name(t, p)), weights_only=True) for f in (a, b))
            assert x["partition_dims"] == y["partition_dims"] and list(x["weights"]) == list(y["weights"])
            for name, tensor in x["weights"].items():
                assert tensor.dtype == y["weights"][name].dtype and torch.equal(tensor, y["weights"][name]), name
    assert_same_state(a, b)


def assert_same_state(a, b):
    source, other = saved(a), saved(b)
    assert source.names() == other.names() and source.step == other.step and source.step is not None
    assert source.has_fp32() == other.has_fp32()
    keys = STATE_KEYS if source.has_fp32() else STATE_KEYS[1:]
    for name in source.names():
        for key in keys:
            assert torch.equal(source.full(name, key), other.full(name, key)), (name, key)
    counters_a, counters_b = universal.engine_counters(a), universal.engine_counters(b)
    assert counters_a[0] == counters_b[0] and counters_a[0]["global_steps"] == read_meta(a)["iteration"]
    assert counters_a[1].keys() == counters_b[1].keys()


def assert_round_trip(a, tmp_path, middle, back):
    b = convert_to(a, tmp_path / "B", *middle)
    a2 = convert_to(b, tmp_path / "A2", *back)
    assert_same_checkpoint(a, a2)
    merged_a, merged_b = convert.load_merged_checkpoint(a), convert.load_merged_checkpoint(b)
    assert merged_a.dtype == merged_b.dtype and merged_a.weights.keys() == merged_b.weights.keys()
    for name, tensor in merged_a.weights.items():
        assert torch.equal(tensor, merged_b.weights[name]), name
    assert_same_state(a, b)
    return b


@pytest.fixture(scope="module")
def fp32_converted(layout_source, tmp_path_factory):
    """A (the fp32 TP 2 x PP 2 checkpoint at iteration 10) -> B (TP 1 x PP 1) -> A' checked; B's save root."""
    b = assert_round_trip(str(layout_source / "ckpt" / "iter_0000010"), tmp_path_factory.mktemp("fp32_converted"),
                          (1, 1), (2, 2))
    return os.path.dirname(b)


@pytest.mark.slow
def test_fp32_tp2_pp2_to_tp1_pp1_and_back_is_bit_for_bit(fp32_converted):
    assert os.path.basename(convert.resolve_checkpoint_folder(fp32_converted)) == "iter_0000010"


@pytest.mark.slow
def test_bf16_zero1_to_tp2_pp2_and_back_is_bit_for_bit(bf16_zero1_source, tmp_path):
    a = str(bf16_zero1_source / "ckpt" / "iter_0000010")
    assert saved(a).has_fp32()
    assert_round_trip(a, tmp_path, (2, 2), (1, 1))


@pytest.mark.slow
def test_training_from_the_converted_checkpoint_equals_the_direct_resume(fp32_converted, layout_resumed_on_zero1,
                                                                         sample_data, tmp_path):
    flags, nproc = LAYOUTS["tp1-pp1-dp2-zero1"]
    proc = run_pretrain(args(sample_data, tmp_path, *flags, "--load", fp32_converted), nproc)
    lines = [line for line in proc.stderr.splitlines() if "resuming on another layout" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "resuming on another layout: the checkpoint was trained on TP 1, PP 1, DP any, ZeRO any, fp32 "
        "(tools/convert_checkpoint.py), this run is TP 1, PP 1, DP 2, ZeRO 1, fp32 (weights, optimizer state, LR "
        "schedule, loss scale and data position carried over; RNG states restart)"), lines
    converted, direct = records(tmp_path / "metrics.jsonl"), records(layout_resumed_on_zero1[1] / "metrics.jsonl")
    assert sorted(converted) == sorted(direct) == list(range(11, 21))
    for iteration in converted:
        for key in ("lm_loss", "lr", "grad_norm"):
            assert converted[iteration][key] == direct[iteration][key], (iteration, key)
