"""The planner's enumeration, its step-time arithmetic and its recommendation for the document's question
(4 x 24 GiB, the 1.72B model, global batch 256, sequence 2048), checked against independent computations."""
import json

import pytest

from megatron.arguments import parse_args
from megatron.planning import memory, planner, plan_cli, speed
from megatron.training.metrics import model_flops_per_iteration

DOC = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
       "--max-position-embeddings", "2048", "--pad-vocab-size-to", "250880", "--global-batch-size", "256",
       "--micro-batch-size", "1", "--bf16", "--lr", "1e-4", "--train-iters", "1", "--mock-data"]


def rtx3090(num_gpus=4, collectives_json=None):
    spec = speed.gpu_spec("rtx3090")
    return planner.Hardware(num_gpus, 24, spec["tflops"], 0.5, speed.bandwidths_from(spec, collectives_json))


@pytest.fixture(scope="module")
def doc_plans():
    args = parse_args(DOC)
    return planner.plan_all(args, {}, rtx3090(), 256, None)


def test_zero0_single_stage_peak_is_twenty_bytes_per_parameter():
    """bf16, ZeRO 0, one stage: at the optimizer step the rank holds bf16 weights and gradients, the fp32
    master gradient, fp32 master weights and Adam's two moments (2+2+4+4+8 bytes) and one fp32 step counter
    per tensor; that is the peak when the activations are small (micro batch 1 with checkpointing)."""
    config, _ = planner.resolve_layout(parse_args(DOC), {}, planner.Layout(1, 1, 4, 0, 1, True, False), 256, None)
    n = config.model.num_parameters()
    tensors = 1 + 2 + 12 * 24 + 2
    stage = memory.layout_memory(config.model, 1, 1, 4, 1, 64, "bf16", 0, True)[0]
    assert stage.states.weights + stage.states.gradients + stage.states.optimizer == 20 * n + 4 * tensors
    assert stage.peak == 20 * n + 4 * tensors


def test_every_layout_is_enumerated_or_refused(doc_plans):
    plans, refused = doc_plans
    layouts = {p.layout for p in plans}
    assert len(layouts) == len(plans)
    # TP x PP x DP = 4 for every plan, and PP > 1 never with ZeRO 2/3 (pretrain_bloom.py refuses those)
    assert all(p.layout.tp * p.layout.pp * p.layout.dp == 4 for p in plans)
    assert not any(p.layout.pp > 1 and p.layout.zero_stage > 1 for p in plans)
    messages = "\n".join(refused)
    assert "DeepSpeed's pipeline engine supports ZeRO 0 and 1" in messages
    assert "--cpu-offload needs ZeRO stage 1, 2 or 3" in messages
    total = sum(refused.values()) + len(plans)
    assert total == len(list(planner.candidates(4, 256)))


def test_sorted_fitting_first_by_speed(doc_plans):
    plans, _ = doc_plans
    fits = [p.fits for p in plans]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    speeds = [p.time.tokens_per_second for p in plans if p.fits]
    assert speeds == sorted(speeds, reverse=True)
    hardware = rtx3090()
    assert all(p.peak <= hardware.usable_bytes for p in plans if p.fits)
    assert all(p.peak > hardware.usable_bytes for p in plans if not p.fits)
    sentence = planner.recommendation(plans, hardware)
    assert sentence.startswith(f"Recommended: {plans[0].layout.short()} ({plans[0].layout.flags()})")


def test_step_time_arithmetic():
    """One layout recomputed by hand: compute at 50% of 71 TFLOP/s, the 1F1B bubble, TP and DP traffic."""
    config, _ = planner.resolve_layout(parse_args(DOC), {}, planner.Layout(2, 2, 1, 1, 2, False, False), 256, None)
    hardware = rtx3090()
    plan = planner.evaluate(config, hardware)
    m = 128  # 256 / (micro 2 x DP 1)
    flops = model_flops_per_iteration(256, 2048, 24, 2048, 250880)
    compute_mb = flops / 4 / m / (71e12 * 0.5)
    hidden = 2 * 2048 * 2048 * 2
    tp_mb = (12 * 4 + 2) * hidden * 2 * (2 - 1) / 2 / 10e9
    pp_mb = 2 * hidden / 10e9
    tied = 2 * 250880 // 2 * 2048 * 2 / 10e9
    expected = (m + 1) * (compute_mb + tp_mb + pp_mb) + tied
    assert plan.time.seconds == pytest.approx(expected, rel=1e-12)
    assert plan.time.bubble == pytest.approx(1 / (m + 1))
    assert plan.time.tokens_per_second == pytest.approx(256 * 2048 / expected)


