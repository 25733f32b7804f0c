"""TP=4 equals TP=1: four gloo processes on the CPU, one tiny BLOOM built from the same seed at both sizes.

Compared in fp32: the loss and the gradient of every parameter (split ones gathered along their partition dim)
within atol 1e-5 (the difference is summation order in the all-reduces and the split matmuls); the gathered
initial weights and the full-vocabulary logits (parallel_output=False) too. Also the vocab-parallel cross entropy
alone over 4 slices against torch, with an ignored target.
"""
import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.model import BloomModel
from tests.distributed import run_distributed
from tests.unit.core.test_tensor_parallel import gather_full

TP = 4
ATOL = 1e-5


def _tp4_equals_tp1(rank, world):
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=16,
                         attention_impl="torch", tensor_model_parallel_size=1)
    state = ps.initialize_model_parallel(world, 1)
    group = state.tp_group
    model = BloomModel(ModelConfig(**{**config.__dict__, "tensor_model_parallel_size": world}), tp_group=group)
    reference = BloomModel(config)
    assert model.tp_size == world and model.layers[0].self_attention.heads_per_partition == 1

    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(11))
    ids[0, 5] = 255  # the last rank's slice
    labels = ids[:, 1:].clone()
    labels[1, 3] = -100  # ignored
    loss = model(ids[:, :-1], labels=labels)
    ref_loss = reference(ids[:, :-1], labels=labels)
    torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=0)
    assert loss[1, 3].item() == 0.0
    weights = torch.rand(loss.shape, generator=torch.Generator().manual_seed(12))
    (loss * weights).sum().backward()
    (ref_loss * weights).sum().backward()

    ref_params = dict(reference.named_parameters())
    assert set(ref_params) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(gather_full(param, param.detach(), group), ref_params[name].detach(),
                                   atol=0, rtol=0, msg=f"initial weight {name}")
        torch.testing.assert_close(gather_full(param, param.grad, group), ref_params[name].grad,
                                   atol=ATOL, rtol=0, msg=f"gradient of {name}")

    model.parallel_output = reference.parallel_output = False
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids), atol=ATOL, rtol=0)

    # The cross entropy alone: 4 vocabulary slices, large logits (stability), one ignored target.
    gen = torch.Generator().manual_seed(0)
    full = (torch.randn(3, 5, 64, generator=gen) * 20).requires_grad_()
    target = torch.randint(0, 64, (3, 5), generator=gen)
    target[2, 1] = -100
    local = full.detach().chunk(world, dim=-1)[rank].clone().requires_grad_()
    ce = tensor_parallel.vocab_parallel_cross_entropy(local, target, group)
    ref_ce = F.cross_entropy(full.view(-1, 64), target.view(-1), reduction="none").view(3, 5)
    torch.testing.assert_close(ce, ref_ce, atol=ATOL, rtol=1e-6)
    ce.sum().backward()
    ref_ce.sum().backward()
    torch.testing.assert_close(local.grad, full.grad.chunk(world, dim=-1)[rank], atol=1e-6, rtol=0)
    ps.destroy_model_parallel()


def test_tp4_loss_gradients_and_logits_equal_tp1():
    run_distributed(_tp4_equals_tp1, TP)
