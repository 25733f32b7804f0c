"""Serve a checkpoint over HTTP: OpenAI-compatible completions (streaming too) and Megatron's PUT /api.

    python tools/run_text_generation_server.py --load bloom_final [--host 127.0.0.1] [--port 8000] \
        [--max-batch-size 32] [--max-new-tokens-limit 1024] [--api-key KEY]

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"prompt": "The cat sat on the", "max_tokens": 32, "temperature": 0}'

Endpoints: POST /v1/completions (OpenAI's schema; top_k as an extension; "stream": true sends server-sent events
ending with "data: [DONE]"; "logprobs" and "echo" as lm-eval's local-completions backend uses them), GET /v1/models,
GET /health (200 once the model is loaded and the engine runs), PUT /api (Megatron-LM's {"prompts": [...],
"tokens_to_generate": n} for tools/text_generation_cli.py), and GET /tokenizer_info, POST /tokenize, POST /detokenize.

Requests share one InferenceEngine with continuous batching: up to --max-batch-size completions decode together,
a new one joins at the next engine step and leaves when done; greedy output does not depend on the batch. On a GPU
every decode step shape (batch buckets up to --max-batch-size x kv-length buckets up to the context) is captured
as a CUDA graph at start-up. Tensor-parallel serving:

    torchrun --nproc_per_node 2 tools/run_text_generation_server.py --load CKPT [--tensor-model-parallel-size 2]

runs the model at TP = the number of processes (each rank reads only its slices of a checkpoint of any layout);
rank 0 answers HTTP and broadcasts each engine round (new requests, cancellations, the step) to the other ranks,
which run the same steps. The server binds to 127.0.0.1 unless --host says otherwise. SIGTERM or Ctrl-C finish
the requests in flight (up to --shutdown-timeout seconds) and exit 0. A failed engine step answers every request
it held or queued with HTTP 500 and GET /health answers 503 until the engine works again.
"""
import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

API_KEY_ENV = "MEGATRON_SERVER_API_KEY"


def parse_args(argv=None):
    from megatron.inference.loading import add_decode_flags, add_model_flags
    from megatron.inference.server import FRONTENDS, ServerSettings

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_flags(parser)
    add_decode_flags(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: %(default)s; 0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000,
                        help="default: %(default)s; 0: a free port (printed at start)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id of /v1/models and responses (default: the --load folder's name)")
    parser.add_argument("--max-batch-size", type=int, default=32,
                        help="completions decoding together (KV-cache slots; default: %(default)s); more wait for "
                             "a free slot. On a GPU the decode step of every batch bucket up to it (1, 2, 4, ...) and "
                             "every kv-length bucket up to the context is captured as a CUDA graph at start-up")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="the context: prompt + generated tokens (default: the model's --seq-length)")
    parser.add_argument("--max-new-tokens-limit", type=int, default=None,
                        help="the largest max_tokens a request may ask for (default: the context less one)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on /v1 and /api (default: ${API_KEY_ENV}; "
                             "unset: no key)")
    parser.add_argument("--steps-per-sync", type=int, default=8,
                        help="decode steps between the engine's host synchronisations (default: %(default)s; "
                             "streamed tokens arrive in bursts of this many; larger is faster)")
    parser.add_argument("--batch-wait-ms", type=float, default=ServerSettings.batch_wait_ms,
                        help="an idle engine, given a request, waits up to this long for more to prefill with it "
                             f"(default: %(default)s); it stops {ServerSettings.batch_gap_ms:g} ms after a lone "
                             f"request, {ServerSettings.burst_gap_ms:g} ms after the last arrival of a burst, or "
                             "once the batch is full. A burst of clients then starts, and finishes, in the same "
                             "rounds rather than over several, each a fraction full; 0: start at once")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20,
                        help="larger request bodies get 413 (default: %(default)s)")
    parser.add_argument("--max-pending", type=int, default=1024,
                        help="completions queued or running at once (default: %(default)s); more get 503")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds SIGTERM waits for requests in flight before cancelling them (default: "
                             "%(default)s)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="never stop at the end-of-document token (benchmarks: every completion gets max_tokens)")
    parser.add_argument("--frontend", default=FRONTENDS[0], choices=FRONTENDS,
                        help="process (default): the HTTP front-end (uvicorn, request parsing, tokenization, "
                             "detokenization) runs in a process of its own, so it never holds the GIL the engine "
                             "needs to launch a round (as vLLM splits its API server from its engine core); thread: "
                             "on an asyncio thread in the engine's process")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="default: %(default)s; warning hides the access log")
    return parser.parse_args(argv)


