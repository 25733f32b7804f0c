"""Checkpoint folders (megatron/checkpoint/): manifest verification, fallback, stale .tmp folders, pruning, failed
saves, --save checks; the engine state (optimizer, LR schedule) saved without weights; the LR-schedule warning on
resume."""
import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron.checkpoint import load, optimizer_state, save
from megatron.checkpoint.format import (CheckpointError, checkpoint_bytes, find_checkpoint, list_checkpoints,
                                        read_latest, read_meta, tag_for, verify_checkpoint)
from megatron.checkpoint.io import write_manifest
from megatron.config import OptimizerConfig
from megatron.core import parallel_state
from tests.faults import Fault, TestFaults


def make_checkpoint(root, iteration, latest=True):
    """A complete checkpoint folder with two small files, a manifest and (optionally) `latest`."""
    folder = os.path.join(root, tag_for(iteration))
    os.makedirs(folder)
    torch.save({"w": torch.arange(100.0) + iteration}, os.path.join(folder, "model_tp00_pp000.pt"))
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"iteration": iteration}, f)
    write_manifest(folder, iteration)
    if latest:
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(tag_for(iteration))
    return folder


def test_complete_checkpoint_verifies(tmp_path):
    assert verify_checkpoint(make_checkpoint(tmp_path, 2)) is None


SHARD, MANIFEST = "model_tp00_pp000.pt", "manifest.json"
DAMAGES = {  # damage: (the file the reason names, the rest of the reason)
    "truncate": (SHARD, "has {half} bytes, the manifest says {size} (truncated?)"),
    "flip": (SHARD, "does not match its checksum (corrupt)"),
    "no_manifest": (MANIFEST, "is missing (the save did not finish)"),
    "bad_manifest": (MANIFEST, "is unreadable (JSONDecodeError: Unterminated string starting at: line 1 column 12 "
                               "(char 11))"),
    "empty_manifest": (MANIFEST, "lists no files"),
    "delete": (SHARD, "is missing")}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_checkpoint_is_reported_by_name(tmp_path, damage):
    folder = make_checkpoint(tmp_path, 2)
    shard = os.path.join(folder, SHARD)
    manifest = os.path.join(folder, MANIFEST)
    size = os.path.getsize(shard)
    if damage == "truncate":
        os.truncate(shard, size // 2)
    elif damage == "flip":
        with open(shard, "r+b") as f:
            f.seek(size - 3)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "no_manifest":
        os.remove(manifest)
    elif damage == "bad_manifest":
        with open(manifest, "w") as f:
            f.write('{"files": {"model_tp00')
    elif damage == "empty_manifest":
        with open(manifest, "w") as f:
            json.dump({"iteration": 2, "files": {}}, f)
    elif damage == "delete":
        os.remove(shard)
    file, expected = DAMAGES[damage]
    assert verify_checkpoint(folder) == f"{os.path.join(folder, file)} {expected.format(half=size // 2, size=size)}"


def test_corrupt_latest_falls_back_to_the_previous_complete_checkpoint(tmp_path, caplog):
    make_checkpoint(tmp_path, 2)
    newest = make_checkpoint(tmp_path, 4)
    os.truncate(os.path.join(newest, "model_tp00_pp000.pt"), 10)
    assert find_checkpoint(str(tmp_path)) == os.path.join(tmp_path, "iter_0000002")
    assert "skipping checkpoint iter_0000004" in caplog.text and "truncated" in caplog.text


def test_strict_load_stops_on_a_corrupt_latest(tmp_path):
    make_checkpoint(tmp_path, 2)
    with open(os.path.join(make_checkpoint(tmp_path, 4), "manifest.json"), "w") as f:
        f.write("not json")
    with pytest.raises(CheckpointError, match="iter_0000004 is incomplete or corrupt.*--strict-load"):
        find_checkpoint(str(tmp_path), strict=True)


def test_tmp_folders_are_never_loaded_and_empty_roots_start_from_scratch(tmp_path):
    assert find_checkpoint(str(tmp_path / "does-not-exist")) is None
    assert find_checkpoint(str(tmp_path)) is None
    make_checkpoint(tmp_path, 2)
    os.rename(make_checkpoint(tmp_path, 4, latest=False), tmp_path / ".tmp_iter_0000004")  # complete but unrenamed
    assert find_checkpoint(str(tmp_path)) == os.path.join(tmp_path, "iter_0000002")
    assert save.remove_stale_tmp(str(tmp_path)) == [".tmp_iter_0000004"]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest"]


def test_prune_keeps_the_new_checkpoint_and_leaves_newer_abandoned_ones(tmp_path, caplog):
    for it in (2, 4, 6, 10):
        make_checkpoint(tmp_path, it)
    save.prune(str(tmp_path), 2, "iter_0000006")
    assert list_checkpoints(str(tmp_path)) == ["iter_0000010", "iter_0000006", "iter_0000004"]
    assert "newer than iter_0000006" in caplog.text


class FakeEngine:
    """What save_checkpoint and megatron.checkpoint.optimizer_state touch of a DeepSpeed engine without a ZeRO or
    fp16 wrapper: the module, torch's optimizer itself (as DeepSpeed uses it in fp32 without ZeRO), the LR scheduler
    and the step counters."""

    def __init__(self, steps=0, module=None):
        from megatron.optimizer import AnnealingLR
        torch.manual_seed(0)
        self.module = module() if module is not None else nn.Linear(4, 4)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-3)
        self.lr_scheduler = AnnealingLR(self.optimizer, 1e-3, 1e-4, 1, 10, "cosine")
        self.global_steps = self.global_samples = self.skipped_steps = 0
        self.train(steps)

    def train(self, steps):
        """steps optimizer steps on random batches of 2, as the engine counts them."""
        for _ in range(steps):
            self.module(torch.randn(2, 4)).sum().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.lr_scheduler.step()
            self.global_steps += 1
            self.global_samples += 2


