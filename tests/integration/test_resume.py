"""Resuming continues a run exactly, in every precision x pipeline x ZeRO layout; what a checkpoint stores.

The matrix: {fp32, bf16, fp16} x {PP 1: ZeRO 0, 1, 2, 3; PP 2: ZeRO 0, 1} (DeepSpeed's pipeline engine takes no
ZeRO 2/3). Each cell is two launches: a straight run of 8 iterations that saves at 5 (and at 8), and a run
relaunched from that iteration-5 checkpoint. The straight run is both the reference and the checkpoint's source.
PP 1 cells run in one process (ZeRO 1-3 with one data-parallel rank still go through ZeRO's optimizers, their
partitioning and their checkpoint code), two of them at a time; PP 2 cells in two processes.

Tolerance: none, in every precision. A resumed run restores every bit of state the next step reads: the weights
as stored (bf16/fp16 weights are the fp32 master weights rounded, as in training), the fp32 master weights, Adam's
moments, the loss scaler, the LR schedule's position, the step counters, the RNG states and the data position;
on CPU with one thread every kernel is deterministic, so iterations 6-8 are bit-identical to the straight run's,
and so is the whole iteration-8 checkpoint (weights, optimizer state, RNG states). A lost piece of state shows
up far above rounding: e.g. without the tied embedding's optimizer state on the last pipeline stage, the loss at
iteration 7 moves by 1e-4 (fp32) to 6e-3 (bf16).

fp16 on CPU: DeepSpeed's CPU accelerator refuses fp16 when oneDNN does not report fp16 support
(torch.ops.mkldnn._is_mkldnn_fp16_supported() is False on CPUs without AVX512-FP16/AMX-FP16, as here), although
torch runs fp16 on any CPU. The fp16 cells run through tests/pretrain_under_test.py, which answers that
capability check True; everything else is the real run. They start from a loss scale of 1024 that doubles every
2 iterations, so that steps are taken (2^32 overflows fp16's gradients, at every ZeRO stage) and the loss scaler's
state changes across the save.
"""
import json
import math
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.checkpoint_reads import assert_reads_within_share
from tests.launch import DEEPSPEED, PYTHON, ROOT, TINY_MODEL, TOKENIZER, _cleanup_shm, _free_port, env, \
    launcher_for, read_losses, run_pretrain

