"""Faults during real 2-process runs (deepspeed launcher, CPU, gloo): kill -9 anywhere, a failed save, corrupt
checkpoints, SIGTERM/SIGINT, NaN losses in bf16/fp32/fp16, one rank raising. Faults are injected through
MEGATRON_TEST_FAULT, which tests/pretrain_under_test.py turns into a training callback (tests/faults.py); every
relaunch uses the same command line.
"""
import json
import math
import os
import re
import signal
import subprocess
import time

import pytest

from megatron.checkpoint.format import file_crc32, read_latest, verify_checkpoint
from tests.launch import DEEPSPEED, ROOT, TEST_LAUNCHER, TINY_MODEL, TOKENIZER, _cleanup_shm, _free_port, env, \
    read_losses, run_pretrain

ITERS = 12


def args(sample_data, out, *extra, iters=ITERS):
    return TINY_MODEL + [
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-decay-iters", str(ITERS), "--warmup", "3",
        "--clip-grad", "1.0", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--data-path", sample_data, "--split", "98,2,0", "--vocab-file", str(TOKENIZER / "vocab.json"),
        "--merge-file", str(TOKENIZER / "merges.txt"), "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "1", "--metrics-file", str(out / "metrics.jsonl"), "--deepspeed", *extra]


def resumable(sample_data, out, *extra):
    """The one command every launch of a fault test uses: --load = --save, so the first launch starts fresh."""
    save = str(out / "ckpt")
    return args(sample_data, out, "--save", save, "--load", save, *extra)


def all_records(metrics_file):
    """Every train record, in order (a resumed run logs some iterations a second time)."""
    with open(metrics_file) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "train"]


def assert_same_curve(metrics_file, expected, iterations=range(1, ITERS + 1)):
    records = all_records(metrics_file)
    assert sorted({r["iteration"] for r in records}) == list(iterations)
    for record in records:  # also the iterations logged before a kill and again after the relaunch
        assert record["lm_loss"] == pytest.approx(expected[record["iteration"]], abs=1e-6), record


def tmp_folders(save):
    return [name for name in os.listdir(save) if name.startswith(".tmp")]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, sample_data):
    """Iteration -> loss of the uninterrupted 2-process run."""
    out = tmp_path_factory.mktemp("straight")
    run_pretrain(args(sample_data, out), 2)
    return read_losses(out / "metrics.jsonl")


