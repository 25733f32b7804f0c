"""What a user sees from multi-process launches (CPU, gloo): one error line per job, not one per process; no
DeepSpeed noise at the default --log-level (all of it at debug); no DeepSpeed shared-memory file left in
/dev/shm by a finished or a killed run.

What remains from the launchers themselves on a failure (outside our processes): the deepspeed launcher's
INFO lines (its command, one line per process spawned and killed) and one `[ERROR] ... exits with return
code = 2` line naming the command (`deepspeed --quiet` leaves only that line); torchrun's failure summary.
"""
import subprocess
from pathlib import Path

import pytest

from tests.launch import DEEPSPEED, PYTHON, ROOT, TINY_MODEL, _free_port, env, run_pretrain

TORCHRUN = str(Path(PYTHON).parent / "torchrun")
TRAIN = TINY_MODEL + ["--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
                      "--mock-vocab-size", "1000", "--log-interval", "1", "--eval-iters", "0", "--bf16"]
# DeepSpeed's and torch's lines that used to bury ours (issue 13, item 5).
NOISE = ["BF16 gradient accumulation is not safe", "begin bf16_optimizer", "MA 0.", "CPU Virtual Memory",
         "Using topology", "SEED_LAYERS", "all_gather_into_tensor", "is deprecated", "c10d::broadcast_",
         "autograd kernel was not registered", "built successfully", "Setting accelerator to CPU", "DeepSpeed info"]


def _lines_with(text, needle):
    return [line for line in text.splitlines() if needle in line]


@pytest.mark.slow
def test_bad_flag_on_four_processes_is_one_line():
    proc = run_pretrain(["--misspeled-flag"] + TRAIN, nproc=4, check=False, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2
    assert _lines_with(out, "unrecognized arguments") == [
        _lines_with(proc.stderr, "ERROR megatron")[0]]
    assert _lines_with(out, "ERROR megatron")[0].endswith(
        "ERROR megatron: unrecognized arguments: --misspeled-flag; see pretrain_bloom.py --help")
    assert "usage:" not in out


@pytest.mark.slow
def test_layout_error_under_torchrun_is_one_line_and_every_rank_exits_2():
    cmd = [TORCHRUN, "--nproc_per_node", "4", "--master_port", str(_free_port()), str(ROOT / "pretrain_bloom.py"),
           "--tensor-model-parallel-size", "3"] + TRAIN
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    errors = _lines_with(out, "processes per model replica")
    assert len(errors) == 1 and errors[0].endswith(
        "ERROR megatron: --tensor-model-parallel-size 3 x --pipeline-model-parallel-size 1 = 3 processes per model "
        "replica, which does not divide the 4 processes launched; launch a multiple of 3 processes or pick a layout "
        "that fits 4: TP 1 x PP 1, TP 1 x PP 2, TP 1 x PP 4, TP 2 x PP 1, TP 2 x PP 2, TP 4 x PP 1"), out[-3000:]
    # torchrun's own summary: the reporting rank and the three it stopped, all with our exit code
    assert len(_lines_with(out, "exitcode  : 2")) == 4, out[-3000:]


@pytest.mark.slow
def test_bf16_pipeline_run_shows_only_our_lines_and_leaves_no_shm():
    proc = run_pretrain(TRAIN + ["--pipe-parallel-size", "2", "--global-batch-size", "4"], nproc=2)
    out = proc.stdout + proc.stderr
    assert [n for n in NOISE if n in out] == [], out[-4000:]
    iterations = _lines_with(proc.stderr, "INFO megatron.training: iteration ")
    assert len(iterations) == 3 and all(line.endswith(" |") for line in iterations)
    assert "TFLOP/s" not in out and "MFU" not in out and "GiB" not in out  # CPU: no such figures
    assert proc.shm_left == []


@pytest.mark.slow
def test_debug_level_shows_deepspeed_and_a_killed_run_leaves_no_shm():
    proc = run_pretrain(TRAIN + ["--global-batch-size", "8", "--zero-stage", "1", "--log-level", "debug"], nproc=2,
                        faults="kill_at=2:rank=1", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "SIGKILL at iteration 2" in proc.stderr, out[-3000:]
    assert "DeepSpeed info: version=" in proc.stdout and "Creating torch.bfloat16 ZeRO stage 1 optimizer" in out
    assert "`torch.distributed.all_gather_into_tensor` is deprecated" in proc.stderr
    assert "built successfully" in proc.stdout
    assert proc.shm_left == []  # the killed rank's and the one the launcher stopped
