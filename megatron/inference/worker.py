"""The server's engine thread and the rows of one HTTP request (no HTTP here; server.py builds the routes on it).

The engine is not thread-safe, so one EngineWorker thread owns it. The asyncio loop hands new rows, cancellations
and scoring calls to the worker through a queue; the worker applies everything queued at the start of a round
(continuous batching: every row that has a free slot is admitted and prefilled together, in the same round as the
decode steps, with no round of its own), runs step(steps_per_sync, overlap=True), and hands each row's new ids
(only those: the host work per token does not grow with the row's length) back to the loop with
call_soon_threadsafe, one call per round. With overlap the engine launches round k+1 before it reads round k, so
the device is never idle while this thread publishes round k and the loop turns its ids into text (both hold the
GIL). The rows that round k+1 admitted get their first token as soon as its prefill is done (engine.first_tokens),
not after its decode steps. An idle engine given a request waits for the rest of its burst (batch_wait, the
server's --batch-wait-ms; a lone request's wait ends batch_gap after it, a burst's burst_gap after its last
arrival), so a wave of clients is prefilled, and finishes, in the same rounds. A Job (on the loop) turns those ids
into text deltas, applies stop strings and queues events for its HTTP handler.

Instrumentation (GET /health): `stats` has the engine's per-round counters under "rounds" (rounds, prefill rounds,
rows admitted, decode steps, the engine thread's seconds launching, waiting for the device and reading results,
and on CUDA the device's seconds per round and idle between rounds), plus this thread's seconds between engine
steps (host_s) and the loop's seconds turning ids into events (deliver_s, delivered_ids).

Tensor parallelism: every TP rank holds a slice of the model and must run the same engine steps. Rank 0's worker
turns each round of commands into a plan (new rows as (key, prompt ids, sampling parameters, seed), cancelled
keys, scoring calls, the number of decode steps) and broadcasts it over a CPU (gloo) group before running it;
the other ranks run follow(), which applies the same plan to their engine, so all ranks admit, cancel and step
identically (the engine's sync_tokens makes every rank use rank 0's sampled tokens).

Failures: a failed step fails every row the engine holds and every row queued behind it (HTTP 500; a stream gets
an error event, then its end) and marks the worker unhealthy (GET /health answers 503) until a step or, while
idle, a probe of the device succeeds. A failure of the thread itself answers everything queued and refuses
what comes later. Under TP a step that raises on rank 0 may have run (or hang) on the other ranks, so it stops the
engine thread for good (/health 503 "stopped": restart the server). The test hook MEGATRON_TEST_ENGINE_FAULT=PATH makes every step fail while PATH exists (under
TP rank 0 decides and the plan carries the fault, so every rank fails the same step).
"""
import asyncio
import itertools
import logging
import os
import queue
import threading
import time

from megatron.inference.api import APIError

logger = logging.getLogger(__name__)

FAULT_HOOK = "MEGATRON_TEST_ENGINE_FAULT"
PROBE_INTERVAL = 1.0  # seconds between device probes while unhealthy and idle


class InjectedFault(RuntimeError):
    pass


# ---- the engine thread -------------------------------------------------------------------------------------------

class Row:
    """One completion (a prompt, one of its n samples): created on the loop, stepped by the worker."""

    _keys = itertools.count()

    def __init__(self, job, index, prompt_ids, params, seed, text):
        self.job, self.index, self.prompt_ids, self.params, self.seed = job, index, prompt_ids, params, seed
        self.key = next(Row._keys)  # names the row in a TP plan
        self.text = text  # api.IncrementalText
        self.finish_reason = None
        self.output = []  # the ids generated so far (extended on the loop)
        self.published = 0  # ids handed to the loop (worker thread only)

    @property
    def finished(self):
        return self.finish_reason is not None


class PlanChannel:
    """Rank 0's plans to the other TP ranks: broadcast_object_list over a gloo group of the TP ranks (a CPU
    channel, so it never waits on the device's stream; its timeout is long, the server may idle for days)."""

    def __init__(self, state):
        import datetime

        import torch.distributed as dist

        ranks = list(state.tp_ranks)
        self.src = ranks[0]
        self.group = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(days=365))
        self.is_source = dist.get_rank() == self.src
        self.stopped = False
        self._lock = threading.Lock()  # the engine thread and close() after a timed-out stop: one broadcast at a time

    def send(self, plan):
        """Broadcasts plan to the other ranks; nothing once a stop has gone (they no longer listen)."""
        import torch.distributed as dist
        with self._lock:
            if self.stopped:
                return
            self.stopped = any(kind == "stop" for kind, _ in plan)
            dist.broadcast_object_list([plan], src=self.src, group=self.group)

    def close(self):
        """Rank 0: tells the other ranks to stop, unless a plan did already (the worker never started)."""
        self.send([("stop", None)])

    def receive(self):
        import torch.distributed as dist
        box = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]


