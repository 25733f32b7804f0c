"""The block's fused elementwise path (megatron.fused_kernels.elementwise) on the CPU: its maths equals the unfused
block (the regions' eager references, fp32), the CPU never takes it, and the flags reach the model; the whole-block
region of --compile-blocks traces as one graph shared by every layer (dynamo + AOTAutograd, without inductor).

The compiled regions themselves need CUDA: tests/gpu/test_fused_elementwise.py.
"""
import pytest
import torch

from megatron.config import ModelConfig
from megatron.model import BloomModel
from megatron.model.attention import _alibi_score_mod, _slopes_key
from megatron.model import bloom
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
    default, _, _ = load_and_resolve(base, world_size=1)
    on, _, _ = load_and_resolve(base + ["--fused-elementwise", "--compile-blocks"], world_size=1)
    off, _, _ = load_and_resolve(base + ["--fused-elementwise", "--no-fused-elementwise"], world_size=1)
    assert (default.model.fused_elementwise, default.model.compile_blocks) == (False, False)
    assert (on.model.fused_elementwise, on.model.compile_blocks) == (True, True)
    assert off.model.fused_elementwise is False
    layers = BloomModel(on.model).layers
    assert [(layer.fused_elementwise, layer.compile_blocks) for layer in layers] == [(True, True)] * 2
    assert [layer.fused_elementwise for layer in BloomModel(off.model).layers] == [False, False]


def test_compiled_block_traces_as_one_graph_for_every_layer():
    """The --compile-blocks region (bloom._block_forward with attention.block_attention_inputs) under dynamo and
    AOTAutograd (aot_eager: the traced forward and backward graphs run as torch ops): three layers compile one
    graph, with no graph break, and the loss and every gradient equal the eager model's (fp32, sdpa on the CPU)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    config = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=128,
                         compile_blocks=True, attention_impl="sdpa")
    torch.manual_seed(0)
    model = BloomModel(config).train()
    ids = torch.randint(0, 256, (2, 129), generator=torch.Generator().manual_seed(1))
    traced = torch.compile(bloom._block_forward, backend="aot_eager", dynamic=False)

    def loss_and_grads(compiled):
        model.zero_grad()
        if compiled:  # the layers' compiled path, as BloomBlock.forward takes it on CUDA
            x = model.embedding(ids[:, :-1])
            for layer in model.layers:
                x = traced(layer, x, layer.compiled_block_inputs(x))
            loss = bloom.lm_loss(model.final_layernorm(x), model.embedding.word_embeddings.weight, ids[:, 1:],
                                 None).mean()
        else:
            loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
        loss.backward()
        return {"loss": loss.detach(), **{name: p.grad.clone() for name, p in model.named_parameters()}}

    want, got = loss_and_grads(False), loss_and_grads(True)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_block_declines_what_it_cannot_trace():
    """compiled_block_inputs is None (the block falls back) with the flag off, dropout, a padding mask, the torch
    attention backend; flex gives (block mask, score_mod, no bias), sdpa (no mask, no score_mod, the bias)."""
    def inputs(mask=None, **options):
        config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=128,
                             **{"compile_blocks": True, **options})
        return BloomBlock(config, 0).train().compiled_block_inputs(torch.zeros(1, 128, 64), mask)
    assert inputs(compile_blocks=False) is None and inputs(hidden_dropout=0.1) is None
    assert inputs(attention_dropout=0.1) is None and inputs(attention_impl="torch") is None
    assert inputs(torch.ones(1, 128, dtype=torch.bool)) is None
    block_mask, score_mod, bias = inputs(attention_impl="flex")
    assert block_mask is not None and callable(score_mod) and bias is None
    block_mask, score_mod, bias = inputs(attention_impl="sdpa")
    assert block_mask is None and score_mod is None and bias.shape == (1, 4, 128, 128)


def test_equal_slopes_share_one_score_mod_and_key():
    """Each layer's slopes tensor is its own object; equal values must map to one score_mod (one compiled flex
    kernel for every layer), and the key is read once per tensor object (not a host sync per call)."""
    a, b = torch.tensor([0.5, 0.25]), torch.tensor([0.5, 0.25])
    assert _slopes_key(a) == _slopes_key(b) == ("cpu", (0.5, 0.25))
    assert _alibi_score_mod(a) is _alibi_score_mod(b)
    assert _alibi_score_mod(torch.tensor([0.5, 0.125])) is not _alibi_score_mod(a)
