"""A crash at every step of publishing a checkpoint, pruning and a tool's --force swap leaves a verified copy.

Each case runs the operation in a forked child that dies (os._exit: no cleanup, no finally) at the k-th named
step (io.crash_point), for k = 0, 1, ... until the child completes; after each crash the parent checks that a
verified checkpoint (or the old or new tool output) is there, then relaunches the operation to completion and
checks that nothing was lost and no leftover remains. Both renaming strategies run: the atomic swap
(renameat2 RENAME_EXCHANGE) and the two-rename fallback of file systems without it.
"""
import json
import os
from types import SimpleNamespace

import pytest

from megatron.checkpoint import io, save
from megatron.checkpoint.format import find_checkpoint, read_latest, tag_for, verify_checkpoint

CRASHED = 86


def crash_at(k, work):
    """Runs work() in a forked child that exits at its k-th crash point. Returns True if it crashed there,
    False if work() completed (fewer than k + 1 steps)."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery past this point
        code = 0
        seen = [0]

        def hook(step):
            if seen[0] == k:
                os._exit(CRASHED)
            seen[0] += 1

        io.crash_hook = hook
        try:
            work()
        except BaseException:  # noqa: BLE001 - reported by the exit code
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, CRASHED), f"the operation failed in the child (exit {code})"
    return code == CRASHED


@pytest.fixture(params=["swap", "two renames"])
def rename_mode(request, monkeypatch, tmp_path_factory):
    if request.param == "two renames":
        monkeypatch.setattr(io, "_exchange", lambda a, b: False)
    else:
        probe = tmp_path_factory.mktemp("probe")
        os.makedirs(probe / "a")
        os.makedirs(probe / "b")
        if not io._exchange(str(probe / "a"), str(probe / "b")):
            pytest.skip("this file system has no RENAME_EXCHANGE")
    return request.param


def fake_run(root, keep):
    """What write_and_publish reads of a run: the checkpoint section, the layout, the precision."""
    config = SimpleNamespace(
        checkpoint=SimpleNamespace(save=str(root), keep_last_n_checkpoints=keep, no_save_optim=True),
        training=SimpleNamespace(zero_stage=0), precision=SimpleNamespace(name="fp32"))
    state = SimpleNamespace(rank=0, world_size=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                            data_parallel_size=1)
    return config, state


def publish(root, iteration, content, keep=2):
    """A one-rank save of text files (no torch in the forked child) through the real write_and_publish."""
    config, state = fake_run(root, keep)
    objects = {"model_tp00_pp000.pt": f"weights {content}", "rng_rank00000.pt": f"rng {content}"}
    save.write_and_publish(objects, config, state, iteration, iteration * 8, comm=save.Comm())


def content_of(folder):
    with open(os.path.join(folder, "model_tp00_pp000.pt")) as f:
        return f.read().split()[1]


@pytest.fixture(autouse=True)
def plain_config_json(monkeypatch):
    monkeypatch.setattr(save.dataclasses, "asdict", lambda config: {"fake": True})


SCENARIOS = {
    # name: (checkpoints present before: {iteration: content}, `latest`, the iteration saved)
    "new iteration, an abandoned run's corrupt folder of the same number": ({1: "one", 2: "two", 3: "stale"}, 2, 3),
    "re-saving `latest`'s own iteration": ({1: "one", 2: "two", 3: "old"}, 3, 3),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_crash_at_every_step_of_publish_and_prune_leaves_a_verified_checkpoint(tmp_path, rename_mode, scenario):
    before, latest, iteration = SCENARIOS[scenario]
    steps = 0
    while True:
        root = tmp_path / f"k{steps}"
        for it, content in before.items():
            publish(root, it, content, keep=None)
        with open(root / "latest", "w") as f:
            f.write(tag_for(latest))
        if content_of(root / tag_for(3)) == "stale":  # the abandoned run's folder is corrupt
            os.truncate(root / tag_for(3) / "model_tp00_pp000.pt", 3)
        crashed = crash_at(steps, lambda: publish(root, iteration, "new"))
        folder = find_checkpoint(str(root))
        assert folder is not None and verify_checkpoint(folder) is None, (steps, os.listdir(root))
        assert content_of(folder) in (before[latest], "new"), (steps, folder)  # never the stale one, never none
        if not crashed:
            break
        publish(root, iteration, "new")  # the relaunch saves the same iteration again
        assert read_latest(str(root)) == tag_for(iteration)
        assert content_of(root / tag_for(iteration)) == "new"
        assert verify_checkpoint(str(root / tag_for(iteration))) is None
        assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000003", "latest"], (steps, os.listdir(root))
        steps += 1
    assert steps >= 5, steps  # files written, manifest, rename(s), latest, prune
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000003", "latest"]


def write_output(tmp, content):
    """What a conversion writes: weight files, an index and a nested folder with `latest`."""
    os.makedirs(os.path.join(tmp, "iter_0000005"))
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        with open(os.path.join(tmp, name), "w") as f:
            f.write(f"{name} {content}")
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"content": content}, f)
    with open(os.path.join(tmp, "iter_0000005", "weights.pt"), "w") as f:
        f.write(content)
    with open(os.path.join(tmp, "latest"), "w") as f:
        f.write("iter_0000005")


def tree(folder):
    """{relative path: text} of every file under folder."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name)) as f:
                out[os.path.relpath(os.path.join(root, name), folder)] = f.read()
    return out


