"""TP=2 equals TP=1 (loss, every gradient, initial weights); the model depends only on (config, tp_group), not
on what parallel_state holds; vocab-parallel cross entropy; RNG tracker."""
import pathlib
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.model import BloomModel
from tests.distributed import run_distributed


def gather_full(param, tensor, group):
    """The full tensor of a TP-split parameter (tensor = its data or grad, joined along partition_dim)."""
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def _tp_model_equals_tp1(rank, world, heads, checkpoint_activations):
    config = ModelConfig(num_layers=2, hidden_size=48, num_attention_heads=heads, vocab_size=1000,
                         seq_length=16, attention_impl="torch", checkpoint_activations=checkpoint_activations,
                         tensor_model_parallel_size=1)
    state = ps.initialize_model_parallel(world, 1)
    tp_config = ModelConfig(**{**config.__dict__, "tensor_model_parallel_size": world})
    group = state.tp_group
    model = BloomModel(tp_config, tp_group=group)
    reference = BloomModel(config)  # no tp_group: one rank, although the TP groups exist
    assert (model.tp_size, reference.tp_size) == (world, 1)

    ids = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(5))
    ref_loss = reference(ids[:, :-1], labels=ids[:, 1:]).mean()
    loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
    ref_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)

    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        # Same seed, any TP size: the same full initial weights (compared on the gathered tensors).
        torch.testing.assert_close(gather_full(param, param.detach(), group), ref_params[name].detach(),
                                   atol=0, rtol=0, msg=f"initial weight {name}")
        torch.testing.assert_close(gather_full(param, param.grad, group), ref_params[name].grad,
                                   atol=1e-5, rtol=0, msg=f"gradient of {name}")
    ps.destroy_model_parallel()


@pytest.mark.parametrize("heads,checkpointing", [(4, False), (6, True)])
def test_tp2_loss_and_gradients_equal_tp1(heads, checkpointing):
    run_distributed(_tp_model_equals_tp1, 2, heads, checkpointing)


def _same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def _build_order_does_not_matter(rank, world):
    """The same (config, tp_group) gives the same model before, during and after parallel_state's TP groups."""
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=8,
                         attention_impl="torch")
    tp_config = ModelConfig(**{**config.__dict__, "tensor_model_parallel_size": world})
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    before = BloomModel(config)
    state = ps.initialize_model_parallel(world, 1)
    during = BloomModel(config)  # the global state says TP = world; no tp_group means one rank all the same
    split_during = BloomModel(tp_config, tp_group=state.tp_group)
    ps.destroy_model_parallel()
    split_after = BloomModel(tp_config, tp_group=state.tp_group)
    after = BloomModel(config)
    for model in (before, during, after):
        assert all(getattr(m, "tp_size", 1) == 1 for m in model.modules())
    _same_model(before, during)
    _same_model(before, after)
    _same_model(split_during, split_after)
    assert split_during.embedding.word_embeddings.weight.shape[0] == 128 // world
    losses = [m(ids[:, :-1], labels=ids[:, 1:]) for m in (before, during, after, split_during, split_after)]
    for loss in losses[1:]:
        torch.testing.assert_close(loss, losses[0], atol=1e-5, rtol=0)


def test_build_order_and_global_state_do_not_change_the_model():
    run_distributed(_build_order_does_not_matter, 2)


