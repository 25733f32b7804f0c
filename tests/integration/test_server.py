"""tools/run_text_generation_server.py end to end on a tiny trained checkpoint, through the real openai client, curl
and Megatron's PUT /api: greedy completions equal tools/generate_text.py token for token, streams concatenate to
the completion, concurrent requests equal their solo answers, bad input gets its status and harms nothing, a
disconnected stream is cancelled, SIGTERM finishes what is in flight and exits 0, an injected engine fault answers
every request with 500 and /health 503 until the engine works again, stop_token and n > 1 seeds; the same server
under torchrun at TP 2 (gloo) answers exactly as the one-process server, streaming too.

The checkpoint is trained once per module (20 iterations); one server serves the module, a second one is stopped by
SIGTERM, a third runs at TP 2. Every request goes to 127.0.0.1 and is bounded in count and time.
"""
import functools
import http.client
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.distributed import free_port
from tests.launch import PYTHON, ROOT, TINY_MODEL, TOKENIZER, env, run_pretrain

KEY = "test-key"
PROMPTS = ["The cat sat on the", "Once upon a time there was a little girl who lived in"]
TRAIN = TINY_MODEL + ["--micro-batch-size", "4", "--global-batch-size", "4", "--lr", "1e-2", "--log-interval", "5",
                      "--vocab-file", str(TOKENIZER / "vocab.json"), "--merge-file", str(TOKENIZER / "merges.txt"),
                      "--deepspeed", "--train-iters", "20", "--save-interval", "20"]
CONTEXT, LIMIT = 2048, 2000  # served beyond the trained 32 tokens (ALiBi): long requests for the disconnect test


@pytest.fixture(scope="module")
def checkpoint(sample_data, tmp_path_factory):
    save = tmp_path_factory.mktemp("server") / "ckpt"
    run_pretrain(TRAIN + ["--data-path", sample_data, "--save", str(save)], timeout=300)
    return save


