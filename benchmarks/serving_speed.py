"""Benchmark: the text generation server under 1, 8, 32 and 64 concurrent streaming clients against the engine alone
at the same batch (tokens/s), with time to first token and per output token.

    python benchmarks/serving_speed.py --device cuda --output benchmarks/results/serving_h200.json
        # the document's 1.72B model (random weights) in bf16 on a GPU
    python benchmarks/serving_speed.py --device cuda --load bloom_final      # a checkpoint or HF folder instead
    python benchmarks/serving_speed.py --device cuda --tp 2                   # TP 2 over two GPUs (torchrun)
    python benchmarks/serving_speed.py --tiny                                 # a small fp32 model on the CPU
        [--clients 1 8 32 64 --prompt-len 32 --new-tokens 256 --requests-per-client 2 --steps-per-sync 8]

A child process builds the model and one InferenceEngine (max batch = the most clients, every decode graph captured
at start-up as tools/run_text_generation_server.py does), times the engine alone at each client count (engine.generate
of that many prompts at once, the clients' own prompts, warm, best of --repeats: what the server could reach), then
serves the same engine with megatron.inference.server (the code behind tools/run_text_generation_server.py) on a
free port of 127.0.0.1. Each client is a thread that sends --requests-per-client streamed completions one after
another: a fixed --prompt-len token prompt (token ids, different per client), --new-tokens tokens, greedy, eod
ignored so every completion has exactly --new-tokens tokens. One warm-up request comes first. Per concurrency:
aggregate tokens/s (all completion tokens / wall time of the round), the engine's tokens/s at that batch and the
ratio server / engine, time to first token (request sent -> first text chunk: p50, p95, max) and time per output
token after the first ((last - first chunk) / (tokens - 1)), p50 and p95 over the requests.
"""
import argparse
import http.client
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENT_MODEL = dict(layers=24, hidden=2048, heads=16, vocab=250880)
TINY_MODEL = dict(layers=4, hidden=256, heads=8, vocab=8192)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present")
    parser.add_argument("--tiny", action="store_true", help=f"a small fp32 model ({TINY_MODEL}) on the CPU")
    parser.add_argument("--load", default=None, help="serve this checkpoint / HF folder instead of random weights")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="default: bf16 on cuda")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 256 (64 with --tiny)")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--steps-per-sync", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="engine timings per batch (best counts)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in the server")
    parser.add_argument("--tp", type=int, default=1,
                        help="serve tensor-parallel over this many processes (torchrun; one GPU each, or gloo on "
                             "the CPU); the engine figures are then the TP engine's")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    parser.add_argument("--output", default=None, help="also write the figures as JSON")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: the server process
    args = parser.parse_args(argv)
    if args.device is None:
        import torch
        args.device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    for key, value in (TINY_MODEL if args.tiny else DOCUMENT_MODEL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.new_tokens = args.new_tokens or (64 if args.tiny else 256)
    return args


# ---- the server process ------------------------------------------------------------------------------------------

def build_model(args, device, dtype, state=None):
    """(model, tokenizer); under TP (state) this rank's slice of the same random weights (or of --load)."""
    import torch

    if state is not None and state.tensor_model_parallel_size > 1:
        return build_tp_model(args, device, dtype, state)

    from megatron.checkpoint import convert
    from megatron.checkpoint.hf import load_any
    from megatron.model import BloomModel
    from megatron.tokenizer import build_tokenizer

    if args.load:
        merged = load_any(args.load)
        tokenizer = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=merged.tokenizer_dir)
        return convert.build_model(merged, dtype, device=device), tokenizer
    tokenizer = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=os.path.join(ROOT, "examples", "tokenizer"))
    torch.manual_seed(0)
    with torch.device(device):
        model = BloomModel(weights_config(args), parallel_output=False).to(dtype)
    return model.eval(), tokenizer


def build_tp_model(args, device, dtype, state):
    import dataclasses

    import torch

    from megatron.checkpoint.convert import as_reader, read_shard_for, stage_names
    from megatron.inference.loading import load_model
    from megatron.model import BloomModel

    if args.load:
        model, tokenizer, _, _ = load_model(args.load, state, dtype_flag=args.dtype)
        return model, tokenizer
    full, tokenizer = build_model(args, device, dtype)  # every rank the same weights (seed 0), then its slice
    tp = state.tensor_model_parallel_size
    weights = read_shard_for(as_reader(full.state_dict()), stage_names(full.config, tp, 1)[0], state.tp_rank, tp)
    del full
    config = dataclasses.replace(weights_config(args), tensor_model_parallel_size=tp)
    with torch.device(device):
        model = BloomModel(config, parallel_output=False, tp_group=state.tp_group).to(dtype)
    model.load_state_dict(weights["weights"], strict=True)
    return model.eval(), tokenizer


