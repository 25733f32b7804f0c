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


def unfused_optimizer(dtype, clip_grad, seed=0):
    """A DeepSpeed FP16_UnfusedOptimizer around torch AdamW over four low-precision parameters (one without a
    gradient), built without its constructor's accelerator and process-group checks."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig, LossScaleProfile
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    generator = torch.Generator().manual_seed(seed)
    low = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype))
           for shape in ((64, 32), (32,), (7, 5, 3), (3,))]
    for p in low[:3]:
        p.grad = (torch.randn(p.shape, generator=generator) * 4).to(dtype)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in low]
    opt = FP16_UnfusedOptimizer.__new__(FP16_UnfusedOptimizer)
    opt.fused_lamb_legacy, opt.mpu, opt.clip_grad, opt.verbose, opt.custom_loss_scaler = False, None, clip_grad, False, False
    opt.fp16_groups, opt.fp32_groups = [low], [masters]
    opt.optimizer = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    opt.loss_scale_config = LossScaleConfig(low_precision_dtype=dtype, dynamic_loss_scale=False, static_loss_scale=1.0,
                                            dynamic_loss_args=None, profile=LossScaleProfile.UNFUSED)
    opt.overflow_checker = type("NoOverflow", (), {"check": staticmethod(lambda param_groups=None: False)})()
    return opt, low, masters


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("clip_grad", [0.0, 1.0])
def test_the_multi_tensor_step_equals_deepspeeds_step_and_fp32_adamw(dtype, clip_grad):
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from megatron.optimizer import unfused
    deepspeed_step = getattr(FP16_UnfusedOptimizer.step, "deepspeed_step", FP16_UnfusedOptimizer.step)
    ours, ours_low, ours_masters = unfused_optimizer(dtype, clip_grad)
    theirs, theirs_low, theirs_masters = unfused_optimizer(dtype, clip_grad)
    grads = [None if p.grad is None else p.grad.float() for p in ours_low]
    assert unfused.multi_tensor_step(ours) is False and deepspeed_step(theirs) is False
    assert ours._global_grad_norm == theirs._global_grad_norm > 0
    for a, b in zip(ours_low + ours_masters, theirs_low + theirs_masters):
        assert torch.equal(a, b) and a.dtype == b.dtype
    assert all(m.grad is None for m in ours_masters)  # the fp32 gradients are released, as DeepSpeed does

    # independently: fp32 AdamW on the gradients in fp32 (clipped by the true norm), weights rounded back
    reference = [torch.nn.Parameter(p.detach().float().clone()) for p in unfused_optimizer(dtype, clip_grad)[1]]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
    factor = max(1.0, (norm + 1e-6) / clip_grad) if clip_grad > 0 else 1.0
    for p, g in zip(reference, grads):
        p.grad = torch.zeros_like(p) if g is None else g / factor if factor != 1.0 else g
    torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1).step()
    for master, low, ref in zip(ours_masters, ours_low, reference):
        torch.testing.assert_close(master, ref, rtol=1e-6, atol=1e-7)
        assert torch.equal(low, master.to(dtype))


def test_group_norms_read_every_group_back_in_one_synchronization(monkeypatch):
    """group_norms: each group's norm as gradient_norm gives it (-1 for a non-finite one), all read back by one
    tolist() of the stacked totals; the step's two parameter groups use it (multi_tensor_step equals DeepSpeed's
    step, which measures each group apart, with the weight-decay split of the real param groups)."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from megatron.optimizer import unfused
    first, second = grads(torch.bfloat16), grads(torch.float32)
    bad = grads(torch.float16)
    bad[1][3] = float("nan")
    expected = [gradient_norm(first), gradient_norm(second), gradient_norm(bad)]
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    assert unfused.group_norms([first, second, bad]) == expected and expected[2] == -1
    assert reads == [torch.Size([3])]
    monkeypatch.undo()

    deepspeed_step = getattr(FP16_UnfusedOptimizer.step, "deepspeed_step", FP16_UnfusedOptimizer.step)
    optimizers = []
    for _ in range(2):
        opt, low, masters = unfused_optimizer(torch.bfloat16, 1.0)
        opt.fp16_groups, opt.fp32_groups = [low[:2], low[2:]], [masters[:2], masters[2:]]
        opt.optimizer = torch.optim.AdamW([{"params": masters[:2]}, {"params": masters[2:], "weight_decay": 0.0}],
                                          lr=1e-2, weight_decay=0.1)
        optimizers.append((opt, low + masters))
    (ours, ours_tensors), (theirs, theirs_tensors) = optimizers
    assert unfused.multi_tensor_step(ours) is False and deepspeed_step(theirs) is False
    assert ours._global_grad_norm == theirs._global_grad_norm > 1.0  # clipped
    for a, b in zip(ours_tensors, theirs_tensors):
        assert torch.equal(a, b)
