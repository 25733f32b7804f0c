"""The server's wire formats: OpenAI completions and Megatron's PUT /api, validated; streamed text deltas.

Everything here is pure (no HTTP, no engine) so each rule is unit-tested on its own:

    parse_completion_request(body, limits)  a JSON object -> CompletionRequest, or APIError(400, field named)
    parse_megatron_request(body, limits)    Megatron's {"prompts": [...], "tokens_to_generate": ...}
    tokenize_prompts(...)                   text or token-id prompts -> ids, checked against the context
    IncrementalText                         a row's growing ids -> text deltas that concatenate to the final text,
                                            cut at the first stop string
    completion_body / chunk_body / ...      the response objects
    logprobs_body                           OpenAI's legacy logprobs (tokens, token_logprobs, top_logprobs,
                                            text_offset) from a scoring.Scored

Errors use OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""
import math
from dataclasses import dataclass

from megatron.inference.checks import PromptLengthError, check_prompt_length
from megatron.inference.sampling import SamplingParams

GREEDY_TEMPERATURE = 1e-5  # temperatures below this decode greedily (0 is the documented way)
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # the most alternatives top_logprobs lists per token (OpenAI allows 5)
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character

COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream",
                     "stream_options", "n", "echo", "user", "logprobs", "presence_penalty", "frequency_penalty",
                     "best_of", "logit_bias", "suffix")


class APIError(Exception):
    """An HTTP error with OpenAI's error object; param names the offending request field (or None)."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error", 500: "server_error"}

    def __init__(self, status, message, param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self):
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(param, message):
    return APIError(400, message, param)


@dataclass(frozen=True)
class Limits:
    """What the server allows: max_tokens up to max_new_tokens, prompt + max_tokens up to context."""
    max_new_tokens: int
    context: int
    vocab_size: int
    max_choices: int = 128  # prompts x n in one request


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list  # each a str or a list of token ids
    max_tokens: int
    params: SamplingParams
    seed: object  # int, or None: a random one per request
    stop: tuple = ()
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    model: str = None
    logprobs: int = None  # None: no log-probabilities; k: each token's and its top k alternatives'


# ---- field checks ------------------------------------------------------------------------------------------------

def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _show(value, limit=40):
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _int(body, name, default, low=None, high=None, high_hint=""):
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise bad(name, f"{name} must be an integer (got {_show(value)})")
    if low is not None and value < low:
        raise bad(name, f"{name} must be at least {low} (got {value})")
    if high is not None and value > high:
        raise bad(name, f"{name} {value} exceeds {high_hint or f'the maximum {high}'}")
    return value


def _number(body, name, default, check, expected):
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not check(value):
        raise bad(name, f"{name} must be {expected} (got {_show(value)})")
    return float(value)


def _bool(body, name, default=False):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be true or false (got {_show(value)})")
    return value


def _token_list(value):
    return isinstance(value, list) and len(value) > 0 and all(_is_int(t) for t in value)


def _prompts(body, field="prompt"):
    """A completion's prompt: a string, a list of strings, a list of token ids, or a list of such lists."""
    if field not in body or body[field] is None:
        raise bad(field, f"{field} is required: a string, a list of strings, a list of token ids or a list of "
                         "lists of token ids")
    value = body[field]
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise bad(field, f"{field} must be a string, a list of strings, a list of token ids or a list of lists of "
                         f"token ids (got {type(value).__name__})")
    if not value:
        raise bad(field, f"{field} is an empty list: give at least one prompt")
    if all(isinstance(p, str) for p in value):
        return list(value)
    if _token_list(value):
        return [list(value)]
    if all(_token_list(p) for p in value):
        return [list(p) for p in value]
    raise bad(field, f"{field} must be a string, a list of strings, a list of token ids or a list of lists of "
                     "token ids (a list mixes types or holds an empty list)")


def _stop(body):
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"stop must be a string or a list of strings (got {_show(value)})")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if any(s == "" for s in stops):
        raise bad("stop", "stop strings must not be empty")
    return tuple(dict.fromkeys(stops))


def _unsupported(body, name, allowed, what):
    """Fields of OpenAI's schema this server does not implement: accepted only at their no-op values."""
    value = body.get(name)
    if value is not None and value not in allowed:
        raise bad(name, f"{name} is not supported by this server ({what}); leave it out")


