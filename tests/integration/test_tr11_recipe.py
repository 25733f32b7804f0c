"""examples/pretrain_bloom_tr11_small.sh (BigScience's tr11 BLOOM recipe, its flags unchanged, at small sizes) runs,
and its flags do what they do upstream.

One run of the script (2 processes, TP 1 x PP 2 with --pp-partition-method 'type:transformer|embedding', fp32 on
the CPU, 36 training samples): the batch-size ramp-up 4 -> 8 in steps of 2 over 16 samples gives the global
batches 4, 4, 6, 6, 8, 8 (6 iterations; upstream's formula worked by hand in the comments), the sample-based
cosine schedule the learning rates computed here from the consumed samples, tensorboard the batch size and the
validation perplexity. Then --eval-only on its checkpoint gives the run's last validation loss without training or
saving, and a kill switch created during a run stops it at the next iteration boundary, exit 0, nothing saved.
"""
import json
import math
import os
import subprocess
import sys
import time

import pytest

from tests.launch import DEEPSPEED, ROOT, TINY_MODEL, TOKENIZER, _cleanup_shm, _free_port, env, launcher_for

SCRIPT = ROOT / "examples" / "pretrain_bloom_tr11_small.sh"


def run_script(work, *extra, num_procs=2, timeout=600):
    port = _free_port()
    extra_env = {"WORK": str(work), "NUM_PROCS": str(num_procs), "TRAIN_SAMPLES": "36", "MASTER_PORT": str(port),
                 "PYTHON": sys.executable, "DEEPSPEED": DEEPSPEED}
    try:
        proc = subprocess.run(["bash", str(SCRIPT), *extra], cwd=ROOT, env=env(extra_env), capture_output=True,
                              text=True, timeout=timeout)
    finally:
        _cleanup_shm(port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def records(work, kind):
    with open(work / "tensorboard" / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


@pytest.fixture(scope="module")
def tr11_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("tr11")
    return work, run_script(work)


def test_rampup_and_sample_based_schedule(tr11_run):
    work, _ = tr11_run
    train = records(work, "train")
    # ramp-up 4 2 16, global 8: increments (8-4)/2 = 2, 16/2 = 8 samples each; batch(consumed) = 4 + 2 x
    # floor(consumed / 8) while consumed <= 16: 0 -> 4, 4 -> 4, 8 -> 6, 14 -> 6, then 8; 36 samples end after 36
    assert [r["global_batch_size"] for r in train] == [4, 4, 6, 6, 8, 8]
    assert [r["consumed_samples"] for r in train] == [4, 8, 14, 20, 28, 36]
    assert [r["train_iters"] for r in train] == [6] * 6
    lr, min_lr, warmup, decay = 6e-4, 6e-5, 8, 80  # --lr-warmup-samples 8, --lr-decay-samples 80

    def expected(samples):
        if samples <= warmup:
            return lr * samples / warmup
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (samples - warmup) / (decay - warmup)))
    for record in train:
        assert record["lr"] == pytest.approx(expected(record["consumed_samples"]), rel=1e-12)
    assert sorted(os.listdir(work / "checkpoints")) == ["iter_0000004", "iter_0000006", "latest"]


def test_tensorboard_gets_the_batch_size_and_validation_ppl(tr11_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    work, _ = tr11_run
    events = EventAccumulator(str(work / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/global_batch_size")] == [4, 4, 6, 6, 8, 8]
    valid = records(work, "valid")
    assert [(e.step, e.value) for e in events.Scalars("valid/ppl")] == \
        [(r["iteration"], pytest.approx(r["ppl"], rel=1e-6)) for r in valid]
    assert [r["iteration"] for r in valid] == [4, 6]


def test_eval_only_evaluates_the_checkpoint_and_exits(tr11_run):
    work, _ = tr11_run
    before = sorted(os.listdir(work / "checkpoints"))
    last_valid = records(work, "valid")[-1]
    proc = run_script(work, "--eval-only")
    log = proc.stdout + proc.stderr
    assert " | lm loss: " not in log.split("validation at iteration")[0].split("resumed from")[-1]  # no training
    assert "training stopped at iteration 6 (--eval-only)" in log
    assert "resume:" not in log  # no iteration-based schedule warning for a sample-based schedule
    valid = records(work, "valid")[-1]
    assert valid["iteration"] == 6 and valid["lm_loss"] == pytest.approx(last_valid["lm_loss"], rel=1e-6)
    assert sorted(os.listdir(work / "checkpoints")) == before


def test_kill_switch_stops_a_run_at_the_next_iteration_without_saving(tmp_path, sample_data):
    kill = tmp_path / "kill-switch"
    metrics = tmp_path / "metrics.jsonl"
    script, extra_env = launcher_for(faults="slow=0.5")
    args = TINY_MODEL + ["--micro-batch-size", "2", "--train-iters", "30", "--lr", "1e-3", "--data-path",
                         sample_data, "--vocab-file", str(TOKENIZER / "vocab.json"), "--merge-file",
                         str(TOKENIZER / "merges.txt"), "--log-interval", "1", "--eval-interval", "1000",
                         "--save", str(tmp_path / "ckpt"), "--save-interval", "1000", "--metrics-file", str(metrics),
                         "--kill-switch-path", str(kill), "--deepspeed"]
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=env({"MASTER_PORT": str(_free_port()), **extra_env}))
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (metrics.exists() and metrics.read_text()):
        time.sleep(0.2)
    kill.touch()
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    stopped = [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()][-1]
    assert 1 <= stopped < 30
    assert f"kill switch {kill} exists: exiting at iteration {stopped} without saving" in output
    assert f"training stopped at iteration {stopped} (kill switch)" in output
    assert not (tmp_path / "ckpt").exists() or not any(n.startswith("iter_") for n in os.listdir(tmp_path / "ckpt"))
