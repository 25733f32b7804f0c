"""Resuming on another layout (TP, PP, DP, ZeRO stage) continues training with the checkpoint's optimizer state.

One uninterrupted TP 2 x PP 2 run of 20 iterations (4 processes, fp32) saves at iteration 10; it is relaunched from
that checkpoint on four other layouts for iterations 11-20. Each continuation's loss, LR and gradient norm equal
the uninterrupted run's within LOSS_TOLERANCE per iteration: the fp32 master weights, Adam's moments and step count,
the LR schedule, the consumed samples (data order) all carry over. The runs have no dropout (the RNG streams are
per-rank, so they restart on another layout); what remains is the order of floating-point sums (another TP split,
another gradient reduction): the losses agree within 1e-6 (measured), the LR exactly. Sensitivity: with Adam's
first moment zeroed on load (TP 1 x DP 2 ZeRO-1), iteration 12's loss moves by 2e-3 and the later ones by up to 1e-2.
The gradient norm is compared relatively (GRAD_NORM_RTOL): DeepSpeed's pipeline engine and its plain engine report
norms that differ by a steady 2-5e-5 relative at every iteration (0.77 here; --clip-grad 1.0 does not act).

bf16 (one pair, TP 1 x DP 2 ZeRO-1 -> TP 2 x PP 2 with BF16_Optimizer): the fp32 master weights and moments carry
over as in fp32, but bf16 matmuls summed in another order differ by ~1e-5 relative; measured loss differences
up to 8e-5 on losses of ~9 over 10 iterations (also for TP 2 x PP 2 -> DP 2 ZeRO-1 and -> DP 4 ZeRO-3), gradient
norms up to 3.5e-4 relative: BF16_LOSS_TOLERANCE 3e-4, BF16_GRAD_NORM_RTOL 1e-3; the test runs 4 iterations past
the save.

fp16 (TP 1 x DP 2 ZeRO-1 -> TP 2 x DP 1 ZeRO-1, and -> TP 2 x DP 1 ZeRO 0, dynamic loss scaling): as tight as fp32
(measured: losses within 4e-6, gradient norms within 5.2e-5 relative), and the loss scaler's state carries over.
ZeRO 0 is DeepSpeed's FP16_UnfusedOptimizer, whose gradients reached Adam divided by the loss scale until
megatron/checkpoint/adapters.py scaled the loss for it: that continuation then drifted by 6.2e-4 one step after the
save and 2.4e-3 after three.

A TP size the checkpoint's model cannot be split into is one line, before any process group.
"""
import json
import re

import pytest

from tests.checkpoint_reads import assert_reads_within_share
from tests.launch import TINY_MODEL, TOKENIZER, run_pretrain

LOSS_TOLERANCE = 2e-5
GRAD_NORM_RTOL = 1e-4
BF16_LOSS_TOLERANCE = 3e-4
BF16_GRAD_NORM_RTOL = 1e-3
SOURCE = ["--tensor-model-parallel-size", "2", "--pipe-parallel-size", "2", "--zero-stage", "0"]
LAYOUTS = {  # id: (flags, processes)
    "tp1-pp1-dp2-zero1": (["--tensor-model-parallel-size", "1", "--pipe-parallel-size", "1", "--zero-stage", "1"], 2),
    "tp1-pp2-dp2-zero0": (["--tensor-model-parallel-size", "1", "--pipe-parallel-size", "2", "--zero-stage", "0"], 4),
    "tp2-pp1-dp2-zero2": (["--tensor-model-parallel-size", "2", "--pipe-parallel-size", "1", "--zero-stage", "2"], 4),
    "tp1-pp1-dp4-zero3": (["--tensor-model-parallel-size", "1", "--pipe-parallel-size", "1", "--zero-stage", "3"], 4),
}