def convert(out, content):
    with io.atomic_folder(str(out), force=True) as tmp:
        write_output(tmp, content)


def test_force_replaces_the_output_atomically_at_every_crash_point(tmp_path, rename_mode):
    old_tree = None
    steps = 0
    while True:
        parent = tmp_path / f"k{steps}"
        out = parent / "bloom_hf"
        convert(out, "old")
        old_tree = old_tree or tree(out)
        crashed = crash_at(steps, lambda: convert(out, "new"))
        if os.path.isdir(out):  # the old output whole, or the new one whole: never a mixture, never a part
            assert tree(out) in (old_tree, {k: v.replace("old", "new") for k, v in old_tree.items()}), steps
        else:  # two renames, between them: the old output whole under its trash name
            assert rename_mode == "two renames" and tree(io.trash_name(out)) == old_tree, steps
        if not crashed:
            break
        convert(out, "new")  # the tool run again
        assert tree(out) == {k: v.replace("old", "new") for k, v in old_tree.items()}
        assert sorted(os.listdir(parent)) == ["bloom_hf"], (steps, os.listdir(parent))
        steps += 1
    assert steps >= 2 and sorted(os.listdir(parent)) == ["bloom_hf"]


def test_tool_output_files_and_folders_are_fsynced_before_the_swap(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    out = tmp_path / "bloom_hf"
    convert(out, "old")
    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(io, "crash_hook", lambda step: synced.append(f"step: {step}"))
    convert(out, "new")
    written = synced.index("step: output written")  # the next step renames the folder into place
    swapped = next(i for i, entry in enumerate(synced) if entry in ("step: swapped", "step: old set aside"))
    tmp = next(p for p in synced if os.path.basename(p).startswith(".tmp_bloom_hf-"))
    before = {os.path.relpath(p, tmp) for p in synced[:written] if p.startswith(tmp)}
    assert {*tree(out), ".", "iter_0000005"} <= before, before  # every file and folder, before the rename
    assert str(tmp_path) in synced[written:swapped]  # the parent, after the rename
    assert tree(out)["iter_0000005/weights.pt"] == "new"


def test_the_manifest_lists_what_the_ranks_reported_not_what_the_folder_holds(tmp_path):
    """A file a rank wrote that vanished before rank 0 published (a write lost by the file system) makes the
    checkpoint fail verification; a stray file nobody reported is not listed."""
    config, state = fake_run(tmp_path, None)

    def lose_one_and_add_a_stray(folder):
        os.remove(os.path.join(folder, "rng_rank00000.pt"))
        with open(os.path.join(folder, "stray.txt"), "w") as f:
            f.write("not written by the save")

    objects = {"model_tp00_pp000.pt": "weights", "rng_rank00000.pt": "rng"}
    folder, written = save.write_and_publish(objects, config, state, 2, 16, on_written=lose_one_and_add_a_stray)
    with open(os.path.join(folder, "manifest.json")) as f:
        listed = json.load(f)["files"]
    assert sorted(listed) == ["config.json", "meta.json", "model_tp00_pp000.pt", "rng_rank00000.pt"]
    assert listed["model_tp00_pp000.pt"]["size"] == len("weights") and written == len("weights") + len("rng")
    assert verify_checkpoint(folder) == f"{os.path.join(folder, 'rng_rank00000.pt')} is missing"


def test_a_finished_run_is_recognised_by_iterations_or_by_samples():
    from megatron.checkpoint.load import finished_message

    def run(train_iters, train_samples=None):
        return SimpleNamespace(training=SimpleNamespace(train_iters=train_iters),
                               upstream=SimpleNamespace(train_samples=train_samples),
                               checkpoint=SimpleNamespace(load="ckpt"))

    meta = {"iteration": 12, "consumed_samples": 96}
    assert finished_message(meta, run(12)) == ("--load ckpt: the run is finished (checkpoint at iteration 12, "
                                               "--train-iters 12); nothing to train or save")
    assert finished_message(meta, run(13)) is None  # one more iteration to train
    assert finished_message(meta, run(20, train_samples=96)) == (
        "--load ckpt: the run is finished (checkpoint at 96 consumed samples, --train-samples 96); nothing to train "
        "or save")
    assert finished_message(meta, run(20, train_samples=97)) is None
