"""megatron/optimizer/unfused.py's gradient norm: DeepSpeed's get_weight_norm in one multi-tensor reduction."""
import math

import pytest
import torch
from deepspeed.runtime.utils import get_weight_norm

from megatron.optimizer.unfused import gradient_norm


def grads(dtype):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in ((64, 32), (32,), (7, 5, 3), (1,))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_norm_equals_deepspeeds_and_an_independent_one(dtype):
    tensors = grads(dtype)
    independent = math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))
    ours = gradient_norm(tensors)
    assert ours == pytest.approx(independent, rel=1e-6)
    assert ours == pytest.approx(get_weight_norm(tensors), rel=1e-6)


def test_the_pipelines_replicated_copy_does_not_count():
    tensors = grads(torch.float32)
    tensors[0].ds_pipe_replicated = True
    assert gradient_norm(tensors) == pytest.approx(math.sqrt(sum(float(t.pow(2).sum()) for t in tensors[1:])),
                                                   rel=1e-6)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_gradient_makes_the_norm_invalid_as_deepspeeds(bad):
    tensors = grads(torch.bfloat16)
    tensors[2][3, 1, 0] = bad
    assert gradient_norm(tensors) == -1 == get_weight_norm(tensors)


def test_a_norm_too_large_for_fp32_squares_is_invalid():
    assert gradient_norm([torch.full((4,), 3e19)]) == -1
