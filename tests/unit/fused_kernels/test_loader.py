"""CPU tests of the fused-kernel loader: no-CUDA and build-failure paths, the abort flag, rank-0-first builds."""
import logging
import os
import time

import pytest
import torch

from megatron.fused_kernels import alibi_causal_softmax, load_fused_kernels
from megatron.fused_kernels import loader
from tests.distributed import run_distributed

NO_CUDA_MESSAGE = (
    "fused kernel unavailable: CUDA is not available (no GPU or a CPU-only torch build); "
    "--abort-on-unmet-fused-kernel-constraints is set, so the torch fallback is not used. "
    "Fix the constraint or drop --abort-on-unmet-fused-kernel-constraints to fall back to torch."
)


@pytest.fixture(autouse=True)
def fresh_loader():
    loader._reset_for_tests()
    yield
    loader._reset_for_tests()


needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")


@needs_no_cuda
def test_no_cuda_returns_none_and_logs_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron.fused_kernels.loader"):
        assert load_fused_kernels() is None
        assert load_fused_kernels() is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["fused kernels not built: CUDA is not available (no GPU or a CPU-only torch build); "
                     "using torch fallbacks"]


@needs_no_cuda
def test_abort_flag_on_cpu_raises_exact_message():
    with pytest.raises(RuntimeError) as info:
        load_fused_kernels(abort_on_unmet_constraints=True)
    assert str(info.value) == NO_CUDA_MESSAGE


def test_abort_flag_makes_unmet_call_constraints_raise(monkeypatch):
    monkeypatch.setattr(loader, "_attempt_build", lambda: (object(), None))
    load_fused_kernels(abort_on_unmet_constraints=True)
    with pytest.raises(RuntimeError, match="scores are on cpu, not CUDA; --abort-on-unmet-fused-kernel-constraints"):
        alibi_causal_softmax(torch.randn(1, 2, 3, 3), torch.ones(2), 1.0)


def test_fallback_reason_logged_once(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron.fused_kernels.loader"):
        for _ in range(3):
            alibi_causal_softmax(torch.randn(1, 2, 3, 3), torch.ones(2), 1.0)
    reasons = [r.getMessage() for r in caplog.records if "scores are on cpu" in r.getMessage()]
    assert reasons == ["fused kernel not used: alibi softmax: scores are on cpu, not CUDA; using the torch fallback"]


def test_build_failure_is_reported(monkeypatch, caplog):
    def failing_build():
        raise RuntimeError("Error building extension 'megatron_fused_kernels_x'\n[1/3] nvcc ...\n"
                           "alibi_softmax.cu(12): error: identifier \"foo\" is undefined")

    monkeypatch.setattr(loader, "_unavailable_reason", lambda: None)
    monkeypatch.setattr(loader, "_build", failing_build)
    with caplog.at_level(logging.WARNING, logger="megatron.fused_kernels.loader"):
        assert load_fused_kernels() is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("fused kernels build failed on rank 0: RuntimeError: Error building extension")
    assert 'alibi_softmax.cu(12): error: identifier "foo" is undefined' in line
    with pytest.raises(RuntimeError, match="Error building extension.*--abort-on-unmet-fused-kernel-constraints"):
        load_fused_kernels(abort_on_unmet_constraints=True)


def test_cache_root_and_arch_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert loader.cache_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert loader.cache_root().name == "megatron_fused_kernels"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert "-gencode=arch=compute_90,code=sm_90" in loader.arch_flags()
    assert len(loader.source_hash()) == 16


def _rank_zero_builds_first(rank, world_size, marker):
    loader._reset_for_tests()
    loader._unavailable_reason = lambda: None
    torch.cuda.get_device_capability = lambda *a: (9, 0)

    def fake_build():
        if rank == 0:
            time.sleep(0.5)  # the others must wait at the barrier, not race ahead
            open(marker, "w").close()
        elif not os.path.exists(marker):
            raise AssertionError(f"rank {rank} built before rank 0 finished")
        return f"module-{rank}"

    loader._build = fake_build
    assert load_fused_kernels() == f"module-{rank}"


def test_rank_zero_builds_before_the_others(tmp_path):
    run_distributed(_rank_zero_builds_first, 2, str(tmp_path / "built"))
