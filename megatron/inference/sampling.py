"""Choosing the next token: greedy, temperature, top-k, top-p; per-row parameters, on the logits' device.

Sampling draws from softmax(logits / temperature) restricted to the top_k most likely tokens (0: all) and to the
smallest set whose probability reaches top_p (1.0: all), by the Gumbel-max rule: argmax(logits / T + G) with
G = -log(-log(u)). The uniforms u come from a counter-based hash of (request seed, token index, vocabulary id), so
a request's draws depend on its seed alone: the same in any batch, at any batch position, with no generator
state to carry and no host synchronisation.
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked and how many may be generated."""
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 32

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"--temperature {self.temperature} must be > 0 (use --greedy for argmax decoding)")
        if self.top_k < 0:
            raise ValueError(f"--top-k {self.top_k} must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p {self.top_p} must be in (0, 1] (1.0 disables it)")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens} must be at least 1")

    @property
    def filters(self):
        return self.top_k > 0 or self.top_p < 1.0


def filter_logits(logits, top_k=0, top_p=1.0):
    """logits (B, V) with every token outside the top-k / nucleus set to -inf (at least one token survives)."""
    logits = logits.clone()
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already reach top_p
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def sample_next_token(logits, params, generator=None):
    """Next token ids (B,) from fp32 logits (B, V) with one generator for the batch (the reference path)."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


_M1, _M2 = -4658895280553007687, -7723592293110705685  # splitmix64's multipliers as signed int64
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15


def _shr(x, bits):
    """Logical right shift of int64 values read as uint64."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x):
    """splitmix64's finaliser on int64 tensors (multiplication wraps modulo 2^64)."""
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def hashed_uniform(seeds, counters, vocab):
    """(B, vocab) uniforms in (0, 1) from int64 seeds (B,) and counters (B,): a pure function of its inputs."""
    key = _mix64(seeds * _GOLDEN + counters)  # (B,)
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _shr(_mix64(key[:, None] + ids[None, :] * _GOLDEN), 40)  # 24 random bits
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def filter_rows(logits, top_k, top_p):
    """Per-row top-k (B,) int and top-p (B,) float filtering of fp32 logits (B, V); k = 0 and p = 1 disable."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def sample_rows(logits, greedy, temperature, top_k, top_p, seeds, counters, any_sampled=True, any_filtered=True):
    """Next tokens (B,) for fp32 logits (B, V) with per-row parameters (tensors of shape (B,)).

    any_sampled / any_filtered are host-side hints (False skips the noise or the sort when no row needs it).
    """
    best = torch.argmax(logits, dim=-1)
    if not any_sampled:
        return best
    scaled = logits / temperature[:, None]
    if any_filtered:
        scaled = filter_rows(scaled, top_k, top_p)
    gumbel = -torch.log(-torch.log(hashed_uniform(seeds, counters, logits.shape[-1])))
    drawn = torch.argmax(scaled + gumbel, dim=-1)
    return torch.where(greedy, best, drawn)
