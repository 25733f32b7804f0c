"""The server's pure parts: request validation (exact messages, the field named), streamed text deltas (multi-byte
characters, stop strings), and the engine thread's continuous batching (a row joins a running batch and its
output equals its solo output)."""
import asyncio
import threading

import pytest
import torch

from megatron.config import ModelConfig
from megatron.inference import InferenceEngine, SamplingParams
from megatron.inference import api
from megatron.inference.api import APIError, IncrementalText, Limits
from megatron.inference.worker import EngineWorker, Job, Row
from megatron.model import BloomModel
from megatron.tokenizer import build_tokenizer
from tests.launch import TOKENIZER

LIMITS = Limits(max_new_tokens=24, context=32, vocab_size=8000, max_choices=8)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=str(TOKENIZER))


def error_of(fn, *args):
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value.status, info.value.param, info.value.message


# ---- POST /v1/completions ----------------------------------------------------------------------------------------

def test_completion_defaults_and_greedy():
    req = api.parse_completion_request({"prompt": "hi"}, LIMITS)
    assert req.prompts == ["hi"] and req.max_tokens == 16 and req.n == 1 and not req.stream and req.seed is None
    assert req.params == SamplingParams(greedy=False, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=16)
    req = api.parse_completion_request({"prompt": ["a", "b"], "max_tokens": 5, "temperature": 0, "top_p": 0.5,
                                        "top_k": -1, "stop": "\n", "seed": 7, "stream": True,
                                        "stream_options": {"include_usage": True}, "model": "m", "n": 2,
                                        "presence_penalty": 0, "logit_bias": {}, "best_of": 2}, LIMITS)
    assert req.params == SamplingParams(greedy=True, max_new_tokens=5)
    assert (req.prompts, req.stop, req.seed, req.stream, req.include_usage, req.model, req.n) == (
        ["a", "b"], ("\n",), 7, True, True, "m", 2)
    req = api.parse_completion_request({"prompt": [[5, 6], [7]], "temperature": 0.7, "top_k": 3}, LIMITS)
    assert req.prompts == [[5, 6], [7]] and req.params.top_k == 3 and req.params.temperature == 0.7
    assert api.parse_completion_request({"prompt": [5, 6]}, LIMITS).prompts == [[5, 6]]


@pytest.mark.parametrize("body, param, message", [
    ([1, 2], None, "the request body must be a JSON object (got a JSON list)"),
    ({"prompt": "x", "max_token": 3}, "max_token", "Unrecognized request argument supplied: max_token"),
    ({}, "prompt", "prompt is required: a string, a list of strings, a list of token ids or a list of lists of "
                   "token ids"),
    ({"prompt": 5}, "prompt", "prompt must be a string, a list of strings, a list of token ids or a list of lists "
                              "of token ids (got int)"),
    ({"prompt": []}, "prompt", "prompt is an empty list: give at least one prompt"),
    ({"prompt": ["a", 3]}, "prompt", "prompt must be a string, a list of strings, a list of token ids or a list of "
                                     "lists of token ids (a list mixes types or holds an empty list)"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be at least 1 (got 0)"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens", "max_tokens must be at least 1 (got -3)"),
    ({"prompt": "x", "max_tokens": 25}, "max_tokens",
     "max_tokens 25 exceeds this server's limit of 24 tokens (--max-new-tokens-limit)"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "max_tokens must be an integer (got '5')"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "max_tokens must be an integer (got True)"),
    ({"prompt": "x", "temperature": "hot"}, "temperature",
     "temperature must be a number >= 0 (0 decodes greedily) (got 'hot')"),
    ({"prompt": "x", "temperature": -1}, "temperature", "temperature must be a number >= 0 (0 decodes greedily) "
                                                        "(got -1)"),
    ({"prompt": "x", "top_p": 0}, "top_p", "top_p must be a number in (0, 1] (1 disables it) (got 0)"),
    ({"prompt": "x", "top_k": 2.5}, "top_k", "top_k must be an integer (got 2.5)"),
    ({"prompt": "x", "stop": 3}, "stop", "stop must be a string or a list of strings (got 3)"),
    ({"prompt": "x", "stop": ["a", ""]}, "stop", "stop strings must not be empty"),
    ({"prompt": "x", "seed": "1"}, "seed", "seed must be an integer (got '1')"),
    ({"prompt": "x", "stream": "yes"}, "stream", "stream must be true or false (got 'yes')"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     "stream_options is only allowed with stream: true"),
    ({"prompt": "x", "n": 3, "best_of": 5}, "best_of",
     "best_of must equal n (3) on this server: it does not rank samples (got 5)"),
    ({"prompt": ["a", "b", "c"], "n": 3}, "n",
     "the request asks for 9 completions (prompts x n); this server allows at most 8 per request"),
    ({"prompt": "x", "logprobs": 21}, "logprobs",
     "logprobs 21 exceeds this server's limit of 20 alternatives per token"),
    ({"prompt": "x", "logprobs": 1, "stream": True}, "logprobs",
     "logprobs is not supported with stream: true on this server; ask without streaming"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be at least 1 (got 0)"),
    ({"prompt": "x", "max_tokens": 0, "echo": True}, "max_tokens",
     "max_tokens 0 (scoring the prompt only) needs echo: true and logprobs, without stream"),
    ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty",
     "frequency_penalty is not supported by this server (only 0); leave it out"),
    ({"prompt": "x", "model": 3}, "model", "model must be a string (got 3)"),
])
def test_bad_completion_requests_name_the_field(body, param, message):
    assert error_of(api.parse_completion_request, body, LIMITS) == (400, param, message)