class Server:
    """The server in a subprocess on a free port of 127.0.0.1; stop() kills it if it is still running."""

    def __init__(self, checkpoint, log_path, *extra, nproc=1, fault_file=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        launcher = [PYTHON] if nproc == 1 else [os.path.join(os.path.dirname(PYTHON), "torchrun"), "--nproc_per_node",
                                                str(nproc), "--master_port", str(free_port())]
        cmd = launcher + [str(ROOT / "tools" / "run_text_generation_server.py"), "--load", str(checkpoint),
               "--port", str(self.port), "--api-key", KEY, "--max-batch-size", "4", "--max-seq-len", str(CONTEXT),
               "--max-new-tokens-limit", str(LIMIT), "--max-body-bytes", "65536", "--steps-per-sync", "4",
               "--log-level", "warning", *extra]
        self.log = open(log_path, "w+")
        self.fault_file = fault_file
        extra_env = {"MEGATRON_TEST_ENGINE_FAULT": str(fault_file)} if fault_file else None
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env(extra_env), stdout=self.log, stderr=subprocess.STDOUT,
                                     text=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                if self.health()["status"] == "ok":
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                output = self.output()
                self.stop()
                raise AssertionError(f"the server did not come up:\n{output}")
            time.sleep(0.2)

    def health(self):
        with urllib.request.urlopen(self.url + "/health", timeout=10) as response:
            return json.loads(response.read())

    def health_status(self):
        try:
            return self.health()["status"], 200
        except urllib.error.HTTPError as err:
            return json.loads(err.read())["status"], err.code

    def output(self):
        self.log.seek(0)
        return self.log.read()[-6000:]

    def stop(self):
        if self.proc.poll() is None:
            if len(self.proc.args) > 1 and self.proc.args[1] == "--nproc_per_node":  # torchrun: its workers too
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module", params=["thread", "process"])
def frontend(request):
    """--frontend: every test of the module runs against both (the HTTP app beside the engine, or in its own
    process)."""
    return request.param


@pytest.fixture(scope="module")
def server(checkpoint, frontend, tmp_path_factory):
    folder = tmp_path_factory.mktemp("server_log")
    srv = Server(checkpoint, folder / "server.log", "--frontend", frontend, fault_file=folder / "fault")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(checkpoint, tmp_path_factory):
    """tools/generate_text.py --greedy on PROMPTS: {prompt: (generated ids, continuation text)}, 12 new tokens."""
    import importlib.util
    out = tmp_path_factory.mktemp("reference") / "gen.jsonl"
    spec = importlib.util.spec_from_file_location("generate_text", ROOT / "tools" / "generate_text.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = ["--load", str(checkpoint), "--greedy", "--max-new-tokens", "12", "--batch-size", "2",
            "--output-file", str(out)]
    assert module.main(args + [a for p in PROMPTS for a in ("--prompt", p)]) == 0
    with open(out) as f:
        records = [json.loads(line) for line in f]
    return {r["prompt"]: (r["generated_ids"], r["continuation"]) for r in records}


def raw(server, method, path, body=None, headers=None, key=KEY):
    """(status, parsed JSON body) of one request; body: bytes, or an object sent as JSON."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    all_headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
                   **(headers or {})}
    request = urllib.request.Request(server.url + path, data=data, method=method, headers=all_headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def greedy(client, prompt, max_tokens, **kwargs):
    return client.completions.create(model="ckpt", prompt=prompt, max_tokens=max_tokens, temperature=0, **kwargs)


def streamed(client, **kwargs):
    """(text per choice index, finish reasons, usage, chunks) of a streamed completion."""
    texts, reasons, usage, chunks = {}, {}, None, 0
    for chunk in client.completions.create(model="ckpt", stream=True, stream_options={"include_usage": True},
                                           **kwargs):
        chunks += 1
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index not in reasons  # nothing after a choice's last chunk
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage, chunks


def test_health_models_and_keys(server, client):
    health = server.health()
    assert health["status"] == "ok" and health["model"] == "ckpt"
    assert [m.id for m in client.models.list().data] == ["ckpt"]
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model="ckpt", prompt="x", max_tokens=2)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    assert raw(server, "GET", "/v1/models", key=None)[0] == 401


def test_greedy_completions_equal_generate_text(client, reference):
    for prompt in PROMPTS:
        ids, text = reference[prompt]
        response = greedy(client, prompt, 12)
        choice = response.choices[0]
        assert choice.text == text and response.usage.completion_tokens == len(ids)
        assert choice.finish_reason == ("stop" if len(ids) < 12 else "length")
        assert response.usage.prompt_tokens == len(client_tokens(prompt))
        assert response.object == "text_completion" and response.model == "ckpt" and response.id.startswith("cmpl-")
    both = greedy(client, PROMPTS, 12)  # a list of prompts: one choice each, in order
    assert [c.text for c in both.choices] == [reference[p][1] for p in PROMPTS]
    assert [c.index for c in both.choices] == [0, 1]
    assert both.usage.completion_tokens == sum(len(reference[p][0]) for p in PROMPTS)
    by_ids = greedy(client, client_tokens(PROMPTS[0]), 12)  # token ids as the prompt
    assert by_ids.choices[0].text == reference[PROMPTS[0]][1]
    echoed = greedy(client, PROMPTS[0], 12, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + reference[PROMPTS[0]][1]


@functools.lru_cache(maxsize=None)
def tokenizer():
    from megatron.tokenizer import build_tokenizer
    return build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=str(TOKENIZER))


def client_tokens(text):
    return tokenizer().tokenize(text)


def test_streamed_chunks_concatenate_to_the_completion(client, reference):
    texts, reasons, usage, chunks = streamed(client, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert texts == {i: reference[p][1] for i, p in enumerate(PROMPTS)}
    assert chunks > 4 and set(reasons) == {0, 1}
    assert usage.completion_tokens == sum(len(reference[p][0]) for p in PROMPTS)
    sampling = dict(prompt=PROMPTS[1], max_tokens=40, temperature=0.9, top_p=0.95, seed=5, extra_body={"top_k": 50})
    whole = client.completions.create(model="ckpt", **sampling)
    texts, reasons, usage, _ = streamed(client, **sampling)
    assert texts == {0: whole.choices[0].text} and reasons == {0: whole.choices[0].finish_reason}
    assert usage.completion_tokens == whole.usage.completion_tokens
    other = client.completions.create(model="ckpt", **{**sampling, "seed": 6})
    assert other.choices[0].text != whole.choices[0].text  # the seed matters: the sampled text is not degenerate


def test_stop_strings_cut_the_text(client):
    full = greedy(client, PROMPTS[0], 20).choices[0].text
    words = full.split()
    stop = next(w for w in words[1:] if w != words[0])  # a word that does not start the text
    expected = full[:full.index(stop)]
    response = greedy(client, PROMPTS[0], 20, stop=["never appears", stop])
    assert response.choices[0].text == expected and response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < 20
    texts, reasons, usage, _ = streamed(client, prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=stop)
    assert texts == {0: expected} and reasons == {0: "stop"}
    assert usage.completion_tokens == response.usage.completion_tokens


def test_concurrent_requests_equal_their_solo_answers(server, client):
    jobs = [dict(prompt=PROMPTS[i % 2] + " and" * (i % 5), max_tokens=8 + 3 * (i % 7), temperature=0)
            for i in range(12)]
    jobs += [dict(prompt=PROMPTS[i % 2], max_tokens=30, temperature=0.8, seed=100 + i) for i in range(4)]

    def ask(job):
        response = client.completions.create(model="ckpt", **job)
        return response.choices[0].text, response.choices[0].finish_reason, response.usage.completion_tokens

    solo = [ask(job) for job in jobs]  # one at a time
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, jobs))
    assert together == solo
    assert server.health()["peak_running"] == 4  # all four slots decoded together


BAD = [  # (method, path, body, status, param)
    ("POST", "/v1/completions", b'{"prompt": "x", ', 400, None),
    ("POST", "/v1/completions", b'["x"]', 400, None),
    ("POST", "/v1/completions", b"[" * 30000 + b"]" * 30000, 400, None),  # nested past the parser's recursion
    ("POST", "/v1/completions", b'{"prompt": "\xff"}', 400, None),  # not UTF-8
    ("POST", "/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": ["a", None]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": [5, 10 ** 7]}, 400, "prompt"),  # token ids: checked on the loop
    ("POST", "/v1/completions", {"prompt": [5] * (CONTEXT + 1), "max_tokens": 4}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": [5] * 5000, "max_tokens": 4}, 400, "prompt"),  # past INLINE_IDS: the pool
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": LIMIT + 1}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": " cat" * CONTEXT, "max_tokens": 4}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": " cat" * 100, "max_tokens": LIMIT}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": "5"}, 400, "top_k"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": 7}, 400, "stop"),
    ("POST", "/v1/completions", {"prompt": "x", "colour": "red"}, 400, "colour"),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("POST", "/v1/completions", {"prompt": "x" * 70000}, 413, None),
    ("GET", "/v1/completions", None, 405, None),
    ("POST", "/v1/chat/completions", {"prompt": "x"}, 404, None),
]


def test_bad_input_gets_its_status_and_harms_nothing(server, client, reference):
    for method, path, body, status, param in BAD:
        code, answer = raw(server, method, path, body)
        assert (code, answer["error"]["param"]) == (status, param), (body, answer)
        assert answer["error"]["message"]
    assert raw(server, "POST", "/v1/completions", {"prompt": "x"}, key=None)[0] == 401
    assert raw(server, "POST", "/v1/completions", {"prompt": "x"}, key="nope")[0] == 401
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="ckpt", prompt="x", max_tokens=LIMIT + 1)
    assert info.value.body["param"] == "max_tokens"
    health = server.health()
    assert health["status"] == "ok" and health["pending"] == 0 and health["errors"] == 0
    assert greedy(client, PROMPTS[0], 12).choices[0].text == reference[PROMPTS[0]][1]


def test_a_client_that_disconnects_mid_stream_has_its_row_cancelled(server, client, reference):
    before = server.health()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("POST", "/v1/completions", json.dumps(
        {"prompt": PROMPTS[1], "max_tokens": LIMIT, "temperature": 0, "stream": True}),
        {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: {")
    connection.close()  # gone after the first chunk of a 2000-token completion
    deadline = time.monotonic() + 20
    while True:
        health = server.health()
        if health["cancelled"] == before["cancelled"] + 1 and health["running"] == 0 and health["pending"] == 0:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    assert health["finished"] == before["finished"]  # cancelled, not run to its end
    assert greedy(client, PROMPTS[1], 12).choices[0].text == reference[PROMPTS[1]][1]


def test_megatron_put_api(server, reference):
    code, answer = raw(server, "PUT", "/api", {"prompts": PROMPTS, "tokens_to_generate": 12, "top_k": 1})
    assert code == 200
    assert answer["text"] == [p + reference[p][1] for p in PROMPTS]
    # one segment per token: the prompt's, then generate_text's greedy ids, token for token
    assert answer["segments"] == [[tokenizer().detokenize([t]) for t in client_tokens(p) + reference[p][0]]
                                  for p in PROMPTS]
    code, answer = raw(server, "PUT", "/api", {"tokens_to_generate": 12})
    assert (code, answer["message"]) == (400, "prompts argument required: a list of strings")


def test_curl_streaming(server, reference):
    body = json.dumps({"model": "ckpt", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stream": True})
    proc = subprocess.run(["curl", "-sSN", "--max-time", "60", server.url + "/v1/completions", "-H",
                           f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json", "-d", body],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference[PROMPTS[0]][1]
    assert chunks[-1]["choices"][0]["finish_reason"] is not None


def test_sigterm_finishes_in_flight_requests_and_exits_0(checkpoint, frontend, client, tmp_path):
    expected = greedy(client, PROMPTS[1], 600).choices[0].text  # from the module's server
    srv = Server(checkpoint, tmp_path / "server.log", "--frontend", frontend)
    try:
        other = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        first_chunk, result = threading.Event(), {}

        def stream():
            text = ""
            for chunk in other.completions.create(model="ckpt", prompt=PROMPTS[1], max_tokens=600, temperature=0,
                                                  stream=True):
                text += chunk.choices[0].text
                first_chunk.set()
            result["text"] = text

        thread = threading.Thread(target=stream)
        thread.start()
        assert first_chunk.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        thread.join(60)
        assert result.get("text") == expected  # finished, not cut
        assert srv.proc.wait(60) == 0, srv.output()
        with pytest.raises(OSError):
            srv.health()
    finally:
        srv.stop()


# ---- failures, stop_token, seeds, tensor parallelism -------------------------------------------------------------

def wait_for_status(server, status, seconds=30):
    deadline = time.monotonic() + seconds
    while server.health_status()[0] != status:
        assert time.monotonic() < deadline, server.health_status()
        time.sleep(0.05)


def check_engine_fault(server, client, reference, concurrent=6):
    """With the fault file present every request (running or queued) gets 500, a stream an error event, /health
    503; without it the server recovers and answers as before."""
    before = server.health()
    server.fault_file.touch()
    try:
        prompts = [dict(prompt=PROMPTS[i % 2] + " and" * i, max_tokens=30, temperature=0) for i in range(concurrent)]

        def ask(job):
            code, answer = raw(server, "POST", "/v1/completions", job)
            return code, answer["error"]["type"]

        with ThreadPoolExecutor(concurrent) as pool:  # more than the 4 slots: some wait in the engine's queue
            assert list(pool.map(ask, prompts)) == [(500, "server_error")] * concurrent
        status, code = server.health_status()
        assert (status, code) == ("unhealthy", 503)
        with pytest.raises(openai.APIError) as info:
            streamed(client, prompt=PROMPTS[0], max_tokens=12, temperature=0)
        assert "the engine failed" in str(info.value)
    finally:
        server.fault_file.unlink()
    wait_for_status(server, "ok")  # the idle engine thread probes the device
    health = server.health()
    assert health["errors"] > before["errors"] and health["pending"] == 0 and health["running"] == 0
    assert greedy(client, PROMPTS[0], 12).choices[0].text == reference[PROMPTS[0]][1]


def test_an_engine_fault_answers_every_request_with_500_until_it_recovers(server, client, reference):
    check_engine_fault(server, client, reference)


def test_stop_token_ends_the_generation_after_it(server):
    body = {"prompts": [PROMPTS[1]], "tokens_to_generate": 24, "temperature": 0.9, "random_seed": 3}
    code, full = raw(server, "PUT", "/api", body)
    assert code == 200
    prompt_len = len(client_tokens(PROMPTS[1]))
    generated = full["segments"][0][prompt_len:]
    assert len(generated) == 24
    k, stop_id = next((k, ids[0]) for k, (seg, ids) in enumerate((g, client_tokens(g)) for g in generated)
                      if k >= 2 and seg.isascii() and len(ids) == 1 and seg not in generated[:k])
    code, answer = raw(server, "PUT", "/api", {**body, "stop_token": stop_id})
    assert code == 200
    assert answer["text"] == [PROMPTS[1] + "".join(generated[:k + 1])]
    assert answer["segments"] == [full["segments"][0][:prompt_len + k + 1]]


def test_each_choice_of_n_has_its_own_reproducible_seed(client):
    from megatron.inference.api import row_seed

    def texts(seed, n):
        response = client.completions.create(model="ckpt", prompt=PROMPTS[1], max_tokens=16, temperature=1.0,
                                             seed=seed, n=n)
        return [c.text for c in response.choices]

    three = texts(5, 3)
    assert texts(5, 3) == three and len(set(three)) == 3
    assert [texts(row_seed(5, k), 1)[0] for k in range(3)] == three  # choice k samples with row_seed(5, k)
    assert texts(6, 1)[0] != three[1]  # seed + k gave choice 1 of seed 5 the sample of seed 6


@pytest.fixture(scope="module")
def tp2_server(checkpoint, frontend, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp2_server_log")
    srv = Server(checkpoint, folder / "server.log", "--tensor-model-parallel-size", "2", "--frontend", frontend,
                 nproc=2, fault_file=folder / "fault")
    yield srv
    srv.stop()


def test_a_tensor_parallel_server_answers_as_the_one_process_server(server, client, tp2_server, reference):
    tp2 = openai.OpenAI(base_url=tp2_server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert tp2_server.health()["status"] == "ok"
    sampled = dict(prompt=PROMPTS, max_tokens=24, temperature=0.9, top_p=0.95, seed=11, n=2,
                   extra_body={"top_k": 50})
    for make in (client, tp2):
        assert [c.text for c in greedy(make, PROMPTS, 12).choices] == [reference[p][1] for p in PROMPTS]
    one = client.completions.create(model="ckpt", **sampled)
    two = tp2.completions.create(model="ckpt", **sampled)
    assert [c.text for c in two.choices] == [c.text for c in one.choices] and len({c.text for c in one.choices}) == 4
    assert streamed(tp2, **sampled)[0] == {c.index: c.text for c in one.choices}
    with ThreadPoolExecutor(6) as pool:  # concurrent requests: rank 0's plans keep the ranks in step
        jobs = [dict(prompt=PROMPTS[i % 2], max_tokens=10 + i, temperature=0.8, seed=i) for i in range(6)]
        together = list(pool.map(lambda job: tp2.completions.create(model="ckpt", **job).choices[0].text, jobs))
    assert together == [client.completions.create(model="ckpt", **job).choices[0].text for job in jobs]
    scored = [make.completions.create(model="ckpt", prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True,
                                      logprobs=2).choices[0].logprobs for make in (client, tp2)]
    assert scored[0].tokens == scored[1].tokens
    assert scored[1].token_logprobs == pytest.approx(scored[0].token_logprobs, abs=1e-4)
    body = {"prompts": PROMPTS, "tokens_to_generate": 12, "temperature": 0.9, "random_seed": 3, "stop_token": 13}
    assert raw(tp2_server, "PUT", "/api", body) == raw(server, "PUT", "/api", body)
    check_engine_fault(tp2_server, tp2, reference, concurrent=5)


# ---- --frontend process: the two processes end together -----------------------------------------------------------

def frontend_process(srv):
    """The spawned HTTP front-end of a --frontend process server (not multiprocessing's resource tracker)."""
    import psutil
    children = [p for p in psutil.Process(srv.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(children) == 1, children
    return children[0]


def test_a_sigterm_while_the_front_end_starts_is_kept_for_it(checkpoint, tmp_path):
    """The serving line comes before the spawned front-end can take signals: a SIGTERM then still stops the server
    gracefully (exit 0), not lost and not killing the front-end."""
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([PYTHON, str(ROOT / "tools" / "run_text_generation_server.py"), "--load",
                                 str(checkpoint), "--port", str(port), "--max-seq-len", "64", "--frontend", "process",
                                 "--log-level", "warning"], cwd=ROOT, env=env(), stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while "serving ckpt at" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert " ERROR " not in log.read_text()


def test_a_killed_front_end_stops_the_engine_process_with_1(checkpoint, tmp_path):
    srv = Server(checkpoint, tmp_path / "server.log", "--frontend", "process")
    try:
        child = frontend_process(srv)
        assert child.pid != srv.proc.pid
        child.kill()
        assert srv.proc.wait(30) == 1
        errors = [line for line in srv.output().splitlines() if " ERROR " in line]
        assert errors and errors[-1].endswith("server: the HTTP front-end process exited with -9; see its log above")
    finally:
        srv.stop()


def test_a_killed_engine_process_ends_the_front_end(checkpoint, tmp_path):
    import psutil
    srv = Server(checkpoint, tmp_path / "server.log", "--frontend", "process")
    try:
        child = frontend_process(srv)
        srv.proc.kill()
        srv.proc.wait(30)
        child.wait(30)  # it saw the pipe end, stopped serving and exited (psutil.TimeoutExpired if not)
        with pytest.raises(OSError):
            srv.health()
        assert "server: the engine process has exited; answering every request in flight with 500" in srv.output()
    except psutil.TimeoutExpired:
        child.kill()
        raise
    finally:
        srv.stop()