@pytest.fixture
def single_rank():
    """The ParallelState of one process (TP = PP = DP = 1)."""
    yield parallel_state.initialize_model_parallel(1, 1)
    parallel_state.destroy_model_parallel()


def fake_config(root, keep=None):
    """A real resolved Config (what save writes as config.json) of a one-layer run saving to root."""
    from megatron.arguments import load_and_resolve
    args = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
            "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--mock-vocab-size", "64", "--save", str(root)]
    if keep is not None:
        args += ["--keep-last-n-checkpoints", str(keep)]
    return load_and_resolve(args, world_size=1)[0]


def test_save_is_atomic_removes_stale_tmp_and_prunes_after_completion(tmp_path, single_rank, monkeypatch):
    engine, config = FakeEngine(), fake_config(tmp_path, keep=2)
    os.makedirs(tmp_path / ".tmp_iter_0000003")  # left by a crash
    for it in (1, 2, 3):
        folder = save.save_checkpoint(engine, config, single_rank, it, it * 8)
        assert verify_checkpoint(folder) is None
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000003", "latest"]
    assert read_latest(str(tmp_path)) == "iter_0000003"


def test_failed_save_leaves_latest_and_previous_checkpoint(tmp_path, single_rank, monkeypatch):
    engine, config = FakeEngine(), fake_config(tmp_path, keep=1)
    save.save_checkpoint(engine, config, single_rank, 2, 16)
    before = sorted(os.listdir(tmp_path / "iter_0000002"))
    faults = TestFaults([Fault("save_error", ((4, 4),), phase="save")])
    with pytest.raises(CheckpointError, match=r"--save .*iter_0000004 failed on rank 0 while writing its files "
                                              r"\(OSError: .*No space left.*`latest` still names iter_0000002"):
        save.save_checkpoint(engine, config, single_rank, 4, 32, on_written=lambda folder: faults.fire(4, "save"))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest"]
    assert sorted(os.listdir(tmp_path / "iter_0000002")) == before
    assert verify_checkpoint(str(tmp_path / "iter_0000002")) is None
    assert read_latest(str(tmp_path)) == "iter_0000002"


