"""Inside real runs (CPU, gloo): phase timers, communication share, pipeline bubble, the profiler window, W&B,
throughput after a resume, and the metrics file of an interrupted-then-resumed run.

Four launches serve every assertion: a 2-process DP 2 run (level 1, profiler, W&B offline, tensorboard timers,
saves at 6), its resume from iteration 6 (W&B failing to start), a 4-process TP 2 x PP 2 run (level 2) and a
1-process run. On CPU every op runs on the host, so each rank's phases (contiguous marks) add up to its iteration
time apart from the loop's few unmarked statements; 10% is the issue's bound.
"""
import glob
import json
import os
import shutil
import struct

import pytest

from megatron.training.timers import COMM_PHASES, PHASES, TP_COMM
from tests.launch import TINY_MODEL, TOKENIZER, run_pretrain

TIMED = ["--timing-log-level", "1", "--timing-log-option", "all"]


# The DP 2 runs compare one iteration's throughput with a 4-iteration window's: a model with ~16x TINY_MODEL's
# work per iteration keeps that comparison above the jitter of Python and of a shared 2-core machine.
DP2_MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "16"]


def args(sample_data, out, *extra, iters=8, model=TINY_MODEL + ["--micro-batch-size", "2", "--global-batch-size", "8"]):
    return model + [
        "--train-iters", str(iters), "--lr", "1e-3",
        "--clip-grad", "1.0", "--data-path", sample_data, "--split", "98,2,0",
        "--vocab-file", str(TOKENIZER / "vocab.json"), "--merge-file", str(TOKENIZER / "merges.txt"),
        "--log-interval", "4", "--eval-interval", "1000", "--eval-iters", "1",
        "--metrics-file", str(out / "metrics.jsonl"), "--deepspeed", *extra]


def train_records(path):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "train"]


def wandb_offline_env(home):
    return {"WANDB_MODE": "offline", "HOME": str(home), "WANDB_CONFIG_DIR": str(home), "WANDB_SILENT": "true"}