def weights_config(args):
    from megatron.config import ModelConfig
    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                       vocab_size=args.vocab, seq_length=args.prompt_len + args.new_tokens, attention_impl="torch",
                       hidden_dropout=0.0, attention_dropout=0.0)


def child(args):
    """Builds the model and the engine, times the engine alone at each client count, serves until SIGTERM (under
    TP: rank 0 serves, the other ranks follow its engine rounds)."""
    import torch

    from megatron.inference import InferenceEngine, SamplingParams
    from megatron.inference.loading import setup_tensor_parallel, tp_token_sync
    from megatron.inference.server import ServerSettings, bind, serve, serve_tensor_parallel

    if args.threads:
        torch.set_num_threads(args.threads)
    state = setup_tensor_parallel(args.tp)
    tp = state.tensor_model_parallel_size
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" \
        else torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model, tokenizer = build_model(args, device, dtype, state)
    context = args.prompt_len + args.new_tokens
    params = SamplingParams(greedy=True, max_new_tokens=args.new_tokens)
    engine = InferenceEngine(model, max_batch_size=max(args.clients), max_seq_len=context, eod_id=None,
                             vocab_limit=tokenizer.vocab_size, cuda_graphs=device.type == "cuda",
                             sync_tokens=tp_token_sync(state) if tp > 1 else None)
    prompts = [client_prompt(args, tokenizer.vocab_size, i) for i in range(max(args.clients))]
    figures = {"vocab_size": tokenizer.vocab_size, "engine_tokens_per_s": {}}

    def time_engine():  # on a thread of its own, as the server's engine runs
        if device.type == "cuda":
            torch.cuda.set_device(device)
        start = time.perf_counter()
        engine.warmup(every_bucket=True)  # what the server tool does at start-up
        figures["graphs"] = len(engine._graphs)
        figures["capture_s"] = time.perf_counter() - start
        for clients in args.clients:
            engine.generate(prompts[:clients], params, steps_per_sync=args.steps_per_sync)  # warm
            timings = []
            for _ in range(args.repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = engine.generate(prompts[:clients], params, steps_per_sync=args.steps_per_sync)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                timings.append((time.perf_counter() - start, sum(len(o) for o in out)))
            seconds, tokens = min(timings)
            figures["engine_tokens_per_s"][clients] = tokens / seconds

    thread = threading.Thread(target=time_engine)
    thread.start()
    thread.join()
    settings = ServerSettings(model_name="bench", max_new_tokens=args.new_tokens, steps_per_sync=args.steps_per_sync,
                              max_pending=max(1024, 2 * max(args.clients)), log_level="warning")
    if tp == 1:
        print("ENGINE " + json.dumps(figures), flush=True)
        return serve(engine, tokenizer, settings, sock=bind("127.0.0.1", 0))
    from megatron.initialize import shutdown_distributed
    if state.tp_rank == 0:
        print("ENGINE " + json.dumps(figures), flush=True)
    code = serve_tensor_parallel(engine, tokenizer, settings, state, bind("127.0.0.1", 0) if state.tp_rank == 0
                                 else None)
    shutdown_distributed()
    return code


def client_prompt(args, vocab_size, client):
    import random
    rng = random.Random(1000 + client)
    return [rng.randrange(4, vocab_size) for _ in range(args.prompt_len)]


# ---- the clients -------------------------------------------------------------------------------------------------

def stream_one(port, prompt, new_tokens, timeout):
    """One streamed completion: {start, first, end, tokens, text} (times from time.perf_counter)."""
    body = json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.perf_counter()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"the server answered {response.status}: {response.read()[:500]!r}")
    first, text, tokens = None, "", None
    while True:
        line = response.readline()
        if not line:
            raise RuntimeError("the stream ended without data: [DONE]")
        line = line.strip()
        if not line:
            continue
        if line == b"data: [DONE]":
            break
        chunk = json.loads(line[len(b"data: "):])
        if "error" in chunk:
            raise RuntimeError(f"the server failed the stream: {chunk['error']}")
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk["choices"]:
            if choice["text"] and first is None:
                first = time.perf_counter()
            text += choice["text"]
    end = time.perf_counter()
    connection.close()
    return {"start": start, "first": first if first is not None else end, "end": end, "tokens": tokens, "text": text}


