"""Gradient accumulation fusion (megatron/core/tensor_parallel/grad_accumulation.py) on CPU in fp32: the gradients
after several micro batches equal autograd's, at TP 1 and on TP 2 slices, with activation checkpointing and loss
chunking; no add kernel sums the fused weights' gradients; a parameter with a gradient hook (what DeepSpeed's
ZeRO and BF16_Optimizer may register) is left to autograd; and whole DeepSpeed training steps give the same weights
with and without the fusion, on the wrappers it serves and on one it must leave alone.

Exactness: after one micro batch every gradient is autograd's own, bit for bit (the fused path starts once .grad
exists). Each later micro batch rounds once inside the GEMM with beta = 1 or the index_put_, where autograd rounds
dW and then the sum: equal to fp32 rounding (1e-6 relative), not bit for bit.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron.config import ModelConfig
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.model import BloomModel
from tests.distributed import run_distributed
from tests.unit.core.test_tensor_parallel import gather_full

CONFIG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                     attention_impl="torch")


def accumulate(model, micro_batches=3, seed=0):
    """{name: .grad} after `micro_batches` forward/backward passes of the mean per-token loss."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(micro_batches):
        ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_length + 1), generator=generator)
        model(ids[:, :-1], labels=ids[:, 1:]).mean().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def assert_same_gradients(fused, unfused, exact=False):
    assert fused.keys() == unfused.keys()
    for name in fused:
        if exact:
            assert torch.equal(fused[name], unfused[name]), name
        else:
            torch.testing.assert_close(fused[name], unfused[name], rtol=1e-6, atol=1e-7, msg=name)


def model(fuse, **fields):
    return BloomModel(dataclasses.replace(CONFIG, gradient_accumulation_fusion=fuse, **fields))


@pytest.mark.parametrize("fields", [{}, {"checkpoint_activations": True}, {"loss_chunk_size": 8}],
                         ids=["plain", "checkpointed", "loss-chunks"])
def test_fused_gradients_equal_autograds_after_several_micro_batches(fields):
    assert CONFIG.gradient_accumulation_fusion  # on by default
    for micro_batches in (1, 3):
        assert_same_gradients(accumulate(model(True, **fields), micro_batches),
                              accumulate(model(False, **fields), micro_batches), exact=micro_batches == 1)


def op_counts(net):
    ops = ("aten::add", "aten::add_", "aten::addmm_", "aten::index_put_")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        accumulate(net, micro_batches=2)
    return {e.key: e.count for e in prof.key_averages() if e.key in ops}


def test_fused_weights_are_summed_by_their_gemm_not_by_an_add():
    """Two micro batches; the first is autograd's either way. Unfused, the second one's AccumulateGrad adds into
    each of the 9 weights (8 linear, the word embedding) after autograd summed the tied embedding's two gradients.
    Fused, its 8 linear and LM head GEMMs write into .grad with beta = 1 and the embedding's rows follow by
    index_put_. Biases and LayerNorms accumulate as before."""
    fused, unfused = op_counts(model(True)), op_counts(model(False))
    assert "aten::addmm_" not in unfused and "aten::index_put_" not in unfused
    assert (fused["aten::addmm_"], fused["aten::index_put_"]) == (9, 1)
    assert unfused["aten::add_"] - fused["aten::add_"] == 9
    assert unfused["aten::add"] - fused["aten::add"] == 1


def test_parameters_with_gradient_hooks_are_left_to_autograd():
    """A post-accumulate-grad hook (ZeRO's, BF16_Optimizer's) or a tensor hook still sees every micro batch."""
    fused = model(True)
    seen = []
    dense = fused.layers[0].mlp.dense_h_to_4h.weight
    dense.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    qkv = fused.layers[1].self_attention.query_key_value.weight
    qkv.register_hook(lambda g: seen.append(g.clone()))
    fused.embedding.word_embeddings.weight.register_post_accumulate_grad_hook(lambda p: seen.append(None))
    grads = accumulate(fused)
    assert len(seen) == 3 * 3  # each hook once per micro batch (autograd sums the tied embedding's two first)
    assert_same_gradients(grads, accumulate(model(False)))


