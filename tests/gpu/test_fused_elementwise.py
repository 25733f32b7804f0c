"""The torch.compile'd elementwise regions (megatron.fused_kernels.elementwise) against their unfused references on
CUDA, forward and gradients, bf16 and fp32, at TP 1 widths and TP-slice widths; whole blocks / models with
--fused-elementwise on against off (also under activation checkpointing); and --compile-blocks (each block's forward
as one compiled region, one graph for every layer) against the eager model, also checkpointed.

Tolerances: every result is compared with the fp32 eager reference computed from the same (rounded) inputs.
fp32: 1e-5 relative to max|ref| (the compiled kernel sums and fuses in another order). bf16: the compiled region
must be as close to the fp32 reference as the eager bf16 ops are (error <= 2 x eager's + 1e-3 x max|ref|): the
kernel keeps the intermediates in fp32, so it is usually closer.
"""
import pytest
import torch

from megatron.fused_kernels import elementwise

pytestmark = pytest.mark.gpu

H = 256  # hidden: the residual/LayerNorm regions are never split by TP
WIDTHS = {"tp1": 4 * H, "tp2-slice": 2 * H, "tp4-slice": H}  # bias_gelu's 4h / p


def tensors(shapes, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", generator=gen).to(dtype).requires_grad_() for shape in shapes]


def graphs_compiled():
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def max_error(got, want):
    return (got.float() - want.float()).abs().max().item()


def check_region(fused, reference, inputs, dtype):
    """fused(*inputs) vs reference in fp32 (and, for bf16, the eager bf16 reference's own error)."""
    fp32_inputs = [t.detach().float().requires_grad_() for t in inputs]
    want = reference(*fp32_inputs)
    want = want if isinstance(want, tuple) else (want,)
    grads_out = [torch.randn_like(w) for w in want]
    want_grads = torch.autograd.grad(want, fp32_inputs, grads_out)

    def run(fn):
        out = fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        grads = torch.autograd.grad(out, inputs, [g.to(dtype) for g in grads_out])
        return list(out) + list(grads)

    before = graphs_compiled()
    got = run(fused)
    assert graphs_compiled() > before, "the region did not run compiled"
    eager = run(reference)
    for i, (g, e, w) in enumerate(zip(got, eager, list(want) + list(want_grads))):
        scale = w.abs().max().item()
        assert scale > 0, i
        bound = 1e-5 * scale if dtype == torch.float32 else 2 * max_error(e, w) + 1e-3 * scale
        assert max_error(g, w) <= bound, (i, max_error(g, w), bound)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # each test compiles its own graphs (and counts them)
    yield


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("width", list(WIDTHS.values()), ids=list(WIDTHS))
def test_bias_gelu(dtype, width):
    y, b = tensors([(2, 128, width), (width,)], dtype)
    check_region(elementwise.bias_gelu, elementwise.bias_gelu_reference, [y, b], dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bias_dropout_add(dtype):
    y, b, r = tensors([(2, 128, H), (H,), (2, 128, H)], dtype)
    check_region(lambda *a: elementwise.bias_dropout_add(*a, 0.0, True),
                 lambda *a: elementwise.bias_dropout_add_reference(*a, 0.0, True), [y, b, r], dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bias_dropout_add_layer_norm(dtype):
    y, b, r, w, c = tensors([(2, 128, H), (H,), (2, 128, H), (H,), (H,)], dtype)
    check_region(lambda *a: elementwise.bias_dropout_add_layer_norm(*a, 1e-5, 0.0, True),
                 lambda *a: elementwise.bias_dropout_add_layer_norm_reference(*a, 1e-5, 0.0, True),
                 [y, b, r, w, c], dtype)


def test_dropout_runs_eager_and_replays_with_the_rng():
    """p > 0 while training takes the eager ops: the same seed gives the same mask (checkpoint recomputation)."""
    y, b, r = tensors([(2, 128, H), (H,), (2, 128, H)], torch.bfloat16)
    torch.manual_seed(1)
    a = elementwise.bias_dropout_add(y, b, r, 0.3, True)
    torch.manual_seed(1)
    want = elementwise.bias_dropout_add_reference(y, b, r, 0.3, True)
    assert torch.equal(a, want)


def run_block(fused, dtype, checkpoint=False, post_ln_residual=False, compile_blocks=False):
    from megatron.config import ModelConfig
    from megatron.core import tensor_parallel
    from megatron.model.bloom import BloomBlock
    config = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4, vocab_size=512, seq_length=256,
                         fused_elementwise=fused, apply_residual_connection_post_layernorm=post_ln_residual,
                         compile_blocks=compile_blocks)
    block = BloomBlock(config, 0).cuda().to(dtype).train()
    with torch.no_grad():
        for name, param in block.named_parameters():
            if param.dim() == 1:  # non-zero biases and affines
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    x = tensors([(2, 256, H)], dtype, seed=3)[0]
    out = tensor_parallel.checkpoint(block, x) if checkpoint else block(x)
    out.backward(torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4),
                             dtype=dtype))
    return [out.detach(), x.grad] + [p.grad for _, p in block.named_parameters()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("post_ln_residual", [False, True], ids=["pre-ln", "post-ln-residual"])
def test_fused_block_equals_unfused(dtype, post_ln_residual):
    """Output, input gradient and every parameter gradient. fp32: fused = unfused to 1e-4 (relative norm). bf16:
    both against the fp32 block, the fused one no further off than 2 x the unfused one + 1e-3."""
    unfused = run_block(False, dtype, post_ln_residual=post_ln_residual)
    before = graphs_compiled()
    fused = run_block(True, dtype, post_ln_residual=post_ln_residual)
    assert graphs_compiled() > before
    reference = unfused if dtype == torch.float32 else run_block(False, torch.float32,
                                                                 post_ln_residual=post_ln_residual)
    for i, (f, u, r) in enumerate(zip(fused, unfused, reference)):
        rel = lambda t: ((t.float() - r.float()).norm() / r.float().norm()).item()  # noqa: E731
        bound = 1e-4 if dtype == torch.float32 else 2 * rel(u) + 1e-3
        assert rel(f) < bound, (i, rel(f), bound)


def test_fused_block_under_activation_checkpointing():
    """Checkpointed (forward under no_grad, recomputed in backward) equals not checkpointed, fused."""
    want = run_block(True, torch.float32)
    got = run_block(True, torch.float32, checkpoint=True)
    for i, (g, w) in enumerate(zip(got, want)):
        rel = ((g - w).norm() / w.norm()).item()
        assert rel < 1e-5, (i, rel)


def test_fused_model_loss_and_grads_equal_unfused():
    """A whole bf16 model (flex attention, tied head, vocab-parallel loss) with the regions on and off, both against
    the fp32 model: the fused one's loss and every gradient no further off than 2 x the unfused one's + 1e-3."""
    from megatron.config import ModelConfig
    from megatron.model import BloomModel
    ids = torch.randint(0, 512, (2, 257), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))

    def run(fused, dtype):
        config = ModelConfig(num_layers=3, hidden_size=H, num_attention_heads=4, vocab_size=512, seq_length=256,
                             **fused)
        torch.manual_seed(0)
        model = BloomModel(config).cuda().to(dtype).train()
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
        loss.backward()
        return {"loss": loss.detach().float(), **{name: p.grad.float() for name, p in model.named_parameters()}}

    reference = run({}, torch.float32)
    unfused, fused = run({}, torch.bfloat16), run({"fused_elementwise": True}, torch.bfloat16)
    for name, want in reference.items():
        assert want.norm() > 0, name
        rel = lambda got: ((got - want).norm() / want.norm()).item()  # noqa: E731
        assert rel(fused[name]) < 2 * rel(unfused[name]) + 1e-3, (name, rel(fused[name]), rel(unfused[name]))


