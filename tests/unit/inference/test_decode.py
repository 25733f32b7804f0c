"""The fused decode step (megatron/inference/decode.py) on the CPU, fp32, eager: the same tokens as the unfused
path and HF generate across prompt lengths and batch compositions; running rows packed into the batch bucket;
the Triton attention kernel (under Triton's interpreter, where triton is installed) equals the torch one."""
import pytest
import torch

from megatron.inference import InferenceEngine, SamplingParams

from tests.unit.inference.conftest import VOCAB


def prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None,
                       pad_token_id=3)[0, len(prompt):].tolist()


def engine(model, decode, **kwargs):
    kwargs = {"max_batch_size": 4, "max_seq_len": 96, "kv_bucket": 16, "prefill_chunk": 16, **kwargs}
    return InferenceEngine(model, decode=decode, **kwargs)


@pytest.mark.parametrize("lengths,max_batch", [((1,), 1), ((7, 2, 33, 16), 4), ((5, 40, 9, 1, 17, 3), 4)])
def test_fused_equals_unfused_and_hf(pair, lengths, max_batch):
    """Prompt lengths 1..40 (one over the prefill chunk), a full batch, and more requests than slots."""
    hf, ours = pair
    ps = prompts(lengths, seed=len(lengths))
    params = SamplingParams(greedy=True, max_new_tokens=20)
    fused = engine(ours, "fused", max_batch_size=max_batch)
    assert fused.decoder is not None and fused.decoder.attention_impl == "torch"
    got = fused.generate(ps, params, steps_per_sync=3)
    assert got == engine(ours, "unfused", max_batch_size=max_batch).generate(ps, params, steps_per_sync=3)
    assert got == [hf_greedy(hf, p, 20) for p in ps]


def test_rows_are_packed_and_the_bucket_follows_the_running_count(pair):
    """The longest request sits in the highest slot; as the others leave the fused step's bucket shrinks to 1
    (the unfused step keeps slots 0..3), a late request fills a hole, and every output equals its run alone."""
    _, ours = pair
    ps = prompts((6, 11, 3, 8, 14), seed=3)
    news = (3, 5, 7, 30, 4)
    alone = [engine(ours, "unfused", max_batch_size=1).generate([p], SamplingParams(greedy=True, max_new_tokens=n))[0]
             for p, n in zip(ps, news)]
    for decode in ("fused", "unfused"):
        eng = engine(ours, decode)
        requests = [eng.add_request(p, SamplingParams(greedy=True, max_new_tokens=n)) for p, n in zip(ps[:4], news)]
        steps, decode_step = [], eng._decode_step

        def recorded():  # (rows running, the step's batch bucket)
            decode_step()
            steps.append((len(eng.running), eng.last_decode_batch))
        eng._decode_step = recorded
        while eng.has_work():
            eng.step(num_steps=1)
            if len(steps) == 5:  # requests 0 and 1 have left: the late request takes slot 0, a hole
                assert sorted(eng.running) == [2, 3]
                requests.append(eng.add_request(ps[4], SamplingParams(greedy=True, max_new_tokens=news[4])))
        assert [r.output for r in requests] == alone
        assert all(r.finish_reason == "length" for r in requests)
        counts = [n for n, _ in steps]
        assert counts[:8] == [4, 4, 3, 3, 2, 3, 2, 2] and counts[-1] == 1
        if decode == "fused":  # the smallest of the buckets 1, 2, 4 that holds the running rows
            assert [b for _, b in steps] == [next(b for b in (1, 2, 4) if b >= n) for n in counts]
        else:  # slots 0..3 while slot 3 runs
            assert all(b == 4 for _, b in steps)


def test_seeded_sampling_is_the_same_on_both_paths(pair):
    _, ours = pair
    ps = prompts((7, 2, 33, 16, 5), seed=4)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=16)
    fused = engine(ours, "fused").generate(ps, params, seed=7)
    assert fused == engine(ours, "unfused").generate(ps, params, seed=7)
    mixed = [SamplingParams(greedy=True, max_new_tokens=16), params, SamplingParams(temperature=1.5, max_new_tokens=9)]
    outs = {}
    for decode in ("fused", "unfused"):
        eng = engine(ours, decode, vocab_limit=200)
        requests = [eng.add_request(p, mixed[i % 3], seed=i) for i, p in enumerate(ps)]
        while eng.has_work():
            eng.step(num_steps=4)
        outs[decode] = [r.output for r in requests]
    assert outs["fused"] == outs["unfused"] and all(t < 200 for out in outs["fused"] for t in out)


