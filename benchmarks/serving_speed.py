"""Benchmark: the text generation server under 1, 8, 32 and 64 concurrent streaming clients against the engine alone
at the same batch (tokens/s), with time to first token and per output token.

    python benchmarks/serving_speed.py --device cuda --output benchmarks/results/serving_h200.json
        # the document's 1.72B model (random weights) in bf16 on a GPU
    python benchmarks/serving_speed.py --device cuda --load bloom_final      # a checkpoint or HF folder instead
    python benchmarks/serving_speed.py --device cuda --tp 2                   # TP 2 over two GPUs (torchrun)
    python benchmarks/serving_speed.py --tiny                                 # a small fp32 model on the CPU
        [--clients 1 8 32 64 --prompt-len 32 --new-tokens 256 --requests-per-client 2 --steps-per-sync 8]
        [--graph-step --compile-mode default --gemm auto]     # the engine's decode options (the tools' flags)
        [--switch-interval 0.001]                             # the server process's GIL switch interval
        [--frontend thread]                                   # the HTTP app on a thread (default: its own process)

A child process builds the model and one InferenceEngine (max batch = the most clients, every decode graph captured
at start-up as tools/run_text_generation_server.py does; --compile-mode, --graph-step and --gemm as the tool's),
times the engine alone at each client count on the clients' own workload (engine_ramp: each client's
--requests-per-client requests one after another, the next added as soon as the last finishes, rounds of
--steps-per-sync steps overlapped as the server runs them; warm, best of --repeats: what the server could reach with
HTTP, the event loop and its thread costing nothing), then serves the same engine with megatron.inference.server (the
code behind tools/run_text_generation_server.py) on a free port of 127.0.0.1. Each client is a thread (of
--client-processes processes: one GIL for all would send a wave one request after another) that sends
--requests-per-client streamed completions one after another on one kept-alive connection (the clients of a round
start together): a fixed --prompt-len token prompt (token ids,
different per client), --new-tokens tokens, greedy, eod ignored so every completion has exactly --new-tokens tokens.
One warm-up request comes first; then, per concurrency, one warm run and --repeats timed runs, as the engine gets:
aggregate tokens/s (all completion tokens / wall time of the run; the best run), the engine's tokens/s on the same
workload and the ratio server / engine, time to first token (request sent -> first text chunk: p50, p95, max) and
time per output token after the first ((last - first chunk) / (tokens - 1)), p50 and p95 over every timed request.
A second table says where the time went, per engine round, for the engine alone and the server (the engine's round
counters, and the server's from GET /health before and after its best run).
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
# the clients' threads share this process's GIL: at Python's 5 ms switch interval a wave of 64 sends spread over
# ~30 ms with holes of 4-5 ms on a 2-core CPU host (independent clients have none); this lets a sender in sooner
CLIENT_SWITCH_INTERVAL = 2e-4
PYTHON_SWITCH_INTERVAL = sys.getswitchinterval()  # the server process's, unless --switch-interval


def parse_args(argv=None):
    from megatron.inference.loading import add_decode_flags
    from megatron.inference.server import FRONTENDS, ServerSettings

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
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per client count, engine and server alike, after one warm run (the best "
                             "tokens/s counts; latencies are over every timed request)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in the server")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval in the server process (default: Python's 0.005 s): how long the "
                             "engine thread may wait for the GIL while the event loop holds it")
    parser.add_argument("--frontend", choices=FRONTENDS, default=FRONTENDS[0],
                        help="the server's HTTP front-end in a process of its own (default, as the tool's) or on a "
                             "thread beside the engine")
    parser.add_argument("--batch-wait-ms", type=float, default=ServerSettings.batch_wait_ms,
                        help="the server's --batch-wait-ms (default: %(default)s, the tool's): an idle engine's "
                             "longest wait for the rest of a burst of requests")
    parser.add_argument("--batch-gap-ms", type=float, default=ServerSettings.batch_gap_ms,
                        help="the wait ends this long after a lone request (default: %(default)s; a setting of "
                             "the server, not a flag of the tool)")
    parser.add_argument("--burst-gap-ms", type=float, default=ServerSettings.burst_gap_ms,
                        help="... and this long after the last arrival once a second has come (default: "
                             "%(default)s; a setting of the server)")
    parser.add_argument("--tp", type=int, default=1,
                        help="serve tensor-parallel over this many processes (torchrun; one GPU each, or gloo on "
                             "the CPU); the engine figures are then the TP engine's")
    parser.add_argument("--client-processes", type=int, default=8,
                        help="the clients of a round run as threads of this many processes (default: %(default)s; "
                             "1: all in the bench's own): threads that share a GIL send a wave one after another, "
                             "which the server would see as a slow burst")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    add_decode_flags(parser)
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
    from megatron.inference.loading import decode_options, setup_tensor_parallel, tp_token_sync
    from megatron.inference.server import ServerSettings, bind, serve, serve_tensor_parallel

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    state = setup_tensor_parallel(args.tp)
    tp = state.tensor_model_parallel_size
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" \
        else torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model, tokenizer = build_model(args, device, dtype, state)
    context = args.prompt_len + args.new_tokens
    params = SamplingParams(greedy=True, max_new_tokens=args.new_tokens)
    cuda_graphs = device.type == "cuda"
    engine = InferenceEngine(model, max_batch_size=max(args.clients), max_seq_len=context, eod_id=None,
                             vocab_limit=tokenizer.vocab_size, cuda_graphs=cuda_graphs,
                             sync_tokens=tp_token_sync(state) if tp > 1 else None,
                             **decode_options(args, device.type, tp, cuda_graphs))
    prompts = [client_prompt(args, tokenizer.vocab_size, i) for i in range(max(args.clients))]
    figures = {"vocab_size": tokenizer.vocab_size, "engine_tokens_per_s": {}, "engine_rounds": {}}

    def time_engine():  # on a thread of its own, as the server's engine runs
        if device.type == "cuda":
            torch.cuda.set_device(device)
        start = time.perf_counter()
        engine.warmup(every_bucket=True)  # what the server tool does at start-up
        figures["graphs"] = len(engine._graphs)
        figures["prefill_graphs"] = len(engine._prefill_graphs)
        figures["capture_s"] = time.perf_counter() - start
        for clients in args.clients:
            engine_ramp(engine, prompts[:clients], params, args.requests_per_client, args.steps_per_sync)  # warm
            timings = []
            for _ in range(args.repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                before, start = dict(engine.stats), time.perf_counter()
                tokens = engine_ramp(engine, prompts[:clients], params, args.requests_per_client,
                                     args.steps_per_sync)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                timings.append((time.perf_counter() - start, tokens, difference(engine.stats, before)))
            seconds, tokens, rounds = min(timings, key=lambda t: t[0])
            figures["engine_tokens_per_s"][clients] = tokens / seconds
            figures["engine_rounds"][clients] = rounds

    thread = threading.Thread(target=time_engine)
    thread.start()
    thread.join()
    settings = ServerSettings(model_name="bench", max_new_tokens=args.new_tokens, steps_per_sync=args.steps_per_sync,
                              max_pending=max(1024, 2 * max(args.clients)), log_level="warning",
                              frontend=args.frontend, batch_wait_ms=args.batch_wait_ms,
                              batch_gap_ms=args.batch_gap_ms, burst_gap_ms=args.burst_gap_ms)
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


def engine_ramp(engine, prompts, params, requests_per_client, steps_per_sync):
    """The clients' workload on the engine alone: client i's requests (prompt i) one after another, the next added
    as soon as the last finishes, every round overlapped (engine.step(overlap=True)) as the server runs them.
    Returns the tokens generated."""
    left, owner, tokens = [requests_per_client] * len(prompts), {}, 0

    def add(client):
        left[client] -= 1
        owner[engine.add_request(prompts[client], params)] = client

    for client in range(len(prompts)):
        add(client)
    while engine.has_work():
        for done in engine.step(steps_per_sync, overlap=True):
            tokens += len(done.output)
            client = owner.pop(done)
            if left[client]:
                add(client)
    return tokens


def difference(after, before):
    """The counters of after less those of before (the numbers; nested dicts too)."""
    return {key: difference(value, before.get(key, {})) if isinstance(value, dict) else value - before.get(key, 0)
            for key, value in after.items() if isinstance(value, (int, float, dict))}


def per_round(rounds, server=None):
    """Where a concurrency's time went, per engine round (ms), from the engine's round counters (and the server's
    GET /health counters: its thread's host time between steps and the event loop's time per id)."""
    n = max(rounds["rounds"], 1)
    row = {"rounds": rounds["rounds"], "prefill_rounds": rounds["prefill_rounds"],
           "admitted_per_prefill": rounds["admitted"] / max(rounds["prefill_rounds"], 1),
           "steps_per_round": rounds["decode_steps"] / n}
    for key in ("launch", "wait", "read", "device", "device_gap"):
        row[f"{key}_ms"] = rounds[f"{key}_s"] * 1e3 / n
    prefills, decodes = rounds["prefill_rounds"], rounds["rounds"] - rounds["prefill_rounds"]
    row["prefill_launch_ms"] = rounds["prefill_launch_s"] * 1e3 / max(prefills, 1)
    row["slow_step_launches"] = rounds["slow_step_launches"]
    row["slow_step_launch_ms"] = rounds["slow_step_launch_s"] * 1e3
    row["prefill_device_ms"] = rounds["prefill_device_s"] * 1e3 / max(prefills, 1)
    row["decode_device_ms"] = (rounds["device_s"] - rounds["prefill_device_s"]) * 1e3 / max(decodes, 1)
    row["host_ms"] = server["host_s"] * 1e3 / n if server else None
    row["loop_us_per_id"] = server["deliver_s"] * 1e6 / max(server["delivered_ids"], 1) if server else None
    row["batch_waits"] = server["batch_waits"] if server else None
    row["batch_wait_ms"] = server["batch_wait_s"] * 1e3 / max(server["batch_waits"], 1) if server else None
    return row


def client_prompt(args, vocab_size, client):
    import random
    rng = random.Random(1000 + client)
    return [rng.randrange(4, vocab_size) for _ in range(args.prompt_len)]


# ---- the clients -------------------------------------------------------------------------------------------------

def stream_one(connection, prompt, new_tokens):
    """One streamed completion on connection (an HTTPConnection, kept alive between a client's requests as OpenAI's
    clients keep theirs): {start, first, end, tokens, text} (times from time.perf_counter)."""
    body = json.dumps({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
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
    response.read()  # the chunked body's end: the connection is ready for the next request
    return {"start": start, "first": first if first is not None else end, "end": end, "tokens": tokens, "text": text}


def client_groups(clients, processes):
    """The client indices of each client process: as even as it goes, in order."""
    processes = max(1, min(processes, clients))
    return [list(range(clients))[p::processes] for p in range(processes)]


def run_clients(args, port, indices, vocab_size, requests, ready=None):
    """The clients `indices` as threads of this process: each connects, then (once every client of the round, in
    every process, has: ready.wait() if given) sends its requests one after another. Their results, each tagged with
    its client and its place in that client's sequence."""
    results, errors = [], []
    connected, go = threading.Barrier(len(indices) + 1), threading.Event()

    def client(index):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=args.timeout)
        try:
            connection.connect()
            connected.wait()
            go.wait()  # the clients of a round send their first requests together, not as their threads start
            for sequence in range(requests):
                result = stream_one(connection, client_prompt(args, vocab_size, index), args.new_tokens)
                results.append(dict(result, client=index, sequence=sequence))
        except Exception as err:  # reported below, after every thread ends
            errors.append(err)
            connected.abort()
        finally:
            connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in indices]
    for thread in threads:
        thread.start()
    try:
        connected.wait()
        if ready is not None:
            ready.wait()
    except threading.BrokenBarrierError:
        pass  # a client failed to connect: its error is raised below
    finally:
        go.set()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _client_process(args, port, indices, vocab_size, requests, ready, queue):
    sys.setswitchinterval(CLIENT_SWITCH_INTERVAL)
    try:
        queue.put((run_clients(args, port, indices, vocab_size, requests, ready), None))
    except Exception as err:
        ready.abort()
        queue.put(([], f"{type(err).__name__}: {err}"))