def test_prompts_are_tokenized_and_checked_against_the_context(tokenizer):
    ids = api.tokenize_prompts(["The cat", [5, 6, 7]], tokenizer, LIMITS, 10)
    assert ids == [tokenizer.tokenize("The cat"), [5, 6, 7]]
    assert error_of(api.tokenize_prompts, [""], tokenizer, LIMITS, 4) == (
        400, "prompt", "prompt is empty (it tokenizes to no tokens); give some text")
    assert error_of(api.tokenize_prompts, ["a", [9000]], tokenizer, LIMITS, 4) == (
        400, "prompt", "prompt 1 holds token id 9000, outside the vocabulary [0, 8000)")
    assert error_of(api.tokenize_prompts, [list(range(32))], tokenizer, LIMITS, 4) == (
        400, "prompt", "prompt is 32 tokens long; the model's context is 32 tokens (prompt + max_tokens): "
                       "shorten the prompt")
    assert error_of(api.tokenize_prompts, [list(range(20))], tokenizer, LIMITS, 13) == (
        400, "max_tokens", "prompt (20 tokens) plus max_tokens (13) exceeds the model's context of 32 tokens: "
                           "ask for at most 12 tokens")
    assert api.tokenize_prompts(["x"], tokenizer, LIMITS, 4, prefix_ids=[2]) == [[2] + tokenizer.tokenize("x")]


def test_row_seeds_are_distinct_and_reproducible():
    assert api._mix64(api._GOLDEN) == 0xE220A8397B1DCDAF  # splitmix64's first output from state 0 (published)
    assert api.row_seed(7, 0) == 7 and api.row_seed(api.INT64_MIN, 0) == api.INT64_MIN  # n 1: the request's seed
    seeds = [api.row_seed(s, k) for s in range(-50, 50) for k in range(8)]
    assert len(set(seeds)) == len(seeds)  # seed + k made choice 1 of seed 5 choice 0 of seed 6
    assert all(api.INT64_MIN <= x <= api.INT64_MAX for x in seeds)
    mixed = api._mix64((api._mix64(5) + 3 * api._GOLDEN) % 2 ** 64)
    assert api.row_seed(5, 3) == (mixed if mixed < 2 ** 63 else mixed - 2 ** 64)
    assert api.row_seed(api.INT64_MAX, 1) == api.row_seed(api.INT64_MAX, 1)


def test_megatron_request():
    req = api.parse_megatron_request({"prompts": ["a", "b"], "tokens_to_generate": 8, "top_k": 1}, LIMITS)
    assert req.params == SamplingParams(greedy=True, max_new_tokens=8) and req.seed is None and req.stop == ()
    req = api.parse_megatron_request({"prompts": ["a"], "top_p": 0.9, "temperature": 0.5, "random_seed": 3,
                                      "stop_on_eol": True, "add_BOS": True}, LIMITS)
    assert (req.params.greedy, req.params.temperature, req.params.top_p, req.params.top_k) == (False, 0.5, 0.9, 0)
    assert (req.seed, req.stop, req.add_bos, req.tokens_to_generate) == (3, ("\n",), True, 24)  # 64, capped
    assert req.stop_ids == () and api.parse_megatron_request({"prompts": ["a"], "stop_token": 7}, LIMITS).stop_ids \
        == (7,)


