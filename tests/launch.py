"""Runs pretrain_bloom.py (and tools) in subprocesses through the deepspeed launcher, on CPU with gloo."""
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
DEEPSPEED = str(Path(PYTHON).parent / "deepspeed")
TOKENIZER = ROOT / "examples" / "tokenizer"
TEST_LAUNCHER = ROOT / "tests" / "pretrain_under_test.py"

TINY_MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--max-position-embeddings", "32"]


def env(extra=None):
    e = dict(os.environ)
    e.setdefault("DS_ACCELERATOR", "cpu")
    e.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra or {})
    return e


def _cleanup_shm(port):
    """Removes the shared-memory buffers the job on `port` left (none, since pretrain_bloom unlinks its own;
    other jobs may be starting right now) and returns their paths."""
    left = sorted(glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"))
    for path in left:
        try:
            os.remove(path)
        except OSError:
            pass
    return left


def run_pretrain(args, nproc=1, extra_env=None, timeout=600, check=True, faults=None, fp16_on_cpu=False):
    """`deepspeed --num_gpus nproc pretrain_bloom.py args` (plain python for one process). The result's
    `shm_left` lists the /dev/shm buffers the job left behind (removed here).

    faults (a MEGATRON_TEST_FAULT spec, tests/faults.py) or fp16_on_cpu: the job runs tests/pretrain_under_test.py,
    pretrain_bloom.main with those faults as a training callback and DeepSpeed's CPU fp16 check answered yes."""
    port = _free_port()
    script, extra_env = launcher_for(faults, fp16_on_cpu, extra_env)
    if nproc == 1:
        cmd = [PYTHON, str(script)] + list(args)
        extra_env = {"MASTER_PORT": str(port), **(extra_env or {})}
    else:
        cmd = [DEEPSPEED, "--num_gpus", str(nproc), "--master_port", str(port),
               str(script)] + list(args)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env(extra_env), capture_output=True, text=True, timeout=timeout)
    finally:
        shm_left = _cleanup_shm(port)
    proc.shm_left = shm_left
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def launcher_for(faults=None, fp16_on_cpu=False, extra_env=None):
    """(script, environment additions) for a pretrain run with test faults and/or fp16 on CPU."""
    if faults is None and not fp16_on_cpu:
        return ROOT / "pretrain_bloom.py", extra_env
    extra = dict(extra_env or {})
    if faults is not None:
        extra["MEGATRON_TEST_FAULT"] = faults
    if fp16_on_cpu:
        extra["MEGATRON_TEST_FP16_ON_CPU"] = "1"
    return TEST_LAUNCHER, extra


def run_tool(script, args, timeout=600, check=True):
    cmd = [PYTHON, str(ROOT / script)] + [str(a) for a in args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def _free_port():
    from tests.distributed import free_port
    return free_port()


def read_losses(metrics_file, kind="train", field="lm_loss"):
    """{iteration: lm loss} (or another field of the record) from a metrics JSONL written with --log-interval 1."""
    losses = {}
    with open(metrics_file) as f:
        for line in f:
            record = json.loads(line)
            if record["kind"] == kind:
                losses[record["iteration"]] = record[field]
    return losses
