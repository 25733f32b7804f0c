"""benchmarks/generation_speed.py: its bandwidth bound by hand, and one tiny CPU run's figures and parity."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from benchmarks import generation_speed  # noqa: E402


def test_nominal_bandwidth_by_device_name():
    assert [generation_speed.nominal_tbps(name) for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 NVL",
                                                            "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "x86_64")] \
        == [4.8, 3.35, 3.9, 2.0, 2.039, 4.8]


def test_bandwidth_bound_by_hand():
    # the 1.72B model's 3.44 GB of bf16 weights at 4.8 TB/s, no cache: 4.8e12 / 3.44e9 tokens/s at batch 1
    assert generation_speed.bandwidth_bound_tokens_per_s(1, 3.44e9, 0, 0, 4.8e12) == pytest.approx(1395.35, abs=0.01)
    # 64 rows, 24 layers x 2 (k, v) x 2048 x 2 bytes per position, 159.5 positions each on average
    kv = 24 * 2 * 2048 * 2
    assert generation_speed.bandwidth_bound_tokens_per_s(64, 3.44e9, kv, 159.5, 4.8e12) == \
        pytest.approx(64 * 4.8e12 / (3.44e9 + 64 * kv * 159.5))


def test_tiny_cpu_run_reports_both_paths_equal_to_hf(tmp_path):
    out = tmp_path / "g.json"
    generation_speed.main(["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "512", "--new-tokens", "8",
                           "--batch-sizes", "1", "3", "--equality-batches", "1", "3", "--repeats", "1",
                           "--output", str(out)])
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert set(row["sides"]) == {"hf", "unfused", "fused"} and row["sides"]["hf"]["mode"] == "default"
        for name in ("unfused", "fused"):
            side = row["sides"][name]
            assert side["rows_equal_to_hf"] == row["batch"] and side["divergences"] == []
            assert side["of_bound"] == pytest.approx(side["tokens_per_s"] / row["bound_tokens_per_s"])
        assert row["sides"]["fused"]["rows_equal_to_unfused"] == row["batch"]
    params = 512 * 64 + 2 * 64 + 2 * (4 * 64 * 64 + 4 * 64 + 2 * 4 * 64 * 64 + 5 * 64 + 4 * 64) + 2 * 64
    assert report["weight_bytes"] == 4 * params


def test_breakdown_splits_the_generate_wall_time(tmp_path):
    """--breakdown: each path's generate() is prefill + its decode steps + host time, the steps counted exactly
    (the prefill gives the first of --new-tokens tokens, one decode step each of the others, one sync)."""
    out = tmp_path / "b.json"
    generation_speed.main(["--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "128", "--new-tokens", "6",
                           "--batch-sizes", "1", "3", "--paths", "unfused", "fused", "--hf", "none", "--repeats", "1",
                           "--breakdown", "--output", str(out)])
    report = json.loads(out.read_text())
    assert [(b["path"], b["batch"]) for b in report["breakdowns"]] == [("unfused", 1), ("fused", 1), ("unfused", 3),
                                                                       ("fused", 3)]
    for b in report["breakdowns"]:
        assert b["decode_steps"] == 5 and b["syncs"] == 1, b
        assert b["prefill_ms"] > 0 and b["decode_ms"] > 0 and b["host_ms"] >= 0, b
        assert b["prefill_ms"] + b["decode_ms"] + b["host_ms"] == pytest.approx(b["wall_ms"])
        assert b["tokens_per_s"] == pytest.approx(b["batch"] * 6 / b["wall_ms"] * 1e3)
        assert b["decode_tokens_per_s"] == pytest.approx(b["batch"] * 5 / b["decode_ms"] * 1e3)
