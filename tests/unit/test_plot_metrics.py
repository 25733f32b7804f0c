"""tools/plot_metrics.py draws a PNG from a metrics file and rejects files that are not one."""
import json

from tests.launch import run_tool


def test_plot(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "iteration": i, "lm_loss": 5.0 / i, "lr": 1e-3, "tokens_per_second": 100.0 + i}
            for i in range(1, 6)] + [{"kind": "valid", "iteration": 5, "lm_loss": 1.2, "ppl": 3.3}]
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    proc = run_tool("tools/plot_metrics.py", [metrics, "--output", tmp_path / "out.png"])
    assert proc.stdout.strip().endswith("(5 training and 1 validation points)")
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_files(tmp_path):
    proc = run_tool("tools/plot_metrics.py", [tmp_path / "nope.jsonl"], check=False)
    assert proc.returncode == 1 and "nope.jsonl does not exist" in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    proc = run_tool("tools/plot_metrics.py", [bad, "--output", tmp_path / "x.png"], check=False)
    assert proc.stderr.strip() == f"error: {bad}:1: not a JSON line; pass the metrics.jsonl written by training"
    assert not (tmp_path / "x.png").exists()
