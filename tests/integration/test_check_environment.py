"""tools/check_environment.py on the CPU (one table, < 30 s, non-zero when broken) and --collectives under
torchrun and the deepspeed launcher (gloo): bandwidths as nccl-tests defines them, values checked, and a broken
collective (the test hook) named in one line instead of hanging. tools/plan_layout.py refuses an impossible layout
with pretrain_bloom.py's own message."""
import json
import os
import subprocess
import time

import pytest

from tests.distributed import free_port
from tests.launch import DEEPSPEED, PYTHON, ROOT, TINY_MODEL, env

TOOL = str(ROOT / "tools" / "check_environment.py")
TORCHRUN = str(ROOT / ".venv" / "bin" / "torchrun")


def run(cmd, extra_env=None, timeout=120):
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env(extra_env), capture_output=True, text=True, timeout=timeout)
    proc.seconds = time.perf_counter() - start
    return proc


def test_environment_table_on_cpu(tmp_path):
    proc = run([PYTHON, TOOL, "--save", str(tmp_path / "checkpoints")])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    rows = {line.split("  ")[0].strip(): line for line in lines}
    assert "ok" in rows["gloo (CPU path)"] and "2-process all-reduce correct" in rows["gloo (CPU path)"]
    assert "MB/s (256 MiB with fsync)" in rows["--save write speed"]
    assert "CUDA-only" in rows["fused kernels"] and "not available" in rows["CUDA"]
    assert lines[-1].startswith("ready")
    assert proc.seconds < 30, f"{proc.seconds:.1f} s"
    assert not any(name.startswith(".check_environment") for name in os.listdir(tmp_path))  # nothing left


def test_environment_table_reports_a_broken_save_folder(tmp_path, monkeypatch, capsys):
    """In-process (the gloo check, covered above, left out): a --save under a file is a FAIL and exit 1."""
    from megatron.planning import check_cli, environment
    monkeypatch.setattr(environment, "check_gloo", lambda: [])
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        check_cli.main(["--save", str(blocker / "checkpoints")])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert f"FAIL  {blocker / 'checkpoints'}: {blocker} is a file, so the folder cannot be created" in out
    assert out.splitlines()[-1].startswith("BROKEN: --save ")


def _collectives(launcher, extra_env=None, extra=()):
    port = str(free_port())
    if launcher == "torchrun":
        cmd = [TORCHRUN, "--nproc_per_node", "2", "--master_port", port]
    else:
        cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", port]
    return run(cmd + [TOOL, "--collectives", "--min-bytes", "256K", "--max-bytes", "1M", "--iters", "2",
                      "--warmup", "1", *extra], extra_env)


def test_collectives_bandwidths_and_values(tmp_path):
    out = tmp_path / "collectives.json"
    proc = _collectives("torchrun", extra=("--json", str(out)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all 12 results have the expected values" in proc.stdout
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo"
    rows = data["results"]
    assert sorted({(r["op"], r["bytes"]) for r in rows}) == sorted(
        (op, size) for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p")
        for size in (256 << 10, 512 << 10, 1 << 20))
    factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "p2p": 1.0}  # 2(n-1)/n, (n-1)/n at n=2
    for r in rows:
        assert r["ok"] and r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor[r["op"]])
    # the planner reads it: each collective's bus bandwidth at the largest message
    from megatron.planning import speed
    bw = speed.bandwidths_from(speed.gpu_spec("rtx3090"), str(out))
    largest = {r["op"]: r["busbw_gbps"] for r in rows if r["bytes"] == 1 << 20}
    assert (bw.all_reduce, bw.all_gather, bw.reduce_scatter, bw.p2p) == (
        largest["all_reduce"], largest["all_gather"], largest["reduce_scatter"], largest["p2p"])


def test_broken_collectives_are_named_not_hung():
    """Wrong values (under the deepspeed launcher) and a hang past --timeout (under torchrun): one FAIL line."""
    proc = _collectives("deepspeed", {"MEGATRON_TEST_BREAK_COLLECTIVE": "reduce_scatter:values"})
    assert proc.returncode != 0
    passed = [line.split()[0] for line in proc.stdout.splitlines() if line.endswith(" ok")]
    assert passed == ["all_reduce"] * 3 + ["all_gather"] * 3  # the ops before it ran and passed
    fails = [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]
    assert fails == ["FAIL reduce_scatter 0.25 MiB over 2 ranks: wrong values (expected the rank-filled inputs' "
                     "exact result)"]
    proc = _collectives("torchrun", {"MEGATRON_TEST_BREAK_COLLECTIVE": "all_gather:hang"}, ("--timeout", "3"))
    assert proc.returncode != 0 and proc.seconds < 60
    first = [line for line in proc.stdout.splitlines() if line.startswith("FAIL")][0]
    assert first.startswith("FAIL all_gather 0.25 MiB over 2 ranks: no result within --timeout 3 s")


@pytest.mark.parametrize("flags, message", [
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 x --pipeline-model-parallel-size 1 = 3 "
                                             "processes per model replica"),
    (["--pipeline-model-parallel-size", "2", "--zero-stage", "2"], "--zero-stage 2 cannot be combined"),
])
def test_impossible_layouts_refused_with_pretrain_messages(flags, message):
    line = TINY_MODEL + ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--mock-data"] + flags
    pretrain = run([PYTHON, str(ROOT / "pretrain_bloom.py"), *line],
                   {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"})
    plan = run([PYTHON, str(ROOT / "tools" / "plan_layout.py"), "--num-gpus", "4", *line])
    assert pretrain.returncode == plan.returncode == 2

    def error_line(proc):
        lines = [line for line in proc.stderr.splitlines() if " ERROR " in line]
        assert len(lines) == 1, proc.stderr[-2000:]
        return lines[0].split(" ERROR ", 1)[1]
    assert message in error_line(pretrain)
    assert error_line(plan) == error_line(pretrain)
