"""The server's engine thread and the rows of one HTTP request (no HTTP here; server.py builds the routes on it).

The engine is not thread-safe, so one EngineWorker thread owns it. The asyncio loop hands new rows and
cancellations to the worker through a queue; the worker admits them at its next step (continuous batching), runs
step(steps_per_sync), and hands each row's new ids back to the loop with call_soon_threadsafe. A Job (on the loop)
turns those ids into text deltas, applies stop strings and queues events for its HTTP handler.
"""
import asyncio
import logging
import queue
import threading

from megatron.inference.api import APIError

logger = logging.getLogger(__name__)


# ---- the engine thread -------------------------------------------------------------------------------------------

class Row:
    """One completion (a prompt, one of its n samples): created on the loop, stepped by the worker."""

    def __init__(self, job, index, prompt_ids, params, seed, text):
        self.job, self.index, self.prompt_ids, self.params, self.seed = job, index, prompt_ids, params, seed
        self.text = text  # api.IncrementalText
        self.finish_reason = None
        self.output = []  # the ids generated so far (set on the loop)
        self.published = 0  # ids handed to the loop (worker thread only)

    @property
    def finished(self):
        return self.finish_reason is not None


class EngineWorker:
    """Owns the InferenceEngine on one thread: admits rows, steps, publishes each row's new ids to the loop."""

    def __init__(self, engine, steps_per_sync=8):
        self.engine = engine
        self.steps_per_sync = steps_per_sync
        self._commands = queue.SimpleQueue()
        self._thread = None
        self._loop = None
        self.alive = False
        self.stats = {"running": 0, "waiting": 0, "peak_running": 0, "steps": 0, "finished": 0, "cancelled": 0,
                      "errors": 0}

    def start(self, loop):
        self._loop = loop
        self.alive = True
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def submit(self, rows):
        self._commands.put(("add", rows))

    def cancel(self, rows, count=True):
        """Stops rows (queued or running); count: a client's cancellation (not a stop string)."""
        self._commands.put(("cancel", (rows, count)))

    def call(self, fn):
        """Runs fn() on the engine thread between steps (the model is the engine's: scoring for logprobs);
        returns an asyncio future of its result (or its exception). Called on the loop."""
        future = self._loop.create_future()
        self._commands.put(("call", (fn, future)))
        return future

    def stop(self, timeout=10.0):
        if self._thread is not None:
            self._commands.put(("stop", None))
            self._thread.join(timeout)

    def _run(self):
        engine, active = self.engine, {}  # Row -> engine Request
        try:
            while True:
                block = not engine.has_work()
                commands = [self._commands.get()] if block else []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for kind, payload in commands:
                    if kind == "stop":
                        for request in active.values():
                            engine.cancel(request)
                        self._post([(row, [], "cancelled") for row in active])
                        return
                    if kind == "add":
                        self._add(payload, active)
                    elif kind == "call":
                        self._call(*payload)
                    else:
                        rows, count = payload
                        for row in rows:
                            request = active.pop(row, None)
                            if request is not None:
                                engine.cancel(request)
                                self.stats["cancelled"] += count
                if engine.has_work():
                    self._step(active)
                self.stats.update(running=len(engine.running), waiting=len(engine.waiting))
        except Exception:  # a bug: fail what is in flight rather than leave its clients waiting
            logger.exception("server: the engine thread failed; the server answers 503 from now on")
            self._post([(row, [], "error") for row in active])
        finally:
            self.alive = False

    def _call(self, fn, future):
        try:
            result, error = fn(), None
        except Exception as err:  # noqa: BLE001  handed to the request that asked, not the engine thread
            logger.exception("server: a scoring call failed")
            result, error = None, err
        try:
            self._loop.call_soon_threadsafe(_resolve, future, result, error)
        except RuntimeError:  # the loop has closed
            pass

    def _add(self, rows, active):
        for row in rows:
            try:
                active[row] = self.engine.add_request(row.prompt_ids, row.params, row.seed, request_id=row)
            except ValueError as err:  # checked on the loop already; an engine limit the checks missed
                logger.error("server: request refused by the engine: %s", err)
                self._post([(row, [], "error")])

    def _step(self, active):
        engine = self.engine
        # a row that can be admitted now gets its first token at once (prefill only); otherwise run the batch
        admit = bool(engine.waiting) and len(engine.running) < engine.max_batch
        batch = min(engine.max_batch, len(engine.running) + len(engine.waiting))  # rows this step runs
        try:
            engine.step(0 if admit else self.steps_per_sync)
        except Exception:  # a failed step (out of memory, ...) fails its rows, not the server
            logger.exception("server: the engine step failed; failing %d rows", len(active))
            self.stats["errors"] += 1
            for request in active.values():
                engine.cancel(request)
            self._post([(row, [], "error") for row in active])
            active.clear()
            return
        self.stats["steps"] += 1
        self.stats["peak_running"] = max(self.stats["peak_running"], batch)
        updates = []
        for row, request in list(active.items()):
            if request.finished:
                del active[row]
                self.stats["finished"] += 1
                updates.append((row, request.output, request.finish_reason))
            elif len(request.output) > row.published:
                row.published = len(request.output)
                updates.append((row, request.output, None))
        self._post(updates)

    def _post(self, updates):
        if updates:
            try:
                self._loop.call_soon_threadsafe(_deliver, updates)
            except RuntimeError:  # the loop has closed: nobody is waiting for these rows
                pass


def _resolve(future, result, error):
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _deliver(updates):
    for row, output, reason in updates:
        row.job.on_update(row, output, reason)


# ---- one HTTP request's rows -------------------------------------------------------------------------------------

class Job:
    """The rows of one HTTP request and the events their updates produce, consumed by the handler."""

    def __init__(self, worker, on_release):
        self.worker = worker
        self.rows = []
        self.events = asyncio.Queue()
        self.unread = 0  # rows whose last event the handler has not read yet
        self._on_release = on_release

    def add(self, row):
        self.rows.append(row)
        self.unread += 1

    async def next(self):
        """The next (row, text delta, finish reason or None) event."""
        row, delta, reason = await self.events.get()
        if reason is not None:
            self.unread -= 1
        return row, delta, reason

    def on_update(self, row, output, reason):
        """On the loop: the row's ids so far (reason: None while it runs, else the engine's finish reason)."""
        if row.finished:
            return
        row.output = output
        if reason in ("error", "cancelled"):
            row.finish_reason = reason
            self.events.put_nowait((row, "", reason))
            return
        delta = row.text.update(output, final=reason is not None)
        if row.text.stopped:
            self.worker.cancel([row], count=False)
            reason = "stop"
        row.finish_reason = reason
        if delta or reason is not None:
            self.events.put_nowait((row, delta, reason))

    def release(self):
        """Cancels the rows that have not finished (the client went away, the server is stopping); idempotent.
        Returns how many were cancelled."""
        if self._on_release is None:
            return 0
        unfinished = [row for row in self.rows if not row.finished]
        for row in unfinished:
            row.finish_reason = "cancelled"
        if unfinished:
            self.worker.cancel(unfinished)
        self._on_release(self)
        self._on_release = None
        return len(unfinished)

    async def wait(self):
        """Until every row has finished; APIError if one failed."""
        while self.unread > 0:
            _, _, reason = await self.next()
            raise_failed(reason)


def raise_failed(reason):
    if reason == "error":
        raise APIError(500, "the engine failed while generating this completion; see the server log")
    if reason == "cancelled":
        raise APIError(503, "the server stopped before this completion finished; retry")
