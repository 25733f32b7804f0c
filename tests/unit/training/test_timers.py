"""Phase timers without a run: the bubble formula against DeepSpeed's own schedule, the host clock, the combined
figures and their log-line text, the metrics file after an interrupted run, the writer's scalars, the flags'
errors, the profiler window's iterations and the phase panel of tools/plot_metrics.py."""
import json
from types import SimpleNamespace

import pytest

from megatron.config import LoggingConfig, MonitoringConfig
from megatron.training.metrics import MetricsWriter, drop_records_after
from megatron.training.monitoring import profiled_iterations
from megatron.training.timers import (PHASES, TP_COMM, PhaseClock, combine, format_detail, format_timing,
                                      pipeline_bubble_fraction, window_timing)


@pytest.mark.parametrize("stages,micro", [(2, 1), (2, 4), (4, 8), (8, 32), (3, 5)])
def test_bubble_fraction_equals_the_idle_steps_of_deepspeeds_schedule(stages, micro):
    """(p - 1) / (m + p - 1) against a count: the steps in which a stage of DeepSpeed's 1F1B TrainSchedule runs
    neither a forward nor a backward pass, over all its steps (each compute step is one forward or backward)."""
    from deepspeed.runtime.pipe import schedule
    for stage in range(stages):
        steps = list(schedule.TrainSchedule(micro_batches=micro, stages=stages, stage_id=stage).steps())
        idle = sum(1 for cmds in steps
                   if not any(isinstance(c, (schedule.ForwardPass, schedule.BackwardPass)) for c in cmds))
        assert idle / len(steps) == pytest.approx(pipeline_bubble_fraction(stages, micro), rel=1e-12)
    assert pipeline_bubble_fraction(1, micro) == 0.0