def run_round(args, port, clients, vocab_size, requests=None):
    """One round: `clients` concurrent streaming clients, spread over --client-processes processes (threads of
    one process share its GIL and send a wave one after another; independent clients do not)."""
    import multiprocessing
    requests = requests or args.requests_per_client
    groups = client_groups(clients, args.client_processes)
    if len(groups) == 1:
        return run_clients(args, port, groups[0], vocab_size, requests)
    context = multiprocessing.get_context("spawn")  # the clients import nothing but the standard library
    ready, queue = context.Barrier(len(groups)), context.Queue()
    processes = [context.Process(target=_client_process, args=(args, port, group, vocab_size, requests, ready,
                                                               queue), daemon=True) for group in groups]
    for process in processes:
        process.start()
    results, errors = [], []
    for _ in processes:
        got, error = queue.get(timeout=args.timeout)
        results += got
        errors += [error] if error else []
    for process in processes:
        process.join()
    if errors:
        raise RuntimeError(f"a client failed: {errors[0]}")
    return results


def send_spread_ms(results):
    """Per wave (every client's n-th request), the time from its first request sent to its last."""
    waves = {}
    for r in results:
        waves.setdefault(r["sequence"], []).append(r["start"])
    return [(max(starts) - min(starts)) * 1e3 for _, starts in sorted(waves.items())]


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
            "tpot_p50_ms": percentile(tpot, 50), "tpot_p95_ms": percentile(tpot, 95),
            "send_spread_ms": send_spread_ms(results)}


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device here; run it on a GPU machine or pass --tiny")
    sys.setswitchinterval(CLIENT_SWITCH_INTERVAL)
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
                for key in ("engine_tokens_per_s", "engine_rounds"):
                    engine[key] = {int(k): v for k, v in engine[key].items()}
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
              f"{'max':>8} {'TPOT p50':>9} {'p95':>8} {'sends':>6}  (ms; sends = the clients' longest spread "
              "between the first and last request of a wave)")
        for clients in args.clients:
            run_round(args, port, clients, vocab_size)  # warm at this concurrency, as the engine's ramp is
            runs = []
            for _ in range(args.repeats):
                before = health(port)
                results = run_round(args, port, clients, vocab_size)
                runs.append((summarize(clients, results), results, difference(health(port), before)))
            row, _, served = max(runs, key=lambda run: run[0]["tokens_per_s"])
            latency = summarize(clients, [r for _, results, _ in runs for r in results])  # every timed request
            row.update({key: latency[key] for key in latency if key.startswith(("ttft", "tpot"))})
            row["engine_tokens_per_s"] = engine["engine_tokens_per_s"][clients]
            row["server_vs_engine"] = row["tokens_per_s"] / row["engine_tokens_per_s"]
            row["engine_per_round"] = per_round(engine["engine_rounds"][clients])
            row["server_per_round"] = per_round(served["rounds"], served)
            rows.append(row)
            print(f"{clients:>7} {row['tokens_per_s']:>12.1f} {row['engine_tokens_per_s']:>12.1f} "
                  f"{row['server_vs_engine']:>6.2f} {row['ttft_p50_ms']:>9.1f} {row['ttft_p95_ms']:>8.1f} "
                  f"{row['ttft_max_ms']:>8.1f} {row['tpot_p50_ms']:>9.2f} {row['tpot_p95_ms']:>8.2f} "
                  f"{max(row['send_spread_ms']):>6.1f}", flush=True)
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
    print_rounds(rows, args.device == "cuda")
    print("server / engine (ratio: the server's tokens/s through HTTP over the engine's alone on the same requests, "
          "the same engine and process; 1.00 = HTTP, the event loop and the server's thread cost nothing): "
          + ", ".join(f"{r['clients']} clients {r['server_vs_engine']:.2f}x" for r in rows)
          + f"; server exit code {code}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": device_name(args), "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                       "graphs": engine["graphs"], "prefill_graphs": engine["prefill_graphs"],
                       "capture_s": engine["capture_s"], "rows": rows,
                       "server_exit_code": code}, f, indent=2)
    return 0 if code == 0 else 1


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def health(port):
    """GET /health's counters."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", "/health")
    body = json.loads(connection.getresponse().read())
    connection.close()
    return body


def print_rounds(rows, device_timing):
    """The per-round table: where each concurrency's time went, engine alone and server."""
    from megatron.inference.engine import SLOW_STEP_LAUNCH_S
    if not rows:
        return
    slow_ms = SLOW_STEP_LAUNCH_S * 1e3
    print("per engine round (ms): launch = the engine thread queueing the round's device work, wait = blocked on "
          "the device, read = reading its results; host = the server's engine thread between rounds; device = the "
          "GPU's time per round and gap = the GPU idle between rounds, waiting for the host (CUDA timing events); "
          "loop = the event loop's us per generated id (ids -> text events); pf launch = the host's time admitting "
          "and prefilling, per prefill round; slow = decode steps whose launch took the host over "
          f"{slow_ms:g} ms (count, their ms in all); pf dev / dec dev = the device's time per round with "
          "a prefill / without; waits = the idle server's waits for the rest of a burst (--batch-wait-ms), ms each")
    print(f"{'clients':>7} {'side':>6} {'rounds':>6} {'prefill':>7} {'rows/pf':>7} {'steps':>5} {'launch':>7} "
          f"{'wait':>7} {'read':>6} {'host':>6} {'device':>7} {'gap':>6} {'loop':>6} {'pf launch':>9} "
          f"{'slow':>11} {'pf dev':>7} {'dec dev':>7} {'waits':>11}")

    def ms(value, width, digits=2):
        return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"

    for row in rows:
        for side in ("engine", "server"):
            r = row[f"{side}_per_round"]
            print(f"{row['clients']:>7} {side:>6} {r['rounds']:>6} {r['prefill_rounds']:>7} "
                  f"{r['admitted_per_prefill']:>7.1f} {r['steps_per_round']:>5.1f} {ms(r['launch_ms'], 7)} "
                  f"{ms(r['wait_ms'], 7)} {ms(r['read_ms'], 6)} {ms(r['host_ms'], 6)} "
                  f"{ms(r['device_ms'] if device_timing else None, 7)} "
                  f"{ms(r['device_gap_ms'] if device_timing else None, 6)} {ms(r['loop_us_per_id'], 6, 1)} "
                  f"{ms(r['prefill_launch_ms'], 9)} {r['slow_step_launches']:>4d} {r['slow_step_launch_ms']:>6.1f} "
                  f"{ms(r['prefill_device_ms'] if device_timing else None, 7)} "
                  f"{ms(r['decode_device_ms'] if device_timing else None, 7)} "
                  + (f"{r['batch_waits']:>4d} {r['batch_wait_ms']:>6.2f}" if r["batch_waits"] is not None
                     else f"{'-':>11}"))


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
          f"tokens, greedy, {args.requests_per_client} requests per client, {args.steps_per_sync} steps per sync, "
          f"compile mode {args.compile_mode}, graph step {'on' if args.graph_step else 'off'}, {args.gemm} GEMMs, "
          f"the server's GIL switch interval {args.switch_interval or PYTHON_SWITCH_INTERVAL} s (the clients' "
          f"{CLIENT_SWITCH_INTERVAL}, in {args.client_processes} processes), batch wait {args.batch_wait_ms:g} ms "
          f"(gap {args.batch_gap_ms:g}, in a burst {args.burst_gap_ms:g}); {engine['graphs']} decode and "
          f"{engine['prefill_graphs']} prefill graphs captured at start-up in {engine['capture_s']:.1f} s",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
