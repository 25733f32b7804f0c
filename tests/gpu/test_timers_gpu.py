"""On the GPU: NVML utilization follows what the device does, and the CUDA-event phase clock measures GPU time
without synchronizing (a phase enqueued in microseconds reads as the milliseconds the device spent on it)."""
import time

import pytest
import torch

from megatron.training.monitoring import GpuUtilization
from megatron.training.timers import PhaseClock

pytestmark = pytest.mark.gpu


def busy(seconds):
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def test_nvml_utilization_busy_and_idle():
    util = GpuUtilization()
    assert util.available
    busy(0.5)
    util.start_window()
    busy(2.5)
    assert util.window_mean() > 80
    util.start_window()
    time.sleep(2.5)
    assert util.window_mean() < 20


def test_phase_clock_reads_device_time_not_host_time():
    clock = PhaseClock(cuda=True)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    host = time.perf_counter()
    clock.mark("forward-compute")
    for _ in range(50):
        a @ a
    clock.mark("optimizer")
    clock.mark(None)
    host = time.perf_counter() - host  # enqueue time only
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        a @ a
    end.record()
    torch.cuda.synchronize()
    phases, _ = clock.collect()
    reference = start.elapsed_time(end) / 1000
    assert phases["forward-compute"] == pytest.approx(reference, rel=0.15)
    assert phases["forward-compute"] > 5 * host and phases["optimizer"] < 1e-3