@pytest.mark.parametrize("body, param, message", [
    ({"tokens_to_generate": 4}, "prompts", "prompts argument required: a list of strings"),
    ({"sentences": ["a"]}, "sentences", "sentences is no longer used; replace it with prompts"),
    ({"prompts": "a"}, "prompts", "prompts is not a list of strings"),
    ({"prompts": []}, "prompts", "prompts is empty"),
    ({"prompts": ["a"] * 9}, "prompts", "Maximum number of prompts is 8"),
    ({"prompts": ["a"], "tokens_to_generate": 0}, "tokens_to_generate",
     "tokens_to_generate must be an integer greater than 0 (got 0)"),
    ({"prompts": ["a"], "tokens_to_generate": 25}, "tokens_to_generate",
     "tokens_to_generate 25 exceeds this server's limit of 24 tokens (--max-new-tokens-limit)"),
    ({"prompts": ["a"], "temperature": 0}, "temperature",
     "temperature must be a positive number less than or equal to 100.0 (got 0)"),
    ({"prompts": ["a"], "top_k": 5, "top_p": 0.5}, "top_p", "cannot set both top-k and top-p samplings."),
    ({"prompts": ["a"], "logprobs": True}, "logprobs",
     "logprobs is not supported by this server; leave it out or set it to false"),
    ({"prompts": ["a"], "beam_width": 2}, "beam_width", "beam search is not supported by this server; leave "
                                                       "beam_width out"),
    ({"prompts": [""]}, "prompts", "Empty prompts require add_BOS=true"),
    ({"prompts": ["a"], "stop_token": 8000}, "stop_token", "stop_token must be a token id in [0, 8000) (got 8000)"),
    ({"prompts": ["a"], "stop_token": "7"}, "stop_token", "stop_token must be a token id in [0, 8000) (got '7')"),
    ({"prompts": ["a"], "random_seed": -1}, "random_seed", "random_seed must be at least 0 (got -1)"),
])
def test_bad_megatron_requests(body, param, message):
    assert error_of(api.parse_megatron_request, body, LIMITS) == (400, param, message)


# ---- streamed text -----------------------------------------------------------------------------------------------

def feed(text_state, ids, step=1, eod_at_end=False):
    """Feeds ids in chunks of step new ids (the last update final) and returns the deltas."""
    deltas = []
    for start in range(0, len(ids), step):
        final = start + step >= len(ids)
        deltas.append(text_state.update(ids[start:start + step] + ([2] if final and eod_at_end else []), final=final))
        if text_state.text is not None:
            break
    return deltas


def test_deltas_of_multibyte_text_concatenate_exactly(tokenizer):
    text = "naïve café — 日本語 ✓ ok"
    ids = tokenizer.tokenize(text)
    partial = [k for k in range(1, len(ids)) if tokenizer.detokenize(ids[:k]).endswith(api.REPLACEMENT)]
    assert len(partial) >= 5  # the test crosses many unfinished characters
    for step in (1, 2, 3):
        state = IncrementalText(tokenizer.detokenize, eod_id=2)
        deltas = feed(state, ids, step, eod_at_end=True)
        assert "".join(deltas) == state.text == text
        assert not any(api.REPLACEMENT in d for d in deltas)
        assert state.tokens == len(ids) + 1 and not state.stopped  # the eod counts


def test_incremental_text_equals_a_full_decode_of_any_ids(tokenizer):
    """Random ids (byte pieces that break UTF-8 characters, invalid sequences, special tokens) and text in many
    scripts: the deltas join to the decode of all ids, a prefix of it after every update."""
    rng = torch.Generator().manual_seed(0)
    texts = ["Ünïcödé ½ — “quotes” 🙂 emoji 👩‍👩‍👧 and ﬁ ligatures", "Привет, мир! 你好，世界。 مرحبا"]
    cases = [tokenizer.tokenize(t) for t in texts]
    cases += [torch.randint(0, tokenizer.vocab_size, (n,), generator=rng).tolist() for n in (50, 200, 200)]
    for ids in cases:
        full = tokenizer.detokenize(ids)
        for step in (1, 3, 7):
            state = IncrementalText(tokenizer.detokenize)
            out = ""
            for start in range(0, len(ids), step):
                out += state.update(ids[start:start + step], final=start + step >= len(ids))
                assert full.startswith(out)
            assert out == state.text == full


