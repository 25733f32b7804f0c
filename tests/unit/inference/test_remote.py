"""The server's engine process and HTTP front-end apart (megatron/inference/remote.py): EngineService and EngineClient
over a real multiprocessing pipe (in one process here; tests/integration/test_server.py runs them as two). Rows
equal the engine's solo answers, cancellations and scoring calls cross by key, only new ids cross the pipe, a
failed step reaches the client with its health, and either side going away is seen by the other."""
import asyncio
import multiprocessing
import pickle
import threading
import time

from megatron.inference import SamplingParams
from megatron.inference.remote import ENGINE_GONE, EngineClient, EngineService
from megatron.inference.worker import Job
from tests.unit.inference.test_server_api import rows_of, tiny_engine


def connect(engine, steps_per_sync=2, scorer=None):
    """(service, client, bytes of "updates" messages sent so far: a one-item list) over a fresh pipe."""
    here, there = multiprocessing.Pipe(duplex=True)
    sent = [0]
    send = here.send

    def counting_send(message):
        if message[0] == "updates":
            sent[0] += len(pickle.dumps(message))
        send(message)

    here.send = counting_send
    service = EngineService(engine, steps_per_sync=steps_per_sync, scorer=scorer)
    service.start(here)
    return service, EngineClient(there), sent


def test_rows_cancellations_and_scores_cross_the_pipe():
    engine = tiny_engine(seq_length=600)
    greedy, sampled = SamplingParams(greedy=True, max_new_tokens=12), SamplingParams(temperature=0.8, top_k=20,
                                                                                     max_new_tokens=9)
    prompts = [[5, 9, 3], [7, 1], [11, 12, 13, 14], [2, 4, 6, 8, 10], [3, 3]]
    solo = [engine.generate([p], greedy if i % 2 == 0 else sampled, seed=40 + i)[0] for i, p in enumerate(prompts)]
    release = threading.Event()

    class Scorer:
        def score(self, sequences, spans, top_n):
            release.wait(30)
            if top_n == 99:
                raise ValueError("top_n 99 is too many")
            return [("scored", seq, top_n) for seq in sequences]

    service, client, _ = connect(engine, scorer=Scorer())
    admitted = engine.stats["admitted"]  # the solo runs' admissions

    async def scenario():
        client.start(asyncio.get_running_loop())
        scored = client.score([[1, 2], [3]], [(0, [2]), (0, [])], 2)  # holds the engine thread until released
        jobs = [rows_of(Job(client, lambda job: None), client, [p], greedy if i % 2 == 0 else sampled, [40 + i])
                for i, p in enumerate(prompts)]  # five rows, four slots
        failing = client.score([[1, 2]], [(0, [2])], 99)
        release.set()
        result = await scored
        try:
            await failing
        except RuntimeError as err:  # the scorer's exception type by name (the HTTP 500 names it)
            failure = (type(err).__name__, str(err))
        for job in jobs:
            await job.wait()
        long = rows_of(Job(client, lambda job: None), client, [[9, 9, 9]],
                       SamplingParams(greedy=True, max_new_tokens=500))
        await long.next()  # it has started (250 rounds to go)
        cancelled = long.release()
        for _ in range(200):
            if client.stats["cancelled"] == 1 and client.stats["running"] == 0:
                break
            await asyncio.sleep(0.02)
        stats, held = client.stats, len(client._rows)
        await asyncio.to_thread(client.stop)
        return result, failure, [job.rows[0].output for job in jobs], cancelled, len(long.rows[0].output), stats, held

    result, failure, outputs, cancelled, long_tokens, stats, held = asyncio.run(scenario())
    assert result == [("scored", [1, 2], 2), ("scored", [3], 2)]
    assert failure == ("ValueError", "top_n 99 is too many")
    assert held == 0  # no row is kept once finished or cancelled
    assert outputs == solo
    assert cancelled == 1 and long_tokens < 500
    assert (stats["finished"], stats["cancelled"], stats["running"], stats["peak_running"]) == (5, 1, 0, 4)
    assert stats["delivered_ids"] >= sum(map(len, outputs)) + long_tokens  # + ids in flight at the cancel
    assert stats["rounds"]["admitted"] - admitted == 6
    assert not client.alive and not service.alive  # stop() waited for the engine's last state


def test_only_new_ids_cross_the_pipe():
    """The bytes of the "updates" messages per generated token do not grow with the output's length (sending each
    row whole at every round would make the 512-token run's ~8x the 64-token run's)."""
    engine = tiny_engine(seq_length=600)
    per_token = {}
    for n in (64, 512):
        service, client, sent = connect(engine, steps_per_sync=8)
        params = SamplingParams(temperature=0.9, max_new_tokens=n)

        async def scenario():
            client.start(asyncio.get_running_loop())
            job = rows_of(Job(client, lambda job: None), client, [[5, 9, 3], [5, 9, 4]], params, [1, 2])
            await job.wait()
            await asyncio.to_thread(client.stop)
            return [row.output for row in job.rows]

        outputs = asyncio.run(scenario())
        assert [len(o) for o in outputs] == [n, n]
        assert outputs == [engine.generate([p], params, seed=s)[0] for p, s in (([5, 9, 3], 1), ([5, 9, 4], 2))]
        per_token[n] = sent[0] / (2 * n)
    assert per_token[512] <= 1.1 * per_token[64], per_token