def test_save_dir_checks_name_the_flag(tmp_path, monkeypatch):
    monkeypatch.setattr(save.shutil, "disk_usage", lambda path: SimpleNamespace(free=2**30))
    assert save.check_save_dir(str(tmp_path / "new"), 2**30) == 2**30  # the free bytes, just enough
    assert os.listdir(tmp_path / "new") == []  # the probe file is gone
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"^--save .*file/ckpt is not writable"):
        save.check_save_dir(str(a_file / "ckpt"), 1)
    needed = checkpoint_bytes(176_000_000_000 // 64, "bf16")
    with pytest.raises(ValueError, match=r"^--save .*: 1.00 GiB free, a checkpoint needs about 35.86 GiB"):
        save.check_save_dir(str(tmp_path), needed)


def test_checkpoint_bytes():
    assert checkpoint_bytes(1000, "fp32") == 1000 * (4 + 8)
    assert checkpoint_bytes(1000, "bf16") == 1000 * (2 + 4 + 8)
    assert checkpoint_bytes(1000, "fp16", no_save_optim=True) == 1000 * 2


def test_saved_folder_holds_weights_once_and_the_optimizer_state(tmp_path, single_rank, monkeypatch):
    engine = FakeEngine(steps=2)
    folder = save.save_checkpoint(engine, fake_config(tmp_path), single_rank, 2, 16)
    assert sorted(os.listdir(folder)) == ["config.json", "index_tp00_pp000_dp00000.json", "manifest.json",
                                          "meta.json", "model_tp00_pp000.pt", "optimizer_tp00_pp000_dp00000.pt",
                                          "rng_rank00000.pt"]
    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    assert (saved["model"]["num_layers"], saved["model"]["hidden_size"], saved["checkpoint"]["save"]) == (
        1, 8, str(tmp_path))
    with open(os.path.join(folder, "index_tp00_pp000_dp00000.json")) as f:
        index = json.load(f)
    assert index == {"version": 2, "step": 2.0, "params": {  # each parameter and the region the file holds
        "weight": {"shape": [4, 4], "partition_dim": None, "start": 0, "numel": 16, "fp32": False},
        "bias": {"shape": [4], "partition_dim": None, "start": 0, "numel": 4, "fp32": False}}}
    saved = torch.load(os.path.join(folder, "optimizer_tp00_pp000_dp00000.pt"), weights_only=False)
    assert saved["wrapper"] == "torch" and saved["lr_scheduler"]["num_steps"] == 2
    assert (saved["global_steps"], saved["global_samples"], saved["skipped_steps"]) == (2, 4, 0)
    params = saved["optimizer"]["params"]
    assert {name: sorted(state) for name, state in params.items()} == {
        "weight": ["exp_avg", "exp_avg_sq"], "bias": ["exp_avg", "exp_avg_sq"]}  # no weights: they are the master
    for name, param in engine.module.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(params[name][key], engine.optimizer.state[param][key].view(-1)), (name, key)
    meta = read_meta(folder)
    assert meta["engine_state_version"] == optimizer_state.FORMAT and meta["deepspeed_state"] is True


def test_compact_copies_views_out_of_larger_storages():
    view = torch.zeros(100)[:10]
    compact = optimizer_state.compact({"a": [view], "b": (torch.ones(3),)})
    assert compact["a"][0].untyped_storage().nbytes() == 40 and isinstance(compact["b"], tuple)


def schedule_config(train_iters=20, **optimizer):
    values = dict(lr=1e-3, min_lr=1e-6, lr_decay_style="cosine", lr_warmup_iters=0, lr_decay_iters=train_iters)
    values.update(optimizer)
    return SimpleNamespace(optimizer=OptimizerConfig(**values), training=SimpleNamespace(train_iters=train_iters))


def saved_config(config):
    return {"optimizer": dataclasses.asdict(config.optimizer), "training": {"train_iters": config.training.train_iters}}


@pytest.mark.parametrize("now,expected", [
    (schedule_config(20), None),
    (schedule_config(40, lr_decay_iters=20), None),  # --lr-decay-iters fixed: a longer run, the same schedule
    (schedule_config(40), "resume: --train-iters 20 -> 40 (checkpoint's value -> now): the cosine decay now ends "
                          "at iteration 40; lr at iteration 20 is 5.01e-4 instead of 1e-6"),
    (schedule_config(20, lr=2e-3), "resume: --lr 1e-3 -> 2e-3 (checkpoint's value -> now): lr at iteration 20 is "
                                   "still 1e-6; later iterations differ"),
    (schedule_config(20, lr_decay_style="linear", lr_warmup_iters=2, min_lr=0.0),
     "resume: --min-lr 1e-6 -> 0, --lr-decay-style cosine -> linear, --lr-warmup-iters 0 -> 2 (checkpoint's value "
     "-> now): the warmup now ends at iteration 2; the linear decay now ends at iteration 20; lr at iteration 20 is "
     "0 instead of 1e-6"),
    (schedule_config(20, lr_decay_iters=30), "resume: --lr-decay-iters 20 -> 30 (checkpoint's value -> now): the "
                                             "cosine decay now ends at iteration 30; lr at iteration 20 is 2.51e-4 "
                                             "instead of 1e-6"),
    (schedule_config(20, lr_decay_style="constant"), "resume: --lr-decay-style cosine -> constant (checkpoint's "
                                                     "value -> now): the lr is now constant after the warmup; lr at "
                                                     "iteration 20 is 1e-3 instead of 1e-6"),
], ids=["same", "longer-run-fixed-decay", "train-iters", "lr", "three-flags", "decay-iters", "constant"])
def test_schedule_change_message(now, expected):
    assert load.schedule_change_message(saved_config(schedule_config(20)), now, 20) == expected
    assert load.schedule_change_message(None, now, 20) is None


def test_fault_spec_parsing():
    faults = TestFaults.from_env(rank=1, environ={
        "MEGATRON_TEST_FAULT": "nan_at=3,6-8,10-:rank=1; kill_at=7:phase=backward; save_error_at=4; slow=0.5"})
    nan, kill, save_error, slow = faults.faults
    assert [i for i in range(1, 13) if nan.matches(i, 1)] == [3, 6, 7, 8, 10, 11, 12]
    assert not nan.matches(3, 0)
    assert (kill.kind, kill.iterations, kill.rank, kill.phase) == ("kill", ((7, 7),), None, "backward")
    assert (save_error.kind, save_error.phase) == ("save_error", "save")
    assert slow.seconds == 0.5
    with pytest.raises(ValueError, match="unknown fault 'explode_at'"):
        TestFaults.parse_one("explode_at=3")
    with pytest.raises(ValueError, match="unknown phase 'sideways'"):
        TestFaults.parse_one("kill_at=3:phase=sideways")
    with pytest.raises(RuntimeError, match="injected fault .* iteration 5, phase forward, rank 1"):
        TestFaults([TestFaults.parse_one("raise_at=5:rank=1")], rank=1).fire(5, "forward")
    TestFaults([TestFaults.parse_one("raise_at=5:rank=1")], rank=0).fire(5, "forward")  # another rank: nothing


def test_weights_load_into_another_pipeline_size_and_another_tp_size(tmp_path, single_rank):
    """A PP 2 checkpoint loads into a PP 1 model (every stage's file is read); a TP 2 one too (each tensor's TP
    slices concatenated along the partition dim its shard records)."""
    from megatron.checkpoint.convert import write_megatron_checkpoint
    from megatron.config import ModelConfig
    from megatron.model import BloomModel
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=16)
    torch.manual_seed(1)
    weights = BloomModel(config).state_dict()
    pp2 = write_megatron_checkpoint(str(tmp_path / "pp2"), weights, config, tp=1, pp=2, iteration=4)
    assert sorted(n for n in os.listdir(pp2) if n.startswith("model_")) == ["model_tp00_pp000.pt",
                                                                           "model_tp00_pp001.pt"]
    tp2 = write_megatron_checkpoint(str(tmp_path / "tp2"), weights, config, tp=2, pp=1, iteration=4)
    for folder in (pp2, tp2):
        model = BloomModel(config)
        load.load_model_weights(model, folder, config.num_layers, single_rank)
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, weights[name]), (folder, name)


