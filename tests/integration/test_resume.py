"""A run interrupted at iteration 10 and resumed with --load continues the loss curve exactly."""
import json
import os

import pytest

from tests.launch import TINY_MODEL, TOKENIZER, read_losses, run_pretrain


def args(sample_data, out, *extra):
    return TINY_MODEL + [
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "20", "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--warmup", "3", "--clip-grad", "1.0",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1",  # the RNG state must resume too
        "--data-path", sample_data, "--split", "98,2,0", "--vocab-file", str(TOKENIZER / "vocab.json"),
        "--merge-file", str(TOKENIZER / "merges.txt"), "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "1", "--metrics-file", str(out / "metrics.jsonl"), "--deepspeed", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("nproc,layout", [(2, ["--zero-stage", "1"]), (2, ["--pipe-parallel-size", "2"])],
                         ids=["dp2-zero1", "pp2"])
def test_resume_equals_uninterrupted(tmp_path, sample_data, nproc, layout):
    straight = tmp_path / "straight"
    run_pretrain(args(sample_data, straight, *layout), nproc)
    expected = read_losses(straight / "metrics.jsonl")

    resumed = tmp_path / "resumed"
    save = str(resumed / "ckpt")
    first = run_pretrain(args(sample_data, resumed, *layout, "--save", save, "--save-interval", "5",
                              "--exit-interval", "10"), nproc)
    assert "training stopped at iteration 10 (--exit-interval 10)" in first.stderr
    assert open(os.path.join(save, "latest")).read() == "iter_0000010"
    with open(os.path.join(save, "iter_0000010", "meta.json")) as f:
        assert json.load(f)["consumed_samples"] == 80
    run_pretrain(args(sample_data, resumed, *layout, "--save", save, "--load", save), nproc)
    got = read_losses(resumed / "metrics.jsonl")  # the same file: iterations 1-10, then 11-20 after resume
    assert sorted(got) == list(range(1, 21))
    for iteration in range(1, 21):
        assert got[iteration] == pytest.approx(expected[iteration], abs=1e-6), f"iteration {iteration}"


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