def test_linear_function_gradients_and_no_grad_forward():
    """The function alone: x and bias gradients equal F.linear's, the weight's after one backward (autograd's) too and
    to fp32 rounding after two; without grad it is F.linear."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 7, generator=gen, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(6, 7, generator=gen))
    bias = torch.nn.Parameter(torch.randn(6, generator=gen))
    dy = torch.randn(2, 5, 6, generator=gen)
    reference = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    for backward in range(2):
        tensor_parallel.linear_with_grad_accumulation(x, weight, bias).backward(dy)
        torch.nn.functional.linear(*reference).backward(dy)
        assert torch.equal(x.grad, reference[0].grad) and torch.equal(bias.grad, reference[2].grad)
        if backward == 0:
            assert torch.equal(weight.grad, reference[1].grad)
        torch.testing.assert_close(weight.grad, reference[1].grad, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(tensor_parallel.linear_with_grad_accumulation(x, weight, bias),
                           torch.nn.functional.linear(x, weight, bias))


def _tp2_slices_equal_tp1(rank, world, fields):
    state = ps.initialize_model_parallel(world, 1)
    config = dataclasses.replace(CONFIG, vocab_size=128, **fields)
    fused = BloomModel(dataclasses.replace(config, tensor_model_parallel_size=world), tp_group=state.tp_group)
    unfused = BloomModel(dataclasses.replace(config, gradient_accumulation_fusion=False))
    fused_grads = accumulate(fused)
    reference = accumulate(unfused)
    for name, param in fused.named_parameters():
        full = gather_full(param, fused_grads[name], state.tp_group)
        # TP sums the partial products in another order: TP 1 and TP 2 agree to fp32 rounding (test_tensor_parallel)
        torch.testing.assert_close(full, reference[name], rtol=1e-5, atol=1e-6, msg=name)
    dist.barrier()


@pytest.mark.parametrize("fields", [{}, {"checkpoint_activations": True}], ids=["plain", "checkpointed"])
def test_tp2_fused_gradient_slices_equal_tp1_unfused(fields):
    run_distributed(_tp2_slices_equal_tp1, 2, fields)


def _training_steps(rank, world, root, case, out):
    """Weights after 2 optimizer steps of 3 micro batches each, with and without the fusion."""
    from megatron.core import parallel_state
    from tests.checkpoint_engines import CASES, batch, build_engine, configure, weights
    state = parallel_state.initialize_model_parallel(1, 1)
    results = {}
    for fuse in (True, False):
        flags = [*CASES[case][0], "--global-batch-size", "6", *([] if fuse else ["--no-gradient-accumulation-fusion"])]
        config, ds_config = configure(f"{root}/{fuse}", flags)
        assert config.model.gradient_accumulation_fusion is fuse
        engine = build_engine(case, config, ds_config, state)
        assert type(engine.optimizer).__name__ == CASES[case][1]
        for micro in range(6):
            inputs, labels = batch(micro)
            engine.backward(engine(inputs, labels=labels).mean())
            engine.step()
        assert engine.global_steps == 2
        results[fuse] = weights(engine)
    torch.save(results, out)


# case (tests/checkpoint_engines.py): the largest difference allowed between the weights with and without fusion
TRAINING_CASES = {
    "fp32-zero0": 1e-5,  # torch's AdamW reads .grad at the step: served
    "bf16-zero0": 1e-3,  # FP16_UnfusedOptimizer reads .grad at the step: served
    "bf16-zero1-fp32-accumulation": 1e-3,  # BF16_Optimizer zeroes .grad before each backward, reads it after: served
    "fp32-zero1": 0.0,  # DeepSpeedZeroOptimizer's post-accumulate-grad hooks: left to autograd
}


@pytest.mark.parametrize("case", TRAINING_CASES)
def test_training_steps_equal_with_and_without_fusion(tmp_path, case):
    """fp32: the gradients' last-bit differences move the weights by less than 1e-5. bf16: the fused GEMM rounds
    each sum into the bf16 .grad once where autograd rounds twice, so gradients differ by a bf16 ulp and the bf16
    weights after two steps by at most 2 ulps (measured 4.7e-4 at |w| < 0.125; bound 1e-3). Hooked: bit for bit."""
    out = str(tmp_path / "weights.pt")
    run_distributed(_training_steps, 1, str(tmp_path), case, out)
    results = torch.load(out)
    for name, fused in results[True].items():
        torch.testing.assert_close(fused, results[False][name], rtol=0, atol=TRAINING_CASES[case], msg=name)


def _mlp_forward(mlp, x):
    return mlp(x)


def test_compiled_region_keeps_one_graph_and_accumulates_in_place():
    """torch.compile of a block's MLP (as --compile-blocks compiles the block, on CPU here): no graph break, one graph
    for the first micro batch (.grad None: autograd's) and one for the others (the custom op into .grad), gradients
    equal to the eager unfused ones after 3 micro batches."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from megatron.model.bloom import ParallelMLP
    torch._dynamo.reset()
    counters.clear()
    fused, unfused = (ParallelMLP(dataclasses.replace(CONFIG, gradient_accumulation_fusion=f)) for f in (True, False))
    unfused.load_state_dict(fused.state_dict())
    compiled = torch.compile(_mlp_forward, dynamic=False)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(2, 8, CONFIG.hidden_size, generator=generator)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            compiled(fused, x).pow(2).mean().backward()
        unfused(x).pow(2).mean().backward()
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    assert [e.count for e in prof.key_averages() if e.key == "megatron::wgrad_accumulate_"] == [2]  # both weights
    for (name, got), want in zip(fused.named_parameters(), unfused.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6, msg=name)
    torch._dynamo.reset()
