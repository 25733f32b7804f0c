"""The whole decode step in one CUDA graph (InferenceEngine(graph_step=True)) and the skinny GEMM kernel
(megatron/inference/skinny_gemm.py, gemm="triton"/"auto") on the GPU: the kernel against torch at the 1.72B model's
decode shapes, the plan timing, and the engine's tokens against the unfused path and the eager state update."""
import pytest
import torch

from megatron.inference import InferenceEngine, SamplingParams
from megatron.inference.decode import ATTENTION_LAUNCHES
from tests.gpu.test_fused_decode import model, prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 8), (torch.bfloat16, 1), (torch.bfloat16, 64)])
def test_skinny_gemm_equals_torch_at_the_decode_shapes(dtype, rows):
    """The 1.72B model's decode GEMMs (N x K) with their epilogues against fp32 torch: the first candidate plan at
    each shape, every candidate at the dense and QKV shapes (split-K, summed in the kernel or by a second one, the
    GEMV products); the QKV, h->4h and LM head GEMMs with their LayerNorm in the kernel's prologue; the split-K tiles'
    arrival counters are back at 0 after each call."""
    from megatron.inference import skinny_gemm
    from megatron.inference.skinny_gemm import candidates, layer_norm, skinny_linear_triton
    gen = torch.Generator(device="cuda").manual_seed(0)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    shapes = [(6144, 2048, False, False, True), (2048, 2048, False, True, False), (8192, 2048, True, False, True),
              (2048, 8192, False, True, False)] + ([(250880, 2048, False, False, True)] if dtype == torch.bfloat16
                                                   else [])
    for n, k, gelu, residual, norm in shapes:
        x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
        ln = {}
        if norm:  # the kernel normalises 3 x + 1; torch's LayerNorm output (in the dtype) is the GEMM's input
            ln = dict(ln_weight=(1 + torch.randn(k, device="cuda", generator=gen) / 4).to(dtype),
                      ln_bias=torch.randn(k, device="cuda", generator=gen).to(dtype), eps=1e-5)
            x, x_in = layer_norm(3 * x + 1, ln["ln_weight"], ln["ln_bias"], 1e-5), 3 * x + 1
        else:
            x_in = x
        w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(dtype)
        b = None if n == 250880 else torch.randn(n, device="cuda", generator=gen).to(dtype)
        r = torch.randn(rows, n, device="cuda", generator=gen).to(dtype) if residual else None
        want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        want = torch.nn.functional.gelu(want, approximate="tanh") if gelu else want
        want = want if r is None else want + r.float()
        plans = candidates(rows, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
        for plan in plans if (n, k) in ((2048, 2048), (6144, 2048)) else plans[:1]:
            got = skinny_linear_triton(x_in, w, b, r, gelu, *plan, **ln)
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol, msg=lambda m: f"{n}x{k} {plan}: {m}")
            assert not skinny_gemm._LOCKS or not skinny_gemm._LOCKS[x.device].any()
            again = skinny_linear_triton(x_in, w, b, r, gelu, *plan, **ln)  # sums in a fixed order: bitwise equal
            assert torch.equal(again, got), plan


