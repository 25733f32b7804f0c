"""The cross-entropy local ops (torch form, CPU): one process plays the ranks of a split vocabulary and combines
their (lse_r, predicted_r) as core's all-reduces do; the result equals torch's cross entropy on the full logits."""
import torch
import torch.nn.functional as F

from megatron.fused_kernels.cross_entropy import (IGNORE_INDEX, TorchCrossEntropyOps, cross_entropy_ops,
                                                  fused_cross_entropy)


def _split_loss_and_grads(full, target, parts, grad_loss):
    slices = full.chunk(parts, dim=-1)
    width = slices[0].shape[-1]
    stats = [TorchCrossEntropyOps.cross_entropy_forward(z.contiguous(), target, r * width, full.shape[-1],
                                                        IGNORE_INDEX) for r, z in enumerate(slices)]
    lses = torch.stack([lse for lse, _ in stats])
    top = lses.max(dim=0)[0]  # the MAX all-reduce
    lse = (lses - top).exp().sum(dim=0).log() + top  # the SUM all-reduce of exp(lse_r - max)
    predicted = torch.stack([p for _, p in stats]).sum(dim=0)  # the SUM all-reduce
    loss = (lse - predicted).float().masked_fill(target == IGNORE_INDEX, 0.0)
    grads = [TorchCrossEntropyOps.cross_entropy_backward(grad_loss, z.contiguous(), target, lse, r * width,
                                                         full.shape[-1], IGNORE_INDEX, False)
             for r, z in enumerate(slices)]
    return loss, torch.cat(grads, dim=-1)


def test_split_local_ops_equal_torch_cross_entropy_for_large_logits():
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(7, 96, generator=gen) * 20
    target = torch.randint(0, 96, (7,), generator=gen)
    target[3] = IGNORE_INDEX
    grad_loss = torch.rand(7, generator=gen)
    reference = full.clone().requires_grad_()
    ref_loss = F.cross_entropy(reference, target, reduction="none")
    ref_loss.backward(grad_loss)
    for parts in (1, 2, 4):
        loss, grad = _split_loss_and_grads(full, target, parts, grad_loss)
        torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(grad, reference.grad, atol=1e-6, rtol=0)
        assert loss[3].item() == 0.0 and torch.count_nonzero(grad[3]).item() == 0


def test_target_outside_the_vocabulary_is_nan_and_in_place_backward_writes_the_logits():
    logits = torch.randn(3, 8, dtype=torch.bfloat16)
    target = torch.tensor([1, 8, -1])
    lse, predicted = TorchCrossEntropyOps.cross_entropy_forward(logits, target, 0, 8, IGNORE_INDEX)
    assert torch.isfinite(predicted[0]) and torch.isnan(predicted[1]) and torch.isnan(predicted[2])
    grad = TorchCrossEntropyOps.cross_entropy_backward(torch.ones(3), logits, target, lse, 0, 8, IGNORE_INDEX, True)
    assert grad.data_ptr() == logits.data_ptr() and grad.dtype == torch.bfloat16
    assert torch.isfinite(grad[0]).all() and torch.isnan(grad[1]).all()


def test_cpu_logits_use_the_torch_ops_and_the_reference_loss():
    logits = torch.randn(2, 5, 16, requires_grad=True)
    target = torch.randint(0, 16, (2, 5))
    assert cross_entropy_ops(logits, target) is TorchCrossEntropyOps
    loss = fused_cross_entropy(logits, target)
    torch.testing.assert_close(loss, F.cross_entropy(logits.view(-1, 16), target.view(-1), reduction="none")
                               .view(2, 5))