def sampling_params(temperature, top_p, top_k, max_tokens):
    """SamplingParams from API values: temperature 0 (below 1e-5) is greedy; top_k -1 or 0 disables top-k."""
    max_tokens = max(max_tokens, 1)  # max_tokens 0 (echo scoring) generates nothing; the params are unused
    if temperature < GREEDY_TEMPERATURE:
        return SamplingParams(greedy=True, max_new_tokens=max_tokens)
    return SamplingParams(greedy=False, temperature=temperature, top_k=max(top_k, 0), top_p=top_p,
                          max_new_tokens=max_tokens)


def parse_completion_request(body, limits):
    """A CompletionRequest from the JSON body of POST /v1/completions; APIError(400) names the first bad field."""
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object (got a JSON {type(body).__name__})")
    unknown = [k for k in body if k not in COMPLETION_FIELDS]
    if unknown:
        raise bad(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"model must be a string (got {_show(model)})")
    prompts = _prompts(body)
    default_tokens = min(DEFAULT_MAX_TOKENS, limits.max_new_tokens)
    echo = _bool(body, "echo")
    # with echo, max_tokens 0 scores the prompt only (OpenAI's legacy completions allow it)
    max_tokens = _int(body, "max_tokens", default_tokens, low=0 if echo else 1, high=limits.max_new_tokens,
                      high_hint=f"this server's limit of {limits.max_new_tokens} tokens (--max-new-tokens-limit)")
    temperature = _number(body, "temperature", 1.0, lambda v: v >= 0, "a number >= 0 (0 decodes greedily)")
    top_p = _number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1] (1 disables it)")
    top_k = _int(body, "top_k", 0, low=-1)
    seed = _int(body, "seed", None, low=INT64_MIN, high=INT64_MAX)
    stop = _stop(body)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options", "stream_options is only allowed with stream: true")
        if not isinstance(options, dict) or any(k != "include_usage" for k in options):
            raise bad("stream_options", f"stream_options must be an object with include_usage only "
                                        f"(got {_show(options)})")
        include_usage = _bool(options, "include_usage")
    n = _int(body, "n", 1, low=1, high=limits.max_choices)
    if len(prompts) * n > limits.max_choices:
        raise bad("n" if n > 1 else "prompt", f"the request asks for {len(prompts) * n} completions (prompts x n); "
                                               f"this server allows at most {limits.max_choices} per request")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad("best_of", f"best_of must equal n ({n}) on this server: it does not rank samples (got "
                             f"{_show(best_of)})")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"user must be a string (got {_show(user)})")
    logprobs = _int(body, "logprobs", None, low=0, high=MAX_LOGPROBS,
                    high_hint=f"this server's limit of {MAX_LOGPROBS} alternatives per token")
    if logprobs is not None and stream:
        raise bad("logprobs", "logprobs is not supported with stream: true on this server; ask without streaming")
    if max_tokens == 0 and (logprobs is None or stream):
        raise bad("max_tokens", "max_tokens 0 (scoring the prompt only) needs echo: true and logprobs, without "
                                "stream")
    _unsupported(body, "presence_penalty", (0,), "only 0")
    _unsupported(body, "frequency_penalty", (0,), "only 0")
    _unsupported(body, "logit_bias", ({},), "only an empty object")
    _unsupported(body, "suffix", ("",), "no insertion")
    return CompletionRequest(prompts=prompts, max_tokens=max_tokens,
                             params=sampling_params(temperature, top_p, top_k, max_tokens), seed=seed, stop=stop,
                             n=n, stream=stream, include_usage=include_usage, echo=echo, model=model,
                             logprobs=logprobs)


# ---- Megatron's PUT /api -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MegatronRequest:
    prompts: list
    tokens_to_generate: int
    params: SamplingParams
    seed: object
    add_bos: bool = False
    stop: tuple = ()  # stop_on_eol / stop_on_double_eol: kept in the text, as Megatron does
    stop_ids: tuple = ()  # stop_token: generation ends after it, its text kept (Megatron's termination id)


