"""Resuming across a change of precision carries the optimizer state (one process, CPU).

An fp32 run saved at iteration 4 and resumed with --bf16 continues the straight fp32 run's loss curve within bf16
rounding: measured 2.2e-4 at most over iterations 5-8, where bf16 alone moves the straight run by up to 5.6e-4. A
resume that restarts Adam (what this path did before, and what --no-load-optim still does) lands 2.9e-3 away at
iteration 6, so the 1.2e-3 bound below tells carried moments from restarted ones.
"""
from tests.launch import TINY_MODEL, TOKENIZER, read_losses, run_pretrain

ITERS = 8


def args(sample_data, out, *extra):
    return TINY_MODEL + [
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--warmup", "2", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--data-path", sample_data, "--split", "98,2,0",
        "--vocab-file", str(TOKENIZER / "vocab.json"), "--merge-file", str(TOKENIZER / "merges.txt"),
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
        "--metrics-file", str(out / "metrics.jsonl"), "--deepspeed", *extra]


def test_fp32_checkpoint_resumed_in_bf16_carries_the_adam_moments(tmp_path, sample_data):
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    run_pretrain(args(sample_data, straight))
    run_pretrain(args(sample_data, first, "--save", str(first / "ckpt"), "--save-interval", "4",
                      "--exit-interval", "4"))
    proc = run_pretrain(args(sample_data, resumed, "--load", str(first / "ckpt"), "--bf16"))
    log = proc.stdout + proc.stderr
    assert "this run is TP 1, PP 1, DP 1, ZeRO 0, bf16 (weights, optimizer state, LR schedule" in log, log[-3000:]
    assert "optimizer and LR schedule restart" not in log
    want, got = read_losses(straight / "metrics.jsonl"), read_losses(resumed / "metrics.jsonl")
    assert sorted(got) == list(range(5, ITERS + 1))
    for iteration in got:
        assert abs(got[iteration] - want[iteration]) < 1.2e-3, (iteration, got[iteration], want[iteration])
