"""The server's HTTP front-end in a process of its own, the engine in the process that loaded it (vLLM's split of
its API server and engine core).

In one process the asyncio loop (uvicorn, the JSON bodies, turning ids into text) and the engine thread share one
GIL: while a wave of requests arrives, the engine thread waits for it before it can launch the next round (measured
on the H100: the server's prefill rounds took the host 12.7 / 26.8 / 35.4 ms against the engine alone's 5.3 / 9.3 /
13.9 at 8 / 32 / 64 clients, `benchmarks/results/h100_2026-12-06.md`). Here the engine process runs only the
EngineWorker thread and a thread that reads the front-end's commands; the front-end process runs the HTTP app.

    engine process (the one started; TP rank 0)            front-end process (spawned)
      EngineService: EngineWorker + a command reader   <->   EngineClient: EngineWorker's interface for the app
                       one duplex pipe (multiprocessing.Pipe), pickled tuples:
      <- ("ready", None), ("add", [(key, prompt ids, params, seed)]), ("cancel", (keys, count)),
         ("score", (args, id)), ("stop", None)
      -> ("state", {...}), ("updates", [(key, new ids, reason)], {state}), ("scored", (id, result, error))

Only new ids cross the pipe (the host work per token does not grow with the output's length); the text is made in
the front-end. The engine process publishes its health and counters with every update and after every round (a
state is ~0.5 kB, ~8 us to build, send and read), so GET /health answers from the front-end's copy at once, even
while the engine is inside a long step, and is current when a client has its answer. Signals: the front-end sits
in its own process group; the engine process forwards the first SIGTERM or SIGINT as SIGTERM (uvicorn's graceful
shutdown: in-flight requests finish, then the engine stops) and a later SIGINT as SIGINT (uvicorn exits at once),
holding them until the front-end says it is ready for them. Either side exiting is seen by the other as the pipe's
end: the front-end then answers 500/503 and shuts down, the engine process stops its engine thread.
"""
import itertools
import logging
import multiprocessing
import multiprocessing.reduction
import os
import queue
import signal
import threading
import time

from megatron.inference.worker import EngineWorker, _resolve

logger = logging.getLogger(__name__)

ENGINE_GONE = "the engine process has exited"
INLINE_BYTES = 16 << 10  # the front-end's messages up to this size are sent from the loop (EngineClient._send)
_PICKLER = multiprocessing.reduction.ForkingPickler  # Connection.send's own pickling: recv() reads the bytes


class RemoteRow:
    """The engine process's side of a front-end Row: what the engine needs, and its key (equality and hashing by
    key, so that a cancellation naming the key finds the row)."""

    __slots__ = ("key", "prompt_ids", "params", "seed", "published")

    def __init__(self, key, prompt_ids=None, params=None, seed=None):
        self.key, self.prompt_ids, self.params, self.seed, self.published = key, prompt_ids, params, seed, 0

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, RemoteRow) and other.key == self.key


# ---- the engine process ------------------------------------------------------------------------------------------

class EngineService(EngineWorker):
    """EngineWorker driven over a pipe: commands come from the front-end process, each round's new ids, the scoring
    results and the worker's state go back to it."""

    def __init__(self, engine, steps_per_sync=8, scorer=None, channel=None, **batching):
        super().__init__(engine, steps_per_sync, scorer=scorer, channel=channel, **batching)
        self._conn = None
        self._send_lock = threading.Lock()  # the engine thread and the command reader both send
        self.frontend_ready = threading.Event()  # the front-end handles SIGTERM from now on

    def start(self, conn):
        """Starts the engine thread and the command reader on conn, the engine's end of the pipe."""
        self._conn = conn
        with self._send_lock:  # the front-end serves once it has this state; a thread dying at once sends after it
            super().start(None)
            conn.send(("state", self._state()))
        threading.Thread(target=self._receive, name="engine-commands", daemon=True).start()

    def _receive(self):
        try:
            while True:
                kind, payload = self._conn.recv()
                if kind == "ready":
                    self.frontend_ready.set()
                elif kind == "add":
                    self.submit([RemoteRow(*fields) for fields in payload])
                elif kind == "cancel":
                    keys, count = payload
                    self.cancel([RemoteRow(key) for key in keys], count)
                elif kind == "score":
                    args, score_id = payload
                    if not self._put(("score", (args, score_id))):
                        self._answer(score_id, None, RuntimeError("the engine thread has stopped"))
                else:  # "stop"
                    self._put(("stop", None))
                    return
        except (EOFError, OSError):  # the front-end has gone without saying stop
            logger.warning("server: the HTTP front-end process has gone; stopping the engine")
            self._put(("stop", None))
        except Exception:  # a message this side cannot read: nothing would answer what follows
            logger.exception("server: a message from the HTTP front-end could not be read; stopping the engine")
            self._put(("stop", None))

    def _post(self, updates):
        if updates:  # with the state, so that /health is current when a client has its answer
            self._send(("updates", [(row.key, new, reason) for row, new, reason in updates], self._state()))

    def _answer(self, score_id, result, error):
        self._send(("scored", (score_id, result, None if error is None else (type(error).__name__, str(error)))))

    def _round_done(self):
        self._send(("state", self._state()))

    def _state(self):
        return {"alive": self.alive, "healthy": self.healthy, "last_error": self.last_error,
                "stats": {**self.stats, "rounds": dict(self.engine.stats)}}

    def _send(self, message):
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the front-end has gone; the reader stops the engine
                pass
            except Exception:  # noqa: BLE001  never the engine thread's end
                logger.exception("server: could not send a %r message to the HTTP front-end", message[0])