def test_bad_decode_choices_are_named(pair):
    _, ours = pair
    with pytest.raises(ValueError, match=r"^decode='fast': choose 'fused' or 'unfused'$"):
        engine(ours, "fast")
    with pytest.raises(ValueError, match=r"^compile_mode 'turbo' is not one of default, max-autotune-no-cudagraphs"):
        engine(ours, "fused", compile_mode="turbo")
    with pytest.raises(ValueError, match=r"^attention='triton' needs CUDA and the triton package"):
        engine(ours, "fused", decode_attention="triton")


_KERNEL_CHECK = """
import torch
from megatron.inference.decode import decode_attention_reference, decode_attention_triton
gen = torch.Generator().manual_seed(0)
slots_n, nh, t, hd = 5, 3, 150, 16
kc, vc = torch.randn(slots_n, nh, t, hd, generator=gen), torch.randn(slots_n, nh, t, hd, generator=gen)
qkv = torch.randn(4, nh * 3 * hd, generator=gen)
slots, pos = torch.tensor([3, 0, 4, 1]), torch.tensor([0, 63, 64, 149])  # block edges, the last position
slopes = torch.tensor([0.5, 0.25, 0.125])
k1, v1 = kc.clone(), vc.clone()
want = decode_attention_reference(qkv, k1, v1, slots, pos, slopes, 0.25)
assert not torch.equal(k1, kc)
from megatron.inference import skinny_gemm
# 1, 2 and 5 splits of the 150 keys at most; min_keys 16 (below block_n): rows whose rounded splits leave some
# without keys (pos 63: 4 splits of 32 keys for 64 keys); 64: fewer, longer splits; the next block prefetched
for target, min_keys, prefetch in ((12, None, False), (24, None, True), (256, None, False), (256, 16, True),
                                   (256, 64, True)):
    for last_combines in (True, False):  # the splits merged by the last to finish, or by a second kernel
        k2, v2 = kc.clone(), vc.clone()
        got = decode_attention_triton(qkv, k2, v2, slots, pos, slopes, 0.25, block_n=32, target_programs=target,
                                      last_combines=last_combines, min_keys=min_keys, prefetch=prefetch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        assert not skinny_gemm._LOCKS or not skinny_gemm._LOCKS[got.device].any()  # the counters back at 0
assert skinny_gemm._LOCKS  # the last splits combined in the kernel took the counters
# the engine's timed launch choice: every candidate runs at a quarter and all of the keys; the least total wins
from megatron.inference.decode import choose_attention
launches = ({}, dict(block_n=32), dict(block_n=16, warps=4), dict(block_n=16, warps=1),
            dict(block_n=16, warps=1, target_programs=2048, min_keys=64))
seconds = iter([5, 5, 4, 4, 3, 1, 1, 3.5, 2, 2.5])  # per call: (quarter, all) for each launch in order
launch, times = choose_attention(2, 3, 16, 100, torch.float32, "cpu", slopes, 0.25, layers=1,
                                 timer=lambda fn: (fn(), next(seconds))[1], launches=launches)
assert launch == launches[2] == dict(block_n=16, warps=4), launch
assert times == {"defaults": 10, "block_n 32": 8, "block_n 16, warps 4": 4, "block_n 16, warps 1": 4.5,
                 "block_n 16, warps 1, target_programs 2048, min_keys 64": 4.5}, times
# each launch is checked on the untouched scratch: the launches timed before it wrote a new key at a quarter of
# the keys, which a later check would otherwise attend over (small slopes: a far key counts; every launch dropped)
_, times = choose_attention(2, 3, 16, 100, torch.float32, "cpu", torch.full((3,), 0.01), 0.25, layers=1,
                            timer=lambda fn: (fn(), 1.0)[1], launches=launches)
assert len(times) == len(launches), times
print("kernel ok")
"""


def test_split_plan():
    from megatron.inference.decode import split_plan
    assert split_plan(4, 3, 150, 32, 12) == 1
    assert split_plan(4, 3, 150, 32, 24) == 2
    assert split_plan(4, 3, 150, 32, 256) == 5
    assert split_plan(1, 16, 288, 64, 256) == 5  # the benchmark's batch 1: up to 5 splits of 64 keys
    assert split_plan(8, 16, 288, 64, 256) == 2
    assert split_plan(64, 16, 288, 64, 256) == 1
    assert split_plan(64, 16, 288, 64, 4096) == 4


