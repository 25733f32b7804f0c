"""The lm-evaluation-harness backend ("megatron"): lm-eval's LM API over our model, on any TP x PP layout.

    lm = MegatronLM(scorer, tokenizer, max_length=2048, batch_size=32, model=bloom_model)  # model: PP 1 only
    results = run_tasks(lm, ["lambada_openai", "hellaswag"], include_path="examples/eval", limit=100)

- loglikelihood: lm-eval's TemplateLM tokenizes (context, continuation) pairs, each truncated on the left to
  max_length + 1 tokens as lm-eval's hf backend does; requests sharing a context (a multiple-choice question's
  answers) run its tokens once and their continuations against its KV cache, longest first, up to batch_size
  contexts and max_batch_tokens padded positions per batch; the LM head runs only on the continuation's positions
  (scoring.Scorer).
- loglikelihood_rolling: the text in disjoint windows of max_length tokens (lm-eval's get_rolling_token_windows,
  the first window after the prefix token), each window's tokens scored, summed per text.
- generate_until: InferenceEngine (KV cache, continuous batching; greedy or sampled, seeded per request) when the
  model runs on one pipeline stage; with PP > 1 a cache-free loop through the pipeline. A row stops at eod, after
  max_gen_toks, or as soon as its text holds one of the `until` strings; the text is cut before the first one.
- Every rank runs the same lm-eval requests: tensor- and pipeline-parallel ranks compute them together; with data
  parallelism (training) each DP replica takes every dp-th batch and the results are all-gathered.
Padding rows of the vocabulary (ids >= the tokenizer's size) never enter a softmax (scoring.Scorer).
"""
import logging
import os

import lm_eval.models  # noqa: F401  lm-eval's own backends first: its registry imports them only while empty
import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval import utils as lm_utils

from megatron.inference.sampling import SamplingParams, sample_next_token

logger = logging.getLogger(__name__)


def _stop_strings(until, eos_text):
    if until is None:
        until = []
    elif isinstance(until, str):
        until = [until]
    elif not isinstance(until, (list, tuple)) or not all(isinstance(s, str) for s in until):
        raise ValueError(f"generate_until: `until` must be a string or a list of strings (got {until!r})")
    until = [s for s in until if s]
    if eos_text and eos_text not in until:
        until.append(eos_text)
    return until


