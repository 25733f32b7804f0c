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


def _tool():
    import importlib.util
    from tests.launch import ROOT
    spec = importlib.util.spec_from_file_location("benchmark_training", ROOT / "tools" / "benchmark_training.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_ab_plans_eager_compiled_blocks_and_regions():
    """--ab: ours (eager, the default), then --compile-blocks, then --fused-elementwise; HF only when asked."""
    tool = _tool()
    assert tool.plan_sides(tool.parse_args(["--ab", "--skip-hf"])) == [
        ("ours", []), ("ours-block", ["--compile-blocks"]), ("ours-regions", ["--fused-elementwise"])]
    assert [label for label, _ in tool.plan_sides(tool.parse_args(["--hf-compile"]))] == ["ours", "hf", "hf-compile"]


def test_kernel_origins_follow_the_launch_to_its_host_op_and_frames():
    """--origins: a kernel is attributed through its correlation id to the innermost host ops and this repo's frames
    open on the launching thread (the autograd thread apart from the main one); other kernels are not counted."""
    def x(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}

    events = [
        x("python_function", "megatron/model/bloom.py(10): forward", 0, 100),
        x("cpu_op", "aten::layer_norm", 10, 30), x("cpu_op", "aten::native_layer_norm", 12, 20),
        x("cuda_runtime", "cudaLaunchKernel", 15, 2, correlation=1),
        x("cpu_op", "aten::sum", 50, 10), x("cuda_runtime", "cudaLaunchKernel", 52, 2, correlation=2),
        x("python_function", "deepspeed/runtime/engine.py(5): backward", 200, 100, tid=2),
        x("cpu_op", "aten::sum", 210, 10, tid=2), x("cuda_runtime", "cudaLaunchKernel", 212, 2, tid=2, correlation=3),
        x("kernel", "reduce_kernel<float>", 20, 4000, correlation=2),
        x("kernel", "reduce_kernel<float>", 220, 1000, correlation=3),
        x("kernel", "layer_norm_kernel", 18, 500, correlation=1),
    ]
    found = _tool()._kernel_origins(events, ["reduce_kernel", "Memset"])
    assert found["Memset"] == []
    assert found["reduce_kernel"] == [[4.0, 1, "aten::sum < megatron/model/bloom.py(10): forward"],
                                      [1.0, 1, "aten::sum < deepspeed/runtime/engine.py(5): backward"]]
    assert _tool()._kernel_origins(events, ["layer_norm"])["layer_norm"] == [
        [0.5, 1, "aten::native_layer_norm < aten::layer_norm < megatron/model/bloom.py(10): forward"]]
