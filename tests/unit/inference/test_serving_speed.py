"""benchmarks/serving_speed.py's clients: spread over processes, every client's requests come back tagged, and the
send spread per wave by hand. The server here is a stand-in that streams OpenAI-style chunks (the real server's
figures are the bench's own run on the GPU machine)."""
import argparse
import contextlib
import http.server
import json
import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from benchmarks import serving_speed  # noqa: E402


class Streamer(http.server.BaseHTTPRequestHandler):
    """POST /v1/completions: one chunk per requested token ("t<i> "), the usage, then [DONE], chunked, kept alive."""
    protocol_version = "HTTP/1.1"
    arrivals = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.arrivals.append(body["prompt"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"index": 0, "text": f"t{i} "}]} for i in range(body["max_tokens"])]
        events.append({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
        for data in [json.dumps(e) for e in events] + ["[DONE]"]:
            payload = f"data: {data}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving(handler):
    """A ThreadingHTTPServer with handler on a free port of 127.0.0.1: its port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def streamer():
    Streamer.arrivals = []
    with serving(Streamer) as port:
        yield port


def bench_args(processes):
    return argparse.Namespace(timeout=60, prompt_len=5, new_tokens=3, requests_per_client=2,
                              client_processes=processes)


@pytest.mark.parametrize("processes", [1, 2])
def test_every_clients_requests_come_back_tagged(streamer, processes):
    results = serving_speed.run_round(bench_args(processes), streamer, clients=3, vocab_size=100)
    assert sorted((r["client"], r["sequence"]) for r in results) == [(c, s) for c in range(3) for s in range(2)]
    for r in results:
        assert r["tokens"] == 3 and r["text"] == "t0 t1 t2 "
        assert r["start"] <= r["first"] <= r["end"]
    prompts = [serving_speed.client_prompt(bench_args(processes), 100, c) for c in range(3)]
    assert sorted(map(tuple, Streamer.arrivals)) == sorted(map(tuple, prompts * 2))
    spreads = serving_speed.send_spread_ms(results)
    assert len(spreads) == 2 and all(0 <= s < 60e3 for s in spreads)


def test_client_groups_and_send_spread_by_hand():
    assert serving_speed.client_groups(5, 2) == [[0, 2, 4], [1, 3]]
    assert serving_speed.client_groups(2, 8) == [[0], [1]]
    assert serving_speed.client_groups(3, 1) == [[0, 1, 2]]
    results = [{"sequence": 0, "start": 1.000}, {"sequence": 0, "start": 1.004}, {"sequence": 1, "start": 2.5},
               {"sequence": 1, "start": 2.5015}, {"sequence": 0, "start": 1.001}]
    assert serving_speed.send_spread_ms(results) == pytest.approx([4.0, 1.5])


def test_a_server_that_refuses_fails_the_round():
    class Refuser(Streamer):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(503)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"busy")

    with serving(Refuser) as port, pytest.raises(RuntimeError, match="the server answered 503: b'busy'"):
        serving_speed.run_round(bench_args(2), port, clients=2, vocab_size=100)