def _round_up(n, multiple):
    return -(-n // multiple) * multiple


def cut_at_stops(text, stops):
    """text up to the first occurrence of any stop string (lm-eval's convention)."""
    for stop in stops:
        text = text.split(stop)[0]
    return text


@register_model("megatron")
class MegatronLM(TemplateLM):
    """lm-eval's LM over a scoring.Scorer (any layout) and, for generation at PP 1, the BloomModel it wraps.

    tokenizer: the project's tokenizer (megatron.tokenizer); max_length: the longest input (the model's
    context); batch_size: contexts per forward (each with its continuations; generation: cache slots);
    max_batch_tokens: padded positions per forward (a single longer request still runs alone); state: the
    ParallelState (data parallelism, TP token broadcast); seed: sampled generations use seed + request index."""

    def __init__(self, scorer, tokenizer, max_length, batch_size=16, model=None, state=None, seed=1234,
                 steps_per_sync=8, max_batch_tokens=8192):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"--batch-size {batch_size} must be at least 1")
        self.scorer, self.tokenizer, self.model = scorer, tokenizer, model
        self.max_length, self.batch_size, self.seed = int(max_length), int(batch_size), seed
        self.state = state or scorer.state
        self.steps_per_sync = steps_per_sync
        self.max_batch_tokens = max_batch_tokens
        self._engine = None
        bos = tokenizer.special_tokens.get("bos_token")
        self._prefix = tokenizer.vocab.get(bos, tokenizer.eod) if bos else tokenizer.eod

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        """lm-eval's `--model megatron --model_args load=CKPT[,max_length=N,dtype=bf16,tokenizer=DIR]` (with this
        module imported): the model of --load on this process (megatron.evaluation.loading.build_lm)."""
        from lm_eval import utils

        return cls.create_from_arg_obj(utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        from megatron.evaluation.loading import build_lm

        args = dict(arg_dict)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if "load" not in args:
            raise ValueError("--model megatron needs --model_args load=CHECKPOINT_OR_HF_FOLDER")
        batch_size = extra.get("batch_size", args.pop("batch_size", 16))
        lm, _ = build_lm(args.pop("load"), int(os.environ.get("WORLD_SIZE", "1")),
                         int(batch_size) if str(batch_size).isdigit() else 16, args.pop("tokenizer", None),
                         args.pop("dtype", "auto"), args.pop("max_length", None), seed=int(args.pop("seed", 1234)))
        if args:
            raise ValueError(f"--model_args: unknown keys {sorted(args)} for the megatron model (known: load, "
                             "tokenizer, dtype, max_length, batch_size, seed)")
        return lm

    # ---- what TemplateLM needs ---------------------------------------------------------------------------------

    @property
    def eot_token_id(self):
        return self.tokenizer.eod

    @property
    def prefix_token_id(self):
        return self._prefix

    @property
    def tokenizer_name(self):
        return "megatron"

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        return self.tokenizer.tokenize(string)

    def tok_decode(self, tokens):
        return self.tokenizer.detokenize(tokens)

    def loglikelihood(self, requests, disable_tqdm=False):
        """TemplateLM.loglikelihood's tokenization (an empty context becomes the prefix token; a context's trailing
        spaces move to the continuation; the continuation is what encoding context + continuation adds to the
        context's ids), done in two batched tokenizer calls with each distinct context encoded once."""
        pairs = [req.args for req in requests]
        empty = [i for i, (context, _) in enumerate(pairs) if context == ""]
        split = {}
        for i, (context, continuation) in enumerate(pairs):
            if context:
                n_spaces = len(context) - len(context.rstrip())
                if n_spaces:
                    context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
                split[i] = (context, context + continuation)
        contexts = sorted({c for c, _ in split.values()})
        context_ids = dict(zip(contexts, self.tokenizer.tokenize_batch(contexts)))
        wholes = self.tokenizer.tokenize_batch([w for _, w in split.values()]) if split else []
        encoded = [None] * len(pairs)
        for (i, (context, _)), whole in zip(split.items(), wholes):
            ctx = context_ids[context]
            encoded[i] = (pairs[i], ctx, whole[len(ctx):])
        for i, cont in zip(empty, self.tokenizer.tokenize_batch([pairs[i][1] for i in empty]) if empty else []):
            ctx, cont = ([self.prefix_token_id], cont) if self.prefix_token_id != cont[0] else (cont[:1], cont[1:])
            encoded[i] = (pairs[i], ctx, cont)
        return self._loglikelihood_tokens(encoded, disable_tqdm=disable_tqdm)

    # ---- data parallelism --------------------------------------------------------------------------------------

    def _dp_map(self, batches, fn):
        """[fn(batch) for batch in batches], each DP replica computing every dp-th batch, gathered on all ranks."""
        dp = self.state.data_parallel_size
        if dp == 1:
            return [fn(b) for b in batches]
        mine = {i: fn(b) for i, b in enumerate(batches) if i % dp == self.state.dp_rank}
        gathered = [None] * dp
        dist.all_gather_object(gathered, mine, group=self.state.dp_group)
        merged = {}
        for part in gathered:
            merged.update(part)
        return [merged[i] for i in range(len(batches))]

    # ---- log-likelihoods ---------------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """requests: ((context, continuation) or None, context ids, continuation ids) -> (log p, is greedy).

        Each (context, continuation) is truncated on the left to max_length + 1 tokens (the hf backend's rule);
        requests with the same (truncated) context form a group whose context runs once
        (Scorer.score_continuations); groups run longest first, batch_size groups per batch."""
        groups = {}  # truncated context -> [request index, ...]
        conts = []
        for index, (key, context, continuation) in enumerate(requests):
            if not continuation:
                raise ValueError(f"a loglikelihood request has an empty continuation (context {key!r})")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens exceeds the model's context of "
                                 f"{self.max_length} tokens")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            prefix = tuple(whole[:len(whole) - len(continuation)])
            groups.setdefault(prefix, []).append(index)
            conts.append(list(continuation))
        ordered = sorted(groups.items(), key=lambda item: (-(len(item[0]) + max(len(conts[i]) for i in item[1])),
                                                           item[1][0]))
        batches = self._batches(ordered, conts)

        def run(batch):
            scored = self.scorer.score_continuations([(list(p), [conts[i] for i in m]) for p, m in batch])
            return [(s.total, s.is_greedy) for group in scored for s in group]

        results = [None] * len(requests)
        for batch, answers in zip(batches, self._dp_map(batches, run)):
            for i, answer in zip((i for _, members in batch for i in members), answers):
                results[i] = answer
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def _batches(self, ordered, conts):
        """Consecutive groups, longest first: at most batch_size contexts per forward (as lm-eval's hf backend
        batches its context groups) and at most max_batch_tokens padded positions (the contexts padded to the
        longest, plus every continuation padded to the longest), so short requests share large batches and long
        ones do not pad many short ones."""
        batches, current, width, suffix, rows = [], [], 0, 0, 0
        for prefix, members in ordered:
            w = max(width, _round_up(len(prefix), 16))
            s = max([suffix] + [len(conts[i]) - 1 for i in members])
            cost = (len(current) + 1) * w + (rows + len(members)) * s
            if current and (len(current) == self.batch_size or cost > self.max_batch_tokens):
                batches.append(current)
                current, w, rows = [], _round_up(len(prefix), 16), 0
                s = max(len(conts[i]) - 1 for i in members)
            current.append((prefix, members))
            width, suffix, rows = w, s, rows + len(members)
        if current:
            batches.append(current)
        return batches

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        windows, owner = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation --------------------------------------------------------------------------------------------

    def _request_params(self, gen_kwargs):
        kwargs = dict(gen_kwargs or {})
        until = _stop_strings(kwargs.pop("until", None), self.tok_decode([self.eot_token_id]))
        max_new = int(kwargs.pop("max_gen_toks", 256))
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
        greedy = not do_sample or temperature <= 0.0
        params = SamplingParams(greedy=greedy, temperature=temperature if not greedy else 1.0,
                                top_k=int(kwargs.pop("top_k", 0) or 0), top_p=float(kwargs.pop("top_p", 1.0) or 1.0),
                                max_new_tokens=max_new)
        if max_new >= self.max_length:
            raise ValueError(f"generate_until: max_gen_toks {max_new} leaves no room for a context in the model's "
                             f"{self.max_length} tokens")
        return params, until

    def generate_until(self, requests, disable_tqdm=False):
        jobs = []
        for index, (context, gen_kwargs) in enumerate(req.args for req in requests):
            params, until = self._request_params(gen_kwargs)
            ids = self.tok_encode(context)[-(self.max_length - params.max_new_tokens):] or [self.prefix_token_id]
            jobs.append((ids, params, until, self.seed + index))
        if self.model is not None:
            outputs = self._generate_with_engine(jobs)
        else:
            outputs = [self._generate_pipelined(job) for job in jobs]
        texts = []
        for req, (_, _, until, _), out in zip(requests, jobs, outputs):
            text = cut_at_stops(self.tok_decode([t for t in out if t != self.eot_token_id]), until)
            self.cache_hook.add_partial("generate_until", req.args, text)
            texts.append(text)
        return texts

    def engine(self):
        """The InferenceEngine over the model (built at first use: batch_size slots of max_length tokens)."""
        if self._engine is None:
            from megatron.inference import InferenceEngine
            sync = None
            if self.state.tensor_model_parallel_size > 1:
                src, group = self.state.tp_ranks[0], self.state.tp_group

                def sync(tokens):
                    dist.broadcast(tokens, src=src, group=group)
                    return tokens
            self._engine = InferenceEngine(self.model, max_batch_size=self.batch_size, max_seq_len=self.max_length,
                                           eod_id=self.eot_token_id, vocab_limit=self.tokenizer.vocab_size,
                                           cuda_graphs=False, sync_tokens=sync)
        return self._engine

    def _generate_with_engine(self, jobs):
        """Continuous batching over all jobs; a row whose text holds a stop string is cancelled at the next sync
        (every TP rank sees the same tokens, so all cancel together)."""
        engine = self.engine()
        requests = [engine.add_request(ids, params, seed) for ids, params, _, seed in jobs]
        stops = {id(r): until for r, (_, _, until, _) in zip(requests, jobs)}
        while engine.has_work():
            engine.step(self.steps_per_sync)
            for request in list(engine.running.values()):
                text = self.tok_decode(request.output)
                if any(s in text for s in stops[id(request)]):
                    engine.cancel(request)
        return [r.output for r in requests]

    def _generate_pipelined(self, job):
        """One request through a pipeline-parallel model without a KV cache (every step re-runs the sequence)."""
        ids, params, until, seed = job
        generator = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(params.max_new_tokens):
            logprobs = self.scorer.next_token_logprobs([ids + out]).cpu()
            token = int(sample_next_token(logprobs, params, generator)[0])
            out.append(token)
            if token == self.eot_token_id or any(s in self.tok_decode(out) for s in until):
                break
        return out


# ---- running tasks -------------------------------------------------------------------------------------------------

def task_manager(tasks, include_path=None):
    """lm-eval's TaskManager: only include_path's tasks when it holds every requested one (indexing lm-eval's
    thousands of built-in task files takes seconds), else the built-in tasks too. ValueError names an unknown
    task and the flags that add tasks."""
    from lm_eval.tasks import TaskManager

    manager = None
    if include_path:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if not all(t in manager.all_tasks for t in tasks):
            manager = None
    if manager is None:
        manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" nor in --include-path {include_path}" if include_path else ""
        raise ValueError(f"--tasks: {unknown[0]} is not one of lm-eval's tasks{where}; list them with "
                         "`lm_eval ls tasks`, or add a task YAML folder with --include-path DIR")
    return manager


def run_tasks(lm, tasks, include_path=None, num_fewshot=None, limit=None, bootstrap_iters=100000,
              log_samples=False, evaluation_tracker=None, gen_kwargs=None, seed=1234):
    """lm-eval's simple_evaluate of tasks (names) on lm; returns its results dict on the processes of local rank 0
    (lm-eval's rule), None on the others, which compute the same requests with them."""
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=list(tasks), task_manager=task_manager(tasks, include_path),
                           num_fewshot=num_fewshot, limit=limit, bootstrap_iters=bootstrap_iters,
                           log_samples=log_samples, evaluation_tracker=evaluation_tracker, gen_kwargs=gen_kwargs,
                           random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                           fewshot_random_seed=seed)


def flat_metrics(results):
    """{"task/metric": value} of a results dict's numeric metrics (stderr left out), e.g. {"lambada/acc": 0.4}."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if key in ("alias", "sample_len") or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            out[f"{task}/{key.split(',')[0]}"] = float(value)
    return out