def parse_megatron_request(body, limits):
    """Megatron-LM's text generation request (tools/text_generation_cli.py sends prompts and tokens_to_generate).

    Sampling follows Megatron: temperature in (0, 100], top_k 0..1000 (1 is greedy), top_p in [0, 1] (0 disables),
    not both top_k and top_p; random_seed >= 0. Beam search, logprobs and the other Megatron extras are refused.
    """
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object (got a JSON {type(body).__name__})")
    if "prompts" not in body:
        for old in ("max_len", "sentences"):
            if old in body:
                new = "tokens_to_generate" if old == "max_len" else "prompts"
                raise bad(old, f"{old} is no longer used; replace it with {new}")
        raise bad("prompts", "prompts argument required: a list of strings")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise bad("prompts", "prompts is not a list of strings")
    if not prompts:
        raise bad("prompts", "prompts is empty")
    if len(prompts) > limits.max_choices:
        raise bad("prompts", f"Maximum number of prompts is {limits.max_choices}")
    logprobs = _bool(body, "logprobs")
    if logprobs:
        raise bad("logprobs", "logprobs is not supported by this server; leave it out or set it to false")
    tokens = body.get("tokens_to_generate", min(64, limits.max_new_tokens))  # Megatron's default, capped
    if not _is_int(tokens) or tokens < 1:
        raise bad("tokens_to_generate", f"tokens_to_generate must be an integer greater than 0 (got {_show(tokens)})")
    if tokens > limits.max_new_tokens:
        raise bad("tokens_to_generate", f"tokens_to_generate {tokens} exceeds this server's limit of "
                                        f"{limits.max_new_tokens} tokens (--max-new-tokens-limit)")
    temperature = _number(body, "temperature", 1.0, lambda v: 0 < v <= 100,
                          "a positive number less than or equal to 100.0")
    top_k = _int(body, "top_k", 0, low=0, high=1000)
    top_p = _number(body, "top_p", 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1] (0 disables it)")
    if top_k > 0 and top_p > 0:
        raise bad("top_p", "cannot set both top-k and top-p samplings.")
    for name in ("top_p_decay", "top_p_bound"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad(name, f"{name} is not supported by this server; leave it out")
    if body.get("beam_width") is not None:
        raise bad("beam_width", "beam search is not supported by this server; leave beam_width out")
    if _bool(body, "prevent_newline_after_colon"):
        raise bad("prevent_newline_after_colon", "prevent_newline_after_colon is not supported by this server")
    add_bos = _bool(body, "add_BOS")
    if any(p == "" for p in prompts) and not add_bos:
        raise bad("prompts", "Empty prompts require add_BOS=true")
    seed = _int(body, "random_seed", None, low=0, high=INT64_MAX)
    stop = (("\n",) if _bool(body, "stop_on_eol") else ()) + (("\n\n",) if _bool(body, "stop_on_double_eol") else ())
    _bool(body, "no_log")
    stop_token = body.get("stop_token")
    if stop_token is not None and not (_is_int(stop_token) and 0 <= stop_token < limits.vocab_size):
        raise bad("stop_token", f"stop_token must be a token id in [0, {limits.vocab_size}) (got {_show(stop_token)})")
    greedy = top_k == 1
    params = SamplingParams(greedy=greedy, temperature=temperature, top_k=0 if greedy else top_k,
                            top_p=top_p if top_p > 0 else 1.0, max_new_tokens=tokens)
    return MegatronRequest(prompts=prompts, tokens_to_generate=tokens, params=params, seed=seed, add_bos=add_bos,
                           stop=stop, stop_ids=() if stop_token is None else (stop_token,))


# ---- prompts -----------------------------------------------------------------------------------------------------

def tokenize_prompts(prompts, tokenizer, limits, max_tokens, field="prompt", tokens_field="max_tokens",
                     prefix_ids=()):
    """Token ids of each prompt (text tokenized, ids checked), each fitting the context with max_tokens more."""
    out = []
    for i, prompt in enumerate(prompts):
        where = field if len(prompts) == 1 else f"{field} {i}"
        ids = list(prefix_ids) + (tokenizer.tokenize(prompt) if isinstance(prompt, str) else list(prompt))
        if not ids:
            raise bad(field, f"{where} is empty (it tokenizes to no tokens); give some text")
        bad_ids = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad_ids:
            raise bad(field, f"{where} holds token id {bad_ids[0]}, outside the vocabulary [0, {limits.vocab_size})")
        try:
            check_prompt_length(len(ids), max_tokens, limits.context, where, tokens_field, field)
        except PromptLengthError as err:
            raise bad(err.field, str(err)) from None
        out.append(ids)
    return out


_GOLDEN, _MASK = 0x9E3779B97F4A7C15, (1 << 64) - 1


def _mix64(x):
    """splitmix64's finaliser: a bijection of 64-bit values."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def row_seed(seed, index):
    """The engine's int64 seed of choice `index` of a request seeded with `seed` (choices count prompts x n).

    Choice 0 samples with the request's seed itself (a request with n 1 equals tools/generate_text.py --seed);
    choice k > 0 with a hash of (seed, k). Choices of one request never share a seed (the hash is a bijection of
    mix(seed) + k), and choice k of seed s collides with choice j of another seed only by a 64-bit coincidence,
    where seed + k, the old rule, made choice 1 of seed 5 the same sample as choice 0 of seed 6.
    """
    if index == 0:
        return seed
    value = _mix64((_mix64(seed & _MASK) + index * _GOLDEN) & _MASK)
    return value - (1 << 64) if value >= 1 << 63 else value


# ---- streamed text -----------------------------------------------------------------------------------------------

class IncrementalText:
    """The text of a row's generated ids, handed out as deltas while it grows, at a cost per id that does not grow
    with the row's length.

    update(new_ids, final) gets the ids generated since the last call and returns the new text: only the part that
    later ids cannot change (no trailing U+FFFD of an unfinished UTF-8 character, nor a tail that could begin a stop
    string), so the deltas concatenate exactly to `text` once final. The new ids are decoded in a short window
    (vLLM's prefix/read offsets): decode(ids[prefix:]) minus decode(ids[prefix:read]) is their new text once it no
    longer ends in U+FFFD, and the offsets then move on; both offsets sit on character boundaries, so the pieces
    join to decode(all ids). Without stop strings that is one window per update (two detokenize calls per engine
    sync, whatever the ids per sync: this runs on the event loop); with stop strings, one window per id, so that a
    stop string is cut at the id that completes it. Stop strings are searched in the new text plus the last
    (longest stop - 1) characters.

    `tokens` counts the ids generated (an eod included). When a stop string appears the text is cut before it (or
    after it with include_stop), `stopped` is set and `tokens` counts the ids up to the one that completed it.
    An id in stop_ids (Megatron's stop_token) ends the text after its own text, counted. `decoded` counts the ids
    handed to detokenize (the host work, tested to be constant per id).
    """

    def __init__(self, detokenize, eod_id=None, stop=(), include_stop=False, stop_ids=()):
        self.detokenize, self.eod_id = detokenize, eod_id
        self.stop, self.include_stop = tuple(stop), include_stop
        self.stop_ids = frozenset(stop_ids)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # characters a stop string reaches back
        self.text = None  # the final text
        self.stopped = False
        self.tokens = 0
        self.decoded = 0
        self._ids = []  # generated ids with text (no eod)
        self._prefix = self._read = 0  # window offsets into _ids
        self._prefix_text = ""  # decode(_ids[_prefix:_read])
        self._pieces = []  # the text, piece by piece
        self._length = 0
        self._tail = ""  # the text's last `hold` characters
        self._pending = ""  # text not handed out yet
        self._emitted = 0  # characters handed out

    def _decode(self, ids):
        self.decoded += len(ids)
        return self.detokenize(ids)

    def _next_piece(self, flush):
        """The text _ids[_read:] adds, or "" while it ends in an unfinished character (flush: take it anyway)."""
        window = self._decode(self._ids[self._prefix:])
        if len(window) <= len(self._prefix_text) or (window.endswith(REPLACEMENT) and not flush):
            return ""
        piece = window[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return piece

    def _find_stop(self, text):
        """(start, end) of the earliest stop string in text, or None."""
        best = None
        for s in self.stop:
            at = text.find(s)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, at + len(s))
        return best

    def _append(self, piece):
        """Adds a piece of text; True when it completes a stop string (the text is then cut and final)."""
        found = None
        if self.stop:
            region = self._tail + piece  # a stop string found here ends inside piece (the tail held none)
            found = self._find_stop(region)
            start = self._length - len(self._tail)
            self._tail = region[-self.hold:] if self.hold else ""
        self._pieces.append(piece)
        self._length += len(piece)
        self._pending += piece
        if found is None:
            return False
        self.stopped = True
        self._finish(start + (found[1] if self.include_stop else found[0]))
        return True

    def _finish(self, cut=None):
        """The final text (cut: its length); what was held back and survives the cut is handed out next."""
        text = "".join(self._pieces)
        self.text = text if cut is None else text[:cut]
        self._pending = self.text[self._emitted:]  # the handed-out text never reaches into a stop string

    def update(self, new_ids, final=False):
        if self.text is not None:
            return ""
        each = bool(self.stop)  # a stop string is cut at the id that completes it: decode id by id
        for token in new_ids:
            self.tokens += 1
            if self.eod_id is not None and token == self.eod_id:
                final = True  # the row's last id; its text is not part of the completion
                break
            self._ids.append(token)
            stop_id = token in self.stop_ids
            if each or stop_id:
                piece = self._next_piece(flush=stop_id)
                if piece and self._append(piece):
                    return self._hand_out()
            if stop_id:
                self.stopped = final = True
                break
        if (final or not each) and self._read < len(self._ids):  # the update's ids in one window
            piece = self._next_piece(flush=final)
            if piece and self._append(piece):
                return self._hand_out()
        if final:
            self._finish()
        return self._hand_out()

    def _hand_out(self):
        if self.text is not None:
            delta = self._pending
        else:
            held = self._stop_prefix(self._tail) if self.stop else 0
            delta = self._pending[:len(self._pending) - min(held, len(self._pending))]
        self._pending = self._pending[len(delta):]
        self._emitted += len(delta)
        return delta

    def _stop_prefix(self, text):
        """The length of the longest tail of text that is a proper prefix of a stop string."""
        for length in range(min(len(text), self.hold), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self.stop):
                return length
        return 0


# ---- responses ---------------------------------------------------------------------------------------------------

def choice_body(index, text, finish_reason, logprobs=None):
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}


def logprobs_body(ids, scored, detokenize, first_offset=0, echo=True):
    """OpenAI's legacy completion logprobs for token ids: tokens (each id's text), token_logprobs, top_logprobs
    ({token text: log-prob}, the best first) and text_offset (where each token's text starts in prompt + text).

    ids: the prompt followed by the completion; scored: a scoring.Scored of ids[1:] (the first token has nothing to
    predict it: with echo its log-prob and top_logprobs are null). Without echo only the completion's tokens, from
    index first_offset (the prompt's length) on, are listed; their offsets still count the prompt's text."""
    texts, offsets = [detokenize([t]) for t in ids], prefix_lengths(ids, detokenize)
    token_logprobs = [None] + list(scored.logprobs)
    top = [None]
    for k in range(len(scored.logprobs)):
        entry = {}
        if scored.top_ids is not None:
            for token, value in zip(scored.top_ids[k], scored.top_logprobs[k]):
                key = detokenize([token])
                entry[key] = max(value, entry.get(key, float("-inf")))
        top.append(entry)
    start = 0 if echo else first_offset
    return {"tokens": texts[start:], "token_logprobs": token_logprobs[start:], "top_logprobs": top[start:],
            "text_offset": offsets[start:]}


def prefix_lengths(ids, detokenize):
    """[len(detokenize(ids[:k])) for k in range(len(ids))], decoding a short window per id (IncrementalText's
    offsets): the text up to the last character boundary `read` is known, and decode(ids[prefix:k]) less
    decode(ids[prefix:read]) is the length the ids since then add, unfinished characters' U+FFFD included."""
    out, prefix, read, prefix_text, length = [], 0, 0, "", 0  # length: len(decode(ids[:read]))
    for k in range(len(ids)):
        window = detokenize(ids[prefix:k]) if k > read else prefix_text
        out.append(length + len(window) - len(prefix_text))
        if k > read and len(window) > len(prefix_text) and not window.endswith(REPLACEMENT):
            length, prefix, read = out[-1], read, k
            prefix_text = detokenize(ids[prefix:read])
    return out


def usage_body(prompt_tokens, completion_tokens):
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id, created, model, choices, usage):
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def chunk_body(request_id, created, model, choices, usage=None):
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def models_body(model, created):
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "megatron",
                                        "root": model, "parent": None}]}