def test_prefix_lengths_equal_full_decodes(tokenizer):
    rng = torch.Generator().manual_seed(1)
    for ids in (tokenizer.tokenize("naïve café — 日本語 ✓ ok 🙂"), torch.randint(0, tokenizer.vocab_size, (300,),
                                                                               generator=rng).tolist()):
        assert api.prefix_lengths(ids, tokenizer.detokenize) == [len(tokenizer.detokenize(ids[:k]))
                                                                 for k in range(len(ids))]


def test_host_work_per_id_does_not_grow_with_the_length(tokenizer):
    words = tokenizer.tokenize(" the quick brown fox jumps over a lazy dog, naïve café" * 60)
    per_id = {}
    for n in (64, 512):
        state = IncrementalText(tokenizer.detokenize, eod_id=2, stop=["never there"])
        assert "".join(feed(state, words[:n], 8)) == tokenizer.detokenize(words[:n])
        per_id[n] = state.decoded / n
    assert per_id[512] <= 4 and per_id[64] <= 4  # ids decoded per id: a window of a few ids, not the whole row
    assert abs(per_id[512] - per_id[64]) < 0.25


def test_without_stop_strings_an_update_is_two_detokenize_calls_whatever_its_length(tokenizer):
    """The loop's work per engine sync and row: one window for all the sync's ids, not one per id."""
    words = tokenizer.tokenize(" the quick brown fox jumps over a lazy dog" * 30)[:256]
    calls = []

    def detokenize(ids):
        calls.append(len(ids))
        return tokenizer.detokenize(ids)

    for per_update in (1, 8, 32):
        calls.clear()
        state = IncrementalText(detokenize, eod_id=2)
        assert "".join(feed(state, words, per_update)) == tokenizer.detokenize(words)
        assert len(calls) == 2 * len(words) // per_update


def test_stop_strings_cut_the_text_and_never_leak(tokenizer):
    text = "Hello world, hello there, hello again"
    ids = tokenizer.tokenize(text)
    for stop, include, expected in ((["lo th", "again"], False, "Hello world, hel"),
                                    (["zzz", ", hello a"], False, "Hello world, hello there"),
                                    (["there"], True, "Hello world, hello there")):
        k = next(k for k in range(1, len(ids) + 1) if any(s in tokenizer.detokenize(ids[:k]) for s in stop))
        for step in (1, 4):
            state = IncrementalText(tokenizer.detokenize, eod_id=2, stop=stop, include_stop=include)
            deltas = feed(state, ids, step)
            assert state.text == expected and "".join(deltas) == expected
            assert state.stopped and state.tokens == k
    state = IncrementalText(tokenizer.detokenize, eod_id=2, stop=["xyz"])
    assert "".join(feed(state, ids, 3)) == text and not state.stopped and state.tokens == len(ids)


def test_a_stop_token_ends_the_text_after_its_own(tokenizer):
    ids = tokenizer.tokenize("Hello world, hello there, hello again")
    k = next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])  # its first occurrence is at k
    for step in (1, 4):
        state = IncrementalText(tokenizer.detokenize, eod_id=2, stop_ids=(ids[k],))
        assert "".join(feed(state, ids, step)) == state.text == tokenizer.detokenize(ids[:k + 1])
        assert state.stopped and state.tokens == k + 1


def test_a_tail_that_may_start_a_stop_string_is_held_back(tokenizer):
    ids = tokenizer.tokenize("Hello world")
    state = IncrementalText(tokenizer.detokenize, stop=["world!"])
    assert state.update(ids) == "Hello "  # "world" could be the start of "world!"
    assert state.update(tokenizer.tokenize(" again"), final=True) == "world again"


# ---- the engine thread -------------------------------------------------------------------------------------------