@pytest.fixture(scope="module")
def dp2(sample_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("timers_dp2")
    proc = run_pretrain(args(sample_data, out, *TIMED, "--save", str(out / "ckpt"), "--save-interval", "6",
                             "--profile", "--profile-step-start", "2", "--profile-step-end", "4",
                             "--profile-ranks", "1", "--profile-dir", str(out / "profile"),
                             "--tensorboard-dir", str(out / "tb"), "--log-timers-to-tensorboard",
                             "--wandb-project", "timers-test", "--wandb-exp-name", "dp2",
                             "--wandb-save-dir", str(out / "wandb"), model=DP2_MODEL), 2,
                        extra_env=wandb_offline_env(out))
    return proc, out


@pytest.fixture(scope="module")
def dp2_resumed(dp2, sample_data, tmp_path_factory):
    """dp2's iteration-6 checkpoint resumed, writing to a copy of dp2's metrics file (which, like the file of a
    run killed after iteration 8, holds records past 6). W&B cannot start: online, no API key anywhere."""
    _, source = dp2
    out = tmp_path_factory.mktemp("timers_dp2_resumed")
    shutil.copy(source / "metrics.jsonl", out / "metrics.jsonl")
    home = out / "home"
    home.mkdir()
    proc = run_pretrain(args(sample_data, out, *TIMED, "--load", str(source / "ckpt" / "iter_0000006"),
                             "--wandb-project", "timers-test", "--wandb-save-dir", str(out / "wandb"), model=DP2_MODEL),
                        2,
                        extra_env={"WANDB_MODE": "online", "HOME": str(home), "WANDB_CONFIG_DIR": str(home),
                                   "WANDB_API_KEY": "", "NETRC": str(home / "netrc")})
    return proc, out


@pytest.fixture(scope="module")
def tp2pp2(sample_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("timers_tp2pp2")
    proc = run_pretrain(args(sample_data, out, "--timing-log-level", "2", "--timing-log-option", "all",
                             "--tensor-model-parallel-size", "2", "--pipe-parallel-size", "2"), 4)
    return proc, out


def assert_phases_add_up(record, ranks):
    """Each rank's phases sum to the iteration time within 10%; the nested TP collectives are not added."""
    for rank in range(ranks):
        total = sum(record["timers"][phase][rank] for phase in PHASES if phase in record["timers"])
        assert total == pytest.approx(record["ms_per_iteration"], rel=0.10), (rank, record)


def expected_comm_share(record, ranks):
    """The share from the phase times themselves: the largest rank's communication time over the step."""
    names = [name for name in (*COMM_PHASES, TP_COMM) if name in record["timers"]]
    return max(sum(record["timers"][name][rank] for name in names) for rank in range(ranks)) \
        / record["ms_per_iteration"]


@pytest.mark.slow
def test_dp2_phases_comm_share_profile_and_tensorboard(dp2):
    proc, out = dp2
    records = train_records(out / "metrics.jsonl")
    assert [(r["iteration"], r["window_iterations"]) for r in records] == [(4, 3), (8, 4)]
    for record in records:
        assert_phases_add_up(record, 2)
        assert set(record["timers"]) >= {"batch-generator", "forward-compute", "backward-compute",
                                         "grads-all-reduce", "optimizer", "loss-sync"}
        assert record["comm_share"] > 0
        assert record["comm_share"] == pytest.approx(expected_comm_share(record, 2), rel=0.10)
        assert "bubble_share" not in record and "gpu_utilization" not in record  # PP 1; no CUDA
    line = next(x for x in proc.stderr.splitlines() if "iteration        8/" in x)
    assert "timers (ms per iteration, per rank): batch-generator [" in line and "| communication: " in line
    assert "first iteration of this process took" in proc.stderr
    assert "checkpoint save at iteration 6 | time (ms):" in proc.stderr

    # --profile: rank 1 only, iterations 3 and 4 only
    traces = sorted(os.listdir(out / "profile"))
    assert traces == ["rank1_iterations3-4.pt.trace.json"]
    with open(out / "profile" / traces[0]) as f:
        events = json.load(f)["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#3", "ProfilerStep#4"}
    assert any(e.get("name", "").startswith("aten::") for e in events)

    # --log-timers-to-tensorboard: the timers/<phase> scalars are the JSON lines' max over ranks
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(out / "tb"))
    tb.Reload()
    for phase in ("forward-compute", "grads-all-reduce"):
        values = {e.step: e.value for e in tb.Scalars(f"timers/{phase}")}
        assert values == {r["iteration"]: pytest.approx(max(r["timers"][phase]), rel=1e-6) for r in records}
    assert {e.step for e in tb.Scalars("train/tokens_per_second")} == {4, 8}


def wandb_history(run_file):
    """The history rows of a W&B .wandb file: its records (LevelDB log format: 32 KiB blocks of chunks with a
    7-byte header crc32/length/type after the file's 7-byte W&B header) parsed as wandb's Record protos."""
    from wandb.proto import wandb_internal_pb2
    with open(run_file, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.mark.slow
def test_wandb_offline_history_holds_the_logged_scalars(dp2):
    _, out = dp2
    records = train_records(out / "metrics.jsonl")
    files = glob.glob(str(out / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, files
    rows = {row["_step"]: row for row in wandb_history(files[0])}
    assert sorted(rows) == [4, 8]
    for record in records:
        row = rows[record["iteration"]]
        assert row["train/lm_loss"] == pytest.approx(record["lm_loss"], rel=1e-12)
        assert row["train/tokens_per_second"] == pytest.approx(record["tokens_per_second"], rel=1e-12)
        assert row["train/lr"] == pytest.approx(record["lr"], rel=1e-12)
        assert row["timers/optimizer"] == pytest.approx(max(record["timers"]["optimizer"]), rel=1e-12)


def fresh_throughput_pair(sample_data, out):
    """tokens/s of iterations 5-8 of an uninterrupted run and of iteration 8 of its resume from 6 (one process
    each: half the launch time of DP 2 and less exposed to other jobs on the machine)."""
    out.mkdir()
    run_pretrain(args(sample_data, out, *TIMED, "--save", str(out / "ckpt"), "--save-interval", "6",
                      model=DP2_MODEL), 1)
    resumed = out / "resumed"
    resumed.mkdir()
    run_pretrain(args(sample_data, resumed, *TIMED, "--load", str(out / "ckpt" / "iter_0000006"), model=DP2_MODEL), 1)
    return tuple(train_records(folder / "metrics.jsonl")[-1]["tokens_per_second"] for folder in (out, resumed))


@pytest.mark.slow
def test_resume_throughput_and_metrics_file_without_the_abandoned_iterations(dp2, dp2_resumed, sample_data,
                                                                            tmp_path):
    _, straight_out = dp2
    proc, out = dp2_resumed
    straight = {r["iteration"]: r for r in train_records(straight_out / "metrics.jsonl")}
    records = train_records(out / "metrics.jsonl")
    # the copied file's record 8 (after the checkpoint at 6) is gone; the resumed run's 8 (one counted iteration:
    # 7 is its first, reported apart) follows record 4
    assert [(r["iteration"], r["window_iterations"]) for r in records] == [(4, 3), (8, 1)]
    assert records[0] == straight[4]
    # One iteration against four: on a loaded 2-core machine single iterations vary by +-30% (measured), so a
    # pair outside 20% is relaunched, up to three times (one process each, ~15 s a pair; in the quiet case none
    # is). A wrong divisor (the bug this guards against) is off by 2x or more in every pair.
    pairs = [(straight[8]["tokens_per_second"], records[1]["tokens_per_second"])]
    while pairs[-1][1] != pytest.approx(pairs[-1][0], rel=0.20) and len(pairs) < 4:
        pairs.append(fresh_throughput_pair(sample_data, tmp_path / f"pair{len(pairs)}"))
    assert pairs[-1][1] == pytest.approx(pairs[-1][0], rel=0.20), pairs
    # W&B could not start: one warning, and the run finished
    warnings = [line for line in proc.stderr.splitlines() if "W&B could not start" in line]
    assert len(warnings) == 1 and "training goes on without W&B" in warnings[0], proc.stderr[-3000:]
    assert "training stopped at iteration 8 (finished)" in proc.stderr


@pytest.mark.slow
def test_tp2_pp2_phases_bubble_and_level2_detail(tp2pp2):
    proc, out = tp2pp2
    for record in train_records(out / "metrics.jsonl"):
        assert_phases_add_up(record, 4)
        assert record["comm_share"] > 0 and min(record["timers"][TP_COMM]) > 0
        assert min(record["timers"]["pipeline-send-recv"]) > 0
        assert record["bubble_theory"] == pytest.approx((2 - 1) / (4 + 2 - 1))  # m = 8 / 2 micro batches
        assert 0 < record["bubble_share"] < 1
        detail = record["timers_detail"]
        assert {f"forward-compute micro-batch {m}" for m in range(4)} <= set(detail)
        assert {f"layer {n} forward" for n in range(4)} <= set(detail)
        for n in range(4):  # two layers per stage: each layer is timed on the two TP ranks of its stage
            assert len(detail[f"layer {n} forward"]) == 2
    assert "pipeline bubble: " in proc.stderr and "(schedule 20.0%)" in proc.stderr
    assert "timers (level 2, ms per iteration, per rank): " in proc.stderr


@pytest.mark.slow
def test_one_process_reports_no_communication(sample_data, tmp_path):
    proc = run_pretrain(args(sample_data, tmp_path, "--timing-log-level", "1", iters=4), 1)
    (record,) = train_records(tmp_path / "metrics.jsonl")
    assert "comm_share" not in record and "bubble_share" not in record
    assert "communication:" not in proc.stderr
    total = sum(record["timers"][phase] for phase in PHASES if phase in record["timers"])
    assert total == pytest.approx(record["ms_per_iteration"], rel=0.10)
    assert "timers (ms per iteration, max over ranks): batch-generator " in proc.stderr
