"""Token log-probabilities from a BLOOM model on any TP x PP layout: the primitive evaluation and the server share.

    scorer = Scorer.for_bloom_model(model, vocab_limit=tokenizer.vocab_size)        # PP 1, any TP
    scorer = Scorer.for_pipeline_module(engine.module, state, config, vocab_limit)  # training's DeepSpeed pipeline
    scorer = Scorer.for_stage(EvalStage(...), state, vocab_limit)                   # a stage built from a checkpoint
    out = scorer.score([[5, 9, 13, 2]], [(1, [13, 2])], top_n=2)
    out[0].logprobs, out[0].greedy, out[0].top_ids, out[0].top_logprobs            # per scored token
    scorer.score_continuations([(prefix, [answer_a, answer_b])])                    # a shared prefix runs once

score(): each row's inputs run through the model once (rows right-padded: attention is causal, so padding never
reaches a real position); (start, targets) scores the logits at positions start .. start + len(targets) - 1
(position p predicts token p + 1) against targets. The LM head runs only on those positions: the TP ranks' vocabulary
slices of its logits are gathered, the padding rows of the vocabulary (ids >= vocab_limit) set to -inf, then
log_softmax in fp32.

Pipeline parallelism: stage k receives the (B, S, H) hidden states from stage k - 1 and sends its own to k + 1; the
last stage scores and broadcasts the results over its pipeline group, so every rank returns the same values.
"""
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.core import tensor_parallel
from megatron.core.parallel_state import ParallelState
from megatron.model.attention import plan_free_attention

HEAD_CHUNK = 2048  # positions per LM-head pass: bounds the (N, V) fp32 logits alive at once
PREFIX_BUCKET = 16  # prefix widths are padded to a multiple of this: few distinct shapes, each warmed up once
SUFFIX_BUCKET = 4