def test_worker_admits_a_row_into_the_running_batch_with_its_solo_output():
    torch.manual_seed(0)
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=64,
                         attention_impl="torch", init_method_std=1.0)
    model = BloomModel(config, parallel_output=False).eval()
    engine = InferenceEngine(model, max_batch_size=4, max_seq_len=64, kv_bucket=16)
    long, short = SamplingParams(greedy=True, max_new_tokens=40), SamplingParams(greedy=True, max_new_tokens=6)
    sampled = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=6)
    prompts = [[5, 9, 3], [7, 1], [11, 12, 13, 14]]
    solo = [engine.generate([prompts[0]], long), engine.generate([prompts[1]], short),
            engine.generate([prompts[2]], sampled, seed=99)]

    async def scenario():
        worker = EngineWorker(engine, steps_per_sync=2)
        worker.start(asyncio.get_running_loop())
        first = Job(worker, lambda job: None)
        first.add(Row(first, 0, prompts[0], long, 0, IncrementalText(lambda ids: " ".join(map(str, ids)))))
        worker.submit(first.rows)
        while len(first.rows[0].output) < 4:  # the first row is decoding
            await first.next()
        second = Job(worker, lambda job: None)
        for i, (p, params, seed) in enumerate([(prompts[1], short, 0), (prompts[2], sampled, 99)]):
            second.add(Row(second, i, p, params, seed, IncrementalText(lambda ids: " ".join(map(str, ids)))))
        worker.submit(second.rows)
        await second.wait()
        running_meanwhile = not first.rows[0].finished
        await first.wait()
        worker.stop()
        rows = first.rows + second.rows
        return [r.output for r in rows], running_meanwhile, worker.stats, [r.text.decoded for r in rows]

    outputs, running_meanwhile, stats, decoded = asyncio.run(scenario())
    assert outputs == [s[0] for s in solo]
    # each update carries only the new ids, each decoded in a short window (a whole-row decode per update of the
    # 40-token row would be ~20 updates x ~20 ids)
    assert all(d <= 3 * len(o) for d, o in zip(decoded, outputs))
    assert running_meanwhile and stats["peak_running"] == 3 and stats["finished"] == 3 and not stats["cancelled"]


def tiny_engine(max_batch_size=4, seq_length=64):
    torch.manual_seed(0)
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=seq_length,
                         attention_impl="torch", init_method_std=1.0)
    model = BloomModel(config, parallel_output=False).eval()
    return InferenceEngine(model, max_batch_size=max_batch_size, max_seq_len=seq_length, kv_bucket=16)


def test_a_sync_copies_only_the_new_tokens():
    engine = tiny_engine(seq_length=600)
    params = {n: SamplingParams(temperature=0.9, max_new_tokens=n) for n in (64, 512)}
    for n in (64, 512):
        before = engine.copied_tokens
        requests = [engine.add_request([5, 9, 3], params[n], seed=s) for s in (1, 2)]
        while engine.has_work():
            engine.step(8)
        assert [len(r.output) for r in requests] == [n, n]
        assert engine.copied_tokens - before == 2 * n  # each id once (the whole rows at each sync: ~n * n / 8)
        assert [r.output for r in requests] == engine.generate([[5, 9, 3]] * 2, params[n], seed=1)


def test_a_burst_of_requests_is_admitted_in_one_round_with_their_solo_outputs():
    """Five requests queued while the engine thread is busy (a scoring call) are all admitted by the next round:
    one prefill round for all five (no round of their own: that round decodes too), each with its solo output."""
    engine = tiny_engine(max_batch_size=8)
    params = SamplingParams(greedy=True, max_new_tokens=10)
    prompts = [[5, 9, 3 + i, 7][:2 + i % 3] for i in range(5)]
    solo = [engine.generate([p], params)[0] for p in prompts]
    engine.stats.update(rounds=0, prefill_rounds=0, admitted=0, decode_steps=0)
    entered, release = threading.Event(), threading.Event()

    class BusyScorer:
        def score(self, *args):
            entered.set()
            release.wait(30)
            return "scored"

    async def scenario():
        worker = EngineWorker(engine, steps_per_sync=4, scorer=BusyScorer())
        worker.start(asyncio.get_running_loop())
        scored = worker.score([[1, 2]], [(0, [2])], None)
        assert await asyncio.to_thread(entered.wait, 30)  # the engine thread is busy: the five wait in its queue
        jobs = [rows_of(Job(worker, lambda job: None), worker, [p], params) for p in prompts]  # 5 submits
        release.set()
        assert await scored == "scored"
        for job in jobs:
            await job.wait()
        worker.stop()
        return [job.rows[0].output for job in jobs], dict(worker.stats["rounds"])

    outputs, rounds = asyncio.run(scenario())
    assert outputs == solo
    # 10 tokens: the prefill's first token and 9 decode steps, in rounds of 4 steps: 3 rounds
    assert (rounds["prefill_rounds"], rounds["admitted"], rounds["rounds"], rounds["decode_steps"]) == (1, 5, 3, 9)