def serve_split(service, frontend_args, settings, sock):
    """Runs service (an EngineService, not started) here and the HTTP app in a spawned process until that process
    exits; returns 0 when it exited normally (after a SIGTERM/SIGINT forwarded to it), else 1.

    frontend_args: (tokenizer, server.EngineInfo) for run_frontend."""
    from megatron.inference.server import announce

    context = multiprocessing.get_context("spawn")  # the engine process holds CUDA and threads: never fork it
    here, there = context.Pipe(duplex=True)
    frontend = context.Process(target=run_frontend, name="megatron-http",
                               args=(there, sock, settings, *frontend_args, logging.getLogger().level))
    received, forwarded = [], [0]

    def forward():
        """The first signal as SIGTERM (uvicorn's graceful shutdown), each later SIGINT as SIGINT (a second Ctrl-C:
        uvicorn exits at once); held until the front-end handles them."""
        if not service.frontend_ready.is_set() or frontend.exitcode is not None:
            return
        for signum in received[forwarded[0]:]:
            if forwarded[0] == 0 or signum == signal.SIGINT:
                os.kill(frontend.pid, signal.SIGTERM if forwarded[0] == 0 else signal.SIGINT)
            forwarded[0] += 1

    previous = {sig: signal.signal(sig, lambda signum, frame: (received.append(signum), forward()))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        service.start(here)
        frontend.start()
        there.close()
        announce(settings, sock)
        logger.info("server: the HTTP front-end runs in process %d", frontend.pid)
        while frontend.exitcode is None:
            frontend.join(0.1)
            forward()  # a signal that came before the front-end was ready
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if frontend.is_alive():  # an exception here: do not leave the front-end behind
            frontend.terminate()
            frontend.join(10)
        service.stop()
        here.close()
        sock.close()
    if received:
        logger.info("server: stopped by %s", ", ".join(signal.Signals(s).name for s in received))
    if frontend.exitcode != 0:
        logger.error("server: the HTTP front-end process exited with %s; see its log above", frontend.exitcode)
        return 1
    return 0


# ---- the front-end process ---------------------------------------------------------------------------------------

class EngineClient:
    """EngineWorker's interface (start, submit, cancel, score, stop, alive, healthy, last_error, stats) for the HTTP
    app, over the pipe to an EngineService. Everything that touches rows and futures runs on the loop; the loop sends
    its small messages itself, a thread the rest (so a long prompt never blocks the loop on a full pipe), and a
    thread reads the engine's."""

    def __init__(self, conn):
        self._conn = conn
        self._loop = None
        self._rows = {}  # key -> Row, until its last update
        self._scores = {}  # id -> asyncio future
        self._score_ids = itertools.count()
        self._outbox = queue.SimpleQueue()
        self._send_lock = threading.Lock()  # the loop's inline sends and the send thread's, in order
        self._queued = 0  # messages in the outbox or being sent by the thread (under _send_lock)
        self._stopped = threading.Event()  # the engine said it stopped, or the pipe ended
        self._stopping = False
        self.on_engine_exit = None  # called on the loop when the engine process goes away unasked
        self.alive, self.healthy, self.last_error = True, True, None
        self._engine_stats = {}
        self._local = {"deliver_s": 0.0, "delivered_ids": 0}  # the loop's own work (as EngineWorker's _deliver)
        self._apply_state(conn.recv()[1])  # EngineService.start sends ("state", ...) first

    @property
    def stats(self):
        return {**self._engine_stats, **self._local}

    def start(self, loop):
        self._loop = loop
        threading.Thread(target=self._send_loop, name="engine-send", daemon=True).start()
        threading.Thread(target=self._receive_loop, name="engine-receive", daemon=True).start()

    def submit(self, rows):
        for row in rows:
            self._rows[row.key] = row
        if not self.alive:
            self._loop.call_soon(self._updates, [(row.key, [], "error") for row in rows], None)
            return
        self._send(("add", [(row.key, row.prompt_ids, row.params, row.seed) for row in rows]))

    def cancel(self, rows, count=True):
        """Rows the front-end has finished already (a client gone, a stop string): the engine sends no more of
        them that anyone reads."""
        for row in rows:
            self._rows.pop(row.key, None)
        self._send(("cancel", ([row.key for row in rows], count)))

    def score(self, sequences, spans, top_n):
        future = self._loop.create_future()
        if not self.alive:
            future.set_exception(RuntimeError("the engine thread has stopped"))
            return future
        score_id = next(self._score_ids)
        self._scores[score_id] = future
        self._send(("score", ((sequences, spans, top_n), score_id)))
        return future

    def stop(self, timeout=10.0):
        """Tells the engine to stop (it cancels what it holds) and waits for its last state."""
        self._stopping = True
        self._send(("stop", None), inline=False)  # by the thread, which ends with it
        self._stopped.wait(timeout)

    def _send(self, message, inline=True):
        """Sends a message from the loop at once when it is small (INLINE_BYTES) and nothing is queued before it,
        else through the send thread (in order either way). Through the thread alone, a wave of requests reached the
        engine in clumps: the thread waits for the GIL while the loop handles the wave, up to Python's switch
        interval (5 ms), longer than the engine's wait for the rest of a burst lets pass between two arrivals."""
        data = _PICKLER.dumps(message)
        with self._send_lock:
            if inline and self._queued == 0 and len(data) <= INLINE_BYTES:
                self._write(message[0], data)  # the socket's buffer holds it: no wait on the loop
                return
            self._queued += 1
        self._outbox.put((message[0], data))

    # ---- the two threads ----

    def _send_loop(self):
        while True:
            kind, data = self._outbox.get()
            with self._send_lock:
                sent = self._write(kind, data)
                self._queued -= 1
            if not sent or kind == "stop":
                return

    def _write(self, kind, data):
        """False once the pipe has ended (the engine process has gone: the reader sees it too)."""
        try:
            self._conn.send_bytes(data)
        except (OSError, ValueError):
            return False
        except Exception:  # noqa: BLE001  keep sending the rest
            logger.exception("server: could not send a %r message to the engine", kind)
        return True

    def _receive_loop(self):
        try:
            while True:
                message = self._conn.recv()
                self._call(self._handle, message)
        except (EOFError, OSError):
            self._call(self._engine_gone)
        except Exception:  # a message this side cannot read: treat the engine as gone rather than hang
            logger.exception("server: a message from the engine could not be read")
            self._call(self._engine_gone)

    def _call(self, fn, *args):
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed
            self._stopped.set()

    # ---- on the loop ----

    def _handle(self, message):
        kind, *payload = message
        if kind == "updates":
            self._updates(*payload)
        elif kind == "state":
            self._apply_state(payload[0])
        else:  # "scored"
            score_id, result, error = payload[0]
            future = self._scores.pop(score_id, None)
            if future is not None:
                _resolve(future, result, None if error is None else type(error[0], (RuntimeError,), {})(error[1]))

    def _updates(self, items, state):
        begin = time.perf_counter()
        if state is not None:
            self._apply_state(state)
        for key, new_ids, reason in items:
            row = self._rows.pop(key, None) if reason is not None else self._rows.get(key)
            if row is not None:
                row.job.on_update(row, new_ids, reason)
                self._local["delivered_ids"] += len(new_ids)
        self._local["deliver_s"] += time.perf_counter() - begin

    def _apply_state(self, state):
        self.alive, self.healthy, self.last_error = state["alive"], state["healthy"], state["last_error"]
        self._engine_stats = state["stats"]
        if not self.alive:
            self._stopped.set()

    def _engine_gone(self):
        unasked = self.alive and not self._stopping
        self.alive = False
        if unasked:
            self.last_error = ENGINE_GONE
            logger.error("server: %s; answering every request in flight with 500", ENGINE_GONE)
        self._updates([(key, [], "error") for key in list(self._rows)], None)
        for future in self._scores.values():
            _resolve(future, None, RuntimeError(ENGINE_GONE))
        self._scores.clear()
        self._stopped.set()
        if unasked and self.on_engine_exit is not None:
            self.on_engine_exit()


def run_frontend(conn, sock, settings, tokenizer, info, log_level):
    """The front-end process: the HTTP app over an EngineClient until SIGTERM (from the engine process) or the
    engine's end. Exits 0 after a graceful shutdown."""
    import sys

    from megatron.inference import server

    os.setpgrp()  # a terminal's Ctrl-C reaches the engine process only, which forwards it here
    received = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: received.append(signum))
    conn.send(("ready", None))  # the engine process forwards signals from now on
    logging.basicConfig(level=log_level, format=server.LOG_FORMAT)
    client = EngineClient(conn)
    app = server.build_app(client, tokenizer, settings, info)
    code = server.run_uvicorn(app, settings, sock, client, received)
    sys.exit(code)