def args(sample_data, out, *extra):
    return TINY_MODEL + [
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "20", "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--warmup", "3", "--clip-grad", "1.0",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--data-path", sample_data, "--split", "98,2,0", "--vocab-file", str(TOKENIZER / "vocab.json"),
        "--merge-file", str(TOKENIZER / "merges.txt"), "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "1", "--metrics-file", str(out / "metrics.jsonl"), "--deepspeed", *extra]


def records(metrics_file):
    with open(metrics_file) as f:
        return {r["iteration"]: r for r in map(json.loads, f) if r["kind"] == "train"}


@pytest.fixture
def source(layout_source):
    """The uninterrupted TP 2 x PP 2 run (tests/conftest.py, shared with test_convert_checkpoint.py); its
    iteration-10 checkpoint."""
    return layout_source


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_resume_on_another_layout_equals_uninterrupted(layout, source, sample_data, tmp_path, request):
    flags, nproc = LAYOUTS[layout]
    if layout == "tp1-pp1-dp2-zero1":  # shared with test_convert_checkpoint.py (tests/conftest.py)
        proc, tmp_path = request.getfixturevalue("layout_resumed_on_zero1")
    elif layout == "tp2-pp1-dp2-zero2":  # shared with the TP 1 x DP 4 resume below; its reads counted
        proc, tmp_path = request.getfixturevalue("layout_resumed_on_tp2_dp2")
        assert_reads_within_share(tmp_path / "reads", source / "ckpt" / "iter_0000010", tp=2, dp=2, zero=2)
    else:
        proc = run_pretrain(args(sample_data, tmp_path, *flags, "--load", str(source / "ckpt" / "iter_0000010")),
                            nproc)
    tp, pp = int(flags[1]), int(flags[3])
    now = f"TP {tp}, PP {pp}, DP {nproc // (tp * pp)}, ZeRO {flags[5]}, fp32"
    lines = [line for line in proc.stderr.splitlines() if "resuming on another layout" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "[rank 0] WARNING megatron.checkpoint.load: resuming on another layout: the checkpoint was trained on "
        f"TP 2, PP 2, DP 1, ZeRO 0, fp32, this run is {now} (weights, optimizer state, LR schedule, loss scale and "
        "data position carried over; RNG states restart)"), lines
    assert_continues(source / "metrics.jsonl", tmp_path / "metrics.jsonl", LOSS_TOLERANCE)


def assert_continues(straight_file, resumed_file, loss_tolerance, norm_rtol=GRAD_NORM_RTOL, last=20, first=11):
    straight, resumed = records(straight_file), records(resumed_file)
    assert sorted(resumed) == list(range(first, last + 1))
    for iteration in range(first, last + 1):
        now, then = resumed[iteration], straight[iteration]
        assert abs(now["lm_loss"] - then["lm_loss"]) <= loss_tolerance, (iteration, now["lm_loss"], then["lm_loss"])
        assert now["lr"] == then["lr"], iteration
        assert abs(now["grad_norm"] - then["grad_norm"]) <= norm_rtol * then["grad_norm"], iteration


@pytest.mark.slow
def test_tp2_dp2_resumed_on_tp1_dp4_reads_only_its_share(source, layout_resumed_on_tp2_dp2, sample_data, tmp_path):
    """The TP 2 x DP 2 ZeRO-2 continuation's iteration-15 checkpoint resumed on TP 1 x DP 4 ZeRO-1: each rank
    reads its quarter of the merged TP slices (tests/checkpoint_reads.py), and iterations 16-20 equal the
    uninterrupted run's."""
    folder = layout_resumed_on_tp2_dp2[1] / "ckpt" / "iter_0000015"
    proc = run_pretrain(args(sample_data, tmp_path, "--tensor-model-parallel-size", "1", "--zero-stage", "1",
                             "--load", str(folder)), 4,
                        extra_env={"MEGATRON_TEST_COUNT_READS": str(tmp_path / "reads")})
    assert ("resuming on another layout: the checkpoint was trained on TP 2, PP 1, DP 2, ZeRO 2, fp32, this run "
            "is TP 1, PP 1, DP 4, ZeRO 1, fp32") in proc.stderr
    assert_reads_within_share(tmp_path / "reads", folder, tp=1, dp=4, zero=1, log=proc.stderr)
    assert_continues(source / "metrics.jsonl", tmp_path / "metrics.jsonl", LOSS_TOLERANCE, first=16)


@pytest.mark.slow
def test_bf16_resume_from_zero1_onto_tp2_pp2(bf16_zero1_source, sample_data, tmp_path):
    straight = bf16_zero1_source  # TP 1 x DP 2 ZeRO-1, bf16, stopped after iteration 14 (tests/conftest.py)
    stop = ["--exit-interval", "14"]  # 4 iterations past the save: the schedule is still --train-iters 20's
    proc = run_pretrain(args(sample_data, tmp_path, "--bf16", *SOURCE, *stop, "--load",
                             str(straight / "ckpt" / "iter_0000010")), 4)
    assert ("resuming on another layout: the checkpoint was trained on TP 1, PP 1, DP 2, ZeRO 1, bf16, this run is "
            "TP 2, PP 2, DP 1, ZeRO 0, bf16") in proc.stderr
    assert_continues(straight / "metrics.jsonl", tmp_path / "metrics.jsonl", BF16_LOSS_TOLERANCE,
                     BF16_GRAD_NORM_RTOL, last=14)


@pytest.mark.slow
def test_fp16_resume_from_dp2_onto_tp2_carries_the_loss_scaler(sample_data, tmp_path):
    """fp16 with dynamic loss scaling, TP 1 x DP 2 ZeRO-1 -> TP 2 x DP 1 at ZeRO 1 and at ZeRO 0
    (FP16_UnfusedOptimizer): the fp32 master weights, the moments and the loss scaler's state carry over
    (tests/pretrain_under_test.py answers DeepSpeed's CPU fp16 check). Measured: losses within 4e-6 (both), gradient
    norms within 2.8e-5 relative (ZeRO 1) and 5.2e-5 (ZeRO 0), the loss scale equal."""
    fp16 = ["--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "2", "--exit-interval", "14"]
    straight = tmp_path / "straight"
    run_pretrain(args(sample_data, straight, *fp16, "--zero-stage", "1", "--save", str(straight / "ckpt"),
                      "--save-interval", "10"), 2, fp16_on_cpu=True)
    before = records(straight / "metrics.jsonl")
    assert before[14]["loss_scale"] == 4 * before[10]["loss_scale"]  # the scaler doubled twice after the save
    for zero in ("1", "0"):
        resumed = tmp_path / f"resumed-zero{zero}"
        proc = run_pretrain(args(sample_data, resumed, *fp16, "--zero-stage", zero, "--tensor-model-parallel-size",
                                 "2", "--load", str(straight / "ckpt" / "iter_0000010")), 2, fp16_on_cpu=True)
        assert ("resuming on another layout: the checkpoint was trained on TP 1, PP 1, DP 2, ZeRO 1, fp16, this run "
                f"is TP 2, PP 1, DP 1, ZeRO {zero}, fp16") in proc.stderr
        assert_continues(straight / "metrics.jsonl", resumed / "metrics.jsonl", LOSS_TOLERANCE, GRAD_NORM_RTOL,
                         last=14)
        after = records(resumed / "metrics.jsonl")
        assert [after[i]["loss_scale"] for i in range(11, 15)] == [before[i]["loss_scale"] for i in range(11, 15)]


def test_a_tp_size_that_cannot_hold_the_checkpoint_is_one_line(source, sample_data, tmp_path):
    proc = run_pretrain(args(sample_data, tmp_path, "--tensor-model-parallel-size", "3", "--load",
                             str(source / "ckpt")), 1, check=False,
                        extra_env={"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and errors[0].endswith(
        f"ERROR megatron: --load {source / 'ckpt'}: its padded vocabulary (8192) is not divisible by "
        "--tensor-model-parallel-size 3; pick a TP size that divides it"), proc.stderr[-2000:]