def test_no_global_parallel_state_in_model_layers_or_kernels():
    """The model, the TP layers/mappings and the cross-entropy kernel take the group explicitly: only
    parallel_state (DeepSpeed's mpu adapter) holds the global, and the kernel module has no communication."""
    root = pathlib.Path(__file__).resolve().parents[3] / "megatron"
    files = [*(root / "model").glob("*.py"), *(root / "core" / "tensor_parallel").glob("*.py"),
             *(root / "fused_kernels").glob("*.py")]
    pattern = re.compile(r"import .*parallel_state|parallel_state\.|get_tensor_model_parallel_\w+\(|"
                         r"get_parallel_state\(|get_world_size\(")
    offenders = [f"{path.name}:{n}" for path in files
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders
    assert "torch.distributed" not in (root / "fused_kernels" / "cross_entropy.py").read_text()


def vocab_parallel_ce_equals_torch(rank, world, device="cpu", kernel=False):
    """TP-split cross entropy (values and gradients) = torch's on the full logits; one target is ignored (-100).

    device "cuda" with kernel=True runs the csrc kernel (loaded with the abort flag, so no silent fallback). Its
    fast exp (__expf) puts fp32 gradients within 1e-5 of torch's (measured 2e-6), far below bf16's rounding.
    """
    if kernel:
        from megatron.fused_kernels import load_fused_kernels
        torch.cuda.set_device(0)
        assert load_fused_kernels(abort_on_unmet_constraints=True) is not None
    state = ps.initialize_model_parallel(world, 1)
    gen = torch.Generator().manual_seed(0)
    full_logits = (torch.randn(3, 5, 64, generator=gen) * 20).to(device).requires_grad_()  # large: stability
    target = torch.randint(0, 64, (3, 5), generator=gen).to(device)
    target[1, 2] = -100
    local = full_logits.detach().chunk(world, dim=-1)[rank].clone().requires_grad_()
    loss = tensor_parallel.vocab_parallel_cross_entropy(local, target, state.tp_group)
    ref = F.cross_entropy(full_logits.view(-1, 64), target.view(-1), reduction="none").view(3, 5)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-6)
    assert loss[1, 2].item() == 0.0
    weights = torch.rand(3, 5, generator=gen).to(device)
    (loss * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(local.grad, full_logits.grad.chunk(world, dim=-1)[rank], atol=1e-5 if kernel else 1e-6,
                               rtol=0)
    assert torch.count_nonzero(local.grad[1, 2]).item() == 0
    ps.destroy_model_parallel()


def test_vocab_parallel_cross_entropy_equals_torch():
    run_distributed(vocab_parallel_ce_equals_torch, 2)


def test_vocab_parallel_cross_entropy_single_rank_bf16_gradient_dtype():
    logits = torch.randn(4, 10).bfloat16().requires_grad_()
    target = torch.randint(0, 10, (4,))
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), target, reduction="none"))


def _rng_tracker(rank, world):
    ps.initialize_model_parallel(world, 1)
    tensor_parallel.model_parallel_manual_seed(42, tp_rank=rank)
    ones = torch.ones(1000)
    outside = F.dropout(ones, 0.5)
    with tensor_parallel.get_rng_tracker().fork():
        inside = F.dropout(ones, 0.5)
    both = [torch.empty(2, 1000) for _ in range(world)]
    dist.all_gather(both, torch.stack([outside, inside]))
    assert torch.equal(both[0][0], both[1][0]), "dropout outside the TP region must agree across TP ranks"
    assert not torch.equal(both[0][1], both[1][1]), "dropout inside the TP region must differ across TP ranks"
    ps.destroy_model_parallel()


def test_rng_tracker_inside_differs_outside_agrees():
    run_distributed(_rng_tracker, 2)


def test_checkpoint_recomputes_same_dropout():
    tensor_parallel.model_parallel_manual_seed(7)
    weight = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        with tensor_parallel.get_rng_tracker().fork():
            x = F.dropout(x @ weight, 0.5)
        return F.dropout(x, 0.3)

    x = torch.randn(4, 8, requires_grad=True)
    tensor_parallel.model_parallel_manual_seed(7)
    fn(x).sum().backward()
    expected = weight.grad.clone(), x.grad.clone()
    weight.grad = x.grad = None
    tensor_parallel.model_parallel_manual_seed(7)
    tensor_parallel.checkpoint(fn, x).sum().backward()
    torch.testing.assert_close((weight.grad, x.grad), expected, atol=0, rtol=0)