class TPModule(nn.Module):
    """A column- then a row-parallel layer (TP 1 here): their parameters' partition dims are 0, 0, 1, None."""

    def __init__(self):
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        super().__init__()
        torch.manual_seed(0)
        self.up = ColumnParallelLinear(4, 8)
        self.down = RowParallelLinear(8, 4, input_is_parallel=True)

    def forward(self, x):
        return self.down(self.up(x)[0])[0]


def test_per_parameter_restore_equals_the_saved_state_and_records_the_layers_dims(tmp_path, single_rank,
                                                                                    monkeypatch):
    """The index names each parameter's partition dim as its layer sets it (also at TP 1); restoring a fresh
    engine through it (the path a layout change takes) gives the trained optimizer state bit for bit, and the
    next step is the same step."""
    from megatron.checkpoint.saved_optimizer import SavedOptimizer
    trained, fresh = FakeEngine(steps=3, module=TPModule), FakeEngine(module=TPModule)
    folder = save.save_checkpoint(trained, fake_config(tmp_path), single_rank, 3, 6)
    meta = {**read_meta(folder), "data_parallel_size": 1}
    source = SavedOptimizer(folder, meta)
    assert {name: source.partition_dim(name) for name in source.names()} == {
        "up.weight": 0, "up.bias": 0, "down.weight": 1, "down.bias": None}
    assert source.step == 3.0 and not source.has_fp32()
    load.load_model_weights(fresh.module, folder, 1, single_rank)
    assert optimizer_state.restore_from_parameters(fresh, source, 1, 0, 1, 0) == 4
    optimizer_state.restore_counters(fresh, torch.load(os.path.join(folder, "optimizer_tp00_pp000_dp00000.pt"),
                                                    weights_only=False))
    assert (fresh.global_steps, fresh.global_samples, fresh.lr_scheduler.num_steps) == (3, 6, 3)
    for p, q in zip(trained.module.parameters(), fresh.module.parameters()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(trained.optimizer.state[p][key], fresh.optimizer.state[q][key]), key
    x = torch.randn(2, 4)
    for engine in (trained, fresh):
        engine.module(x).sum().backward()
        engine.optimizer.step()
    for p, q in zip(trained.module.parameters(), fresh.module.parameters()):
        assert torch.equal(p, q)


# ---------------------------------------------------------------- every DeepSpeed wrapper, real engines

def _round_trips(rank, world_size, root, fixtures):
    """For each wrapper (tests/checkpoint_engines.py): an engine trained 3 steps and saved; a fresh engine resumed
    from that checkpoint (load.load_checkpoint, the same-layout path); both stepped once more. fp16 ZeRO 2's
    checkpoint also resumed without ZeRO (FP16_UnfusedOptimizer) and stepped once. And each FORMAT 2 checkpoint of
    tests/fixtures/format2 resumed, saved again (in today's format) and resumed once more."""
    from megatron.checkpoint.adapters import adapter_for
    from megatron.core import parallel_state
    from tests.checkpoint_engines import CASES, build_engine, configure, raw_state, train, weights
    state = parallel_state.initialize_model_parallel(1, 1)
    results = {}
    for case, (flags, _) in CASES.items():
        folder = os.path.join(root, case)
        config, ds_config = configure(folder, flags)
        trained = build_engine(case, config, ds_config, state)
        train(trained, 3)
        saved = save.save_checkpoint(trained, config, state, 3, 6)
        with open(os.path.join(saved, "index_tp00_pp000_dp00000.json")) as f:
            index = json.load(f)
        load_config, _ = configure(folder, flags, load=folder)
        resumed = build_engine(case, load_config, ds_config, state)
        untouched = raw_state(resumed)
        load.load_checkpoint(resumed, load_config, state)
        result = {"wrapper": type(trained.optimizer).__name__, "expected": raw_state(trained),
                  "got": raw_state(resumed), "untouched": untouched, "index": index,
                  "names": {name: tuple(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
                            for name, p in trained.module.named_parameters()}}
        unzeroed = None
        if case == "fp16-zero2":
            unzeroed_config, unzeroed_ds = configure(os.path.join(root, "fp16-unzeroed"), CASES["fp16-zero0"][0],
                                                     load=folder)
            unzeroed = build_engine("fp16-zero0", unzeroed_config, unzeroed_ds, state)
            load.load_checkpoint(unzeroed, unzeroed_config, state)
        train(trained, 1, first=3)
        train(resumed, 1, first=3)
        result.update(next_expected=weights(trained), next_got=weights(resumed))
        results[case] = result
        if unzeroed is not None:
            train(unzeroed, 1, first=3)
            results["fp16 zero2 and zero0, one step"] = {
                name: {"wrapper": type(engine.optimizer).__name__, "weights": weights(engine),
                       "grad_norm": float(engine.get_global_grad_norm()),
                       "scale": adapter.scaler().cur_scale, "skipped": engine.skipped_steps,
                       "state": {slot.name: {key: value.clone() for key, value in adapter.get(slot).items()}
                                 for slot in adapter.params()}}
                for name, engine in (("zero2", trained), ("zero0", unzeroed)) for adapter in [adapter_for(engine)]}
    for case in fixtures:  # written by the code before the adapters (FORMAT 2: DeepSpeed's state_dict + paths)
        flags = CASES[case][0]
        old = os.path.join(FIXTURES, case, "ckpt")
        config, ds_config = configure(os.path.join(root, "format2", case), flags, load=old)
        resumed = build_engine(case, config, ds_config, state)
        load.load_checkpoint(resumed, config, state)
        result = {"got": raw_state(resumed)}
        folder = save.save_checkpoint(resumed, config, state, 3, 6)  # today's format
        result["meta"] = read_meta(folder)
        config, ds_config = configure(os.path.join(root, "format2", case), flags, load=folder)
        again = build_engine(case, config, ds_config, state)
        load.load_checkpoint(again, config, state)
        result["again"] = raw_state(again)
        results["format2 " + case] = result
    torch.save(results, os.path.join(root, "results.pt"))


FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "format2")
FORMAT2_CASES = sorted(n for n in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, n))) \
    if os.path.isdir(FIXTURES) else []


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    from tests.distributed import run_distributed
    root = str(tmp_path_factory.mktemp("wrappers"))
    run_distributed(_round_trips, 1, root, FORMAT2_CASES)
    return torch.load(os.path.join(root, "results.pt"), weights_only=False)


