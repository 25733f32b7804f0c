"""The text generation server: OpenAI's completions API and Megatron's PUT /api over one InferenceEngine.

    POST /v1/completions   OpenAI completions (prompt: a string, strings or token ids; stream: server-sent events)
    GET  /v1/models        the one served model
    GET  /health           200 with the engine's counters while the engine runs and its last step succeeded;
                           503 after a failed step (until a step or a device probe succeeds) or once stopped
    PUT  /api              Megatron-LM's text generation request ({"prompts": [...], "tokens_to_generate": n})
    GET  /tokenizer_info   the special tokens and the context (what lm-eval's remote tokenizer reads)
    POST /tokenize         {"prompt": text} -> {"tokens": [...], "count", "max_model_len"}
    POST /detokenize       {"tokens": [...]} -> {"prompt": text}

Completions with "logprobs": k carry OpenAI's legacy log-probabilities (tokens, token_logprobs, top_logprobs,
text_offset) of the completion, and of the prompt too with "echo": true (its first token's are null); "max_tokens":
0 with echo scores the prompt alone. They come from one forward pass of prompt + completion on the engine thread
(megatron/inference/scoring.py), so lm-eval's local-completions backend gets the scores of our own backend.

Threads and processes: by default (ServerSettings.frontend "process") the app runs in a process of its own
(remote.py: the app over an EngineClient) and the process that loaded the model runs only its EngineWorker
(remote.EngineService), so neither waits for the other's GIL. With frontend "thread" the HTTP side runs on one
asyncio loop (uvicorn) in the engine's process, beside the EngineWorker thread that owns the engine (worker.py: the
thread, and the Job/Row objects that carry each request's new ids back to the loop). Either way tokenizing prompts and detokenizing whole sequences run
on a small thread pool, off the loop; the streamed text is decoded incrementally on the loop (a few ids per new id,
api.IncrementalText). Under tensor parallelism the engine's process is TP rank 0 and its worker broadcasts each
engine round to the other ranks (worker.follow).

A client that disconnects (mid-stream or while waiting) has its rows cancelled; a stop string cancels its row.
SIGTERM/SIGINT stop accepting connections, let in-flight requests finish for up to shutdown_timeout seconds,
then cancel what is left, and serve() returns 0.
"""
import asyncio
import hmac
import json
import logging
import os
import secrets
import signal
import socket
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from megatron.inference import api
from megatron.inference.api import APIError
from megatron.inference.worker import EngineWorker, Job, Row, raise_failed

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FRONTENDS = ("process", "thread")  # --frontend; the first is the default
INLINE_IDS = 4096  # prompts given as this many token ids or fewer are checked on the loop (no pool round trip)


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    max_new_tokens: int  # the largest max_tokens a request may ask for
    api_key: str = None
    steps_per_sync: int = 8  # decode steps per engine synchronisation (tokens reach clients in bursts of this)
    batch_wait_ms: float = 50.0  # an idle engine's longest wait for the rest of a burst of requests (EngineWorker)
    batch_gap_ms: float = 3.0  # ... which ends this long after a lone request
    burst_gap_ms: float = 10.0  # ... or, once a second has come, this long after the last arrival
    max_body_bytes: int = 1 << 20
    max_pending: int = 1024  # rows queued or running; more are refused with 503
    tokenizer_threads: int = 4  # the pool that tokenizes prompts off the event loop
    shutdown_timeout: float = 30.0
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    frontend: str = FRONTENDS[0]  # the HTTP app in a process of its own (remote.py), or on a thread beside the engine


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP app needs to know of the engine (it may run in another process)."""
    context: int  # prompt + generated tokens
    max_batch: int
    stops_at_eod: bool

    @classmethod
    def of(cls, engine):
        return cls(context=engine.max_seq_len, max_batch=engine.max_batch, stops_at_eod=engine.eod_id >= 0)


# ---- the application ---------------------------------------------------------------------------------------------

def engine_worker(engine, tokenizer, settings, channel=None, worker_class=EngineWorker):
    """The engine's worker (with the scorer of the server's logprobs). channel: the PlanChannel to the other
    tensor-parallel ranks (None: TP 1)."""
    from megatron.inference.scoring import Scorer

    scorer = Scorer.for_bloom_model(engine.model, vocab_limit=tokenizer.vocab_size)
    return worker_class(engine, steps_per_sync=settings.steps_per_sync, scorer=scorer, channel=channel,
                        batch_wait=settings.batch_wait_ms / 1000, batch_gap=settings.batch_gap_ms / 1000,
                        burst_gap=settings.burst_gap_ms / 1000)


def build_app(worker, tokenizer, settings, info):
    """The FastAPI application over worker: an EngineWorker (its thread starts and stops with the app's lifespan)
    or a remote.EngineClient (the same interface, the engine in another process). info: the EngineInfo."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    class JobStream(StreamingResponse):
        """Server-sent events of a job; its rows are released however the response ends (even unstarted)."""

        def __init__(self, job, content):
            super().__init__(content, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.job = job

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                cancelled = self.job.release()
                if cancelled:
                    logger.info("server: client disconnected mid-stream; cancelled %d rows", cancelled)

    pool = ThreadPoolExecutor(settings.tokenizer_threads, thread_name_prefix="tokenizer")

    async def off_loop(fn, *args):
        """fn(*args) on the tokenizer pool (tokenizing a long prompt must not stall every stream)."""
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    limits = api.Limits(max_new_tokens=settings.max_new_tokens, context=info.context,
                        vocab_size=tokenizer.vocab_size)
    eod = tokenizer.eod if info.stops_at_eod else None
    created = int(time.time())
    pending = [0]  # rows the handlers started and have not released

    @asynccontextmanager
    async def lifespan(app):
        worker.start(asyncio.get_running_loop())
        logger.info("server: serving %s (context %d tokens, batch %d, max_tokens <= %d)", settings.model_name,
                    limits.context, info.max_batch, limits.max_new_tokens)
        yield
        await asyncio.to_thread(worker.stop)
        pool.shutdown(wait=False)

    app = FastAPI(title="Megatron-DeepSpeed BLOOM text generation", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.worker = worker

    def error_response(err, megatron=False):
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        body = err.body()
        if megatron:  # Megatron's CLI prints response.json()["message"]
            body = {"message": err.message, **body}
        return JSONResponse(body, status_code=err.status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request, err):
        return error_response(err, megatron=request.url.path == "/api")

    @app.exception_handler(HTTPException)
    async def http_error(request, err):  # unknown paths, wrong methods
        message = {404: f"no route {request.url.path}: the server has POST /v1/completions, GET /v1/models, "
                        "GET /health, PUT /api, GET /tokenizer_info, POST /tokenize and POST /detokenize",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(err.status_code, str(err.detail))
        return error_response(APIError(err.status_code, message))

    @app.exception_handler(Exception)
    async def internal_error(request, err):
        logger.exception("server: %s %s failed", request.method, request.url.path)
        return error_response(APIError(500, f"internal server error ({type(err).__name__}); see the server log"))

    def authorize(request):
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "Incorrect API key provided: pass the server's --api-key as 'Authorization: Bearer "
                                "KEY'" if header else "Missing API key: pass the server's --api-key as "
                                "'Authorization: Bearer KEY'", code="invalid_api_key")

    async def read_json(request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            raise APIError(413, f"the request body ({length} bytes) exceeds this server's limit of "
                                f"{settings.max_body_bytes} bytes (--max-body-bytes)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > settings.max_body_bytes:
                raise APIError(413, f"the request body exceeds this server's limit of {settings.max_body_bytes} "
                                    "bytes (--max-body-bytes)")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks), parse_constant=_no_constant)
        except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
            raise APIError(400, f"the request body is not valid JSON: {err}") from None

    def check_model(name):
        if name is not None and name != settings.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{settings.model_name}` "
                                "(GET /v1/models)", param="model", code="model_not_found")

    def release(job):
        pending[0] -= len(job.rows)

    def start_job(prompt_ids, params, seed, n, stop, include_stop=False, stop_ids=()):
        count = len(prompt_ids) * n
        if not worker.alive:
            raise APIError(503, "the engine is not running (the server is stopping); retry later")
        if pending[0] + count > settings.max_pending:
            raise APIError(503, f"the server is busy ({pending[0]} completions queued or running, --max-pending "
                                f"{settings.max_pending}); retry later")
        if seed is None:
            seed = secrets.randbits(63)
        job = Job(worker, release)
        for i, ids in enumerate(prompt_ids):
            for j in range(n):
                text = api.IncrementalText(tokenizer.detokenize, eod, stop, include_stop, stop_ids)
                job.add(Row(job, i * n + j, ids, params, api.row_seed(seed, i * n + j), text))
        pending[0] += count
        worker.submit(job.rows)
        return job

    async def finish(request, job):
        """Waits for every row of a non-streamed job; False if the client disconnected first (rows cancelled)."""
        done = asyncio.ensure_future(job.wait())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not done.done():
                done.cancel()
            cancelled = job.release()
        if cancelled:
            logger.info("server: client disconnected; cancelled %d rows", cancelled)
            return False
        done.result()
        return True

    @app.get("/health")
    async def health():
        stats = dict(worker.stats, pending=pending[0])
        stats["rounds"] = dict(stats["rounds"])  # EngineWorker's is the engine's own, changing dict
        status = "ok" if worker.alive and worker.healthy else "unhealthy" if worker.alive else "stopped"
        body = {"status": status, "model": settings.model_name, **stats}
        if status != "ok" and worker.last_error:
            body["error"] = worker.last_error
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return JSONResponse(api.models_body(settings.model_name, created))

    async def logprobs_of(sequences, prompt_lengths, top_n, echo):
        """OpenAI logprobs objects of token sequences (prompt + completion), scored on the engine thread."""
        if not worker.alive:
            raise APIError(503, "the engine is not running (the server is stopping); retry later")
        spans = [(0, seq[1:]) for seq in sequences]
        try:
            scored = await worker.score(sequences, spans, top_n)
        except Exception as err:  # noqa: BLE001  the engine thread logged it
            raise APIError(500, f"scoring the tokens failed ({type(err).__name__}); see the server log") from err
        return await off_loop(lambda: [api.logprobs_body(seq, s, tokenizer.detokenize, length, echo)
                                       for seq, s, length in zip(sequences, scored, prompt_lengths)])

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        authorize(request)
        special = tokenizer.special_tokens
        return JSONResponse({"eos_token": special.get("eos_token"), "bos_token": special.get("bos_token"),
                             "pad_token": special.get("pad_token"), "unk_token": special.get("unk_token"),
                             "model_max_length": limits.context, "vocab_size": tokenizer.vocab_size,
                             "chat_template": None})

    @app.post("/tokenize")
    async def tokenize(request: Request):
        authorize(request)
        body = await read_json(request)
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise APIError(400, "prompt must be a string (the text to tokenize)", param="prompt")
        ids = await off_loop(tokenizer.tokenize, text)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": limits.context})

    @app.post("/detokenize")
    async def detokenize(request: Request):
        authorize(request)
        body = await read_json(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(api._is_int(t) and 0 <= t < limits.vocab_size for t in ids):
            raise APIError(400, f"tokens must be a list of token ids in [0, {limits.vocab_size})", param="tokens")
        return JSONResponse({"prompt": await off_loop(tokenizer.detokenize, ids)})

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = api.parse_completion_request(await read_json(request), limits)
        check_model(req.model)
        if all(not isinstance(p, str) for p in req.prompts) and sum(map(len, req.prompts)) <= INLINE_IDS:
            ids = api.tokenize_prompts(req.prompts, tokenizer, limits, req.max_tokens)  # ids: only checked
        else:
            ids = await off_loop(api.tokenize_prompts, req.prompts, tokenizer, limits, req.max_tokens)
        echo = await off_loop(lambda: [p if isinstance(p, str) else tokenizer.detokenize(p) for p in req.prompts]) \
            if req.echo else None
        request_id, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = sum(len(i) for i in ids)
        if req.max_tokens == 0:  # echo + logprobs: the prompts scored, nothing generated
            bodies = await logprobs_of([list(p) for p in ids for _ in range(req.n)],
                                       [len(p) for p in ids for _ in range(req.n)], req.logprobs, True)
            choices = [api.choice_body(k, echo[k // req.n], "length", body) for k, body in enumerate(bodies)]
            return JSONResponse(api.completion_body(request_id, now, settings.model_name, choices,
                                                    api.usage_body(prompt_tokens * req.n, 0)))
        job = start_job(ids, req.params, req.seed, req.n, req.stop)

        def prefix(row):
            return echo[row.index // req.n] if echo else ""

        def usage():
            return api.usage_body(prompt_tokens, sum(row.text.tokens for row in job.rows))

        if not req.stream:
            if not await finish(request, job):
                return Response(status_code=499)  # nobody is listening
            bodies = [None] * len(job.rows)
            if req.logprobs is not None:
                prompts = [ids[row.index // req.n] for row in job.rows]
                completions = [[t for t in row.output[:row.text.tokens] if eod is None or t != eod]
                               for row in job.rows]
                bodies = await logprobs_of([list(p) + c for p, c in zip(prompts, completions)],
                                           [len(p) for p in prompts], req.logprobs, req.echo)
            choices = [api.choice_body(row.index, prefix(row) + row.text.text, row.finish_reason, body)
                       for row, body in zip(job.rows, bodies)]
            return JSONResponse(api.completion_body(request_id, now, settings.model_name, choices, usage()))

        async def events():
            started = set()
            while job.unread > 0:
                row, delta, reason = await job.next()
                if reason in ("error", "cancelled"):
                    try:
                        raise_failed(reason)
                    except APIError as err:
                        yield _sse(err.body())
                    break
                if row.index not in started:
                    started.add(row.index)
                    delta = prefix(row) + delta
                yield _sse(api.chunk_body(request_id, now, settings.model_name,
                                          [api.choice_body(row.index, delta, reason)]))
            else:
                if req.include_usage:
                    yield _sse(api.chunk_body(request_id, now, settings.model_name, [], usage()))
            yield "data: [DONE]\n\n"

        return JobStream(job, events())

    @app.put("/api")
    async def megatron_api(request: Request):
        authorize(request)
        req = api.parse_megatron_request(await read_json(request), limits)
        ids = await off_loop(lambda: api.tokenize_prompts(
            req.prompts, tokenizer, limits, req.tokens_to_generate, field="prompts", tokens_field="tokens_to_generate",
            prefix_ids=[tokenizer.eod] if req.add_bos else ()))
        job = start_job(ids, req.params, req.seed, 1, req.stop, include_stop=True, stop_ids=req.stop_ids)
        if not await finish(request, job):
            return Response(status_code=499)
        texts = [prompt + row.text.text for prompt, row in zip(req.prompts, job.rows)]
        segments = await off_loop(lambda: [[tokenizer.detokenize([t]) for t in row.prompt_ids
                                            + row.output[:row.text.tokens]] for row in job.rows])
        return JSONResponse({"text": texts, "segments": segments, "logprobs": None})

    return app


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _sse(body):
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _disconnected(request):
    """Returns when the client has gone (the body has been read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---- running it --------------------------------------------------------------------------------------------------

def bind(host, port):
    """A listening socket on host:port (port 0: a free one); OSError names the address."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(family[4])
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(engine, tokenizer, settings, sock=None, channel=None):
    """Serves engine until SIGTERM or SIGINT (then finishes in-flight requests, up to settings.shutdown_timeout
    seconds) and returns 0 (1 if the HTTP front-end process failed). sock: an already bound socket (default: bind
    settings.host:settings.port); channel: the PlanChannel to the other tensor-parallel ranks (they run
    worker.follow meanwhile)."""
    if settings.frontend not in FRONTENDS:
        raise ValueError(f"frontend {settings.frontend!r}: choose one of {', '.join(FRONTENDS)}")
    if sock is None:
        sock = bind(settings.host, settings.port)
    if settings.frontend == "process":
        from megatron.inference import remote

        service = engine_worker(engine, tokenizer, settings, channel, remote.EngineService)
        return remote.serve_split(service, (tokenizer, EngineInfo.of(engine)), settings, sock)
    app = build_app(engine_worker(engine, tokenizer, settings, channel), tokenizer, settings, EngineInfo.of(engine))
    announce(settings, sock)
    return run_uvicorn(app, settings, sock)


def announce(settings, sock):
    """The line tools and benchmarks wait for: the address, and the pid to send SIGTERM to."""
    host, port = sock.getsockname()[:2]
    print(f"serving {settings.model_name} at http://{host if ':' not in host else f'[{host}]'}:{port} "
          f"(pid {os.getpid()})", flush=True)


def run_uvicorn(app, settings, sock, client=None, received=None):
    """uvicorn on sock until SIGTERM or SIGINT (graceful: in-flight requests finish first); 0. client: the app's
    remote.EngineClient: its engine process going away unasked shuts the server down too (then 1). received: the
    signals recorded so far (a SIGTERM before uvicorn ran: it starts and shuts down at once)."""
    import uvicorn

    config = uvicorn.Config(app, log_level=settings.log_level, timeout_graceful_shutdown=settings.shutdown_timeout,
                            timeout_keep_alive=5, server_header=False)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in place (it
    # restores them first) that is a no-op, so a SIGTERM ends the process with 0 after the graceful shutdown
    received = [] if received is None else received
    previous = {sig: signal.signal(sig, lambda s, frame: received.append(s)) for sig in (signal.SIGINT,
                                                                                         signal.SIGTERM)}
    server.should_exit = bool(received)
    engine_gone = []
    if client is not None:
        def shut_down():
            engine_gone.append(True)
            server.should_exit = True
        client.on_engine_exit = shut_down
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    if received:
        logger.info("server: stopped by %s", ", ".join(signal.Signals(s).name for s in received))
    return 1 if engine_gone else 0


def serve_tensor_parallel(engine, tokenizer, settings, state, sock=None):
    """serve() on TP rank 0, which broadcasts each engine round to the other ranks; they follow it (ignoring
    SIGINT/SIGTERM: rank 0 finishes the requests in flight, then tells them to stop). Returns 0 on every rank."""
    from megatron.inference.scoring import Scorer
    from megatron.inference.worker import PlanChannel, follow

    channel = PlanChannel(state)
    if channel.is_source:
        try:
            return serve(engine, tokenizer, settings, sock=sock, channel=channel)
        finally:
            channel.close()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return follow(engine, Scorer.for_bloom_model(engine.model, vocab_limit=tokenizer.vocab_size), channel)
