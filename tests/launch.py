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
FAULT_LAUNCHER = ROOT / "tests" / "train_with_faults.py"

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


def run_pretrain(args, nproc=1, extra_env=None, timeout=600, check=True, faults=None):
    """`deepspeed --num_gpus nproc pretrain_bloom.py args` (plain python for one process). The result's
    `shm_left` lists the /dev/shm buffers the job left behind (removed here).

    faults: a MEGATRON_TEST_FAULT spec (tests/faults.py); the job then runs tests/train_with_faults.py, which is
    pretrain_bloom.main with those faults as a training callback."""
    port = _free_port()
    script = ROOT / "pretrain_bloom.py"
    if faults is not None:
        script = FAULT_LAUNCHER
        extra_env = {**(extra_env or {}), "MEGATRON_TEST_FAULT": faults}
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


def run_tool(script, args, timeout=600, check=True):
    cmd = [PYTHON, str(ROOT / script)] + [str(a) for a in args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def _free_port():
    from tests.distributed import free_port
    return free_port()


def read_losses(metrics_file, kind="train"):
    """{iteration: lm loss} from a metrics JSONL written with --log-interval 1."""
    losses = {}
    with open(metrics_file) as f:
        for line in f:
            record = json.loads(line)
            if record["kind"] == kind:
                losses[record["iteration"]] = record["lm_loss"]
    return losses
