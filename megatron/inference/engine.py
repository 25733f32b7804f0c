"""The generation engine: a static KV cache, batched prefill, CUDA-graph decode steps, sampling on the device.

    engine = InferenceEngine(model, max_batch_size=8, max_seq_len=1024, eod_id=tok.eod, vocab_limit=tok.vocab_size)
    request = engine.add_request(prompt_ids, SamplingParams(greedy=True, max_new_tokens=64))
    while engine.has_work():
        for done in engine.step():          # requests that finished during this step
            print(done.output, done.finish_reason)

step(n, overlap=True) keeps one round in flight (vLLM's async scheduling): it launches round k+1 (admissions,
prefill, n decode steps, the read-back copy) before it reads round k's results, so the device runs round k+1 while
the host turns round k's ids into text. A row that finished in round k runs round k+1 as a done row (its output
and cache untouched), which is all overlapping costs. `stats` counts rounds, prefills and the time the host spent
launching and waiting (the prefills' share of the launch time, and the decode steps whose launch took the host
longer than SLOW_STEP_LAUNCH_S), and on CUDA, from timing events, the device's time per round (that of rounds with
a prefill apart) and its idle gaps between rounds.

A request takes a free slot of the cache when it is admitted (prefill, the LM head on its last position only,
chunked for long prompts), then decodes one token per step together with every other running request; it leaves
when it produces eod or reaches its max_new_tokens, and a waiting request takes its slot at the next step
(continuous batching). Greedy output of a request does not depend on what else is in the batch.

Per decode step the device holds all per-row state (next input token, position, token count, done flag, sampling
parameters) and the generated tokens, so `step(num_steps=n)` runs n steps with no host synchronisation and copies
results to the host once. On CUDA each decode step shape is captured once as a CUDA graph and replayed.

Prefill graphs (prefill_graph_tokens): an admitted group is padded to a bucket, rows and width each to the next of
2^k and 1.5 x 2^k (at most 1.5x the real ones; rows from 1, the padding rows write the scratch slot; width from
MIN_PREFILL_WIDTH, right padding: a row's real queries see only its earlier real keys, and decode overwrites the
padding positions before any query sees them), and when rows x width <= prefill_graph_tokens the group's forward
up to each row's last hidden state is one CUDA graph replay: the eager prefill is ~32 host-side ops per layer
(10-15 ms for 24 layers), longer than the device's work for short prompts, and it competes for the GIL with a
server's event loop. Groups are formed so they fit a bucket; longer prompts prefill eagerly.

Two decode paths (`decode=`):
    fused    (default at TP 1) megatron/inference/decode.py's step: the blocks' maths in a few segments (fused by
             torch.compile with compile_mode=...) around a Triton attention kernel that writes the new key/value
             and attends over each row's own length. Running rows are packed into the first n rows of the step
             (the batch bucket is the smallest one >= n, whatever slots they hold); one graph per batch bucket.
    unfused  the model's own forward over the cache (TP > 1): rows 0..max slot, attention over the first
             multiple of kv_bucket positions that holds every row; one graph per (batch, kv-length) bucket.
Greedy rows take the argmax of the logits; the vocabulary is sorted only when a sampled row filters (top-k/p).

graph_step=True (CUDA graphs, no sync_tokens) captures the whole decode step in the graph: the gathers of the
running rows' state, the forward, the argmax (or the sampling) and the per-row state update (tokens, pos, count,
done, the output write), so a step is one graph replay and no host work; one graph per (bucket, sampled,
filtered). graph_step=False replays the forward's graph and updates the state eagerly (round 1's engine).
gemm (fused step): "torch", "triton" or "auto" (megatron/inference/skinny_gemm.py's kernel per weight shape
where it is faster than torch's matmul at that batch bucket, timed at capture).
"""
import heapq
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from megatron.inference.kv_cache import StaticKVCache
from megatron.inference.sampling import SamplingParams, sample_rows
from megatron.model.attention import plan_free_attention

logger = logging.getLogger(__name__)

SLOW_STEP_LAUNCH_S = 2e-3  # stats: decode steps whose host launch took longer than this (a stall, not the norm)
PREFILL_GRAPH_TOKENS = 2048  # default bound of a graphed prefill's padded tokens (rows bucket x width bucket)
MIN_PREFILL_WIDTH = 16  # the narrowest prefill width bucket