def _differences(expected, got):
    assert sorted(expected) == sorted(got), (sorted(expected), sorted(got))
    return [label for label in expected if not (torch.equal(expected[label], got[label]) if
                                                torch.is_tensor(expected[label]) else expected[label] == got[label])]


def _case_ids():
    from tests.checkpoint_engines import CASES
    return sorted(CASES)


@pytest.mark.parametrize("case", _case_ids())
def test_every_wrapper_resumes_its_exact_state_from_a_checkpoint(round_trips, case):
    """Real engines, each wrapper: after save and load into a fresh engine, every fp32 master weight (or weight),
    Adam moment and step count the wrapper holds, the loss scaler and the step counters equal the trained
    engine's bit for bit, as DeepSpeed's own structures show them; the next step is the same step. The index names
    every parameter with the region the file holds (one process: the whole parameter)."""
    from tests.checkpoint_engines import CASES
    result = round_trips[case]
    assert result["wrapper"] == CASES[case][1]
    untouched = result["untouched"]  # the fresh engine's state differed before loading
    assert sorted(untouched) != sorted(result["expected"]) or _differences(result["expected"], untouched)
    assert _differences(result["expected"], result["got"]) == []
    assert _differences(result["next_expected"], result["next_got"]) == []
    names = result["names"]
    # Adam's step count as the wrapper keeps it: FP16_UnfusedOptimizer takes one zero-gradient step when built
    assert result["index"]["version"] == 2 and result["index"]["step"] == (4.0 if "zero0" in case and
                                                                            not case.startswith("fp32") else 3.0)
    assert {name: (tuple(entry["shape"]), entry["start"], entry["numel"])
            for name, entry in result["index"]["params"].items()} == {
        name: (shape, 0, int(torch.Size(shape).numel())) for name, shape in names.items()}
    assert {entry["fp32"] for entry in result["index"]["params"].values()} == {not case.startswith("fp32")}