@pytest.mark.slow
def test_kill_anywhere_failed_save_and_corrupt_checkpoint_then_relaunch_continues_exactly(
        tmp_path, sample_data, straight):
    cmd = resumable(sample_data, tmp_path, "--save-interval", "2", "--keep-last-n-checkpoints", "2")
    save = tmp_path / "ckpt"
    steps = [  # (fault, the checkpoint `latest` names afterwards)
        ("kill_at=3:rank=1:phase=forward", "iter_0000002"),  # first launch: --load names an empty folder
        ("save_error_at=4:rank=1", "iter_0000002"),  # resumes at 2; saving 4 fails on rank 1
        ("kill_at=5:rank=0:phase=backward", "iter_0000004"),
        ("kill_at=7:rank=1:phase=step", "iter_0000006"),
        ("kill_at=8:rank=0:phase=save", "iter_0000006"),  # dies after writing its files, before the manifest
    ]
    for spec, latest in steps:
        proc = run_pretrain(cmd, 2, faults=spec, check=False, timeout=120)
        assert proc.returncode != 0, spec
        assert read_latest(str(save)) == latest, (spec, proc.stderr[-3000:])
        assert verify_checkpoint(str(save / latest)) is None
        if spec.startswith("save_error"):
            assert "writing checkpoint iter_0000004 failed on rank 1 while writing its files (OSError" in proc.stderr
            assert "`latest` still names iter_0000002" in proc.stderr
            assert tmp_folders(save) == []
        else:
            assert "SIGKILL at iteration" in proc.stderr
    assert tmp_folders(save) == [".tmp_iter_0000008"]

    shard = save / "iter_0000006" / "model_tp00_pp000.pt"
    os.truncate(shard, os.path.getsize(shard) // 2)
    final = run_pretrain(cmd, 2, timeout=120)
    assert "skipping checkpoint iter_0000006" in final.stderr and "truncated" in final.stderr
    assert f"resumed from {save / 'iter_0000004'} at iteration 4" in final.stderr
    assert "removed" in final.stderr and ".tmp_iter_0000008" in final.stderr
    assert read_latest(str(save)) == "iter_0000012"
    assert sorted(os.listdir(save)) == ["iter_0000010", "iter_0000012", "latest"]
    assert_same_curve(tmp_path / "metrics.jsonl", straight)


def _default_signals():
    """SIGINT and SIGTERM as a terminal gives them: a shell that runs the tests in the background (`cmd &`, nohup)
    leaves SIGINT ignored, which the launched job would inherit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Job:
    """The deepspeed launcher in its own session, so that a test can signal one worker or the whole group."""

    def __init__(self, argv, faults):
        self.port = _free_port()
        cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(self.port), str(TEST_LAUNCHER)]
        self.proc = subprocess.Popen(cmd + argv, cwd=ROOT, env=env({"MEGATRON_TEST_FAULT": faults}),
                                     stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True,
                                     preexec_fn=_default_signals)

    def worker(self, local_rank):
        import psutil
        deadline = time.time() + 60
        while time.time() < deadline:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    cmdline = child.cmdline()
                except psutil.NoSuchProcess:
                    continue
                if f"--local_rank={local_rank}" in cmdline and any("pretrain_under_test" in c for c in cmdline):
                    return child.pid
            time.sleep(0.1)
        raise AssertionError(f"worker {local_rank} not found")

    def wait_for_iteration(self, metrics_file, iteration, timeout=90):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if os.path.isfile(metrics_file) and any(r["iteration"] >= iteration for r in all_records(metrics_file)):
                return
            assert self.proc.poll() is None, self.proc.communicate()[1][-3000:]
            time.sleep(0.05)
        raise AssertionError(f"iteration {iteration} not reached in {timeout} s")

    def finish(self, timeout=120):
        """Waits for the launcher and every process holding its output (the workers), then cleans up."""
        try:
            stdout, stderr = self.proc.communicate(timeout=timeout)
        finally:
            _cleanup_shm(self.port)
        return self.proc.returncode, stdout, stderr


def stopped_at(stderr):
    lines = [line for line in stderr.splitlines() if "training stopped at iteration" in line]
    assert lines, stderr[-3000:]
    return int(lines[-1].split("training stopped at iteration")[1].split()[0])


@pytest.mark.slow
def test_sigterm_to_a_worker_saves_at_the_next_boundary_exits_0_and_resumes_exactly(
        tmp_path, sample_data, straight):
    cmd = resumable(sample_data, tmp_path, "--exit-signal-handler")
    job = Job(cmd, "slow=0.2")
    job.wait_for_iteration(tmp_path / "metrics.jsonl", 3)
    os.kill(job.worker(1), signal.SIGTERM)  # what a scheduler's preemption notice does to one process
    returncode, _, stderr = job.finish()
    assert returncode == 0, stderr[-3000:]
    iteration = stopped_at(stderr)
    assert 3 <= iteration < ITERS and "(exit signal)" in stderr
    assert read_latest(str(tmp_path / "ckpt")) == f"iter_{iteration:07d}"
    assert verify_checkpoint(str(tmp_path / "ckpt" / f"iter_{iteration:07d}")) is None

    run_pretrain(cmd, 2, timeout=120)
    assert_same_curve(tmp_path / "metrics.jsonl", straight)


@pytest.mark.slow
def test_sigint_to_the_whole_job_saves_on_every_rank(tmp_path, sample_data):
    """Ctrl-C (SIGINT to the launcher's process group): the workers save at the next boundary and exit 0; the
    deepspeed runner itself is killed by the SIGINT (its behaviour, see docs/FAULTS.md)."""
    job = Job(resumable(sample_data, tmp_path, "--exit-signal-handler"), "slow=0.2")
    job.wait_for_iteration(tmp_path / "metrics.jsonl", 2)
    os.killpg(job.proc.pid, signal.SIGINT)
    returncode, _, stderr = job.finish()
    iteration = stopped_at(stderr)
    assert read_latest(str(tmp_path / "ckpt")) == f"iter_{iteration:07d}"
    assert verify_checkpoint(str(tmp_path / "ckpt" / f"iter_{iteration:07d}")) is None
    assert stderr.count("(exit signal)") == 1  # rank 0 logs it; rank 1 stopped at the same boundary
    # the `deepspeed` runner has no SIGINT handler on one node: it dies of the KeyboardInterrupt (Python re-raises
    # SIGINT on exit), whatever its workers did; the workers themselves saved and exited 0
    assert returncode == -signal.SIGINT


# fp32 without ZeRO: our NonFiniteGuard (2 processes, the NaN on rank 1 only); bf16 ZeRO-1: DeepSpeed's check;
# bf16 ZeRO 0: FP16_UnfusedOptimizer, whose non-finite gradient norm is its overflow test (megatron/optimizer/unfused.py)
NAN_LAYOUTS = [("fp32-zero0-dp2", 2, 1, []), ("bf16-zero1", 1, 0, ["--bf16", "--zero-stage", "1"]),
               ("bf16-zero0", 1, 0, ["--bf16"])]


@pytest.mark.slow
@pytest.mark.parametrize("name,nproc,rank,flags", NAN_LAYOUTS, ids=[layout[0] for layout in NAN_LAYOUTS])
def test_nan_skips_the_update_and_stops_after_max_nan_iterations(tmp_path, sample_data, straight, name, nproc, rank,
                                                                 flags):
    # NaN at iteration 3 (one bad iteration), then from iteration 6 on (never recovers)
    cmd = resumable(sample_data, tmp_path, "--save-interval", "2", "--max-nan-iterations", "3", *flags)
    proc = run_pretrain(cmd, nproc, faults=f"nan_at=3,6-:rank={rank}", check=False, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    records = {r["iteration"]: r for r in all_records(tmp_path / "metrics.jsonl")}
    assert sorted(records) == list(range(1, 9))
    if name == "fp32-zero0-dp2":  # the straight run's command and layout: the same losses before the fault
        assert [records[it]["lm_loss"] for it in (1, 2)] == pytest.approx([straight[1], straight[2]], abs=1e-6)
    for it in (1, 2, 4, 5):  # the update of iteration 3 was not applied: the weights stayed finite
        assert math.isfinite(records[it]["lm_loss"]) and records[it]["lm_loss"] < 20, records[it]
    assert records[5]["skipped_iterations"] == 1 and records[5]["nan_iterations"] == 1
    assert records[8]["skipped_iterations"] == 4 and records[8]["nan_iterations"] == 4
    assert records[4]["lr"] > records[3]["lr"] == records[2]["lr"]  # the LR schedule waited for iteration 3
    message = [line for line in proc.stderr.splitlines() if "ERROR" in line and "iterations in a row" in line]
    assert message, proc.stderr[-3000:]
    for words in ("at iteration 8, 3 iterations in a row (--max-nan-iterations 3)", "learning rate", "--bf16",
                  "--clip-grad", "iter_0000004", "is intact"):
        assert words in message[0]
    save = tmp_path / "ckpt"
    assert read_latest(str(save)) == "iter_0000004"  # nothing saved at 6 (non-finite) nor at the stop
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000002", "iter_0000004"]
    assert verify_checkpoint(str(save / "iter_0000004")) is None and tmp_folders(save) == []


@pytest.mark.slow
def test_fp16_nan_is_skipped_by_the_loss_scaler_and_training_continues(tmp_path, sample_data):
    cmd = args(sample_data, tmp_path, "--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1", iters=6)
    proc = run_pretrain(cmd, 1, faults="nan_at=3", fp16_on_cpu=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["iteration"]: r for r in all_records(tmp_path / "metrics.jsonl")}
    assert records[3]["skipped_iterations"] == records[2]["skipped_iterations"] + 1
    assert records[3]["loss_scale"] == records[2]["loss_scale"] / 2  # the dynamic loss scaler backed off
    assert records[3]["nan_iterations"] == 1
    assert all(records[it]["lm_loss"] < 20 for it in (4, 5, 6))  # training went on with finite weights


@pytest.mark.slow
def test_one_rank_raising_stops_the_whole_job(tmp_path, sample_data):
    start = time.time()
    proc = run_pretrain(args(sample_data, tmp_path), 2, faults="raise_at=3:rank=1", check=False,
                        timeout=120)
    elapsed = time.time() - start
    assert proc.returncode != 0 and elapsed < 90
    first_error = next(line for line in proc.stderr.splitlines() if re.search(r"\w+Error: ", line))
    assert "RuntimeError: injected fault" in first_error and "rank 1" in first_error, proc.stderr[-3000:]


def test_unwritable_save_is_refused_at_start_up(tmp_path, sample_data):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    proc = run_pretrain(args(sample_data, tmp_path, "--save", str(a_file / "ckpt")), 1, check=False, timeout=120)
    assert proc.returncode == 2
    assert f"--save {a_file / 'ckpt'} is not writable" in proc.stderr


def files_state(folder):
    """{relative path: (mtime_ns, CRC32)} of every file under folder."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = (os.stat(path).st_mtime_ns, file_crc32(path))
    return out


@pytest.mark.slow
def test_async_save_killed_mid_write_resumes_exactly_and_relaunching_the_finished_run_writes_nothing(
        tmp_path, sample_data, straight):
    cmd = resumable(sample_data, tmp_path, "--save-interval", "2", "--keep-last-n-checkpoints", "2", "--async-save")
    save = tmp_path / "ckpt"
    # rank 1 dies in the background writer of iteration 6, its files written, before the manifest
    proc = run_pretrain(cmd, 2, faults="kill_at=6:rank=1:phase=save", check=False, timeout=120)
    assert proc.returncode != 0 and "SIGKILL at iteration 6, phase save, rank 1" in proc.stderr, proc.stderr[-3000:]
    assert "checkpoint snapshot at iteration 4" in proc.stderr
    assert "checkpoint iteration 4 written in the background" in proc.stderr
    assert read_latest(str(save)) == "iter_0000004" and verify_checkpoint(str(save / "iter_0000004")) is None

    final = run_pretrain(cmd, 2, timeout=120)
    assert f"resumed from {save / 'iter_0000004'} at iteration 4" in final.stderr
    assert read_latest(str(save)) == "iter_0000012"
    assert sorted(os.listdir(save)) == ["iter_0000010", "iter_0000012", "latest"]
    assert_same_curve(tmp_path / "metrics.jsonl", straight)  # async snapshots resume exactly as sync ones

    before, records = files_state(save), len(all_records(tmp_path / "metrics.jsonl"))
    again = run_pretrain(cmd, 2, timeout=120)
    assert again.returncode == 0
    said = [line for line in again.stderr.splitlines() if "finished" in line]
    assert len(said) == 1 and said[0].endswith(
        f"--load {save}: the run is finished (checkpoint at iteration 12, --train-iters 12); nothing to train or "
        "save"), said
    assert files_state(save) == before and sorted(os.listdir(save)) == ["iter_0000010", "iter_0000012", "latest"]
    assert len(all_records(tmp_path / "metrics.jsonl")) == records
