"""The fused decode step on the GPU: the Triton attention kernel equals the torch one; the fused step (eager and
torch.compile'd, inside CUDA graphs) gives the unfused path's tokens in fp32; bf16 against HF generate with every
divergence measured (a near-tie of HF's own logits, reported, or a failure); no recompilation across lengths."""
import pytest
import torch

from megatron.config import ModelConfig
from megatron.inference import InferenceEngine, SamplingParams, skinny_gemm
from megatron.inference.decode import decode_attention_reference, decode_attention_triton
from megatron.inference.parity import compare_rows, describe
from megatron.model import BloomModel

pytestmark = pytest.mark.gpu
VOCAB = 4096


def model(std=0.15, dtype=torch.float32):
    config = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=VOCAB, seq_length=512,
                         attention_impl="torch", init_method_std=std)
    torch.manual_seed(0)
    return BloomModel(config, parallel_output=False).cuda().to(dtype).eval()


def prompts(batch, seed=1, low=5, high=40):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (int(n),), generator=gen).tolist()
            for n in torch.randint(low, high, (batch,), generator=gen)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b", [1, 3, 8, 32])  # at most 10, 5, 2 and 1 splits of the keys (decode.split_plan)
def test_triton_attention_equals_torch(dtype, b):
    gen = torch.Generator().manual_seed(0)
    slots_n, nh, t, hd = 33, 16, 600, 128
    kc = torch.randn(slots_n, nh, t, hd, generator=gen).to("cuda", dtype)
    vc = torch.randn(slots_n, nh, t, hd, generator=gen).to("cuda", dtype)
    qkv = torch.randn(b, nh * 3 * hd, generator=gen).to("cuda", dtype)
    slots = torch.tensor([8, 0, 3, 4, 5, 6, 7, 1] + list(range(9, 33)), device="cuda")[:b]
    pos = torch.tensor([599, 1, 63, 64, 65, 300, 598, 0] * 4, device="cuda")[:b]
    slopes = torch.linspace(0.5, 0.004, nh, device="cuda")
    k1, v1 = kc.clone(), vc.clone()
    want = decode_attention_reference(qkv, k1, v1, slots, pos, slopes, hd ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # the engine's launch, its splits merged by a second kernel, small programs split over long rows, prefetch
    for config in ({}, dict(last_combines=False), dict(block_n=16, warps=1, target_programs=4096, min_keys=64),
                   dict(block_n=32, prefetch=True), dict(block_n=16, warps=1, target_programs=2048, prefetch=True)):
        k2, v2 = kc.clone(), vc.clone()
        got = decode_attention_triton(qkv, k2, v2, slots, pos, slopes, hd ** -0.5, **config)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        assert not skinny_gemm._LOCKS or not skinny_gemm._LOCKS[got.device].any()  # the counters back at 0


@pytest.mark.parametrize("batch", [1, 8])
def test_fused_and_compiled_equal_unfused_in_fp32(batch):
    """Equal lengths of generation, so every step runs the full bucket (one compilation per path)."""
    ours = model()
    ps = prompts(batch)
    params = SamplingParams(greedy=True, max_new_tokens=48)
    want = InferenceEngine(ours, max_batch_size=batch, max_seq_len=128, decode="unfused").generate(ps, params)
    fused = InferenceEngine(ours, max_batch_size=batch, max_seq_len=128)
    assert fused.decode == "fused" and fused.decoder.attention_impl == "triton" and fused.cuda_graphs
    assert fused.generate(ps, params) == want
    compiled = InferenceEngine(ours, max_batch_size=batch, max_seq_len=128, compile_mode="default")
    assert compiled.generate(ps, params) == want


def test_fused_continuous_batching_equals_each_row_alone():
    ours = model()
    ps = prompts(6, seed=3)
    lengths = [5, 30, 9, 17, 3, 22]
    alone = [InferenceEngine(ours, max_batch_size=1, max_seq_len=128, decode="unfused").generate(
        [p], SamplingParams(greedy=True, max_new_tokens=n))[0] for p, n in zip(ps, lengths)]
    eng = InferenceEngine(ours, max_batch_size=4, max_seq_len=128)
    requests = [eng.add_request(p, SamplingParams(greedy=True, max_new_tokens=n)) for p, n in zip(ps, lengths)]
    while eng.has_work():
        eng.step(num_steps=3)
    assert [r.output for r in requests] == alone


@pytest.mark.parametrize("compile_mode", [None, "default"])
def test_bf16_against_hf_divergences_are_near_ties(compile_mode):
    from transformers import BloomConfig, BloomForCausalLM

    from megatron.model.hf_bloom import from_hf_state_dict
    torch.manual_seed(0)
    hf = BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=256, n_layer=4, n_head=8,
                                      initializer_range=0.15)).cuda().bfloat16()
    hf = hf.eval()
    ours = model(dtype=torch.bfloat16)
    ours.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    ps = prompts(8, seed=4, low=32, high=33)
    n = 64
    ids = torch.tensor(ps, device="cuda")
    theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=3)[:, 32:].tolist()
    got = InferenceEngine(ours, max_batch_size=8, max_seq_len=128, compile_mode=compile_mode).generate(
        ps, SamplingParams(greedy=True, max_new_tokens=n))
    equal, report = compare_rows(hf, ps, got, theirs, near_tie_ulps=8.0)
    print(f"bf16 vs HF ({compile_mode}): {equal}/8 rows equal; {describe(report)}")
    assert all(d["near_tie"] for d in report), describe(report)


def test_compiled_step_does_not_recompile_across_lengths():
    from torch._dynamo.utils import counters
    ours = model()
    eng = InferenceEngine(ours, max_batch_size=2, max_seq_len=320, compile_mode="default")
    params = SamplingParams(greedy=True, max_new_tokens=8)
    eng.generate([list(range(5, 38))], params)  # warm-up: bucket 1
    before = dict(counters["stats"])
    for length in range(33, 301, 37):
        eng.generate([list(range(5, 5 + length))], params)
    assert dict(counters["stats"]) == before