class EngineWorker:
    """Owns the InferenceEngine on one thread: admits rows, steps, publishes each row's new ids to the loop.

    scorer: runs the ("score", ...) commands (the server's logprobs) on the engine thread, on every TP rank.
    channel: a PlanChannel under tensor parallelism (this is rank 0), else None."""

    def __init__(self, engine, steps_per_sync=8, scorer=None, channel=None, batch_wait=0.0, batch_gap=0.002,
                 burst_gap=None):
        self.engine = engine
        self.steps_per_sync = steps_per_sync
        self.batch_wait, self.batch_gap = batch_wait, min(batch_gap, batch_wait)
        self.burst_gap = min(max(batch_gap if burst_gap is None else burst_gap, self.batch_gap), batch_wait)
        self.scorer = scorer
        self.channel = channel
        self._commands = queue.SimpleQueue()
        self._lock = threading.Lock()  # alive and the command queue change together (nothing is queued after death)
        self._thread = None
        self._loop = None
        self.alive = False
        self.healthy = True
        self.last_error = None
        self._fault_path = os.environ.get(FAULT_HOOK)
        self._desynced = False  # TP: a step failed on this rank but maybe not on the others
        self.stats = {"running": 0, "waiting": 0, "peak_running": 0, "steps": 0, "finished": 0, "cancelled": 0,
                      "errors": 0, "batch_waits": 0, "batch_wait_s": 0.0, "host_s": 0.0, "deliver_s": 0.0,
                      "delivered_ids": 0, "rounds": engine.stats}

    def start(self, loop):
        self._loop = loop
        self.alive = True
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def _put(self, command):
        """Queues a command; False when the worker has died (nothing would ever answer it)."""
        with self._lock:
            if not self.alive:
                return False
            self._commands.put(command)
            return True

    def submit(self, rows):
        if not self._put(("add", rows)):
            self._post([(row, [], "error") for row in rows])

    def cancel(self, rows, count=True):
        """Stops rows (queued or running); count: a client's cancellation (not a stop string)."""
        self._put(("cancel", (rows, count)))

    def score(self, sequences, spans, top_n):
        """scorer.score(sequences, spans, top_n) on the engine thread (every TP rank); an asyncio future of its
        result (or exception). Called on the loop."""
        future = self._loop.create_future()
        if not self._put(("score", ((sequences, spans, top_n), future))):
            future.set_exception(RuntimeError("the engine thread has stopped"))
        return future

    def stop(self, timeout=10.0):
        if self._thread is not None:
            self._put(("stop", None))
            self._thread.join(timeout)

    # ---- the thread ----

    def _run(self):
        engine, active = self.engine, {}  # Row -> engine Request
        try:
            if engine.device.type == "cuda":  # the current device is per thread; graphs and NCCL use it
                import torch
                torch.cuda.set_device(engine.device)
            while True:
                idle = not engine.has_work()
                commands = []
                if idle:
                    try:
                        commands.append(self._commands.get(timeout=None if self.healthy else PROBE_INTERVAL))
                    except queue.Empty:
                        self._probe()
                        continue
                    if self.batch_wait > 0 and commands[0][0] == "add":
                        commands = self._gather(commands)
                begin, self._step_s = time.perf_counter(), 0.0
                commands += self._queued_commands()
                if not self._round(commands, active):
                    return
                self.stats.update(running=len(engine.running), waiting=len(engine.waiting))
                self.stats["host_s"] += time.perf_counter() - begin - self._step_s
                self._round_done()
        except Exception as err:  # a bug: fail what is in flight and queued rather than leave its clients waiting
            logger.exception("server: the engine thread failed; the server answers 503 from now on")
            self.last_error = f"{type(err).__name__}: {err}"
            self._post([(row, [], "error") for row in active])
        finally:
            with self._lock:
                self.alive = False
            self._fail_queued()
            self._round_done()
            if self.channel is not None and not self._desynced:
                try:
                    self.channel.close()
                except Exception:  # noqa: BLE001  the other ranks are gone already
                    logger.exception("server: could not tell the other tensor-parallel ranks to stop")

    def _round(self, commands, active):
        """Applies one round of commands and runs one engine step; False once told to stop."""
        engine, plan, scores = self.engine, [], []
        for index, (kind, payload) in enumerate(commands):
            if kind == "stop":
                for request in active.values():
                    engine.cancel(request)
                self._post([(row, [], "cancelled") for row in active])
                active.clear()
                for _, future in scores:  # taken with the stop: answered, not dropped
                    self._answer(future, None, RuntimeError("the engine thread has stopped"))
                for command in commands[index + 1:]:  # _fail_queued answers them
                    self._commands.put(command)
                return False
            if kind == "add":
                added = self._add(payload, active)
                if added:
                    plan.append(("add", [(row.key, row.prompt_ids, row.params, row.seed) for row in added]))
            elif kind == "score":
                args, future = payload
                scores.append((args, future))
                plan.append(("score", args))
            else:
                rows, count = payload
                keys = []
                for row in rows:
                    request = active.pop(row, None)
                    if request is not None:
                        engine.cancel(request)
                        self.stats["cancelled"] += count
                        keys.append(row.key)
                if keys:
                    plan.append(("cancel", keys))
        num_steps, fault = None, False
        if engine.has_work():  # admits (prefills) what has a free slot, then decodes: one round, one sync
            num_steps = self.steps_per_sync
            fault = self._fault_path is not None and os.path.exists(self._fault_path)
            plan.append(("step", (num_steps, fault)))
        if self.channel is not None and plan:
            self.channel.send(plan)
        for args, future in scores:
            self._score(args, future)
        if num_steps is not None:
            self._step(active, num_steps, fault)
        return True

    def _add(self, rows, active):
        added = []
        for row in rows:
            try:
                active[row] = self.engine.add_request(row.prompt_ids, row.params, row.seed, request_id=row)
                added.append(row)
            except ValueError as err:  # checked on the loop already; an engine limit the checks missed
                logger.error("server: request refused by the engine: %s", err)
                self._post([(row, [], "error")])
        return added

    def _score(self, args, future):
        try:
            result, error = self.scorer.score(*args), None
        except Exception as err:  # noqa: BLE001  handed to the request that asked, not the engine thread
            logger.exception("server: a scoring call failed")
            result, error = None, err
        self._answer(future, result, error)

    def _answer(self, future, result, error):
        """Hands a scoring call's result (or exception) to the request that asked."""
        try:
            self._loop.call_soon_threadsafe(_resolve, future, result, error)
        except RuntimeError:  # the loop has closed
            pass

    def _round_done(self):
        """After each round and when the thread ends (remote.EngineService publishes its state here)."""

    def _step(self, active, num_steps, fault):
        engine = self.engine
        batch = min(engine.max_batch, len(engine.running) + len(engine.waiting))  # rows this step runs
        begin = time.perf_counter()
        try:
            run_step(engine, num_steps, fault)
        except Exception as err:  # a failed step (out of memory, a device fault) fails its rows and the queue
            logger.exception("server: the engine step failed; failing %d rows and those queued", len(active))
            self.stats["errors"] += 1
            self.healthy = False
            self.last_error = f"{type(err).__name__}: {err}"
            engine.abort()
            failed = list(active)
            active.clear()
            failed += self._drain_adds()
            self._post([(row, [], "error") for row in failed])
            if self.channel is not None and not isinstance(err, InjectedFault):
                # the other ranks may have run (or be stuck in) this step: they are out of step for good
                self._desynced = True
                raise RuntimeError("a tensor-parallel engine step failed; the ranks are out of step: restart the "
                                   "server") from err
            return
        finally:
            self._step_s = time.perf_counter() - begin
        self.healthy = True
        self.stats["steps"] += 1
        self.stats["peak_running"] = max(self.stats["peak_running"], batch)
        self._publish(active)  # the round before's ids
        begin = time.perf_counter()
        first = engine.first_tokens()  # the new rows' first tokens, once the round in flight has prefilled them
        self._step_s += time.perf_counter() - begin
        if first:
            self._publish(active)

    def _publish(self, active):
        """Posts each row's ids since its last update (and its end) to the loop, in one call."""
        updates = []
        for row, request in list(active.items()):
            count = len(request.output)
            new = request.output[row.published:count] if count > row.published else []
            row.published = count
            if request.finished:
                del active[row]
                self.stats["finished"] += 1
                updates.append((row, new, request.finish_reason))
            elif new:
                updates.append((row, new, None))
        self._post(updates)

    def _gather(self, commands):
        """An idle engine's wait for the rest of a burst (the clients of a wave arrive over a few ms): commands
        until the rows fill the batch, a stop comes, batch_wait has passed since the first, or a gap passes with
        none arriving: batch_gap after a lone request (its cost when it is alone), burst_gap once a second has come
        (a wave's requests reach the engine with holes of a few ms between them: its clients' and the HTTP
        front-end's threads share GILs). Prefilled together, a burst's rows start and finish in the same rounds;
        admitted over several rounds, the last of them decode on after the others have finished, in rounds a
        fraction full, and their clients' next requests come staggered too."""
        deadline = time.perf_counter() + self.batch_wait
        rows = sum(len(payload) for kind, payload in commands if kind == "add")
        while rows < self.engine.max_batch and commands[-1][0] != "stop":
            timeout = min(self.batch_gap if rows < 2 else self.burst_gap, deadline - time.perf_counter())
            if timeout <= 0:
                break
            try:
                command = self._commands.get(timeout=timeout)
            except queue.Empty:
                break
            commands.append(command)
            rows += len(command[1]) if command[0] == "add" else 0
        self.stats["batch_waits"] += 1
        self.stats["batch_wait_s"] += self.batch_wait - max(0.0, deadline - time.perf_counter())
        return commands

    def _queued_commands(self):
        """Takes every command queued now, in order."""
        commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _drain_adds(self):
        """The rows of every queued "add" (other commands stay queued, in order)."""
        rows, keep = [], []
        for kind, payload in self._queued_commands():
            if kind == "add":
                rows += payload
            else:
                keep.append((kind, payload))
        for command in keep:
            self._commands.put(command)
        return rows

    def _fail_queued(self):
        """After the thread has ended: answer every queued row and scoring call (nothing is queued after this)."""
        rows = []
        for kind, payload in self._queued_commands():
            if kind == "add":
                rows += payload
            elif kind == "score":
                self._answer(payload[1], None, RuntimeError("the engine thread has stopped"))
        self._post([(row, [], "error") for row in rows])

    def _probe(self):
        """While unhealthy and idle: healthy again once the device answers (and the test fault is gone)."""
        try:
            if self._fault_path is not None and os.path.exists(self._fault_path):
                raise InjectedFault(f"injected engine fault ({FAULT_HOOK})")
            probe_device(self.engine.device)
        except Exception as err:  # noqa: BLE001  still unhealthy; /health says why
            self.last_error = f"{type(err).__name__}: {err}"
            self._round_done()
            return
        logger.info("server: the engine answers again; healthy")
        self.healthy = True
        self._round_done()

    def _post(self, updates):
        if updates:
            try:
                self._loop.call_soon_threadsafe(self._deliver, updates)
            except RuntimeError:  # the loop has closed: nobody is waiting for these rows
                pass

    def _deliver(self, updates):
        """On the loop: one round's updates to their jobs (timed: the loop's work per token)."""
        begin = time.perf_counter()
        for row, new_ids, reason in updates:
            row.job.on_update(row, new_ids, reason)
            self.stats["delivered_ids"] += len(new_ids)
        self.stats["deliver_s"] += time.perf_counter() - begin