def model_loss_and_grads(dtype, ids, checkpoint=False, **options):
    from megatron.config import ModelConfig
    from megatron.model import BloomModel
    config = ModelConfig(num_layers=3, hidden_size=H, num_attention_heads=4, vocab_size=512, seq_length=256,
                         checkpoint_activations=checkpoint, **options)
    torch.manual_seed(0)
    model = BloomModel(config).cuda().to(dtype).train()
    loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
    loss.backward()
    return {"loss": loss.detach().float(), **{name: p.grad.float() for name, p in model.named_parameters()}}


@pytest.mark.parametrize("impl", ["flex", "sdpa"])
def test_compiled_blocks_model_equals_eager(impl):
    """--compile-blocks: a bf16 model's loss and every gradient against the fp32 eager model, no further off than
    the eager bf16 model's (2x + 1e-3); the three layers share one compiled graph (no graph break, no recompile)."""
    ids = torch.randint(0, 512, (2, 257), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    reference = model_loss_and_grads(torch.float32, ids, attention_impl=impl)
    eager = model_loss_and_grads(torch.bfloat16, ids, attention_impl=impl)
    before = graphs_compiled()
    compiled = model_loss_and_grads(torch.bfloat16, ids, attention_impl=impl, compile_blocks=True)
    assert graphs_compiled() - before == 1
    for name, want in reference.items():
        assert want.norm() > 0, name
        rel = lambda got: ((got - want).norm() / want.norm()).item()  # noqa: E731
        assert rel(compiled[name]) < 2 * rel(eager[name]) + 1e-3, (name, rel(compiled[name]), rel(eager[name]))


def test_compiled_blocks_under_activation_checkpointing():
    """fp32, --checkpoint-activations with --compile-blocks (the block compiled inside the checkpointed function:
    once under no_grad, once recomputed with grad) equals the compiled model without checkpointing to 1e-5."""
    ids = torch.randint(0, 512, (2, 257), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    want = model_loss_and_grads(torch.float32, ids, compile_blocks=True)
    got = model_loss_and_grads(torch.float32, ids, checkpoint=True, compile_blocks=True)
    for name, w in want.items():
        rel = ((got[name] - w).norm() / w.norm()).item()
        assert rel < 1e-5, (name, rel)


def test_compiled_block_post_ln_residual_equals_eager():
    """fp32 block with --apply-residual-connection-post-layernorm: compiled = eager to 1e-4 (relative norm)."""
    eager = run_block(False, torch.float32, post_ln_residual=True)
    before = graphs_compiled()
    compiled = run_block(False, torch.float32, post_ln_residual=True, compile_blocks=True)
    assert graphs_compiled() > before
    for i, (c, e) in enumerate(zip(compiled, eager)):
        rel = ((c - e).norm() / e.norm()).item()
        assert rel < 1e-4, (i, rel)