def run_round(args, port, clients, vocab_size, requests=None):
    results, errors = [], []

    def client(index):
        try:
            for _ in range(requests or args.requests_per_client):
                results.append(stream_one(port, client_prompt(args, vocab_size, index), args.new_tokens,
                                          args.timeout))
        except Exception as err:  # reported below, after every thread ends
            errors.append(err)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def summarize(clients, results):
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    ttft = [(r["first"] - r["start"]) * 1e3 for r in results]
    tpot = [(r["end"] - r["first"]) * 1e3 / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    return {"clients": clients, "requests": len(results), "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "per_client_tokens_per_s": statistics.mean(
                r["tokens"] / (r["end"] - r["start"]) for r in results),
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p95_ms": percentile(ttft, 95), "ttft_max_ms": max(ttft),
            "tpot_p50_ms": percentile(tpot, 50), "tpot_p95_ms": percentile(tpot, 95)}


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device here; run it on a GPU machine or pass --tiny")
    launcher = [sys.executable] if args.tp == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                                      str(args.tp), "--master_port", str(free_port())]
    cmd = launcher + [os.path.abspath(__file__), "--child", "1"] + (argv if argv is not None else sys.argv[1:])
    environment = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=environment)
    rows = []
    try:
        engine, port, server_pid, deadline = None, None, None, time.monotonic() + args.timeout
        for line in proc.stdout:
            if line.startswith("ENGINE "):
                engine = json.loads(line[len("ENGINE "):])
                engine["engine_tokens_per_s"] = {int(k): v for k, v in engine["engine_tokens_per_s"].items()}
            match = re.match(r"serving \S+ at http://127\.0\.0\.1:(\d+) \(pid (\d+)\)", line)
            if match:
                port, server_pid = int(match.group(1)), int(match.group(2))
                break
            if time.monotonic() > deadline:
                break
        if port is None:
            raise RuntimeError("the server process did not start; its errors are above")
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain the rest
        wait_healthy(port, deadline)
        vocab_size = engine["vocab_size"]
        describe(args, engine)
        run_round(args, port, 1, vocab_size, requests=1)  # warm-up (every decode graph was captured at start-up)
        print(f"{'clients':>7} {'server tok/s':>12} {'engine tok/s':>12} {'ratio':>6} {'TTFT p50':>9} {'p95':>8} "
              f"{'max':>8} {'TPOT p50':>9} {'p95':>8}  (ms)")
        for clients in args.clients:
            row = summarize(clients, run_round(args, port, clients, vocab_size))
            row["engine_tokens_per_s"] = engine["engine_tokens_per_s"][clients]
            row["server_vs_engine"] = row["tokens_per_s"] / row["engine_tokens_per_s"]
            rows.append(row)
            print(f"{clients:>7} {row['tokens_per_s']:>12.1f} {row['engine_tokens_per_s']:>12.1f} "
                  f"{row['server_vs_engine']:>6.2f} {row['ttft_p50_ms']:>9.1f} {row['ttft_p95_ms']:>8.1f} "
                  f"{row['ttft_max_ms']:>8.1f} {row['tpot_p50_ms']:>9.2f} {row['tpot_p95_ms']:>8.2f}", flush=True)
    finally:
        if server_pid is not None:  # the serving process (TP rank 0) finishes, then stops the other ranks
            os.kill(server_pid, signal.SIGTERM)
        else:
            proc.terminate()
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    print("server / engine at the same batch: " + ", ".join(f"{r['clients']} clients {r['server_vs_engine']:.2f}x"
                                                             for r in rows) + f"; server exit code {code}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": device_name(args), "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                       "graphs": engine["graphs"], "capture_s": engine["capture_s"], "rows": rows,
                       "server_exit_code": code}, f, indent=2)
    return 0 if code == 0 else 1


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(port, deadline):
    """Until GET /health answers 200 (the socket is bound before uvicorn listens on it)."""
    while True:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not answer GET /health in time")
        time.sleep(0.1)


def device_name(args):
    import torch
    return torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"


def describe(args, engine):
    model = f"--load {args.load}" if args.load else (f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
                                                      f"vocab {args.vocab} (random weights)")
    print(f"model: {model}, {args.dtype}, {device_name(args)}; prompt {args.prompt_len} tokens, {args.new_tokens} new "
          f"tokens, greedy, {args.requests_per_client} requests per client, {args.steps_per_sync} steps per sync; "
          f"{engine['graphs']} decode graphs captured at start-up in {engine['capture_s']:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
