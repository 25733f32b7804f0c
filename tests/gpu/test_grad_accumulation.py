"""Gradient accumulation fusion on CUDA: a tiny BLOOM's losses and gradients after several micro batches with the
fusion against without it, in fp32 and bf16, eager, with --compile-blocks (the custom op inside the compiled
block's backward graph), with activation checkpointing (also compiled) and with --fused-elementwise.

Tolerances: the forward is the same ops either way (losses equal to 1e-5 relative: inductor may fuse the compiled
block's graph with the custom function otherwise). fp32 gradients agree to 1e-5 relative to
max|g| (cuBLAS's beta = 1 GEMM rounds once where mm + add rounds twice). bf16: each gradient is compared with the
fp32 gradients of the same (rounded) weights; the fused one must be as close as the unfused one (error <= 2 x the
unfused error + 1e-3 x max|g|): it rounds the bf16 .grad once per micro batch instead of twice.
"""
import dataclasses

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model import BloomModel

pytestmark = pytest.mark.gpu

CONFIG = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=1024, seq_length=256,
                     attention_impl="sdpa")


def gradients(fields, dtype, fuse, micro_batches=3):
    """(losses, {name: fp32 .grad}) of a fresh model after `micro_batches` forward/backward passes."""
    model = BloomModel(dataclasses.replace(CONFIG, gradient_accumulation_fusion=fuse, **fields))
    model = model.to("cuda", dtype).train()
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(micro_batches):
        ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length + 1), generator=generator).cuda()
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
        loss.backward()
        losses.append(loss.item())
    return losses, {name: p.grad.float() for name, p in model.named_parameters()}


@pytest.mark.parametrize("fields", [{}, {"compile_blocks": True}, {"checkpoint_activations": True},
                                    {"compile_blocks": True, "checkpoint_activations": True},
                                    {"fused_elementwise": True}],
                         ids=["eager", "compile-blocks", "checkpointed", "compile-blocks-checkpointed",
                              "fused-elementwise"])
def test_fused_gradients_match_unfused_fp32(fields):
    fused_losses, fused = gradients(fields, torch.float32, True)
    losses, unfused = gradients(fields, torch.float32, False)
    torch.testing.assert_close(fused_losses, losses, rtol=1e-5, atol=0)
    for name, grad in unfused.items():
        torch.testing.assert_close(fused[name], grad, rtol=0, atol=1e-5 * grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("fields", [{}, {"compile_blocks": True}], ids=["eager", "compile-blocks"])
def test_fused_bf16_gradients_as_close_to_fp32_as_unfused(fields):
    fused_losses, fused = gradients(fields, torch.bfloat16, True)
    losses, unfused = gradients(fields, torch.bfloat16, False)
    torch.testing.assert_close(fused_losses, losses, rtol=1e-2, atol=0)  # bf16 activations: a rounding step
    # the fp32 reference starts from the same bf16-rounded weights (BloomModel initialises in fp32, then casts)
    reference = BloomModel(dataclasses.replace(CONFIG, gradient_accumulation_fusion=False, **fields))
    reference = reference.to("cuda", torch.bfloat16).float().train()
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length + 1), generator=generator).cuda()
        reference(ids[:, :-1], labels=ids[:, 1:]).mean().backward()
    for name, param in reference.named_parameters():
        want = param.grad
        fused_error = (fused[name] - want).abs().max().item()
        unfused_error = (unfused[name] - want).abs().max().item()
        assert fused_error <= 2 * unfused_error + 1e-3 * want.abs().max().item(), (name, fused_error, unfused_error)