def test_an_idle_worker_waits_for_the_rest_of_a_burst():
    """batch_wait: four requests arriving 50 ms apart at an idle engine are prefilled in one round (each with its
    solo output), the wait ending when they fill the batch, not at batch_wait; once a second request has come the
    wait spans gaps up to burst_gap, not batch_gap; a lone request's wait ends batch_gap after it; batch_wait=0
    (EngineWorker's default) never waits."""
    engine = tiny_engine(max_batch_size=4)
    params = SamplingParams(greedy=True, max_new_tokens=6)
    prompts = [[5, 9, 3 + i, 7][:2 + i % 3] for i in range(4)]
    solo = [engine.generate([p], params)[0] for p in prompts]

    async def scenario(batch_wait, batch_gap, wave, burst_gap=None, apart=(0.05, 0.05, 0.05)):
        engine.stats.update(rounds=0, prefill_rounds=0, admitted=0)
        worker = EngineWorker(engine, steps_per_sync=2, batch_wait=batch_wait, batch_gap=batch_gap,
                              burst_gap=burst_gap)
        worker.start(asyncio.get_running_loop())
        jobs = []
        for p, pause in zip(wave, apart + (0.0,)):
            jobs.append(rows_of(Job(worker, lambda job: None), worker, [p], params))
            if pause:
                await asyncio.sleep(pause)
        for job in jobs:
            await job.wait()
        worker.stop()
        return [job.rows[0].output for job in jobs], dict(worker.stats), dict(engine.stats)

    outputs, stats, rounds = asyncio.run(scenario(30.0, 5.0, prompts))
    assert outputs == solo
    assert (rounds["prefill_rounds"], rounds["admitted"], stats["batch_waits"]) == (1, 4, 1)
    assert 0.1 < stats["batch_wait_s"] < 5.0  # three 50 ms gaps; ended by the full batch, not the 5 s gap

    # two together, then two more 0.3 s apart: a 0.25 s gap for a lone request, 5 s within a burst -> one round
    outputs, stats, rounds = asyncio.run(scenario(30.0, 0.25, prompts, burst_gap=5.0, apart=(0.0, 0.3, 0.3)))
    assert outputs == solo
    assert (rounds["prefill_rounds"], rounds["admitted"], stats["batch_waits"]) == (1, 4, 1)
    assert 0.6 <= stats["batch_wait_s"] < 5.0
    # the same arrivals with the burst's gap no longer than the lone request's: the wave splits after the first two
    outputs, stats, rounds = asyncio.run(scenario(30.0, 0.25, prompts, apart=(0.0, 0.3, 0.3)))
    assert outputs == solo
    assert rounds["prefill_rounds"] >= 2 and 0.25 <= stats["batch_wait_s"] / stats["batch_waits"] < 0.3

    outputs, stats, rounds = asyncio.run(scenario(30.0, 0.3, prompts[:1]))
    assert outputs == solo[:1] and stats["batch_waits"] == 1
    assert 0.3 <= stats["batch_wait_s"] < 5.0  # the gap passed with nothing arriving

    _, stats, _ = asyncio.run(scenario(0.0, 0.3, prompts[:1]))
    assert (stats["batch_waits"], stats["batch_wait_s"]) == (0, 0.0)


def rows_of(job, worker, prompts, params, seeds=None):
    for i, p in enumerate(prompts):
        job.add(Row(job, i, p, params, 0 if seeds is None else seeds[i],
                    IncrementalText(lambda ids: " ".join(map(str, ids)))))
    worker.submit(job.rows)
    return job