def test_a_failed_step_reaches_the_client_with_its_health(engine_fault):
    from megatron.inference.worker import FAULT_HOOK

    fault = engine_fault
    engine = tiny_engine()
    params = SamplingParams(greedy=True, max_new_tokens=6)
    solo = engine.generate([[5, 9, 3]], params)[0]
    service, client, _ = connect(engine)

    async def scenario():
        client.start(asyncio.get_running_loop())
        fault.touch()
        job = rows_of(Job(client, lambda job: None), client, [[5, 9, 3 + i] for i in range(6)], params)
        reasons = []
        for _ in range(6):
            reasons.append((await job.next())[2])
        health_then = (client.healthy, client.last_error)  # carried with the failed rows, not a later message
        fault.unlink()
        for _ in range(200):
            if client.healthy:
                break
            await asyncio.sleep(0.02)
        again = rows_of(Job(client, lambda job: None), client, [[5, 9, 3]], params)
        await again.wait()
        await asyncio.to_thread(client.stop)
        return reasons, health_then, client.stats["errors"], again.rows[0].output

    reasons, (healthy, error), errors, output = asyncio.run(scenario())
    assert reasons == ["error"] * 6
    assert not healthy and error == f"InjectedFault: injected engine fault ({FAULT_HOOK})"
    assert errors == 1 and output == solo


def test_the_engine_process_going_away_fails_every_request_and_stops_the_front_end():
    """The test plays the engine process: it takes the rows and a scoring call, then dies (its end of the pipe
    closes, as at a crash)."""
    here, there = multiprocessing.Pipe(duplex=True)
    here.send(("state", {"alive": True, "healthy": True, "last_error": None, "stats": {"rounds": {}}}))
    client = EngineClient(there)
    exits = []
    client.on_engine_exit = lambda: exits.append(True)

    async def scenario():
        client.start(asyncio.get_running_loop())
        job = rows_of(Job(client, lambda job: None), client, [[5, 9, 3], [5, 9, 4]],
                      SamplingParams(greedy=True, max_new_tokens=20))
        scored = client.score([[1, 2]], [(0, [2])], None)
        received = [await asyncio.to_thread(here.recv) for _ in range(2)]
        here.close()
        reasons = [(await job.next())[2] for _ in range(2)]
        try:
            await scored
            score_error = None
        except RuntimeError as err:
            score_error = str(err)
        late = rows_of(Job(client, lambda job: None), client, [[5, 9, 5]], SamplingParams(max_new_tokens=3))
        return [kind for kind, _ in received], reasons, score_error, (await late.next())[2]

    received, reasons, score_error, late = asyncio.run(scenario())
    assert received == ["add", "score"]
    assert reasons == ["error", "error"] and score_error == ENGINE_GONE and late == "error"
    assert not client.alive and client.last_error == ENGINE_GONE and exits == [True]


def test_the_front_end_going_away_stops_the_engine():
    engine = tiny_engine()
    cancelled, cancel = [], engine.cancel
    engine.cancel = lambda request: (cancelled.append(request.request_id.key), cancel(request))
    step = engine.step
    engine.step = lambda *args, **kwargs: (time.sleep(0.05), step(*args, **kwargs))[1]  # 40 tokens: ~1 s
    here, there = multiprocessing.Pipe(duplex=True)
    service = EngineService(engine, steps_per_sync=2)
    service.start(here)
    EngineClient(there)
    there.send(("add", [(1, [5, 9, 3], SamplingParams(greedy=True, max_new_tokens=40), 0)]))
    for _ in range(200):
        if engine.has_work():
            break
        threading.Event().wait(0.01)
    there.close()  # the front-end process died without saying stop
    service._thread.join(30)
    assert not service._thread.is_alive() and not service.alive and cancelled == [1]


def test_the_front_end_sends_small_messages_at_once_and_every_message_in_order():
    """Small messages leave from the loop itself (not behind the send thread's wait for the GIL); one over
    INLINE_BYTES goes through the thread, and what follows it waits its turn: the engine reads them in the order
    they were sent."""
    from megatron.inference import remote
    here, there = multiprocessing.Pipe(duplex=True)
    here.send(("state", {"alive": True, "healthy": True, "last_error": None, "stats": {"rounds": {}}}))
    client = EngineClient(there)
    thread_sends = []
    write = client._write
    client._write = lambda kind, data: (thread_sends.append(threading.current_thread().name), write(kind, data))[1]
    params = SamplingParams(greedy=True, max_new_tokens=4)
    long_prompt = list(range(remote.INLINE_BYTES))  # pickled: more than INLINE_BYTES

    async def scenario():
        client.start(asyncio.get_running_loop())
        sent = []
        for i in range(20):
            prompt = long_prompt if i % 5 == 2 else [5, 9, i]
            job = rows_of(Job(client, lambda job: None), client, [prompt], params)
            client.cancel(job.rows)
            sent += [("add", len(prompt)), ("cancel", None)]
        received = []
        for _ in sent:
            kind, payload = await asyncio.to_thread(here.recv)
            received.append((kind, len(payload[0][1]) if kind == "add" else None))
        return sent, received

    sent, received = asyncio.run(scenario())
    assert received == sent
    # the first message went from the loop at once; the long prompts (and what came right behind them) by the thread
    assert thread_sends[0] == "MainThread" and thread_sends.count("engine-send") >= 4