def test_choose_plan_times_torch_and_every_candidate():
    """torch, every candidate and, on Hopper, the fastest candidate as a programmatic dependent launch."""
    from megatron.inference.skinny_gemm import candidates, choose_plan, pdl_available, plan_name
    ws = [torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    bs = [torch.randn(2048, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    plan, seconds = choose_plan(1, ws, bs, residual=True, label="test")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pdl = pdl_available("cuda")
    assert len(seconds) == 1 + len(candidates(1, 2048, 2048, sms)) + pdl and "torch" in seconds, seconds
    assert sum(name.endswith(" pdl") for name in seconds) == pdl, seconds
    assert all(0 < s < 1e-2 for s in seconds.values()), seconds
    best = min(seconds, key=seconds.get)
    assert best == plan_name(plan)


@pytest.mark.parametrize("rows", [1, 64])
def test_pdl_launches_equal_plain_ones_in_a_dependent_chain(rows):
    """A chain of GEMMs where each reads the last one's output (h -> 4h -> h, 12 times, with the residual of the
    input), captured in a CUDA graph and replayed: launched as programmatic dependent launches (each waits for the
    last before it reads) it gives the plain launches' outputs bit for bit; the split-K counters back at 0."""
    from megatron.inference import skinny_gemm
    from megatron.inference.skinny_gemm import candidates, linear, pdl_available
    if not pdl_available("cuda"):
        pytest.skip("programmatic dependent launches need a Hopper or newer GPU")
    gen = torch.Generator(device="cuda").manual_seed(3)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    layers = [((torch.randn(8192, 2048, device="cuda", generator=gen) / 2048 ** 0.5).bfloat16(),
               (torch.randn(2048, 8192, device="cuda", generator=gen) / 8192 ** 0.5).bfloat16(),
               torch.randn(8192, device="cuda", generator=gen).bfloat16() / 10) for _ in range(12)]
    up, down = candidates(rows, 8192, 2048, sms)[0], candidates(rows, 2048, 8192, sms)[0]  # split-K, summed in-kernel
    x0 = torch.randn(rows, 2048, device="cuda", generator=gen).bfloat16()

    def chain(pdl):
        x = x0
        for w1, w2, b1 in layers:
            h = linear(x, w1, b1, up + (pdl,), gelu=True)
            x = linear(h, w2, None, down + (pdl,), residual=x)
        return x
    outs = {}
    for pdl in (False, True):
        chain(pdl)  # compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(pdl)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        outs[pdl] = out.clone()
        assert not skinny_gemm._LOCKS or not skinny_gemm._LOCKS[x0.device].any()
    assert outs[False].abs().max() > 0
    assert torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("batch", [1, 8])
def test_whole_step_graph_and_triton_gemms_equal_unfused_in_fp32(batch):
    """graph_step (the state update inside the graph) with torch and with the Triton GEMMs, eager and compiled."""
    ours = model()
    ps = prompts(batch)
    params = SamplingParams(greedy=True, max_new_tokens=48)
    want = InferenceEngine(ours, max_batch_size=batch, max_seq_len=128, decode="unfused").generate(ps, params)
    compiled = [dict(gemm="auto", compile_mode="default")] if batch == 8 else []
    for kwargs in [dict(), dict(gemm="triton")] + compiled:
        eng = InferenceEngine(ours, max_batch_size=batch, max_seq_len=128, graph_step=True, **kwargs)
        assert eng.graph_step and eng.generate(ps, params) == want, kwargs
        assert all(len(key) == 4 for key in eng._graphs), list(eng._graphs)
        if kwargs.get("gemm") == "auto":  # every attention launch ran, agreed with torch and was timed
            assert len(eng.decoder.attention_times[batch]) == len(ATTENTION_LAUNCHES), eng.decoder.attention_times
            assert eng.decoder.launches[batch] in ATTENTION_LAUNCHES
    unfused = InferenceEngine(ours, max_batch_size=batch, max_seq_len=128, decode="unfused", graph_step=True)
    assert unfused.generate(ps, params) == want


def test_whole_step_graph_continuous_batching_and_sampling():
    """Rows joining and leaving (buckets 4, 2, 1), greedy and seeded top-p rows: the same tokens as the engine
    that updates the state outside the graph; warmup(every_bucket=True) captures the sampled graphs too."""
    ours = model()
    ps = prompts(6, seed=3)
    lengths = [5, 30, 9, 17, 3, 22]

    def run(**kwargs):
        eng = InferenceEngine(ours, max_batch_size=4, max_seq_len=128, **kwargs)
        eng.warmup(every_bucket=True)
        requests = [eng.add_request(p, SamplingParams(greedy=i % 2 == 0, top_p=0.9 if i % 3 else 1.0,
                                                      max_new_tokens=n), seed=i)
                    for i, (p, n) in enumerate(zip(ps, lengths))]
        while eng.has_work():
            eng.step(num_steps=3)
        return [r.output for r in requests], eng
    want, _ = run()
    got, eng = run(graph_step=True)
    assert got == want
    assert {key[2:] for key in eng._graphs} == {(False, False), (True, False), (True, True)}