def test_a_failed_step_fails_every_row_and_the_worker_recovers(engine_fault):
    fault = engine_fault
    engine = tiny_engine()
    params = SamplingParams(greedy=True, max_new_tokens=6)
    prompts = [[5, 9, 3 + i] for i in range(6)]
    solo = engine.generate(prompts[:1], params)[0]

    async def scenario():
        worker = EngineWorker(engine, steps_per_sync=2)
        worker.start(asyncio.get_running_loop())
        fault.touch()
        job = rows_of(Job(worker, lambda job: None), worker, prompts, params)  # 6 rows, 4 slots: 2 queued
        reasons = [(await job.next())[2] for _ in prompts]
        unhealthy = (worker.healthy, worker.stats["errors"], engine.has_work())
        fault.unlink()
        for _ in range(100):  # the idle worker probes the device
            if worker.healthy:
                break
            await asyncio.sleep(0.05)
        again = rows_of(Job(worker, lambda job: None), worker, prompts[:1], params)
        await again.wait()
        worker.stop()
        return reasons, unhealthy, worker.healthy, again.rows[0].output

    reasons, unhealthy, healthy, output = asyncio.run(scenario())
    assert reasons == ["error"] * 6 and unhealthy == (False, 1, False)
    assert healthy and output == solo


def test_a_dead_engine_thread_answers_what_is_queued_and_what_comes_later():
    engine = tiny_engine()
    params = SamplingParams(greedy=True, max_new_tokens=6)

    async def scenario():
        worker = EngineWorker(engine, steps_per_sync=2)
        worker.start(asyncio.get_running_loop())
        job = rows_of(Job(worker, lambda job: None), worker, [[5, 9, 3]], params)
        await job.wait()
        engine.has_work = lambda: (_ for _ in ()).throw(RuntimeError("a bug"))  # the next round dies
        queued = rows_of(Job(worker, lambda job: None), worker, [[5, 9, 4], [5, 9, 5]], params)
        first = [(await queued.next())[2] for _ in range(2)]
        late = rows_of(Job(worker, lambda job: None), worker, [[5, 9, 6]], params)
        second = (await late.next())[2]
        return first, second, worker.alive

    first, second, alive = asyncio.run(scenario())
    assert first == ["error", "error"] and second == "error" and not alive


def test_logprobs_body_is_openais_legacy_format(tokenizer):
    from megatron.inference.scoring import Scored

    ids = tokenizer.tokenize("The cat sat")  # prompt: the first two tokens, completion: the rest
    scored = Scored([-1.5, -0.25][:len(ids) - 1] + [-2.0] * (len(ids) - 3), [False] * (len(ids) - 1),
                    top_ids=[[ids[k + 1], 7] for k in range(len(ids) - 1)],
                    top_logprobs=[[-0.5, -0.75] for _ in range(len(ids) - 1)])
    body = api.logprobs_body(ids, scored, tokenizer.detokenize, first_offset=2, echo=True)
    texts = [tokenizer.detokenize([t]) for t in ids]
    assert body["tokens"] == texts
    assert body["token_logprobs"] == [None] + scored.logprobs
    assert body["text_offset"] == [sum(len(t) for t in texts[:k]) for k in range(len(ids))]
    assert body["top_logprobs"][0] is None
    assert body["top_logprobs"][1] == {texts[1]: -0.5, tokenizer.detokenize([7]): -0.75}
    plain = api.logprobs_body(ids, scored, tokenizer.detokenize, first_offset=2, echo=False)
    assert plain == {key: value[2:] for key, value in body.items()}


def test_logprobs_and_echo_scoring_are_parsed():
    req = api.parse_completion_request({"prompt": [[5, 6]], "max_tokens": 0, "echo": True, "logprobs": 1}, LIMITS)
    assert (req.max_tokens, req.echo, req.logprobs, req.prompts) == (0, True, 1, [[5, 6]])
    assert api.parse_completion_request({"prompt": "x"}, LIMITS).logprobs is None


def test_the_plan_channel_sends_nothing_after_its_stop(monkeypatch):
    """Rank 0's close() after a timed-out worker stop and the engine thread's own last plans: one stop reaches the
    other ranks and nothing after it (they have left the broadcast loop; a later broadcast would hang)."""
    import torch.distributed as dist

    from megatron.inference.worker import PlanChannel

    sent = []
    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src, group: sent.append(box[0]))

    def fresh():  # PlanChannel's state without a process group
        channel = object.__new__(PlanChannel)
        channel.src, channel.group, channel.stopped, channel._lock = 0, None, False, threading.Lock()
        return channel

    channel = fresh()
    channel.send([("step", (4, False))])
    channel.send([("cancel", [3]), ("stop", None)])
    channel.send([("step", (4, False))])
    channel.close()
    assert sent == [[("step", (4, False))], [("cancel", [3]), ("stop", None)]]
    channel = fresh()
    channel.close()  # the worker never started: close() says stop
    channel.close()
    assert sent[2:] == [[("stop", None)]]
