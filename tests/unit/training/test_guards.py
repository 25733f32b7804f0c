"""The NonFiniteGuard on a real one-process DeepSpeed engine (fp32, no ZeRO: torch's optimizer, which checks
nothing itself): a finite step logs the true gradient norm and applies AdamW to the clipped gradients; a
non-finite loss skips the update, counts it, and leaves the weights and the LR schedule where they were."""
import math

import pytest
import torch
from torch import nn

from tests.distributed import run_distributed

CLIP = 0.5
LR = 1e-2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))


def _loss(model, x):
    return model(x).pow(2).mean()


def _guarded_steps(rank, world_size, out):
    import deepspeed
    from megatron.core import parallel_state
    from megatron.optimizer import AnnealingLR
    from megatron.training.guards import NonFiniteGuard

    state = parallel_state.initialize_model_parallel(1, 1)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = AnnealingLR(optimizer, LR, LR / 10, 0, 10, "cosine")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config={
        "train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": CLIP},
        dist_init_required=False)
    guard = NonFiniteGuard(engine, state, CLIP)
    assert guard.active
    x = torch.arange(8.0).reshape(2, 4) / 4
    results = {}
    for name, inputs in (("finite", x), ("nan", x * float("nan"))):
        loss = _loss(engine.module, inputs)
        guard.note_loss(loss)
        engine.backward(loss)
        engine.step()
        results[name] = dict(weights=[p.detach().clone() for p in engine.module.parameters()],
                             grad_norm=guard.grad_norm(), skipped=engine.skipped_steps, lr=scheduler.get_lr())
    torch.save(results, out["path"])


def test_guard_measures_clips_and_skips_a_non_finite_step(tmp_path):
    path = str(tmp_path / "results.pt")
    run_distributed(_guarded_steps, 1, {"path": path})
    got = torch.load(path)

    # the reference: plain torch, the same model and input, the gradient clipped by the same rule
    model = _model()
    loss = _loss(model, torch.arange(8.0).reshape(2, 4) / 4)
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
    assert norm > CLIP  # so that clipping is exercised
    for p in model.parameters():
        p.grad.mul_(CLIP / (norm + 1e-6))
    reference = torch.optim.AdamW(model.parameters(), lr=LR)
    reference.step()

    finite, nan = got["finite"], got["nan"]
    assert finite["grad_norm"] == pytest.approx(norm, rel=1e-6)
    for ours, theirs in zip(finite["weights"], model.parameters()):
        torch.testing.assert_close(ours, theirs.detach(), rtol=0, atol=1e-7)
    assert finite["skipped"] == 0
    assert nan["grad_norm"] == float("inf") and nan["skipped"] == 1
    for before, after in zip(finite["weights"], nan["weights"]):
        assert torch.equal(before, after)  # the update was not applied
    assert nan["lr"] == finite["lr"]  # the LR schedule held
