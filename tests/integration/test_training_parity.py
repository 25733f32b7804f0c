"""Every parallel layout's loss curve equals the single-process run with the same global batch (CPU, gloo).

Tolerances: fp32 layouts agree within 2e-5 absolute per iteration (only the order of float reductions
differs: TP splits matmuls, DP averages gradients by all-reduce instead of accumulation); bf16 within 2e-2.
"""
import pytest

from tests.launch import TINY_MODEL, TOKENIZER, read_losses, run_pretrain

ITERS = 6


def train(tmp_path, sample_data, name, nproc=1, extra=()):
    out = tmp_path / name
    args = TINY_MODEL + [
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS),
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--warmup", "2", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--data-path", sample_data, "--split", "98,2,0",
        "--vocab-file", str(TOKENIZER / "vocab.json"), "--merge-file", str(TOKENIZER / "merges.txt"),
        "--pad-vocab-size-to", "8192",  # the same embedding rows for TP 1 and 2 (128 x TP would differ)
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
        "--metrics-file", str(out / "metrics.jsonl"), "--deepspeed", *extra]
    run_pretrain(args, nproc=nproc)
    losses = read_losses(out / "metrics.jsonl")
    assert sorted(losses) == list(range(1, ITERS + 1))
    return [losses[i] for i in range(1, ITERS + 1)]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, sample_data):
    tmp = tmp_path_factory.mktemp("baseline")
    return {"fp32": train(tmp, sample_data, "fp32"), "bf16": train(tmp, sample_data, "bf16", extra=["--bf16"])}


LAYOUTS = [
    ("tp2", 2, ["--tensor-model-parallel-size", "2"], "fp32"),
    ("pp2", 2, ["--pipe-parallel-size", "2"], "fp32"),
    ("dp2-zero1", 2, ["--zero-stage", "1"], "fp32"),
    ("dp2-zero2", 2, ["--zero-stage", "2"], "fp32"),
    ("dp2-zero3", 2, ["--zero-stage", "3"], "fp32"),
    ("tp2-pp2", 4, ["--tensor-model-parallel-size", "2", "--pipe-parallel-size", "2"], "fp32"),
    ("dp2-zero1-bf16", 2, ["--zero-stage", "1", "--bf16"], "bf16"),
    ("dp2-zero2-offload", 2, ["--zero-stage", "2", "--cpu-offload"], "fp32"),
    ("tp2-partitioned-checkpointing", 2, ["--tensor-model-parallel-size", "2", "--checkpoint-activations",
                                          "--partition-activations"], "fp32"),
    ("pp2-checkpointing", 2, ["--pipe-parallel-size", "2", "--checkpoint-activations"], "fp32"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,nproc,flags,precision", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_layout_matches_single_process(tmp_path, sample_data, baseline, name, nproc, flags, precision):
    losses = train(tmp_path, sample_data, name, nproc, flags)
    tolerance = 2e-5 if precision == "fp32" else 2e-2
    reference = baseline[precision]
    for iteration, (got, want) in enumerate(zip(losses, reference), start=1):
        assert abs(got - want) <= tolerance, f"{name} iteration {iteration}: {got} vs single process {want}"
    assert losses[-1] < losses[0], "the loss should fall over the run"
