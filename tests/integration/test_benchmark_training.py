"""tools/benchmark_training.py runs end to end in its small CPU mode and reports both sides."""
import json

from tests.launch import run_tool


def test_small_benchmark_reports_both_sides(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_tool("tools/benchmark_training.py", ["--small", "--iters", "1", "--warmup-iters", "1",
                                                    "--micro-batch-size", "2", "--grad-accum", "2",
                                                    "--output", out], timeout=300)
    results = json.loads(out.read_text())
    for side in ("ours", "hf"):
        r = results[side]
        assert r["tokens_per_second"] > 0 and r["model_tflops"] > 0 and 0 < r["mfu"]
        assert all(loss == loss and loss > 0 for loss in r["losses"])  # finite, positive
    assert results["ratio"] == results["ours"]["tokens_per_second"] / results["hf"]["tokens_per_second"]
    assert "ratio ours/hf: throughput" in proc.stdout


def test_ab_plans_eager_compiled_blocks_and_regions():
    """--ab: ours (eager, the default), then --compile-blocks, then --fused-elementwise; HF only when asked."""
    import importlib.util
    from tests.launch import ROOT
    spec = importlib.util.spec_from_file_location("benchmark_training", ROOT / "tools" / "benchmark_training.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.plan_sides(tool.parse_args(["--ab", "--skip-hf"])) == [
        ("ours", []), ("ours-block", ["--compile-blocks"]), ("ours-regions", ["--fused-elementwise"])]
    assert [label for label, _ in tool.plan_sides(tool.parse_args(["--hf-compile"]))] == ["ours", "hf", "hf-compile"]