@dataclass(eq=False)
class Request:
    """One prompt's generation; `output` grows at each step()'s synchronisation."""
    request_id: object
    prompt: list
    params: SamplingParams
    seed: int
    output: list = field(default_factory=list)
    finish_reason: str = None  # "stop" (eod), "length" (max_new_tokens) or "cancelled"
    slot: int = None
    _host_pos: int = 0  # upper bounds known without a sync: the slot's next write position,
    _host_count: int = 0  # and the tokens generated
    _launched: int = 0  # ids that launched read-backs cover (len(output) once they are read)

    @property
    def finished(self):
        return self.finish_reason is not None


@dataclass(eq=False)
class Round:
    """A launched round: its read-back of (count, done, new ids) per slot, and of its admitted rows' first tokens.
    ready: a CUDA event after the copy (None on the CPU, where host is already filled)."""
    rows: list  # (request, slot, ids already covered) of every row running at launch
    host: torch.Tensor  # (max slot + 1, 2 + width)
    ready: object = None
    first: tuple = None  # (admitted requests, their first tokens, a CUDA event after that copy or None)
    start: object = None  # CUDA timing events: before the round's first work,
    end: object = None  # after its copy,
    previous_end: object = None  # and after the round before, when the engine had work in between
    prefilled: bool = False  # the round admitted (prefilled) rows


