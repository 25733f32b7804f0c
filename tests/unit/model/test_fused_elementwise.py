"""The block's fused elementwise path (megatron.fused_kernels.elementwise) on the CPU: its maths equals the unfused
block (the regions' eager references, fp32), the CPU never takes it, and the flag reaches the model.

The compiled regions themselves need CUDA: tests/gpu/test_fused_elementwise.py.
"""
import pytest
import torch

from megatron.config import ModelConfig
from megatron.model import BloomModel
from megatron.model.attention import _alibi_score_mod, _slopes_key
from megatron.model.bloom import BloomBlock


def block_and_input(dropout=0.0, post_ln_residual=False, seed=0):
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=16,
                         hidden_dropout=dropout, apply_residual_connection_post_layernorm=post_ln_residual,
                         attention_impl="torch")
    block = BloomBlock(config, 0).train()
    with torch.no_grad():  # non-zero biases and LayerNorm affines, so a bias added twice or dropped shows
        for name, param in block.named_parameters():
            if param.dim() == 1:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    return block, x


def forward_backward(block, x, forward, seed=5):
    block.zero_grad()
    x.grad = None
    torch.manual_seed(seed)  # the same dropout masks for both paths (drawn in the same order)
    out = forward(x)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    out.backward(grad)
    return out.detach(), x.grad.clone(), {name: p.grad.clone() for name, p in block.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("post_ln_residual", [False, True])
def test_fused_path_maths_equals_unfused_block(dropout, post_ln_residual):
    """forward_fused (here the regions' eager references: GEMMs without bias, the bias added in the region) gives
    the unfused block's output and every gradient: same biases, same residual, same LayerNorm, same dropout."""
    block, x = block_and_input(dropout, post_ln_residual)
    want = forward_backward(block, x, block.forward)
    got = forward_backward(block, x, block.forward_fused)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        assert want[2][name].abs().sum() > 0, name
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=1e-5, msg=name)


def test_cpu_never_takes_the_fused_path():
    """On the CPU, fused_elementwise on or off runs the same ops: bitwise-equal output and gradients."""
    block, x = block_and_input()
    want = forward_backward(block, x, block.forward)
    block.forward_fused = None  # would raise if called
    got = forward_backward(block, x, block.forward)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(got[2][name], want[2][name]) for name in want[2])


def test_flag_reaches_the_blocks():
    from megatron.arguments import load_and_resolve
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--lr", "1e-4", "--train-iters", "1", "--mock-data"]
    on, _, _ = load_and_resolve(base, world_size=1)
    off, _, _ = load_and_resolve(base + ["--no-fused-elementwise"], world_size=1)
    assert on.model.fused_elementwise is True and off.model.fused_elementwise is False
    assert [layer.fused_elementwise for layer in BloomModel(off.model).layers] == [False, False]


def test_equal_slopes_share_one_score_mod_and_key():
    """Each layer's slopes tensor is its own object; equal values must map to one score_mod (one compiled flex
    kernel for every layer), and the key is read once per tensor object (not a host sync per call)."""
    a, b = torch.tensor([0.5, 0.25]), torch.tensor([0.5, 0.25])
    assert _slopes_key(a) == _slopes_key(b) == ("cpu", (0.5, 0.25))
    assert _alibi_score_mod(a) is _alibi_score_mod(b)
    assert _alibi_score_mod(torch.tensor([0.5, 0.125])) is not _alibi_score_mod(a)
