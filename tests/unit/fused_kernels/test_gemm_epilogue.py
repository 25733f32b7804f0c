"""The GEMM epilogues' start-up check (megatron/fused_kernels/gemm_epilogue.py) on the CPU with stand-in modules:
a module that agrees with the torch ops is used, one that is wrong or raises is not (one warning naming why); the
CPU never takes the epilogues. The kernels themselves: tests/gpu/test_gemm_epilogue.py."""
import logging

import pytest
import torch

from megatron.fused_kernels import gemm_epilogue
from megatron.fused_kernels.gemm_epilogue import TorchGemmEpilogueOps


class WrongBiasGradient(TorchGemmEpilogueOps):
    @staticmethod
    def gemm_dgelu_bgrad(grad, weight, pre):
        grad_pre, grad_bias = TorchGemmEpilogueOps.gemm_dgelu_bgrad(grad, weight, pre)
        return grad_pre, grad_bias * 0.5


class Raising(TorchGemmEpilogueOps):
    @staticmethod
    def gemm_bias_gelu(x, weight, bias):
        raise RuntimeError("cuBLASLt heuristic failed: CUBLAS_STATUS_NOT_SUPPORTED\nmore")


@pytest.mark.parametrize("module,warning", [
    (TorchGemmEpilogueOps, None),
    (WrongBiasGradient, "relative errors 0.00e+00, 0.00e+00, 0.00e+00, 5.00e-01 against torch exceed 0.0001"),
    (Raising, "cuBLASLt heuristic failed: CUBLAS_STATUS_NOT_SUPPORTED"),
    (None, None)], ids=["agrees", "wrong", "raises", "not-built"])
def test_self_check_uses_only_a_module_that_agrees(monkeypatch, caplog, module, warning):
    monkeypatch.setattr(gemm_epilogue, "_module", lambda: module)
    with caplog.at_level(logging.WARNING, logger="megatron.fused_kernels.gemm_epilogue"):
        assert gemm_epilogue._self_check(torch.device("cpu"), torch.float32) is (module is TorchGemmEpilogueOps)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ([] if warning is None else
                        [f"GEMM epilogues not used on cpu for torch.float32: {warning}"])


def test_the_cpu_never_takes_the_epilogues(monkeypatch):
    monkeypatch.setattr(gemm_epilogue, "_module", lambda: TorchGemmEpilogueOps)
    assert not gemm_epilogue.available(torch.zeros(2))
    assert gemm_epilogue.unserved_reason(torch.zeros(2)) == "GEMM epilogues need CUDA tensors"