def _token_rows(token_lists, rows, columns):
    """A (rows, columns) int64 host tensor of zeros with token_lists[i] at the start of row i (right padding)."""
    out = torch.zeros(rows, columns, dtype=torch.long)
    for row, tokens in enumerate(token_lists):
        out[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return out


def _fine_buckets(smallest, limit):
    """smallest x 2^k and 1.5 x smallest x 2^k (where whole) below limit, then limit: 1, 2, 3, 4, 6, 8, ... or
    16, 24, 32, 48, ..."""
    out, value = set(), smallest
    while value < limit:
        out.add(value)
        if value % 2 == 0 and value * 3 // 2 < limit:
            out.add(value * 3 // 2)
        value *= 2
    return sorted(out | {limit})


def _buckets(limit):
    """1, 2, 4, ... up to limit (limit itself last)."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


class InferenceEngine:
    """Continuous-batching generation for a BloomModel (parallel_output=False, eval mode, on its device).

    max_seq_len: the longest prompt + generation a request may reach (the cache's length).
    eod_id: stops a row (None: never). vocab_limit: ids >= it (the embedding's padding rows) are never produced.
    cuda_graphs: capture decode steps (default: on CUDA at TP 1). kv_bucket: decode attends over the first
    multiple of kv_bucket positions that holds every running row. sync_tokens: called with each step's tokens,
    returns the tokens every rank uses (tensor parallelism: rank 0's choice).
    decode: "fused" or "unfused" (default: fused at TP 1). compile_mode: for the fused step, None (eager) or a
    torch.compile mode ("default", "max-autotune-no-cudagraphs"); decode_attention: "triton" or "torch"
    (default: triton on CUDA). graph_step: the whole step (state update included) in the CUDA graph (default
    False). gemm: the fused step's GEMMs, "torch" (default), "triton" or "auto" (timed per shape).
    prefill_graph_tokens: the largest padded prefill (rows bucket x width bucket) run as a CUDA graph (default
    PREFILL_GRAPH_TOKENS with cuda_graphs, else 0: no padding); without CUDA graphs a positive value pads the same
    way and runs eagerly.
    """

    def __init__(self, model, max_batch_size=8, max_seq_len=None, eod_id=None, vocab_limit=None,
                 prefill_chunk=2048, cuda_graphs=None, kv_bucket=256, sync_tokens=None, decode=None,
                 compile_mode=None, decode_attention=None, graph_step=None, gemm=None, prefill_graph_tokens=None):
        config = model.config
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_batch = max_batch_size
        self.max_seq_len = max_seq_len or config.seq_length
        self.eod_id = -1 if eod_id is None else eod_id
        self.vocab_limit = vocab_limit
        self.prefill_chunk = prefill_chunk
        self.kv_bucket = kv_bucket
        self.sync_tokens = sync_tokens
        tp_size = config.num_attention_heads // model.layers[0].self_attention.heads_per_partition
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and tp_size == 1
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.cuda_graphs = cuda_graphs
        if decode is None:  # the fused step reads a whole BloomModel's weights at TP 1
            whole = all(hasattr(model, name) for name in ("embedding", "final_layernorm", "tp_size"))
            decode = "fused" if tp_size == 1 and whole else "unfused"
        if decode not in ("fused", "unfused"):
            raise ValueError(f"decode={decode!r}: choose 'fused' or 'unfused'")
        self.decode = decode
        attention = model.layers[0].self_attention
        # slot max_batch_size is scratch: the fused step's padding rows write their keys there
        self.cache = StaticKVCache(config.num_layers, max_batch_size + 1, attention.heads_per_partition,
                                   self.max_seq_len, attention.head_dim, self.dtype, self.device,
                                   attention.core_attention.slopes)
        self.decoder = None
        if decode == "fused":
            from megatron.inference.decode import FusedDecoder
            self.decoder = FusedDecoder(model, self.cache, vocab_limit, decode_attention, compile_mode, gemm)
        elif gemm not in (None, "torch"):
            raise ValueError(f"gemm={gemm!r} needs decode='fused' (the unfused step runs the model's own GEMMs)")
        if graph_step and sync_tokens is not None:
            raise ValueError("graph_step=True cannot capture sync_tokens (tensor parallelism): use graph_step=False")
        self.graph_step = bool(graph_step) and cuda_graphs
        self.max_new_cap = self.max_seq_len
        self._init_slot_state()
        self.waiting = deque()
        self.running = {}  # slot -> Request
        self._free = list(range(max_batch_size))
        self._ids = itertools.count()
        self._graphs = {}  # decode step graphs by bucket key
        self._prefill_graphs = {}  # prefill graphs by ("prefill", rows, width)
        self._pool = None
        self._batch_buckets = _buckets(max_batch_size)
        if prefill_graph_tokens is None:
            prefill_graph_tokens = PREFILL_GRAPH_TOKENS if cuda_graphs else 0
        self.prefill_graph_tokens = prefill_graph_tokens
        self._row_buckets = _fine_buckets(1, max_batch_size)
        self._width_buckets = _fine_buckets(MIN_PREFILL_WIDTH, min(self.max_seq_len, prefill_chunk))
        self._order = []  # the running slots in the fused step's row order
        self._order_dirty = False
        self.scratch = max_batch_size
        self.active = torch.full((max_batch_size,), self.scratch, dtype=torch.long, device=self.device)
        self.last_decode_batch = None  # the batch bucket of the latest decode step
        self.copied_tokens = 0  # generated ids copied to the host (one per new id and row slot at each sync)
        self._in_flight = None  # the Round that step(overlap=True) left running
        self._last_end = None  # the latest round's end event while the engine has work (CUDA)
        self.stats = {"rounds": 0, "prefill_rounds": 0, "admitted": 0, "decode_steps": 0, "launch_s": 0.0,
                      "prefill_launch_s": 0.0, "slow_step_launches": 0, "slow_step_launch_s": 0.0, "wait_s": 0.0,
                      "read_s": 0.0, "device_s": 0.0, "prefill_device_s": 0.0, "device_gap_s": 0.0,
                      "prefill_passes": 0, "prefill_bucketed": 0}

    def _init_slot_state(self):
        b, dev = self.max_batch + 1, self.device  # + the scratch slot (always done)
        self.tokens = torch.zeros(b, dtype=torch.long, device=dev)  # next input token
        self.pos = torch.zeros(b, dtype=torch.long, device=dev)  # where that token is written
        self.count = torch.zeros(b, dtype=torch.long, device=dev)  # tokens generated
        self.done = torch.ones(b, dtype=torch.bool, device=dev)  # free slots count as done
        self.max_new = torch.ones(b, dtype=torch.long, device=dev)
        self.greedy = torch.ones(b, dtype=torch.bool, device=dev)
        self.temperature = torch.ones(b, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(b, dtype=torch.long, device=dev)
        self.top_p = torch.ones(b, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(b, dtype=torch.long, device=dev)
        self.out = torch.zeros(b, self.max_new_cap + 1, dtype=torch.long, device=dev)  # last column: discard

    # ---- requests ----------------------------------------------------------------------------------------------

    def add_request(self, prompt, params, seed=0, request_id=None):
        """Queues a prompt (token ids); it is admitted at the next step() with a free slot."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"the prompt ({len(prompt)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the engine's max_seq_len {self.max_seq_len}: shorten the prompt, ask for "
                             "fewer tokens or build the engine with a larger max_seq_len")
        request = Request(next(self._ids) if request_id is None else request_id, prompt, params, int(seed))
        self.waiting.append(request)
        return request

    def has_work(self):
        return bool(self.waiting or self.running or self._in_flight)

    def cancel(self, request):
        """Stops a request (waiting or running); its slot is free for the next step."""
        if request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        elif request.slot is not None:
            self._release(request)
        request.finish_reason = "cancelled"

    def generate(self, prompts, params, seed=0, steps_per_sync=16):
        """Continuations (lists of ids, each ending at eod included or after max_new_tokens) of token-id prompts.
        Prompt i samples with seed + i."""
        requests = [self.add_request(p, params, seed + i) for i, p in enumerate(prompts)]
        while self.has_work():
            self.step(steps_per_sync, overlap=True)
        return [r.output for r in requests]

    def abort(self):
        """Cancels every request and forgets the round in flight (after a failed step)."""
        for request in list(self.waiting) + list(self.running.values()):
            self.cancel(request)
        self._in_flight = self._last_end = None

    # ---- stepping ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, num_steps=1, overlap=False):
        """Admits every waiting request that has a free slot (one batched prefill), runs up to num_steps decode
        steps for all running rows without a host sync, then reads the results back once. Returns the requests
        that finished. overlap: leave this round in flight and return those that finished in the round before
        (the engine's has_work() stays true while a round is in flight)."""
        launched = self._launch(num_steps)
        previous, self._in_flight = self._in_flight, launched if overlap else None
        finished = self._finish(previous) if previous is not None else []
        if launched is not None and not overlap:
            finished += self._finish(launched)
        if not self.has_work():
            self._last_end = None  # idle from here: the next round's wait is not the host's doing
        return finished

    def _launch(self, num_steps):
        """Queues a round's device work and its read-back (None when there is nothing to run)."""
        begin = time.perf_counter()
        timing = self.device.type == "cuda"
        start = None
        if timing and (self.running or self.waiting and self._free):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        stats = self.stats
        admitted = self._admit()
        first = self._read_first(admitted) if admitted else None
        prefill_end = time.perf_counter()
        steps = 0
        if self.running:
            steps = min(num_steps, max(r.params.max_new_tokens - r._host_count for r in self.running.values()))
            for _ in range(steps):
                step_begin = time.perf_counter()
                self._decode_step()
                took = time.perf_counter() - step_begin
                if took > SLOW_STEP_LAUNCH_S:  # a decode step that took the host this long to queue stalls the device
                    stats["slow_step_launches"] += 1
                    stats["slow_step_launch_s"] += took
        if not admitted and steps <= 0:
            return None
        launched = self._read_back()
        launched.first, launched.prefilled = first, bool(admitted)
        if timing:
            launched.start, launched.previous_end = start, self._last_end
            launched.end = self._last_end = torch.cuda.Event(enable_timing=True)
            launched.end.record()
        stats["rounds"] += 1
        stats["prefill_rounds"] += bool(admitted)
        stats["prefill_launch_s"] += (prefill_end - begin) if admitted else 0.0
        stats["admitted"] += len(admitted)
        stats["decode_steps"] += max(steps, 0)
        stats["launch_s"] += time.perf_counter() - begin
        return launched

    def first_tokens(self):
        """The first token of each request that the round in flight admitted, read as soon as its prefill is done
        (not after the round's decode steps): appends it to the request's output and returns those requests. A
        server streams them at once, so the time to first token does not include the round's decode steps."""
        launched = self._in_flight
        if launched is None or launched.first is None:
            return []
        requests, host, ready = launched.first
        launched.first = None
        if ready is not None:
            begin = time.perf_counter()
            ready.synchronize()
            self.stats["wait_s"] += time.perf_counter() - begin
        out = []
        for request, token in zip(requests, host.tolist()):
            if not request.finished and not request.output:
                request.output.append(token)
                out.append(request)
        return out

    def _admit(self):
        """Takes waiting requests into free slots and prefills them; returns them."""
        admitted = []
        while self.waiting and self._free:
            request = self.waiting.popleft()
            request.slot = heapq.heappop(self._free)
            request._host_pos = len(request.prompt)
            self.running[request.slot] = request
            self._order.append(request.slot)
            self._order_dirty = True
            admitted.append(request)
        if not admitted:
            return []
        self._load_params(admitted)
        short = [r for r in admitted if len(r.prompt) <= self.prefill_chunk]
        for r in admitted:
            if len(r.prompt) > self.prefill_chunk:
                self._prefill([r])
        group = []  # batch short prompts together, up to prefill_chunk padded tokens per pass, keeping a bucket
        for r in sorted(short, key=lambda r: len(r.prompt)):
            if group and ((len(group) + 1) * len(r.prompt) > self.prefill_chunk
                          or self._prefill_key(len(group), len(group[-1].prompt)) is not None
                          and self._prefill_key(len(group) + 1, len(r.prompt)) is None):
                self._prefill(group)
                group = []
            group.append(r)
        if group:
            self._prefill(group)
        return admitted

    def _load_params(self, requests):
        """Writes the admitted rows' state with one host-to-device copy: slots and parameters packed into one
        (8, n) int64 host tensor (pinned on CUDA; fp32 values travel as their int32 bit patterns, exactly)."""
        def floats(values):
            return torch.tensor(values, dtype=torch.float32).view(torch.int32).long()

        host = torch.stack([torch.tensor([r.slot for r in requests]),
                            torch.tensor([int(r.params.greedy) for r in requests]),
                            floats([r.params.temperature for r in requests]),
                            torch.tensor([r.params.top_k for r in requests]),
                            floats([r.params.top_p for r in requests]),
                            torch.tensor([r.seed for r in requests]),
                            torch.tensor([r.params.max_new_tokens for r in requests]),
                            torch.tensor([len(r.prompt) for r in requests])])
        if self.device.type == "cuda":
            host = host.pin_memory()
        slots, greedy, temperature, top_k, top_p, seeds, max_new, pos = host.to(self.device, non_blocking=True)
        self.greedy[slots] = greedy.bool()
        self.temperature[slots] = temperature.int().view(torch.float32)
        self.top_k[slots] = top_k
        self.top_p[slots] = top_p.int().view(torch.float32)
        self.seeds[slots] = seeds
        self.max_new[slots] = max_new
        self.count[slots] = 0
        self.done[slots] = False
        self.pos[slots] = pos

    def _prefill(self, requests):
        """Fills the requests' slots with their prompts and samples each one's first token."""
        lengths = [len(r.prompt) for r in requests]
        key = self._prefill_key(len(requests), max(lengths))  # None beyond the widest bucket (<= prefill_chunk)
        if key is not None:
            last = self._prefill_bucket(key, requests)
        elif len(requests) == 1 and lengths[0] > self.prefill_chunk:
            prompt = requests[0].prompt
            for start in range(0, len(prompt), self.prefill_chunk):
                chunk = prompt[start:start + self.prefill_chunk]
                hidden = self._prefill_pass([requests[0].slot], [chunk], start)
            last = hidden[:, len(chunk) - 1]
        else:
            # right-padded: a row's real queries see only earlier real keys (causal), the padding positions are
            # overwritten by its later tokens before any query can see them
            hidden = self._prefill_pass([r.slot for r in requests], [r.prompt for r in requests], 0)
            last = hidden[torch.arange(len(requests), device=self.device),
                          torch.tensor(lengths, device=self.device) - 1]
        logits = self._logits(last[:, None])  # the LM head on each row's last position only
        slots = torch.tensor([r.slot for r in requests], device=self.device)
        self._advance(slots, logits, any(not r.params.greedy for r in requests),
                      any(r.params.filters and not r.params.greedy for r in requests), decode=False)
        for r in requests:
            r._host_count = 1

    def _prefill_key(self, rows, width):
        """("prefill", rows bucket, width bucket) of a group, or None when it prefills unpadded (eagerly)."""
        if not self.prefill_graph_tokens:
            return None
        batch = next(b for b in self._row_buckets if b >= rows)
        padded = next((w for w in self._width_buckets if w >= width), None)
        if padded is None or batch * padded > self.prefill_graph_tokens:
            return None
        return ("prefill", batch, padded)

    def prefill_buckets(self):
        """Every ("prefill", rows, width) bucket a group can prefill with (each one CUDA graph)."""
        if not self.prefill_graph_tokens:
            return []
        return [("prefill", b, w) for b in self._row_buckets for w in self._width_buckets
                if b * w <= self.prefill_graph_tokens]

    def _prefill_bucket(self, key, requests):
        """The group's last hidden states (n, H), the group padded to the bucket: one host-to-device copy of
        (rows, width + 2) int64 (ids, then each row's slot and last position), then one graph replay."""
        _, batch, width = key
        host = _token_rows([r.prompt for r in requests], batch, width + 2)
        host[:, width] = self.scratch  # the padding rows
        for row, r in enumerate(requests):
            host[row, width], host[row, width + 1] = r.slot, len(r.prompt) - 1
        self.stats["prefill_passes"] += 1
        self.stats["prefill_bucketed"] += 1
        if not self.cuda_graphs:
            return self._prefill_forward(host.to(self.device))[:len(requests)]
        if key not in self._prefill_graphs:
            self._prefill_graphs[key] = self._capture_prefill(key)
        graph, inputs, last = self._prefill_graphs[key]
        inputs.copy_(host.pin_memory(), non_blocking=True)
        graph.replay()
        return last[:len(requests)]

    def _prefill_forward(self, inputs):
        """A padded group's forward, all device work (what a prefill graph captures): inputs (rows, width + 2) as
        _prefill_bucket lays it out; returns each row's hidden state at its last position."""
        width = inputs.shape[1] - 2
        self.cache.set_prefill(inputs[:, width], 0, width, self.dtype)
        try:
            with plan_free_attention(self.device):
                hidden = self.model.hidden_states(inputs[:, :width], cache=self.cache)
        finally:
            self.cache.clear()
        return hidden[self.cache.rows[:inputs.shape[0]], inputs[:, width + 1]]

    def _capture_prefill(self, key):
        """Records a prefill bucket's forward; its warm-up and capture write only the scratch slot."""
        _, batch, width = key
        inputs = torch.zeros(batch, width + 2, dtype=torch.long, device=self.device)
        inputs[:, width] = self.scratch
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._prefill_forward(inputs)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            last = self._prefill_forward(inputs)
        logger.info(f"inference: captured the prefill of {batch} rows x {width} positions")
        return graph, inputs, last

    def _prefill_pass(self, slots, token_lists, start):
        self.stats["prefill_passes"] += 1
        width = max(len(t) for t in token_lists)
        ids = _token_rows(token_lists, len(token_lists), width)
        self.cache.set_prefill(slots, start, width, self.dtype)
        try:  # every group size and width is a new shape: no per-shape cuDNN plan on the serving path
            with plan_free_attention(self.device):
                return self.model.hidden_states(ids.to(self.device), cache=self.cache)
        finally:
            self.cache.clear()

    def _logits(self, hidden):
        logits = self.model.lm_logits(hidden)[:, 0].float()  # (B, V)
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
            logits[:, self.vocab_limit:] = float("-inf")
        return logits

    def _advance(self, rows, logits, any_sampled, any_filtered, decode):
        """Samples the rows' next tokens (rows: a (B,) tensor of slots) and updates their state on the device,
        with no host synchronisation. A decode step moves a live row's position on; a prefill's first token is
        written at the prompt's end, where pos already points."""
        count = self.count[rows]
        tokens = sample_rows(logits, self.greedy[rows], self.temperature[rows], self.top_k[rows], self.top_p[rows],
                             self.seeds[rows], count, any_sampled, any_filtered)
        if self.sync_tokens is not None:
            tokens = self.sync_tokens(tokens)
        live = ~self.done[rows]
        self.out[rows, torch.where(live, count, self.max_new_cap)] = tokens  # finished rows: the discard column
        count = count + live.long()
        finished = live & ((tokens == self.eod_id) | (count >= self.max_new[rows]))
        self.count[rows] = count
        self.done[rows] = ~live | finished
        self.tokens[rows] = torch.where(live, tokens, self.tokens[rows])
        if decode:
            self.pos[rows] += (live & ~finished).long()

    def _decode_step(self):
        if self.decoder is not None:  # running rows packed into rows 0..n-1, one graph per batch bucket
            batch = next(b for b in self._batch_buckets if b >= len(self.running))
            self._sync_order()
            key = (batch, None)
        else:
            top = max(self.running) + 1
            batch = next(b for b in self._batch_buckets if b >= top)
            needed = max(r._host_pos for r in self.running.values()) + 1
            key = (batch, min(self.max_seq_len, -(-needed // self.kv_bucket) * self.kv_bucket))
        self.last_decode_batch = batch
        requests = self.running.values()
        sampled = [r for r in requests if not r.params.greedy]
        flags = (bool(sampled), any(r.params.filters for r in sampled))
        if self.graph_step:
            self._replay(key + flags)
        elif self.cuda_graphs:
            self._advance(self._step_rows(batch), self._decode_logits(key), *flags, decode=True)
        else:
            self._whole_step(key + flags)
        for r in requests:
            r._host_pos = min(r._host_pos + 1, self.max_seq_len - 1)
            r._host_count += 1

    def _sync_order(self):
        """Copies the running slots' row order to the device (only after rows joined or left)."""
        if not self._order_dirty:
            return
        host = torch.full((self.max_batch,), self.scratch, dtype=torch.long)
        host[:len(self._order)] = torch.tensor(self._order, dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.active.copy_(host, non_blocking=True)
        self._order_dirty = False

    def _step_rows(self, batch):
        """The state rows a decode step of this bucket reads and updates (a (batch,) device tensor of slots)."""
        return self.active[:batch] if self.decoder is not None else self.cache.rows[:batch]

    def _whole_step(self, key):
        """One decode step, forward and state update, all device work (what graph_step captures)."""
        batch, kv_len, sampled, filtered = key
        try:
            logits = self._decode_forward((batch, kv_len))
        finally:
            self.cache.clear()
        self._advance(self._step_rows(batch), logits, sampled, filtered, decode=True)

    def _replay(self, key):
        if key not in self._graphs:
            self._graphs[key] = self._capture(key)
        self._graphs[key][0].replay()

    def _state(self):
        return (self.tokens, self.pos, self.count, self.done, self.out)

    def _warm(self, key, runs):
        """Runs the step `runs` times for compilation and capture's warm-up; a whole step's state update is undone
        after each (the cache writes are the ones the next real step makes: the same keys at the same positions)."""
        if len(key) == 2:
            for _ in range(runs):
                self._decode_forward(key)
            return
        saved = [t.clone() for t in self._state()]
        for _ in range(runs):
            self._whole_step(key)
            for t, s in zip(self._state(), saved):
                t.copy_(s)

    def _decode_forward(self, key):
        batch, kv_len = key
        if self.decoder is not None:
            rows = self.active[:batch]
            return self.decoder(self.tokens[rows], rows, self.pos[rows])
        self.cache.set_decode(batch, kv_len, self.pos[:batch], self.dtype)
        hidden = self.model.hidden_states(self.tokens[:batch, None], cache=self.cache)
        return self._logits(hidden)

    def _decode_logits(self, key):
        if not self.cuda_graphs:
            try:
                return self._decode_forward(key)
            finally:
                self.cache.clear()
        if key not in self._graphs:
            self._graphs[key] = self._capture(key)
        graph, logits = self._graphs[key]
        graph.replay()
        return logits

    def _capture(self, key):
        """Warms the step up on a side stream, then records it; the graph reads tokens/pos and writes the cache
        in place (the warm-up's writes are the same values the replay writes)."""
        batch, kv_len = key[:2]
        if self.decoder is not None:
            self.decoder.prepare(batch)  # times the GEMM choices of this bucket (gemm="auto"), outside the capture
            if self.decoder.compile_mode is not None:
                self._warm(key, 1)  # compiles (and autotunes) on the current stream, outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._warm(key, 2)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._decode_forward(key) if len(key) == 2 else self._whole_step(key)
        self.cache.clear()
        what = "decode step" if len(key) == 2 else "whole decode step ({})".format(
            "greedy" if not key[2] else "sampled, filtered" if key[3] else "sampled")
        logger.info(f"inference: captured the {self.decode} {what} for batch {batch}"
                    + ("" if kv_len is None else f", kv length {kv_len}"))
        return graph, logits

    def _read_first(self, requests):
        """Queues the copy of the admitted requests' first tokens (column 0 of their output), right after the
        prefill: (requests, host tokens, CUDA event or None)."""
        slots = torch.tensor([r.slot for r in requests], dtype=torch.long)
        if self.device.type != "cuda":
            return requests, self.out[slots, 0], None
        device = self.out[slots.pin_memory().to(self.device, non_blocking=True), 0]
        host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
        host.copy_(device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return requests, host, ready

    def _read_back(self):
        """Queues the round's one device-to-host copy: each running row's count, done flag and only the ids it
        produced since the last read-back (one (rows, 2 + new) copy into pinned memory on CUDA, not waited for;
        `copied_tokens` counts the ids copied)."""
        top = max(self.running) + 1
        synced = [0] * top  # ids of each slot already covered
        rows = []
        for slot, request in self.running.items():
            synced[slot] = request._launched
            rows.append((request, slot, request._launched))
        width = max(r._host_count - r._launched for r in self.running.values())  # >= the new ids of any row
        parts = [self.count[:top, None], self.done[:top, None].long()]
        if width > 0:
            base = torch.tensor(synced, dtype=torch.long)
            base = base.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else base
            columns = (base[:, None] + torch.arange(width, device=self.device)).clamp_(max=self.max_new_cap)
            parts.append(self.out[:top].gather(1, columns))  # (top, width)
        device = torch.cat(parts, dim=1)
        for request in self.running.values():
            request._launched = request._host_count
        self.copied_tokens += top * max(width, 0)
        if self.device.type != "cuda":
            return Round(rows, device)
        host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
        host.copy_(device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return Round(rows, host, ready)

    def _finish(self, launched):
        """The one host synchronisation of a round: waits for its copy, extends each of its rows' output, finishes
        and frees the done rows. Rows cancelled or finished since its launch are skipped."""
        begin = time.perf_counter()
        if launched.ready is not None:
            launched.ready.synchronize()
        read = time.perf_counter()
        values = launched.host.tolist()
        finished = []
        for request, slot, synced in launched.rows:
            if request.finished:
                continue
            count, done = values[slot][0], values[slot][1]
            early = len(request.output) - synced  # the first token, when first_tokens() read it
            assert early in (0, 1), (len(request.output), synced)
            if count > synced + early:
                request.output.extend(values[slot][2 + early:2 + count - synced])
            if done:
                request.finish_reason = "stop" if request.output and request.output[-1] == self.eod_id \
                    else "length"
                self._release(request)
                finished.append(request)
        stats = self.stats
        if launched.end is not None:
            device_s = launched.start.elapsed_time(launched.end) / 1e3
            stats["device_s"] += device_s
            stats["prefill_device_s"] += device_s if launched.prefilled else 0.0
            if launched.previous_end is not None:
                stats["device_gap_s"] += launched.previous_end.elapsed_time(launched.start) / 1e3
        stats["wait_s"] += read - begin
        stats["read_s"] += time.perf_counter() - read
        return finished

    def _release(self, request):
        self.done[request.slot] = True
        del self.running[request.slot]
        index = self._order.index(request.slot)  # the last row moves into the hole: rows stay packed
        self._order[index] = self._order[-1]
        self._order.pop()
        self._order_dirty = True
        heapq.heappush(self._free, request.slot)
        request.slot = None

    def decode_buckets(self):
        """Every (batch bucket, kv-length bucket) a decode step can run with (the fused step: one graph per batch
        bucket, kv length None, since its attention kernel reads each row's own length)."""
        if self.decoder is not None:
            return [(b, None) for b in self._batch_buckets]
        kv_lengths = sorted({min(self.max_seq_len, k) for k in range(self.kv_bucket, self.max_seq_len
                                                                       + self.kv_bucket, self.kv_bucket)})
        return [(b, k) for b in self._batch_buckets for k in kv_lengths]

    @torch.no_grad()
    def warmup(self, batch_sizes=None, kv_lengths=None, every_bucket=False):
        """Captures the decode graphs of the given buckets now (default: every batch bucket; unfused: the first kv
        bucket; every_bucket: all of decode_buckets() and prefill_buckets(), so that serving never captures). A
        capture's warm-up writes running rows' keys/values, the same ones their next step writes."""
        if not self.cuda_graphs:
            return
        self._sync_order()
        if every_bucket:
            keys = self.decode_buckets()
        else:
            if self.decoder is not None:
                kv_lengths = [None]
            else:
                kv_lengths = kv_lengths or [min(self.max_seq_len, self.kv_bucket)]
            keys = [(b, k) for b in batch_sizes or self._batch_buckets for k in kv_lengths]
        if self.graph_step:  # greedy steps; every_bucket: sampled ones (filtered or not) too
            flags = [(False, False), (True, False), (True, True)] if every_bucket else [(False, False)]
            keys = [key + f for key in keys for f in flags]
        for key in keys:
            if key not in self._graphs:
                self._graphs[key] = self._capture(key)
        for key in self.prefill_buckets() if every_bucket else []:
            if key not in self._prefill_graphs:
                self._prefill_graphs[key] = self._capture_prefill(key)