class FakeTime:
    """A host clock that moves only when told (sleep(s) adds s)."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_host_clock_sums_contiguous_phases_spans_and_skips_paused_time():
    fake = FakeTime()
    clock = PhaseClock(cuda=False, detail=True, host_clock=fake)
    clock.mark("forward-compute", 0)
    token = clock.begin()
    fake.sleep(0.02)
    clock.end(token)  # a TP collective inside the forward pass
    fake.sleep(0.01)
    clock.mark("forward-compute", 0)  # the same phase again: no new boundary
    clock.mark("optimizer")
    fake.sleep(0.02)
    clock.pause()  # e.g. a checkpoint save
    fake.sleep(0.5)
    assert clock.begin() is None
    clock.mark("optimizer")
    clock.resume()
    clock.mark("forward-compute", 1)
    fake.sleep(0.01)
    clock.mark("loss-sync")
    fake.sleep(0.004)
    clock.mark(None)
    fake.sleep(1.0)  # between iterations: not a phase
    clock.mark("batch-generator", 0)
    fake.sleep(0.003)
    phases, detail = clock.collect()
    assert phases == pytest.approx({**dict.fromkeys(PHASES, 0.0), "forward-compute": 0.04, "optimizer": 0.02,
                                    "loss-sync": 0.004, TP_COMM: 0.02}, abs=1e-9)
    assert detail == pytest.approx({"forward-compute micro-batch 0": 0.03, "forward-compute micro-batch 1": 0.01},
                                   abs=1e-9)
    fake.sleep(0.002)
    clock.mark(None)  # the open phase carries over into the next window
    assert clock.collect()[0]["batch-generator"] == pytest.approx(0.005, abs=1e-9)


def test_window_timing_on_one_process():
    phases = dict.fromkeys(PHASES, 0.0)
    phases.update({"forward-compute": 0.3, "backward-compute": 0.5, "grads-all-reduce": 0.1, "loss-sync": 0.1,
                   TP_COMM: 0.0})
    m = window_timing(phases, None, iterations=4, window_seconds=1.0, option="max", pipeline_stages=2,
                      micro_batches=4, gpu_utilization=91.5)
    assert m["timers"] == {"forward-compute": 75.0, "backward-compute": 125.0, "grads-all-reduce": 25.0,
                           "loss-sync": 25.0}
    assert m["timers_max"] == m["timers"]
    assert "comm_share" not in m  # one process communicates with nobody
    assert m["bubble_share"] == 0.0 and m["bubble_theory"] == pytest.approx(0.2)
    assert m["gpu_utilization"] == 91.5
    assert format_timing({**m, "comm_share": 0.2}, "max") == (
        "timers (ms per iteration, max over ranks): forward-compute 75.00, backward-compute 125.00, "
        "grads-all-reduce 25.00, loss-sync 25.00 | communication: 20.0% | pipeline bubble: 0.0% (schedule 20.0%) "
        "| GPU utilization: 91.5% |")


def test_combine_and_format_options():
    assert combine([3.0, 1.0, 2.0], "max") == 3.0
    assert combine([3.0, 1.0, 2.0], "minmax") == [1.0, 3.0]
    assert combine([3.0, 1.0, 2.0], "all") == [3.0, 1.0, 2.0]
    m = {"timers": {"optimizer": [1.0, 2.5]}}
    assert format_timing(m, "minmax") == "timers (ms per iteration, min/max over ranks): optimizer 1.00/2.50 |"
    assert format_timing(m, "all") == "timers (ms per iteration, per rank): optimizer [1.00, 2.50] |"
    assert format_detail(8, {"layer 0 forward": 1.5}, "max") == (
        "iteration        8 timers (level 2, ms per iteration, max over ranks): layer 0 forward 1.50")


def test_metrics_file_drops_the_abandoned_iterations(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "iteration": i} for i in (4, 8, 12)] + [{"kind": "valid", "iteration": 10}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    assert drop_records_after(str(path), 8) == 2
    assert path.read_text() == json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\nnot json\n"
    assert drop_records_after(str(path), 8) == 0
    assert drop_records_after(str(tmp_path / "none.jsonl"), 8) == 0
    # a resumed run's writer: the file keeps iterations <= 4 and gets the new records after them
    writer = MetricsWriter(LoggingConfig(metrics_file=str(path)), rank=0, start_iteration=4)
    writer.write("train", {"iteration": 8, "lm_loss": 1.0})
    writer.close()
    assert [json.loads(x)["iteration"] for x in path.read_text().splitlines() if x.startswith("{")] == [4, 8]


def test_scalars_hold_timers_only_when_asked():
    metrics = {"iteration": 4, "lm_loss": 2.0, "tflops": None, "timers": {"optimizer": [1.0, 3.0]},
               "timers_max": {"optimizer": 3.0}, "timers_detail": {"layer 0 forward": 0.5}}
    plain = MetricsWriter(LoggingConfig(), rank=1)
    assert plain.scalars("train", metrics) == {"train/lm_loss": 2.0}
    timed = MetricsWriter(LoggingConfig(), rank=1, timers_to_scalars=True)
    assert timed.scalars("train", metrics) == {"train/lm_loss": 2.0, "timers/optimizer": 3.0,
                                               "timers/layer 0 forward": 0.5}


@pytest.mark.parametrize("fields,message", [
    ({"log_timers_to_tensorboard": True},
     "--log-timers-to-tensorboard writes the phase timers, which --timing-log-level 0 does not measure; add "
     "--timing-log-level 1"),
    ({"profile": True, "profile_step_start": 5, "profile_step_end": 5, "profile_dir": "p"},
     "--profile-step-start 5 and --profile-step-end 5: need 0 <= start < end (start 10, end 12 traces iterations "
     "11 and 12)"),
    ({"profile": True}, "--profile needs a folder for its traces: pass --profile-dir or --tensorboard-dir"),
    ({"timing_log_option": "mean"}, "--timing-log-option mean is not one of max, minmax, all"),
])
def test_monitoring_config_errors(fields, message):
    with pytest.raises(ValueError) as err:
        MonitoringConfig(**fields)
    assert str(err.value) == message


def test_log_timers_to_tensorboard_alone_turns_on_level_one():
    """Upstream's flag (BLOOM's tr11 recipe passes it without --timing-log-level) asks for the timers."""
    from megatron.arguments import load_and_resolve
    base = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
            "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--mock-vocab-size", "64"]
    for extra, level in (([], 0), (["--log-timers-to-tensorboard"], 1),
                         (["--log-timers-to-tensorboard", "--timing-log-level", "2"], 2)):
        assert load_and_resolve(base + extra, world_size=1)[0].monitoring.timing_log_level == level


def test_profiler_window_iterations():
    assert list(profiled_iterations(SimpleNamespace(profile_step_start=10, profile_step_end=12))) == [11, 12]
    assert list(profiled_iterations(SimpleNamespace(profile_step_start=0, profile_step_end=1))) == [1]


def test_plot_phase_panel(tmp_path):
    from tests.launch import run_tool
    from tools.plot_metrics import phase_series
    rows = [{"kind": "train", "iteration": i, "lm_loss": 5.0 / i, "lr": 1e-3, "tokens_per_second": 100.0,
             "ms_per_iteration": 10.0, "timers_max": {"forward-compute": 4.0, "optimizer": 1.0 * i}}
            for i in (4, 8)] + [{"kind": "train", "iteration": 12, "lm_loss": 0.4, "lr": 1e-3,
                                 "tokens_per_second": 100.0}]
    steps, phases = phase_series(rows)
    assert steps == [4, 8] and phases == {"forward-compute": [4.0, 4.0], "optimizer": [4.0, 8.0]}
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_tool("tools/plot_metrics.py", [path, "--output", tmp_path / "out.png"])
    assert proc.stdout.strip().endswith("(3 training and 0 validation points, phase timers at 2)")
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_utilization_averages_the_samples_of_the_window():
    """The window logic on NVML's sample buffer, with a stand-in for pynvml (no GPU here)."""
    from megatron.training.monitoring import GpuUtilization

    class Error(Exception):
        pass

    buffer = [(10, 100), (20, 50)]
    fake = SimpleNamespace(
        NVMLError=Error, NVML_GPU_UTILIZATION_SAMPLES=1,
        nvmlDeviceGetSamples=lambda handle, kind, since: (0, [
            SimpleNamespace(timeStamp=t, sampleValue=SimpleNamespace(uiVal=v)) for t, v in buffer if t > since]),
        nvmlDeviceGetUtilizationRates=lambda handle: SimpleNamespace(gpu=37))
    util = GpuUtilization(warn=False)
    assert not util.available and util.window_mean() is None  # no CUDA here
    util.pynvml, util.handle = fake, object()
    util.start_window()
    assert util.since == 20
    buffer += [(30, 90), (40, 70)]
    assert util.window_mean() == 80.0  # (90 + 70) / 2: not the samples before the window
    assert util.window_mean() == 37.0  # no new sample: NVML's last-period figure