def _bucket(n, size):
    return -(-n // size) * size


@dataclasses.dataclass
class Scored:
    """One row's scored tokens: log p(target), whether the target is the argmax, and the top-n alternatives."""
    logprobs: list
    greedy: list
    top_ids: list = None
    top_logprobs: list = None

    @property
    def total(self):
        return sum(self.logprobs)

    @property
    def is_greedy(self):
        return all(self.greedy)


class EvalStage(nn.Module):
    """The layers of one pipeline stage of a BloomModel, named as BloomModel names them (layers.N.* keep their
    global N), so a checkpoint's canonical tensors load straight in. The first stage embeds; the last applies the
    final LayerNorm and holds the tied word embeddings for the LM head."""

    def __init__(self, config, layer_ids, first, last, tp_group=None):
        super().__init__()
        from megatron.model.bloom import BloomBlock, BloomEmbedding, make_layernorm

        self.config, self.first, self.last = config, first, last
        self.embedding = BloomEmbedding(config, tp_group) if first or last else None
        self.layers = nn.ModuleDict({str(i): BloomBlock(config, i, tp_group) for i in layer_ids})
        self.final_layernorm = make_layernorm(config, config.hidden_size) if last else None

    def forward(self, x):
        """ids (B, S) on the first stage, hidden states (B, S, H) on the others -> (B, S, H)."""
        if self.first:
            x = self.embedding(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.final_layernorm(x) if self.last else x

    @property
    def head_weight(self):
        return self.embedding.word_embeddings.weight if self.last else None


class _SharedPrefixCache:
    """Layer caches over a prefix cache (InferenceCache of G prefixes): row r attends to the cached keys and values
    of prefix rows[r], then to its own new ones. The prefix is gathered per layer as the layer runs, so one layer's
    (R, nh/p, P, hd) copy is alive at a time, not every layer's."""

    class _Layer:
        def __init__(self, layer, rows):
            self.layer, self.rows = layer, rows

        def attend(self, q, k, v, core_attention, key_padding_mask=None):  # q, k, v: (R, nh/p, s_new, hd)
            keys = torch.cat([self.layer.k.index_select(0, self.rows), k], dim=2)  # (R, nh/p, P + s_new, hd)
            values = torch.cat([self.layer.v.index_select(0, self.rows), v], dim=2)
            return core_attention(q, keys, values, key_padding_mask)

    def __init__(self, cache, rows):
        self.layers = [self._Layer(layer, rows) for layer in cache.layers]


class Scorer:
    """Log-probabilities of target tokens (see the module docstring) on this rank's part of the model.

    forward_stage: ids or hidden (B, S, H) -> this stage's output hidden (B, S, H); head_weight: the (V/p, H)
    word embeddings on the last stage. state: the ParallelState (TP and PP groups and ranks)."""

    def __init__(self, forward_stage, head_weight, state=None, vocab_limit=None, hidden_size=None, dtype=None,
                 device=None, model=None):
        self.forward_stage, self.head_weight = forward_stage, head_weight
        self.model = model  # a BloomModel (PP 1): score_continuations shares each prefix through a KV cache
        self.state = state or ParallelState()
        self.vocab_limit = vocab_limit
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, torch.device(device or "cpu")
        pp, rank = self.state.pipeline_model_parallel_size, self.state.pp_rank
        self.first, self.last = rank == 0, rank == pp - 1
        self.prev_rank = self.state.pp_ranks[rank - 1] if pp > 1 and not self.first else None
        self.next_rank = self.state.pp_ranks[rank + 1] if pp > 1 and not self.last else None

    # ---- construction ------------------------------------------------------------------------------------------

    @classmethod
    def for_bloom_model(cls, model, vocab_limit=None, state=None):
        """A BloomModel (PP 1; TP over model.tp_group)."""
        param = next(model.parameters())
        state = state or ParallelState(tensor_model_parallel_size=model.tp_size, tp_group=model.tp_group)
        return cls(model.hidden_states, model.embedding.word_embeddings.weight, state, vocab_limit,
                   model.config.hidden_size, param.dtype, param.device, model=model)

    @classmethod
    def for_stage(cls, stage, state, vocab_limit=None):
        """An EvalStage of this rank (any TP x PP)."""
        param = next(stage.parameters())
        return cls(stage, stage.head_weight, state, vocab_limit, stage.config.hidden_size, param.dtype,
                   param.device)

    @classmethod
    def for_pipeline_module(cls, module, state, config, vocab_limit=None):
        """This rank's stage of training's DeepSpeed PipelineModule (megatron/model/pipeline.py): its layers run
        in order, except the LM head, which the scorer applies to the scored positions only."""
        funcs = list(module.forward_funcs)
        last = module._local_stop is None or module._local_stop >= len(module._layer_specs)
        if last:
            funcs = funcs[:-1]  # the tied LM head (TiedLayerSpec with forward_fn)

        def forward_stage(x):
            for func in funcs:
                x = func(x)
            return x

        head = module.tied_modules["embed"].word_embeddings.weight if last else None
        param = next(module.parameters())
        return cls(forward_stage, head, state, vocab_limit, config.hidden_size, param.dtype, param.device)

    # ---- scoring -----------------------------------------------------------------------------------------------

    def _hidden(self, ids):
        """(B, S) ids -> the last stage's (B, S, H) hidden states (None on the other stages)."""
        if self.first:
            x = self.forward_stage(ids)
        else:
            x = torch.empty(*ids.shape, self.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(x, src=self.prev_rank)
            x = self.forward_stage(x)
        if not self.last:
            dist.send(x.contiguous(), dst=self.next_rank)
            return None
        return x

    def _logprobs(self, hidden):
        """(N, H) -> (N, V) fp32 log-probabilities over the real vocabulary (padding rows at -inf)."""
        logits = F.linear(hidden, self.head_weight)
        if self.state.tensor_model_parallel_size > 1:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits, self.state.tp_group)
        logits = logits.float()
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
            logits[:, self.vocab_limit:] = float("-inf")
        return torch.log_softmax(logits, dim=-1)

    def _pack(self, sel, targets, top_n):
        """(N, H) hidden states of the scored positions and their N targets -> (N, 2 + 2 top_n) float64 rows:
        log p(target), target == argmax, top_n ids, top_n log-probs (the LM head in chunks of HEAD_CHUNK)."""
        packed = torch.empty(len(targets), 2 + 2 * top_n, dtype=torch.float64, device=self.device)
        tgt = torch.tensor(targets, device=self.device)
        for a in range(0, len(targets), HEAD_CHUNK):
            logp = self._logprobs(sel[a:a + HEAD_CHUNK])
            t = tgt[a:a + HEAD_CHUNK]
            packed[a:a + len(t), 0] = logp.gather(1, t[:, None])[:, 0].double()
            packed[a:a + len(t), 1] = (logp.argmax(-1) == t).double()
            if top_n:
                values, indices = logp.topk(top_n, dim=-1)
                packed[a:a + len(t), 2:2 + top_n] = indices.double()
                packed[a:a + len(t), 2 + top_n:] = values.double()
        return packed

    @staticmethod
    def _unpack(packed, lengths, top_n):
        values, out, k = packed.cpu().tolist(), [], 0
        for n in lengths:
            chunk = values[k:k + n]
            k += n
            scored = Scored([c[0] for c in chunk], [c[1] > 0.5 for c in chunk])
            if top_n:
                scored.top_ids = [[int(x) for x in c[2:2 + top_n]] for c in chunk]
                scored.top_logprobs = [c[2 + top_n:] for c in chunk]
            out.append(scored)
        return out

    @torch.no_grad()
    def score_continuations(self, groups, top_n=0):
        """groups: [(prefix ids, [continuation ids, ...]), ...] -> per group, a Scored per continuation: log p of
        each continuation token given the prefix and the continuation's earlier tokens.

        With a BloomModel (PP 1) each prefix runs once: the prefixes left-padded (ALiBi depends only on the
        distance, padded keys masked) into a KV cache, then every continuation's tokens but its last as one
        right-padded batch attending to its group's cached prefix; the prefix's last position predicts the first
        token. Multiple-choice requests (one context, several answers) so cost one context pass. Otherwise (PP >
        1) each continuation is scored in full by score()."""
        if self.model is None:
            rows = [list(p) + list(c)[:-1] for p, conts in groups for c in conts]
            spans = [(len(p) - 1, list(c)) for p, conts in groups for c in conts]
            flat = iter(self.score(rows, spans, top_n))
            return [[next(flat) for _ in conts] for _, conts in groups]
        with plan_free_attention(self.device):
            return self._score_shared(groups, top_n)

    def _score_shared(self, groups, top_n):
        from megatron.model.bloom import InferenceCache

        model, device = self.model, self.device
        width = _bucket(max(len(p) for p, _ in groups), PREFIX_BUCKET)
        ids = torch.zeros(len(groups), width, dtype=torch.long)
        mask = torch.zeros(len(groups), width, dtype=torch.bool)
        for g, (prefix, _) in enumerate(groups):
            ids[g, width - len(prefix):] = torch.tensor(prefix, dtype=torch.long)
            mask[g, width - len(prefix):] = True
        ids, mask = ids.to(device), mask.to(device)
        padded = not bool(mask.all())
        cache = InferenceCache(model.config.num_layers)
        last = model.hidden_states(ids, attention_mask=mask if padded else None, cache=cache)[:, -1]  # (G, H)
        conts = [(g, list(c)) for g, (_, cs) in enumerate(groups) for c in cs]
        suffix = max(len(c) for _, c in conts) - 1
        suffix = _bucket(suffix, SUFFIX_BUCKET) if suffix > 0 else 0
        parts = [last[torch.tensor([g for g, _ in conts], device=device)]]  # each row's first prediction
        if suffix > 0:  # only the continuations of two or more tokens have a suffix to run
            longer = [(g, c) for g, c in conts if len(c) > 1]
            rows = torch.tensor([g for g, _ in longer], device=device)
            sids = torch.zeros(len(longer), suffix, dtype=torch.long)
            for r, (_, c) in enumerate(longer):
                sids[r, :len(c) - 1] = torch.tensor(c[:-1], dtype=torch.long)
            expanded = _SharedPrefixCache(cache, rows)
            keys = torch.cat([mask.index_select(0, rows), torch.ones(len(longer), suffix, dtype=torch.bool,
                                                                     device=device)], dim=1)
            hidden = model.hidden_states(sids.to(device), attention_mask=keys if padded else None, cache=expanded)
            row_index = [r for r, (_, c) in enumerate(longer) for _ in range(len(c) - 1)]
            col_index = [i for _, c in longer for i in range(len(c) - 1)]
            parts.append(hidden[torch.tensor(row_index, device=device), torch.tensor(col_index, device=device)])
        # order the scored positions row by row: first prediction, then the suffix's
        order, k_first, k_rest = [], 0, len(conts)
        for _, c in conts:
            order.append(k_first)
            order += range(k_rest, k_rest + len(c) - 1)
            k_first, k_rest = k_first + 1, k_rest + len(c) - 1
        sel = torch.cat(parts)[torch.tensor(order, device=device)]
        targets = [t for _, c in conts for t in c]
        flat = iter(self._unpack(self._pack(sel, targets, top_n), [len(c) for _, c in conts], top_n))
        return [[next(flat) for _ in cs] for _, cs in groups]

    @torch.no_grad()
    def score(self, rows, spans, top_n=0):
        """rows: token lists (the inputs); spans: per row (start, targets): the logits at positions start,
        start + 1, ... are scored against targets. Returns a Scored per row, the same on every rank."""
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        row_index, positions, targets = [], [], []
        for i, (start, tgt) in enumerate(spans):
            if start < 0 or start + len(tgt) > len(rows[i]):
                raise ValueError(f"row {i}: positions {start}..{start + len(tgt) - 1} lie outside its "
                                 f"{len(rows[i])} tokens")
            row_index += [i] * len(tgt)
            positions += range(start, start + len(tgt))
            targets += list(tgt)
        with plan_free_attention(self.device):
            hidden = self._hidden(ids.to(self.device))
        if self.last and targets:
            sel = hidden[torch.tensor(row_index, device=self.device), torch.tensor(positions, device=self.device)]
            packed = self._pack(sel, targets, top_n)
        else:
            packed = torch.empty(len(targets), 2 + 2 * top_n, dtype=torch.float64, device=self.device)
        if self.state.pipeline_model_parallel_size > 1 and targets:
            dist.broadcast(packed, src=self.state.pp_ranks[-1], group=self.state.pp_group)
        return self._unpack(packed, [len(t) for _, t in spans], top_n)

    @torch.no_grad()
    def next_token_logprobs(self, rows):
        """(B, V) fp32 log-probabilities of the token after each row's last one (padding rows at -inf), on every
        rank: the no-cache decoding step of pipeline-parallel generation."""
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        with plan_free_attention(self.device):
            hidden = self._hidden(ids.to(self.device))
        vocab = self.vocab_limit
        out = None
        if self.last:
            last = hidden[torch.arange(len(rows), device=self.device),
                          torch.tensor([len(r) - 1 for r in rows], device=self.device)]
            out = self._logprobs(last)
            vocab = out.shape[1]
        if self.state.pipeline_model_parallel_size > 1:
            size = torch.tensor([vocab or 0], dtype=torch.long, device=self.device)
            dist.broadcast(size, src=self.state.pp_ranks[-1], group=self.state.pp_group)
            if out is None:
                out = torch.empty(len(rows), int(size), dtype=torch.float32, device=self.device)
            dist.broadcast(out, src=self.state.pp_ranks[-1], group=self.state.pp_group)
        return out