PRECISION_FLAGS = {"fp32": [], "bf16": ["--bf16"],
                   "fp16": ["--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "2"]}
CELLS = [(precision, pp, zero) for precision in PRECISION_FLAGS for pp, zeros in ((1, (0, 1, 2, 3)), (2, (0, 1)))
         for zero in zeros]
# What a checkpoint should hold per parameter: the weights once (4 or 2 bytes) and Adam's two fp32 moments,
# plus fp32 master weights under bf16/fp16. The files add torch.save's framing (~200 bytes per tensor), and
# ZeRO pads its flat partitions by a few elements: under 1.1% for this 0.7M-parameter, ~75-tensor model.
BYTES_PER_PARAMETER = {"fp32": 4 + 8, "bf16": 2 + 4 + 8, "fp16": 2 + 4 + 8}
FRAMING = 0.011
COMPARED = ("lm_loss", "lr", "loss_scale", "skipped_iterations", "grad_norm")


def args(sample_data, out, *extra, iters=20):
    return TINY_MODEL + [
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--warmup", "3", "--clip-grad", "1.0",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1",  # the RNG state must resume too
        "--data-path", sample_data, "--split", "98,2,0", "--vocab-file", str(TOKENIZER / "vocab.json"),
        "--merge-file", str(TOKENIZER / "merges.txt"), "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "1", "--metrics-file", str(out / "metrics.jsonl"), "--deepspeed", *extra]


def cell_id(cell):
    precision, pp, zero = cell
    return f"{precision}-pp{pp}-zero{zero}"


def cell_flags(cell):
    precision, pp, zero = cell
    return PRECISION_FLAGS[precision] + ["--pipe-parallel-size", str(pp), "--zero-stage", str(zero)]


def launch(argv, nproc, fp16_on_cpu=False):
    """pretrain_bloom (tests/pretrain_under_test.py for fp16) on nproc processes; returns the CompletedProcess."""
    port = _free_port()
    script, extra = launcher_for(fp16_on_cpu=fp16_on_cpu)
    if nproc == 1:
        cmd, extra = [PYTHON, str(script)] + argv, {**(extra or {}), "MASTER_PORT": str(port)}
    else:
        cmd = [DEEPSPEED, "--num_gpus", str(nproc), "--master_port", str(port), str(script)] + argv
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env(extra), capture_output=True, text=True, timeout=300)
    finally:
        _cleanup_shm(port)


def records(metrics_file):
    with open(metrics_file) as f:
        return {r["iteration"]: r for r in map(json.loads, f) if r["kind"] == "train"}


def run_cell(cell, sample_data, work):
    """Straight run (saves at 5 and 8), then the run relaunched from its iteration-5 checkpoint."""
    out = work / cell_id(cell)
    out.mkdir()
    nproc = cell[1]
    result = {"out": out, "errors": []}
    for leg, extra in (("straight", ["--save", str(out / "straight"), "--save-interval", "5"]),
                       ("resumed", ["--load", str(out / "straight" / "iter_0000005"), "--save",
                                    str(out / "resumed")])):
        (out / leg).mkdir()
        proc = launch(args(sample_data, out / leg, *cell_flags(cell), *extra, iters=8), nproc, cell[0] == "fp16")
        result[leg] = proc
        if proc.returncode != 0:
            result["errors"].append(f"{leg} run exited {proc.returncode}:\n{proc.stderr[-6000:]}")
            break
    return result


def selected_cells(session):
    cells = set()
    for item in session.items:
        if item.originalname == "test_resume_matrix":
            cells.add(item.callspec.params["cell"])
        elif item.originalname == "test_changed_schedule_flags_are_named_in_one_warning":
            cells.add(("fp32", 2, 0))
    return cells


@pytest.fixture(scope="module")
def matrix(request, tmp_path_factory, sample_data):
    """Runs the selected cells (PP 1 cells two at a time, one process each; PP 2 cells one at a time)."""
    work = tmp_path_factory.mktemp("resume_matrix")
    cells = selected_cells(request.session)
    single = [c for c in CELLS if c in cells and c[1] == 1]
    double = [c for c in CELLS if c in cells and c[1] == 2]
    results = {}
    with ThreadPoolExecutor(2) as pool:
        for cell, result in zip(single, pool.map(lambda c: run_cell(c, sample_data, work), single)):
            results[cell] = result
    for cell in double:
        results[cell] = run_cell(cell, sample_data, work)
    return results


def assert_same(a, b, where):
    """Equal tensor for tensor (dtype and bits), recursively through dicts, lists and plain objects."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b), where
        assert_same(vars(a), vars(b), where)
    else:
        assert a == b, (where, a, b)


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS, ids=[cell_id(c) for c in CELLS])
def test_resume_matrix(cell, matrix):
    result = matrix[cell]
    assert not result["errors"], "\n".join(result["errors"])
    out = result["out"]
    straight, resumed = records(out / "straight" / "metrics.jsonl"), records(out / "resumed" / "metrics.jsonl")
    assert sorted(straight) == list(range(1, 9)) and sorted(resumed) == [6, 7, 8]
    assert f"resumed from {out / 'straight' / 'iter_0000005'} at iteration 5" in result["resumed"].stderr
    for iteration in (6, 7, 8):
        for key in COMPARED:
            assert resumed[iteration][key] == straight[iteration][key], (iteration, key)
    if cell[0] == "fp16":  # the loss scaler's state crossed the save: it grew before and after iteration 5
        assert straight[8]["loss_scale"] > straight[5]["loss_scale"] > straight[1]["loss_scale"]
        assert straight[8]["skipped_iterations"] == 0

    final_straight, final_resumed = out / "straight" / "iter_0000008", out / "resumed" / "iter_0000008"
    names = sorted(p.name for p in final_straight.glob("*.pt"))
    assert names == sorted(p.name for p in final_resumed.glob("*.pt"))
    assert [n for n in names if n.startswith("optimizer_")], names
    for name in names:  # weights, every rank's optimizer state, RNG states
        assert_same(torch.load(final_straight / name, weights_only=False),
                    torch.load(final_resumed / name, weights_only=False), name)

    # bytes on disk per parameter: each tensor once
    folder = out / "straight" / "iter_0000005"
    shards = [torch.load(p, weights_only=True)["weights"] for p in sorted(folder.glob("model_tp*_pp*.pt"))]
    parameters = sum(t.numel() for shard in shards for t in shard.values())
    weight_bytes = 4 if cell[0] == "fp32" else 2
    assert sum(t.numel() * t.element_size() for shard in shards for t in shard.values()) == parameters * weight_bytes
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cell[0]]
    assert all(t.dtype == dtype for shard in shards for t in shard.values())
    on_disk = sum(os.path.getsize(p) for p in folder.iterdir() if p.name.startswith(("model_tp", "optimizer_tp")))
    expected = parameters * BYTES_PER_PARAMETER[cell[0]]
    assert expected <= on_disk <= expected * (1 + FRAMING), (on_disk / parameters, BYTES_PER_PARAMETER[cell[0]])
    assert sorted(p.name for p in folder.iterdir() if p.suffix == ".pt" and not p.name.startswith(
        ("model_tp", "optimizer_tp", "rng_rank"))) == []  # nothing of DeepSpeed's own


@pytest.mark.slow
def test_changed_schedule_flags_are_named_in_one_warning(matrix, sample_data, tmp_path):
    """--train-iters 8 -> 16 on resume moves the end of the cosine decay (--lr-decay-iters follows it)."""
    from megatron.optimizer import AnnealingLR
    source = matrix[("fp32", 2, 0)]
    assert not source["errors"], "\n".join(source["errors"])
    proc = run_pretrain(args(sample_data, tmp_path, *cell_flags(("fp32", 2, 0)), "--load",
                             str(source["out"] / "straight" / "iter_0000005"), "--exit-interval", "6", iters=16), 2)
    expected = ("resume: --train-iters 8 -> 16 (checkpoint's value -> now): the cosine decay now ends at iteration "
                "16; lr at iteration 5 is 9.48e-4 instead of 6.89e-4")
    lines = [line for line in proc.stderr.splitlines() if "resume: " in line]
    assert len(lines) == 1 and lines[0].endswith("[rank 0] WARNING megatron.checkpoint.load: " + expected), lines
    now = records(tmp_path / "metrics.jsonl")[6]["lr"]
    assert now == AnnealingLR(type("NoGroups", (), {"param_groups": []})(), 1e-3, 1e-4, 3, 16, "cosine").get_lr(6)
    assert not math.isclose(now, records(source["out"] / "straight" / "metrics.jsonl")[6]["lr"])


@pytest.mark.slow
def test_dp2_zero1_resume_after_exit_interval_equals_uninterrupted(tmp_path, sample_data):
    """Two data-parallel ranks, each with its own ZeRO partition file; stopped by --exit-interval, resumed from
    the save folder's `latest`, logging into the same metrics file."""
    layout = ["--zero-stage", "1"]
    straight = tmp_path / "straight"
    run_pretrain(args(sample_data, straight, *layout), 2)
    expected = read_losses(straight / "metrics.jsonl")

    resumed = tmp_path / "resumed"
    save = str(resumed / "ckpt")
    first = run_pretrain(args(sample_data, resumed, *layout, "--save", save, "--save-interval", "5",
                              "--exit-interval", "10"), 2)
    assert "training stopped at iteration 10 (--exit-interval 10)" in first.stderr
    assert open(os.path.join(save, "latest")).read() == "iter_0000010"
    folder = Path(save) / "iter_0000010"
    assert json.loads((folder / "meta.json").read_text())["consumed_samples"] == 80
    assert sorted(p.name for p in folder.glob("optimizer_*.pt")) == ["optimizer_tp00_pp000_dp00000.pt",
                                                                     "optimizer_tp00_pp000_dp00001.pt"]
    second = run_pretrain(args(sample_data, resumed, *layout, "--save", save, "--load", save), 2,
                          extra_env={"MEGATRON_TEST_COUNT_READS": str(tmp_path / "reads")})
    # each rank read the weights and its half of the optimizer state, no more (tests/checkpoint_reads.py)
    assert_reads_within_share(tmp_path / "reads", folder, tp=1, dp=2, zero=1, log=second.stderr)
    got = read_losses(resumed / "metrics.jsonl")  # the same file: iterations 1-10, then 11-20 after resume
    assert sorted(got) == list(range(1, 21))
    for iteration in range(1, 21):
        assert got[iteration] == expected[iteration], f"iteration {iteration}"


def test_no_save_optim_writes_weights_only_and_resumes(tmp_path, sample_data):
    save = tmp_path / "ckpt"
    run_pretrain(args(sample_data, tmp_path, "--save", str(save), "--save-interval", "5", "--exit-interval", "5",
                      "--no-save-optim"), 1)
    folder = save / "iter_0000005"
    assert json.loads((folder / "meta.json").read_text())["deepspeed_state"] is False
    assert sorted(p.name for p in folder.glob("*.pt")) == ["model_tp00_pp000.pt", "rng_rank00000.pt"]
    resumed = run_pretrain(args(sample_data, tmp_path, "--load", str(save), "--train-iters", "6"), 1)
    assert "so the optimizer and LR schedule restart" in resumed.stderr
    assert "training stopped at iteration 6 (finished)" in resumed.stderr