def test_fp16_without_zero_takes_the_step_zero_takes(round_trips):
    """fp16 ZeRO 2's checkpoint resumed without ZeRO (FP16_UnfusedOptimizer): the next step, with gradients over
    --clip-grad (clipped), leaves every fp32 master weight, Adam moment and weight as ZeRO 2's step does, bit for
    bit, and reports the same gradient norm. Without the loss scaling megatron/checkpoint/adapters.py installs for
    that wrapper, Adam got its gradients divided by the loss scale and no clipping (measured: the first moments
    differed by up to 107% of their largest value, the second by 99.7%, the master weights by 19%). Bit for bit
    where the two wrappers' gradient norms agree to the last bit; where they differ in the last bits (the order of
    the fp32 sums follows the CPU's vector width: seen on an AMD EPYC host), the clip coefficient does too, so the
    state is compared to 1e-5 relative, four orders of magnitude inside the bug's differences."""
    result = round_trips["fp16 zero2 and zero0, one step"]
    zero2, zero0 = result["zero2"], result["zero0"]
    assert (zero2["wrapper"], zero0["wrapper"]) == ("DeepSpeedZeroOptimizer", "FP16_UnfusedOptimizer")
    assert zero2["skipped"] == zero0["skipped"] == 0 and zero2["scale"] == zero0["scale"] == 2048.0
    assert zero2["grad_norm"] > 1.0  # over --clip-grad 1.0: the step clips
    assert zero0["grad_norm"] == pytest.approx(zero2["grad_norm"], rel=1e-6)
    assert sorted(zero2["state"]) == sorted(zero0["state"])
    for name, expected in zero2["state"].items():
        assert sorted(expected) == sorted(zero0["state"][name]) == ["exp_avg", "exp_avg_sq", "fp32"], name
        for key, value in expected.items():
            if zero0["grad_norm"] == zero2["grad_norm"]:
                assert torch.equal(value, zero0["state"][name][key]), (name, key)
            else:
                torch.testing.assert_close(zero0["state"][name][key], value, rtol=1e-5, atol=1e-8,
                                           msg=lambda m: f"{name} {key}: {m}")
    if zero0["grad_norm"] == zero2["grad_norm"]:
        assert _differences(zero2["weights"], zero0["weights"]) == []
    else:
        assert sorted(zero2["weights"]) == sorted(zero0["weights"])
        for name, value in zero2["weights"].items():  # fp16: one rounding step of the weight at most (2^-10)
            torch.testing.assert_close(zero0["weights"][name].float(), value.float(), rtol=2e-3, atol=1e-7)


@pytest.mark.skipif(not FORMAT2_CASES, reason="no tests/fixtures/format2")
@pytest.mark.parametrize("case", FORMAT2_CASES)
def test_checkpoints_of_the_previous_format_still_resume_exactly(round_trips, case):
    """tests/fixtures/format2/<case>: checkpoints written by the code before the optimizer adapters (FORMAT 2:
    each rank's DeepSpeed state_dict, indexed by paths into it; tests/fixtures/format2/generate.py) with the
    state DeepSpeed held when they were saved. Resumed today, the state is the same bit for bit; saved again it is
    written in today's format, which resumes to the same state."""
    expected = torch.load(os.path.join(FIXTURES, case, "expected.pt"), weights_only=False)
    result = round_trips["format2 " + case]
    assert _differences(expected, result["got"]) == []
    assert result["meta"]["engine_state_version"] == optimizer_state.FORMAT == 3
    assert _differences(expected, result["again"]) == []
