"""InferenceEngine on the CPU (fp32): greedy equals HF generate token for token, with and without the static cache;
per-row eod stop; continuous batching; seeded sampling reproducible and independent of the batch; bad requests."""
import pytest
import torch

from megatron.inference import InferenceEngine, SamplingParams
from megatron.inference.reference import generate as reference_generate
from megatron.inference.sampling import filter_logits, filter_rows, hashed_uniform, sample_rows

# different lengths, one longer than the prefill chunk used below (so it is prefilled in chunks)
PROMPTS = [[17, 90, 45, 200, 33, 12, 8], [150, 61], [99, 98, 97, 96], list(range(10, 50))]


def hf_greedy(hf, prompt, max_new_tokens, eos=None):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                      eos_token_id=eos, pad_token_id=3)[0, len(prompt):].tolist()
    return out[:out.index(eos) + 1] if eos is not None and eos in out else out


_MASK64, _GOLDEN = (1 << 64) - 1, 0x9E3779B97F4A7C15


def _splitmix64_finaliser(x):  # in Python's unbounded integers, reduced modulo 2^64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def splitmix_uniform(seed, counter, vocab_id):
    """The uniform the sampler's hash promises for (seed, token index, vocabulary id), computed independently of
    its int64 tensor arithmetic: the top 24 bits of splitmix64's finaliser, centred, in float32."""
    key = _splitmix64_finaliser((seed * _GOLDEN + counter) & _MASK64)
    bits = _splitmix64_finaliser((key + vocab_id * _GOLDEN) & _MASK64) >> 40
    return (torch.tensor(float(bits)) + 0.5).item() / (1 << 24)


def reference_sample(model, prompt, seed, params):
    """Token by token without a cache: full forward, the single-row filter, Gumbel-max with splitmix_uniform."""
    ids, out = list(prompt), []
    for counter in range(params.max_new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0, -1].float()
        scaled = filter_logits((logits / params.temperature)[None], params.top_k, params.top_p)[0]
        u = torch.tensor([splitmix_uniform(seed, counter, v) for v in range(logits.shape[-1])])
        out.append(int(torch.argmax(scaled - torch.log(-torch.log(u)))))
        ids.append(out[-1])
    return out


def engine(model, **kwargs):
    kwargs = {"max_batch_size": 4, "max_seq_len": 96, "kv_bucket": 16, "prefill_chunk": 16, **kwargs}
    return InferenceEngine(model, **kwargs)


def test_greedy_batch_of_different_lengths_equals_hf_and_the_reference_path(pair):
    hf, ours = pair
    params = SamplingParams(greedy=True, max_new_tokens=24)
    expected = [hf_greedy(hf, p, 24) for p in PROMPTS]
    assert all(len(set(e)) > 3 for e in expected)  # the test model does not merely repeat one token
    assert engine(ours).generate(PROMPTS, params, steps_per_sync=5) == expected  # static cache
    assert reference_generate(ours, PROMPTS, params, eod_id=-1, pad_id=3) == expected  # growing cache, left padding


def test_each_row_stops_at_eod_and_reports_why(pair):
    hf, ours = pair
    free = engine(ours).generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=12))
    # the end of document: the first token of row 0, after its first, that did not occur earlier in the row
    cut = next(i for i in range(1, len(free[0])) if free[0][i] not in free[0][:i])
    eod = free[0][cut]
    eng = engine(ours, eod_id=eod)
    requests = [eng.add_request(p, SamplingParams(greedy=True, max_new_tokens=12)) for p in PROMPTS]
    while eng.has_work():
        eng.step(num_steps=4)
    assert requests[0].output == free[0][:cut + 1] and requests[0].finish_reason == "stop"
    for prompt, request in zip(PROMPTS, requests):
        assert request.output == hf_greedy(hf, prompt, 12, eos=eod)
        assert request.finish_reason == ("stop" if request.output[-1] == eod else "length")


def test_continuous_batching_rows_join_and_leave_without_changing_outputs(pair):
    hf, ours = pair
    alone = [hf_greedy(hf, p, n) for p, n in zip(PROMPTS, (5, 20, 9, 14))]
    eng = engine(ours, max_batch_size=2)  # 4 requests of different lengths through 2 slots
    requests = [eng.add_request(p, SamplingParams(greedy=True, max_new_tokens=n))
                for p, n in zip(PROMPTS[:2], (5, 20))]
    eng.step()
    assert len(eng.running) == 2 and len(eng.waiting) == 0
    requests += [eng.add_request(p, SamplingParams(greedy=True, max_new_tokens=n))
                 for p, n in zip(PROMPTS[2:], (9, 14))]  # arrive while the first two decode
    finished = []
    while eng.has_work():
        finished += eng.step(num_steps=3)
    assert [r.output for r in requests] == alone
    assert finished[0] is requests[0]  # the shortest left first and freed its slot for a waiting one
    assert all(r.finish_reason == "length" for r in requests)


