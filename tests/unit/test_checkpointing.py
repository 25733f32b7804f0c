"""Checkpoint folders: manifest verification, fallback, stale .tmp folders, pruning, failed saves, --save checks."""
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron import checkpointing
from megatron.checkpointing import CheckpointError, find_checkpoint, tag_for, verify_checkpoint
from megatron.core import parallel_state
from megatron.fault_injection import Fault, TestFaults


def make_checkpoint(root, iteration, latest=True):
    """A complete checkpoint folder with two small files, a manifest and (optionally) `latest`."""
    folder = os.path.join(root, tag_for(iteration))
    os.makedirs(folder)
    torch.save({"w": torch.arange(100.0) + iteration}, os.path.join(folder, "model_tp00_pp000.pt"))
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"iteration": iteration}, f)
    checkpointing.write_manifest(folder, iteration)
    if latest:
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(tag_for(iteration))
    return folder


def test_complete_checkpoint_verifies(tmp_path):
    assert verify_checkpoint(make_checkpoint(tmp_path, 2)) is None


@pytest.mark.parametrize("damage,expected", [
    ("truncate", "truncated"), ("flip", "checksum"), ("no_manifest", "missing (the save did not finish)"),
    ("bad_manifest", "unreadable"), ("empty_manifest", "lists no files"), ("delete", "is missing")])
def test_damaged_checkpoint_is_reported_by_name(tmp_path, damage, expected):
    folder = make_checkpoint(tmp_path, 2)
    shard = os.path.join(folder, "model_tp00_pp000.pt")
    manifest = os.path.join(folder, "manifest.json")
    if damage == "truncate":
        os.truncate(shard, os.path.getsize(shard) // 2)
    elif damage == "flip":
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) - 3)
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
    reason = verify_checkpoint(folder)
    assert reason is not None and expected in reason, reason
    assert ("model_tp00_pp000.pt" in reason) or ("manifest.json" in reason), reason


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
    assert checkpointing.remove_stale_tmp(str(tmp_path)) == [".tmp_iter_0000004"]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest"]


def test_prune_keeps_the_new_checkpoint_and_leaves_newer_abandoned_ones(tmp_path, caplog):
    for it in (2, 4, 6, 10):
        make_checkpoint(tmp_path, it)
    checkpointing._prune(str(tmp_path), 2, "iter_0000006")
    assert checkpointing.list_checkpoints(str(tmp_path)) == ["iter_0000010", "iter_0000006", "iter_0000004"]
    assert "newer than iter_0000006" in caplog.text


class FakeEngine:
    """The parts of a DeepSpeed engine that save_checkpoint touches: save_checkpoint and module."""

    def __init__(self):
        self.module = nn.Linear(4, 4)

    def save_checkpoint(self, root, tag, save_latest, exclude_frozen_parameters):
        torch.save(self.module.state_dict(), os.path.join(root, tag, "mp_rank_00_model_states.pt"))


@pytest.fixture
def single_rank():
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()


def fake_config(root, keep=None):
    return SimpleNamespace(
        checkpoint=SimpleNamespace(save=str(root), keep_last_n_checkpoints=keep, no_save_optim=False),
        model=SimpleNamespace(num_layers=1), training=SimpleNamespace(zero_stage=0),
        precision=SimpleNamespace(name="fp32"))


def test_save_is_atomic_removes_stale_tmp_and_prunes_after_completion(tmp_path, single_rank, monkeypatch):
    monkeypatch.setattr(checkpointing.dataclasses, "asdict", lambda config: {"fake": True})
    engine, config = FakeEngine(), fake_config(tmp_path, keep=2)
    os.makedirs(tmp_path / ".tmp_iter_0000003")  # left by a crash
    for it in (1, 2, 3):
        folder = checkpointing.save_checkpoint(engine, config, it, it * 8)
        assert verify_checkpoint(folder) is None
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000003", "latest"]
    assert checkpointing.read_latest(str(tmp_path)) == "iter_0000003"


def test_failed_save_leaves_latest_and_previous_checkpoint(tmp_path, single_rank, monkeypatch):
    monkeypatch.setattr(checkpointing.dataclasses, "asdict", lambda config: {"fake": True})
    engine, config = FakeEngine(), fake_config(tmp_path, keep=1)
    checkpointing.save_checkpoint(engine, config, 2, 16)
    before = sorted(os.listdir(tmp_path / "iter_0000002"))
    faults = TestFaults([Fault("save_error", ((4, 4),), phase="save")])
    with pytest.raises(CheckpointError, match=r"--save .*iter_0000004 failed on rank 0 while writing its files "
                                              r"\(OSError: .*No space left.*`latest` still names iter_0000002"):
        checkpointing.save_checkpoint(engine, config, 4, 32, fault_hook=lambda stage: faults.fire(4, "save"))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "latest"]
    assert sorted(os.listdir(tmp_path / "iter_0000002")) == before
    assert verify_checkpoint(str(tmp_path / "iter_0000002")) is None
    assert checkpointing.read_latest(str(tmp_path)) == "iter_0000002"


def test_save_dir_checks_name_the_flag(tmp_path, monkeypatch):
    assert checkpointing.check_save_dir(str(tmp_path / "new"), 1) > 0
    assert os.listdir(tmp_path / "new") == []  # the probe file is gone
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"^--save .*file/ckpt is not writable"):
        checkpointing.check_save_dir(str(a_file / "ckpt"), 1)
    monkeypatch.setattr(checkpointing.shutil, "disk_usage", lambda path: SimpleNamespace(free=2**30))
    needed = checkpointing.checkpoint_bytes(176_000_000_000 // 64, "bf16")
    with pytest.raises(ValueError, match=r"^--save .*: 1.00 GiB free, a checkpoint needs about 40.98 GiB"):
        checkpointing.check_save_dir(str(tmp_path), needed)


def test_checkpoint_bytes():
    assert checkpointing.checkpoint_bytes(1000, "fp32") == 1000 * (2 * 4 + 8)
    assert checkpointing.checkpoint_bytes(1000, "bf16") == 1000 * (2 * 2 + 12)
    assert checkpointing.checkpoint_bytes(1000, "fp16", no_save_optim=True) == 1000 * 4


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