def test_measured_bandwidths_replace_the_published_ones(tmp_path):
    path = tmp_path / "collectives.json"
    rows = [dict(op=op, bytes=size, busbw_gbps=bw * size / 2 ** 30, ok=True)
            for op, bw in (("all_reduce", 20.0), ("all_gather", 30.0), ("reduce_scatter", 40.0), ("p2p", 50.0))
            for size in (2 ** 20, 2 ** 30)]
    path.write_text(json.dumps({"world_size": 4, "backend": "nccl", "results": rows}))
    bw = speed.bandwidths_from(speed.gpu_spec("rtx3090"), str(path))
    assert (bw.all_reduce, bw.all_gather, bw.reduce_scatter, bw.p2p) == (20.0, 30.0, 40.0, 50.0)
    path.write_text(json.dumps({"world_size": 1, "backend": "nccl", "results": rows}))
    with pytest.raises(ValueError, match="was measured by one process, which moves nothing between GPUs"):
        speed.bandwidths_from(speed.gpu_spec("rtx3090"), str(path))
    path.write_text("{}")
    with pytest.raises(ValueError, match="--collectives-json .*: not a tools/check_environment.py --collectives JSON"):
        speed.bandwidths_from(speed.gpu_spec("rtx3090"), str(path))


def test_tool_prints_table_and_recommendation(capsys, isolated_logging):
    plans = plan_cli.main(["--num-gpus", "4", "--gpu-memory-gib", "24", "--gpu", "rtx3090", *DOC])
    out = capsys.readouterr().out
    assert "peak GiB" in out and "DOES NOT FIT" in out  # the launch line's ZeRO 0 at micro batch 1
    assert f"Recommended: {plans[0].layout.short()}" in out
    assert "stage 0: 24 layers, word embedding + tied LM head and loss" in out


def test_pretrain_advice_names_the_planners_best_layout(caplog):
    """pretrain_bloom.py's memory line and warning text: the launch line's predicted peak, and for a smaller
    device the fastest layout of the same GPU count that fits (the planner's own ranking on published figures)."""
    from megatron.arguments import resolve
    from megatron.planning import advice
    config, ds = resolve(parse_args(DOC), 4, None, None, None)  # DP 4, ZeRO 0, micro batch 1: 32 GiB
    line, peak = advice.predicted_memory_line(config, cuda=False, ds_config=ds)
    stage = memory.layout_memory(config.model, 1, 1, 4, 1, 64, "bf16", 0, False)[0]
    assert peak == stage.peak
    assert line.startswith(f"predicted peak memory per GPU: {stage.peak / memory.GIB:.2f} GiB = weights")
    device = 24 * memory.GIB
    best = planner.best_fitting(config, device, ds_config=ds)
    hardware = planner.Hardware(4, 24, speed.GPUS["h100"]["tflops"], speed.DEFAULT_EFFICIENCY,
                                speed.bandwidths_from(speed.GPUS["h100"]))
    plans, _ = planner.plan_all(parse_args(DOC), {}, hardware, 256, None)
    assert best.layout == [p for p in plans if p.fits][0].layout
    assert advice.suggestion(config, device, ds) == (
        f"the planner's best layout that fits is {best.layout.flags()} (predicted {best.peak / memory.GIB:.1f} GiB "
        "per GPU); see tools/plan_layout.py")
    assert "no layout of 4 GPUs fits" in advice.suggestion(config, 2 * memory.GIB, ds)


def test_pretrain_logs_the_predicted_peak_at_debug_on_cpu(caplog):
    import logging
    import types
    from megatron.arguments import resolve
    from megatron.planning import advice
    config, ds = resolve(parse_args(DOC), 4, None, None, None)
    with caplog.at_level(logging.DEBUG, logger="megatron.planning"):
        peak = advice.check_before_build(config, ds, types.SimpleNamespace(rank=0), cuda=False)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, advice.predicted_memory_line(config, False, ds)[0])]
    assert peak == advice.predicted_memory_line(config, False, ds)[1]


def test_warning_once_on_rank_0_and_the_oom_suggestion(caplog, monkeypatch):
    """On a 24 GiB GPU (device properties stubbed: this machine has none) the 32 GiB launch line gets one warning
    on rank 0 naming the planner's best layout for an RTX 3090; the out-of-memory hint ends with the same."""
    import logging
    import types
    import torch
    from megatron.arguments import resolve
    from megatron.planning import advice
    from megatron.training.trainer import OOM_HINT
    prop = types.SimpleNamespace(total_memory=24 * memory.GIB, name="NVIDIA GeForce RTX 3090")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: prop)
    config, ds = resolve(parse_args(DOC), 4, None, None, None)
    expected = advice.suggestion(config, prop.total_memory, ds, prop.name)
    assert expected.startswith("the planner's best layout that fits is --tensor-model-parallel-size 1 "
                               "--pipeline-model-parallel-size 1 --zero-stage 1")
    with caplog.at_level(logging.INFO, logger="megatron.planning"):
        advice.check_before_build(config, ds, types.SimpleNamespace(rank=1), cuda=True)
        assert caplog.records == []
        advice.check_before_build(config, ds, types.SimpleNamespace(rank=0), cuda=True)
    line, peak = advice.predicted_memory_line(config, True, ds)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, line),
        (logging.WARNING, f"the predicted peak memory per GPU, {peak / memory.GIB:.2f} GiB, exceeds this GPU's "
                          f"24.00 GiB: {expected}")]
    assert OOM_HINT + advice.oom_suggestion(config) == OOM_HINT + "; " + advice.suggestion(
        config, prop.total_memory, None, prop.name)