def test_cancel_frees_the_slot(pair):
    hf, ours = pair
    eng = engine(ours, max_batch_size=1)
    first = eng.add_request(PROMPTS[0], SamplingParams(greedy=True, max_new_tokens=30))
    second = eng.add_request(PROMPTS[1], SamplingParams(greedy=True, max_new_tokens=6))
    eng.step()
    eng.cancel(first)
    assert first.finish_reason == "cancelled"
    while eng.has_work():
        eng.step()
    assert second.output == hf_greedy(hf, PROMPTS[1], 6)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(pair):
    _, ours = pair
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=16)
    batched = engine(ours).generate(PROMPTS, params, seed=7)
    assert batched == [reference_sample(ours, p, 7 + i, params) for i, p in enumerate(PROMPTS)]
    one_by_one = [engine(ours, max_batch_size=1).generate([p], params, seed=7 + i)[0] for i, p in enumerate(PROMPTS)]
    assert batched == one_by_one
    assert batched != engine(ours).generate(PROMPTS, params, seed=8)


def test_vocab_limit_excludes_padding_rows(pair):
    _, ours = pair
    outputs = engine(ours, vocab_limit=100).generate(PROMPTS, SamplingParams(temperature=2.0, max_new_tokens=20))
    assert all(t < 100 for out in outputs for t in out)
    assert len({t for out in outputs for t in out}) > 10


def test_bad_requests_name_the_limit(pair):
    _, ours = pair
    eng = engine(ours)
    with pytest.raises(ValueError, match=r"^the prompt \(90 tokens\) plus max_new_tokens \(7\) exceeds the engine's "
                                         r"max_seq_len 96: shorten the prompt"):
        eng.add_request(list(range(90)), SamplingParams(max_new_tokens=7))
    with pytest.raises(ValueError, match="the prompt is empty"):
        eng.add_request([], SamplingParams())
    assert not eng.has_work()


def test_hashed_uniform_is_a_function_of_seed_and_counter():
    seeds, counters = torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0])
    u = hashed_uniform(seeds, counters, 50_000)
    for row, (seed, counter) in enumerate([(1, 0), (1, 1), (2, 0)]):
        for vocab_id in (0, 1, 777, 49_999):
            assert u[row, vocab_id].item() == splitmix_uniform(seed, counter, vocab_id), (row, vocab_id)
    assert torch.equal(u[0], hashed_uniform(torch.tensor([1]), torch.tensor([0]), 50_000)[0])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002


def test_per_row_filters_match_the_single_row_filter():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    got = filter_rows(logits, torch.tensor([5, 0, 3]), torch.tensor([1.0, 0.7, 0.5]))
    for row, (k, p) in enumerate([(5, 1.0), (0, 0.7), (3, 0.5)]):
        assert torch.equal(torch.isinf(got[row]), torch.isinf(filter_logits(logits[row:row + 1], k, p)[0]))


def test_gumbel_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(6000, 3)
    n = logits.shape[0]
    tokens = sample_rows(logits, torch.zeros(n, dtype=torch.bool), torch.full((n,), 0.5), torch.zeros(n, dtype=torch.long),
                         torch.ones(n), torch.arange(n), torch.zeros(n, dtype=torch.long))
    expected = torch.softmax(logits[0] / 0.5, dim=0)
    share = torch.bincount(tokens, minlength=3).float() / n
    assert torch.allclose(share, expected, atol=0.02), (share, expected)


def test_round_counters_time_the_prefill_and_count_slow_step_launches(pair, monkeypatch):
    """stats: the launch time of prefill rounds' admissions and the decode steps whose launch took the host longer
    than SLOW_STEP_LAUNCH_S, checked against known delays (a 40 ms admission, 30 ms in the third decode step)."""
    import time

    from megatron.inference import engine as engine_module

    eng = engine(pair[1], max_batch_size=2)
    admit, decode_step, steps = eng._admit, eng._decode_step, [0]

    def slow_admit():
        admitted = admit()
        if admitted:
            time.sleep(0.04)
        return admitted

    def third_step_slow():
        decode_step()
        steps[0] += 1
        if steps[0] == 3:
            time.sleep(0.03)

    monkeypatch.setattr(eng, "_admit", slow_admit)
    monkeypatch.setattr(eng, "_decode_step", third_step_slow)
    monkeypatch.setattr(engine_module, "SLOW_STEP_LAUNCH_S", 0.02)
    eng.add_request([5, 9, 3], SamplingParams(greedy=True, max_new_tokens=6))
    while eng.has_work():
        eng.step(2)
    stats = eng.stats
    assert (stats["rounds"], stats["prefill_rounds"], stats["decode_steps"]) == (3, 1, 5)
    assert 0.04 <= stats["prefill_launch_s"] <= stats["launch_s"] - 0.03
    assert stats["slow_step_launches"] == 1
    assert 0.03 <= stats["slow_step_launch_s"] <= stats["launch_s"] - stats["prefill_launch_s"]
    assert stats["prefill_device_s"] == stats["device_s"] == 0.0  # timing events on CUDA only


