"""The inference engine on the GPU (bf16): CUDA-graph decoding equals the eager paths token for token, and no
attention path recompiles as the sequence grows."""
import pytest
import torch

from megatron.config import ModelConfig
from megatron.inference import InferenceEngine, SamplingParams
from megatron.inference.reference import generate as reference_generate
from megatron.model import BloomModel

pytestmark = pytest.mark.gpu
VOCAB = 4096


def model(impl="torch", std=0.15):
    """Random weights with a large init, so logits are far apart and bf16 rounding does not flip a greedy choice."""
    config = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=VOCAB, seq_length=512,
                         attention_impl=impl, init_method_std=std)
    torch.manual_seed(0)
    return BloomModel(config, parallel_output=False).cuda().bfloat16().eval()


def prompts(batch, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (int(n),), generator=gen).tolist()
            for n in torch.randint(5, 40, (batch,), generator=gen)]


@pytest.mark.parametrize("batch", [1, 8])
def test_cuda_graph_greedy_equals_the_eager_paths(batch):
    """bf16: the CUDA-graph engine equals its eager run bit for bit (same kernels, replayed). fp32: it equals the
    reference path (growing cache, the torch attention) token for token; in bf16 the two paths' different
    attention kernels round differently, and a random model's near-ties then flip greedy choices."""
    ps = prompts(batch)
    params = SamplingParams(greedy=True, max_new_tokens=64)
    ours = model()
    fast = InferenceEngine(ours, max_batch_size=batch, max_seq_len=128, kv_bucket=64)
    assert fast.cuda_graphs
    got = fast.generate(ps, params)
    eager = InferenceEngine(ours, max_batch_size=batch, max_seq_len=128, kv_bucket=64, cuda_graphs=False)
    assert got == eager.generate(ps, params)

    ours = ours.float()
    got = InferenceEngine(ours, max_batch_size=batch, max_seq_len=128, kv_bucket=64).generate(ps, params)
    want = [reference_generate(ours, [p], params, eod_id=-1, pad_id=0)[0] for p in ps]
    assert got == want, [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)]


def test_cuda_graphs_change_nothing_also_when_sampling():
    ours = model()
    ps = prompts(8, seed=2)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_new_tokens=40)
    graphs = InferenceEngine(ours, max_batch_size=4, max_seq_len=128, kv_bucket=32).generate(ps, params, seed=5)
    eager = InferenceEngine(ours, max_batch_size=4, max_seq_len=128, kv_bucket=32,
                            cuda_graphs=False).generate(ps, params, seed=5)
    assert graphs == eager


def test_no_recompilation_after_warm_up_across_lengths():
    from torch._dynamo.utils import counters
    ours = model(impl="auto")
    params = SamplingParams(greedy=True, max_new_tokens=8)
    engine = InferenceEngine(ours, max_batch_size=2, max_seq_len=320)
    engine.generate([list(range(5, 38))], params)  # warm-up
    reference_generate(ours, [list(range(5, 38))], params, eod_id=-1, pad_id=0)
    ids = torch.randint(0, VOCAB, (1, 256), device="cuda")
    with torch.no_grad():
        ours(ids)  # training's fixed shape: flex compiles once here
    before = dict(counters["stats"])
    for length in range(33, 301, 17):
        prompt = list(range(5, 5 + length))
        engine.generate([prompt], params)
        reference_generate(ours, [prompt], params, eod_id=-1, pad_id=0)
    with torch.no_grad():
        ours(ids)
    assert dict(counters["stats"]) == before


@pytest.mark.parametrize("graph_step", [False, True])
def test_overlapped_rounds_equal_synchronous_ones_on_the_device(graph_step):
    """step(overlap=True) (pinned non-blocking read-backs, CUDA events, one round in flight) and first_tokens()
    give the synchronous step loop's tokens, greedy and sampled, with rows joining as slots free; the round
    counters time the device."""
    ours = model()
    ps = prompts(8, seed=3)
    for params in (SamplingParams(greedy=True, max_new_tokens=40),
                   SamplingParams(temperature=0.9, top_k=50, max_new_tokens=33)):
        outputs = []
        for overlap in (False, True):
            eng = InferenceEngine(ours, max_batch_size=4, max_seq_len=128, graph_step=graph_step)
            requests = [eng.add_request(p, params, seed=i) for i, p in enumerate(ps)]
            while eng.has_work():
                eng.step(8, overlap=overlap)
                for request in eng.first_tokens():
                    assert len(request.output) == 1
            outputs.append([r.output for r in requests])
        assert outputs[0] == outputs[1]
        assert eng.stats["prefill_rounds"] >= 2 and eng.stats["admitted"] == 8 and eng.stats["device_s"] > 0
        assert 0 < eng.stats["prefill_device_s"] < eng.stats["device_s"]  # rounds without a prefill ran too


def test_prefill_attention_never_takes_the_cudnn_backend(monkeypatch):
    """cuDNN's SDPA builds an execution plan per new shape (60-90 ms per prefill group of a 24-layer model on the
    H100), and every admitted group size and prompt width is a new shape: the prefill runs the plan-free kernels."""
    import megatron.inference.kv_cache as kv_cache
    seen = []
    sdpa = kv_cache.F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        if q.shape[2] > 1:  # a prefill (decode steps attend with one query)
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(q, *args, **kwargs)
    monkeypatch.setattr(kv_cache.F, "scaled_dot_product_attention", spy)
    engine = InferenceEngine(model(), max_batch_size=8, max_seq_len=128, kv_bucket=64)
    engine.generate(prompts(8, seed=3), SamplingParams(greedy=True, max_new_tokens=4))
    assert seen and not any(seen), seen


def test_prefill_graphs_equal_the_eager_prefill_and_are_all_captured_at_warm_up():
    """Groups padded to (rows, width) buckets and replayed from CUDA graphs: fp32 greedy equals the reference token
    for token, bf16 equals the unpadded eager prefill; warmup(every_bucket=True) captures every prefill bucket, so
    serving captures none."""
    ps = prompts(8, seed=4) + [list(range(5, 70))]  # 65 tokens: a 128-wide bucket
    params = SamplingParams(greedy=True, max_new_tokens=16)
    ours = model()
    graphed = InferenceEngine(ours, max_batch_size=8, max_seq_len=128, kv_bucket=64, prefill_graph_tokens=256)
    graphed.warmup(every_bucket=True)
    captured = (len(graphed._graphs), len(graphed._prefill_graphs))
    assert captured[1] == len(graphed.prefill_buckets()) > 0 and captured[0] > 0
    got = graphed.generate(ps, params)
    assert (len(graphed._graphs), len(graphed._prefill_graphs)) == captured
    assert graphed.stats["prefill_bucketed"] > 0
    assert got == InferenceEngine(ours, max_batch_size=8, max_seq_len=128, kv_bucket=64,
                                  prefill_graph_tokens=0).generate(ps, params)
    ours = ours.float()
    got = InferenceEngine(ours, max_batch_size=8, max_seq_len=128, kv_bucket=64,
                          prefill_graph_tokens=256).generate(ps, params)
    assert got == [reference_generate(ours, [p], params, eod_id=-1, pad_id=0)[0] for p in ps]