def test_triton_kernel_equals_the_torch_attention_under_the_interpreter():
    """In a fresh process: TRITON_INTERPRET must be set before triton is first imported."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "kernel ok" in done.stdout, done.stderr[-3000:]


def test_parity_report_measures_the_divergence(pair):
    from megatron.inference.parity import bf16_ulp, compare_rows
    hf, _ = pair
    for value in (1.0, 3.0, -0.3, 200.0):  # the next bf16 number above |value| minus |value|
        x = torch.tensor(abs(value), dtype=torch.bfloat16)
        up = (x.view(torch.int16) + 1).view(torch.bfloat16)
        assert bf16_ulp(value) == float(up) - float(x)
    ps = prompts((5, 9), seed=5)
    theirs = [hf_greedy(hf, p, 6) for p in ps]
    ours = [list(theirs[0]), theirs[1][:3] + [(theirs[1][3] + 1) % VOCAB] + theirs[1][4:]]
    equal, report = compare_rows(hf, ps, ours, theirs)
    assert equal == 1 and [(d["row"], d["index"], d["ours"], d["hf"]) for d in report] == \
        [(1, 3, ours[1][3], theirs[1][3])]
    ids = torch.tensor([ps[1] + theirs[1][:3]])
    logits = hf(ids).logits[0, -1]
    assert report[0]["hf_logit_gap"] == pytest.approx(float(logits[theirs[1][3]] - logits[ours[1][3]]), rel=1e-6)
    assert report[0]["hf_logit_gap"] > 0


def test_the_one_row_matmul_form_gives_the_same_tokens(pair):
    """decoder.gemv (set under max-autotune: x @ W^T + b as a matmul and an add at one row) changes no token."""
    hf, ours = pair
    ps = prompts((9,), seed=6)
    eng = engine(ours, "fused", max_batch_size=1)
    eng.decoder.gemv = True
    assert eng.generate(ps, SamplingParams(greedy=True, max_new_tokens=20)) == [hf_greedy(hf, ps[0], 20)]


@pytest.mark.parametrize("decode", ["fused", "unfused"])
def test_greedy_never_sorts_the_vocabulary(pair, monkeypatch, decode):
    _, ours = pair
    want = engine(ours, decode).generate(prompts((7, 3)), SamplingParams(greedy=True, max_new_tokens=6))

    def refuse(*args, **kwargs):
        raise AssertionError("the vocabulary was sorted on the greedy path")
    monkeypatch.setattr(torch, "sort", refuse)
    monkeypatch.setattr(torch, "topk", refuse)
    assert engine(ours, decode).generate(prompts((7, 3)), SamplingParams(greedy=True, max_new_tokens=6)) == want
    with pytest.raises(AssertionError, match="sorted"):  # a filtered sampled row does sort
        engine(ours, decode).generate(prompts((7,)), SamplingParams(top_p=0.9, max_new_tokens=2))


@pytest.mark.parametrize("decode", ["fused", "unfused"])
def test_a_whole_step_captures_warm_up_leaves_the_state_as_it_was(pair, decode):
    """graph_step's capture warms the whole step up (forward, sampling, state update) and undoes the update: every
    row's state is unchanged after it (the cache holds the keys the next step writes again), and generation goes on
    to the same tokens, greedy and sampled-with-top-p rows alike."""
    _, ours = pair
    ps = prompts((7, 3, 12), seed=7)
    greedy, sampled = SamplingParams(greedy=True, max_new_tokens=10), SamplingParams(top_p=0.8, max_new_tokens=10)

    def run(warm):
        eng = engine(ours, decode)
        reqs = [eng.add_request(p, sampled if i == 1 else greedy, seed=i) for i, p in enumerate(ps)]
        eng.step(num_steps=3)
        if warm:
            before = [t.clone() for t in eng._state()]
            eng._warm((4, None if decode == "fused" else 96, True, True), 2)
            assert all(torch.equal(a, b) for a, b in zip(eng._state(), before))
        while eng.has_work():
            eng.step(num_steps=3)
        return [r.output for r in reqs]
    assert run(True) == run(False)