def test_overlapped_rounds_and_early_first_tokens_give_the_solo_outputs(pair):
    """step(overlap=True) reads round k after launching round k+1, first_tokens() hands the rows round k+1 admitted
    their first token before it is read; rows that join, finish mid-round or are cancelled meanwhile keep their
    solo outputs."""
    eng = engine(pair[1], max_batch_size=3)
    long, short = SamplingParams(greedy=True, max_new_tokens=9), SamplingParams(greedy=True, max_new_tokens=6)
    prompts, params = [[5, 9, 3], [7, 1], [11, 12, 13, 14], [4, 4]], [long, short, long, long]
    solo = []
    for p, par in zip(prompts, params):
        request = eng.add_request(p, par)
        while eng.has_work():
            eng.step(1)
        solo.append(request.output)
    first = [eng.add_request(p, par) for p, par in zip(prompts[:2], params[:2])]
    assert eng.step(4, overlap=True) == []  # round 1 (both prefilled, 4 steps) in flight
    assert eng.first_tokens() == first and [r.output for r in first] == [s[:1] for s in solo[:2]]
    assert eng.first_tokens() == []
    third = eng.add_request(prompts[2], params[2])
    assert eng.step(4, overlap=True) == []  # round 2 in flight, round 1 read
    assert [len(r.output) for r in first + [third]] == [5, 5, 0]
    assert eng.first_tokens() == [third]
    fourth = eng.add_request(prompts[3], params[3])  # no free slot until the cancel
    eng.cancel(first[0])
    assert eng.step(4, overlap=True) == [first[1]]  # round 3 admits the fourth; round 2 finished the short row
    while eng.has_work():
        eng.step(4, overlap=True)
        eng.first_tokens()
    assert first[0].finish_reason == "cancelled" and first[0].output == solo[0][:5]
    assert [r.output for r in (first[1], third, fourth)] == [solo[1], solo[2], solo[3]]
    assert eng.stats["prefill_rounds"] == 4 + 3 and not eng.running and eng._in_flight is None


def test_padded_prefill_buckets_give_the_unpadded_outputs_and_write_only_scratch(pair):
    """prefill_graph_tokens pads each admitted group to (rows bucket, width bucket) as the CUDA-graph prefill does
    (here eagerly, on the CPU): greedy and sampled outputs equal the unpadded prefill's and the reference across
    prompt lengths (1 to 70, one longer than the prefill chunk) and group sizes; the padding rows write only the
    scratch slot."""
    hf, ours = pair
    prompts = PROMPTS + [[5], list(range(60, 77)), [8, 9, 10, 11, 12], list(range(100, 131)),
                         [7 * t % 150 + 5 for t in range(70)]]
    greedy = SamplingParams(greedy=True, max_new_tokens=10)
    sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=10)
    padded = engine(ours, max_batch_size=8, prefill_chunk=64, prefill_graph_tokens=64)
    assert padded._width_buckets == [16, 24, 32, 48, 64] and padded._row_buckets == [1, 2, 3, 4, 6, 8]
    assert ("prefill", 2, 32) in padded.prefill_buckets()
    assert ("prefill", 4, 32) not in padded.prefill_buckets()  # 128 padded tokens > 64
    plain = engine(ours, max_batch_size=8, prefill_chunk=64)
    assert plain.prefill_buckets() == []
    for params in (greedy, sampled):
        want = plain.generate(prompts, params, seed=3)
        assert padded.generate(prompts, params, seed=3) == want
        if params is greedy:
            assert want == [hf_greedy(hf, p, 10) for p in prompts]
    assert 0 < padded.stats["prefill_bucketed"] < padded.stats["prefill_passes"]  # 70 tokens: two eager chunks
    assert plain.stats["prefill_bucketed"] == 0

    fresh = engine(ours, max_batch_size=8, prefill_chunk=64, prefill_graph_tokens=96)
    for prompt in ([5, 6, 7], [9, 10, 11, 12, 13], [14], [15, 16], [17, 18, 19]):
        fresh.add_request(prompt, greedy)  # 5 rows: bucket of 6, one padding row
    fresh.step()
    assert fresh.stats["prefill_bucketed"] == 1
    used = sorted(r.slot for r in fresh.running.values())
    assert used == [0, 1, 2, 3, 4]
    k = fresh.cache.k
    assert k[:, 5:fresh.scratch].abs().sum() == 0  # free slots untouched
    assert k[:, fresh.scratch].abs().sum() > 0  # the padding row wrote the scratch slot