def run_step(engine, num_steps, fault=False):
    """One engine round with the one before it read (overlap), or the injected test fault (the same on every TP
    rank: the plan carries it). Returns the requests that finished in the round before."""
    if fault:
        raise InjectedFault(f"injected engine fault ({FAULT_HOOK})")
    return engine.step(num_steps, overlap=True)


def probe_device(device):
    """Raises if the device no longer runs work (a CUDA fault is sticky: every later call raises)."""
    import torch
    if device.type == "cuda":
        x = torch.ones(8, device=device)
        torch.cuda.synchronize(device)
        if float(x.sum()) != 8.0:
            raise RuntimeError("the device computed a wrong sum")


def follow(engine, scorer, channel):
    """The engine loop of a TP rank other than 0: applies rank 0's plans until it says stop (returns 0). The
    injected test fault fails every request, as on rank 0; any other failed step raises (the ranks are out of
    step: torchrun then stops them all)."""
    requests = {}  # row key -> engine Request
    while True:
        plan = channel.receive()
        for kind, payload in plan:
            if kind == "stop":
                for request in requests.values():
                    engine.cancel(request)
                return 0
            if kind == "add":
                for key, prompt_ids, params, seed in payload:
                    try:
                        requests[key] = engine.add_request(prompt_ids, params, seed, request_id=key)
                    except ValueError:  # rank 0 refused it too
                        pass
            elif kind == "cancel":
                for key in payload:
                    request = requests.pop(key, None)
                    if request is not None:
                        engine.cancel(request)
            elif kind == "score":
                try:
                    scorer.score(*payload)
                except Exception:  # noqa: BLE001  rank 0 answers the client
                    logger.exception("server: a scoring call failed on this rank")
            else:
                num_steps, fault = payload
                try:
                    for request in run_step(engine, num_steps, fault):
                        requests.pop(request.request_id, None)
                except Exception:  # rank 0 fails the rows; do the same here
                    if not fault:  # this rank alone: out of step with the others for good (torchrun stops them)
                        raise
                    logger.warning("server: injected engine fault (%s); failing every request", FAULT_HOOK)
                    engine.abort()
                    requests.clear()


def _resolve(future, result, error):
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


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

    def on_update(self, row, new_ids, reason):
        """On the loop: the row's ids since its last update (reason: None while it runs, else the engine's finish
        reason)."""
        if row.finished:
            return
        row.output.extend(new_ids)
        if reason in ("error", "cancelled"):
            row.finish_reason = reason
            self.events.put_nowait((row, "", reason))
            return
        delta = row.text.update(new_ids, final=reason is not None)
        if row.text.stopped:
            if reason is None:
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