def check_args(args):
    for flag, value, low in (("--max-batch-size", args.max_batch_size, 1), ("--steps-per-sync", args.steps_per_sync, 1),
                             ("--max-body-bytes", args.max_body_bytes, 64), ("--max-pending", args.max_pending, 1),
                             ("--port", args.port, 0)):
        if value < low:
            raise ValueError(f"{flag} {value} must be at least {low}")
    if args.port > 65535:
        raise ValueError(f"--port {args.port} must be at most 65535")
    if args.max_seq_len is not None and args.max_seq_len < 2:
        raise ValueError(f"--max-seq-len {args.max_seq_len} must be at least 2")
    if args.max_new_tokens_limit is not None and args.max_new_tokens_limit < 1:
        raise ValueError(f"--max-new-tokens-limit {args.max_new_tokens_limit} must be at least 1")
    if args.batch_wait_ms < 0:
        raise ValueError(f"--batch-wait-ms {args.batch_wait_ms:g} must be >= 0")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout} must be >= 0")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty; pass a key or leave the flag out")
    if args.tensor_model_parallel_size is not None and args.tensor_model_parallel_size < 1:
        raise ValueError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} must be at least 1")


def build(args):
    """(engine, tokenizer, settings, state) for the parsed arguments: this rank's part of the model on the device,
    every decode bucket's CUDA graph captured (so that serving never stops to capture)."""
    import time

    from megatron.checkpoint import convert
    from megatron.inference import InferenceEngine
    from megatron.inference.loading import decode_options, load_model, setup_tensor_parallel, tp_token_sync
    from megatron.inference.server import ServerSettings

    state = setup_tensor_parallel(args.tensor_model_parallel_size)
    model, tokenizer, device, dtype = load_model(args.load, state, args.num_partitions, args.tokenizer_name_or_path,
                                                 args.dtype)
    context = args.max_seq_len or model.config.seq_length
    limit = args.max_new_tokens_limit or context - 1
    if limit >= context:
        raise ValueError(f"--max-new-tokens-limit {limit} leaves no room for a prompt in the context of {context} "
                         "tokens; lower it or raise --max-seq-len")
    tp = state.tensor_model_parallel_size
    cuda_graphs = device == "cuda" and not args.no_cuda_graphs
    engine = InferenceEngine(model, max_batch_size=args.max_batch_size, max_seq_len=context,
                             eod_id=None if args.ignore_eos else tokenizer.eod, vocab_limit=tokenizer.vocab_size,
                             cuda_graphs=cuda_graphs, sync_tokens=tp_token_sync(state) if tp > 1 else None,
                             **decode_options(args, device, tp, cuda_graphs))
    start = time.perf_counter()
    engine.warmup(every_bucket=True)  # every (batch, kv length) bucket up to --max-batch-size and the context
    log = logging.getLogger(__name__)
    if engine.cuda_graphs:
        log.info("captured %d decode graphs (batch buckets up to --max-batch-size %d, kv lengths up to %d) and %d "
                 "prefill graphs (up to --prefill-graph-tokens %d) in %.1f s", len(engine.decode_buckets()),
                 args.max_batch_size, context, len(engine.prefill_buckets()), engine.prefill_graph_tokens,
                 time.perf_counter() - start)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.load))
    settings = ServerSettings(model_name=name, max_new_tokens=limit, api_key=args.api_key,
                              steps_per_sync=args.steps_per_sync, batch_wait_ms=args.batch_wait_ms,
                              max_body_bytes=args.max_body_bytes,
                              max_pending=args.max_pending, shutdown_timeout=args.shutdown_timeout, host=args.host,
                              port=args.port, log_level=args.log_level, frontend=args.frontend)
    log.info("loaded %s: %s, %s, TP %d, context %d tokens, %d slots", args.load, device, convert.DTYPE_NAMES[dtype],
             tp, context, args.max_batch_size)
    return engine, tokenizer, settings, state


def main(argv=None):
    from megatron.inference import server

    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=getattr(logging, args.log_level.upper()) if rank == 0 else logging.WARNING,
                        format=server.LOG_FORMAT)
    sock = None
    try:
        check_args(args)
        if rank == 0:
            sock = server.bind(args.host, args.port)  # before loading: a taken port fails at once
    except OSError as err:
        print(f"error: --host {args.host} --port {args.port}: cannot listen there ({err.strerror or err}); pick "
              "another --port or stop what holds it", file=sys.stderr)
        return 2
    except ValueError as err:
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        engine, tokenizer, settings, state = build(args)
    except (ValueError, RuntimeError) as err:
        if sock is not None:
            sock.close()
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    if state.tensor_model_parallel_size == 1:
        return server.serve(engine, tokenizer, settings, sock=sock)
    from megatron.initialize import shutdown_distributed
    code = server.serve_tensor_parallel(engine, tokenizer, settings, state, sock)
    shutdown_distributed()  # every rank got here normally (rank 0's stop reached the others)
    return code


if __name__ == "__main__":
    sys.exit(main())