def resolve_flags(*flags, world=1):
    from megatron.arguments import load_and_resolve
    from tests.launch import TINY_MODEL
    return load_and_resolve(TINY_MODEL + ["--micro-batch-size", "2", "--train-iters", "8", "--lr", "1e-3",
                                          "--mock-data", *flags], world_size=world)[0]


def test_flags_resolve_into_the_monitoring_config(tmp_path):
    config = resolve_flags("--timing-log-level", "2", "--timing-log-option", "minmax", "--profile",
                           "--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "0", "1",
                           "--tensorboard-dir", str(tmp_path), "--wandb-project", "p", world=2)
    monitoring = config.monitoring
    assert monitoring.timing_log_level == 2 and monitoring.timing_log_option == "minmax"
    assert monitoring.profile_ranks == (0, 1)
    assert monitoring.profile_dir == monitoring.wandb_save_dir == str(tmp_path)  # both default to --tensorboard-dir
    with pytest.raises(ValueError) as err:
        resolve_flags("--profile", "--profile-step-start", "6", "--profile-step-end", "10", "--profile-dir", "p")
    assert str(err.value) == "--profile-step-end 10 is past the last iteration (8); lower it or raise --train-iters"
    with pytest.raises(ValueError) as err:
        resolve_flags("--profile", "--profile-step-start", "2", "--profile-step-end", "4", "--profile-dir", "p",
                      "--profile-ranks", "2", world=2)
    assert str(err.value) == "--profile-ranks 2: the run has ranks 0 to 1; name ranks in that range"


def test_engine_hooks_mark_deepspeeds_phases_and_come_off():
    """install_engine_hooks on a stand-in pipeline engine: each schedule instruction marks its phase (forward and
    backward passes numbered per iteration), the gradient reduction marks its own and restores the phase it
    interrupted; uninstall leaves the engine as it was (Trainer.set_timing_level switches levels this way)."""
    from deepspeed.runtime.pipe import schedule

    from megatron.training.timers import install_engine_hooks

    fake = FakeTime()
    clock = PhaseClock(cuda=False, detail=True, host_clock=fake)
    seen = []

    class Engine:
        def allreduce_gradients(self, bucket_size=0):
            seen.append(("reduce", clock.current))
            fake.sleep(0.5)

        def _aggregate_total_loss(self):
            seen.append(("loss", clock.current))

        def _run(self, cmd):  # DeepSpeed's _exec_schedule: self._INSTRUCTION_MAP[type(cmd)](self, **kwargs)
            self._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs)

        def _pass(self, buffer_id):
            fake.sleep(0.1)

        def _reduce(self):
            self.allreduce_gradients(bucket_size=1)

        _INSTRUCTION_MAP = {schedule.ForwardPass: _pass, schedule.BackwardPass: _pass,
                            schedule.ReduceGrads: _reduce}

    engine = Engine()
    uninstall = install_engine_hooks(engine, clock, pipelined=True)
    clock.new_iteration()
    for cmd in (schedule.ForwardPass(0), schedule.ForwardPass(1), schedule.BackwardPass(0),
                schedule.ReduceGrads()):
        engine._run(cmd)
    engine._aggregate_total_loss()
    clock.mark(None)
    phases, detail = clock.collect()
    assert seen == [("reduce", ("grads-all-reduce", None)), ("loss", ("loss-sync", None))]
    assert phases["forward-compute"] == pytest.approx(0.2) and phases["grads-all-reduce"] == pytest.approx(0.5)
    assert detail == pytest.approx({"forward-compute micro-batch 0": 0.1, "forward-compute micro-batch 1": 0.1,
                                    "backward-compute micro-batch 0": 0.1})
    uninstall()
    assert vars(engine) == {} and engine._INSTRUCTION_MAP is Engine._INSTRUCTION_MAP
    engine._run(schedule.ForwardPass(0))
    assert clock.collect()[0]["forward-compute"] == 0.0
