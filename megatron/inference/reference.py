"""Reference text generation: BloomModel with the growing (concatenating) KV cache, left-padded batches, eod stop.

The plain eager path that the engine (megatron/inference/engine.py) is checked against; not for speed.

    ids, mask = left_pad(prompts, pad_id)          # (B, S), (B, S) bool, prompts right-aligned
    one forward of the whole prompt fills the cache, then one token per step: (B, 1) -> logits (B, V)

ALiBi depends only on key positions relative to the query, and padded keys are masked out, so a left-padded
row produces the same tokens as the same prompt alone (tests/unit/test_generation.py checks it).
"""

import torch

from megatron.inference.sampling import sample_next_token
from megatron.model.bloom import InferenceCache


def left_pad(prompts, pad_id):
    """ids (B, S) with each prompt right-aligned after pad_id, and mask (B, S) True on real tokens."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must have at least one token; drop empty prompts")
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, length - len(prompt):] = True
    return ids, mask


@torch.no_grad()
def generate(model, prompts, params, eod_id, pad_id, generator=None, vocab_limit=None, sync_tokens=None):
    """Continuations of token-id prompts (list of lists) as lists of ids, each ending at eod (included) or
    after params.max_new_tokens tokens.

    model: a BloomModel with parallel_output=False (full-vocabulary logits).
    vocab_limit: ids >= vocab_limit (the padding rows of the embedding) are never produced.
    sync_tokens: called on each step's (B,) tokens, returns the tokens every rank uses (tensor parallelism).
    """
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    padded = not bool(mask.all())
    cache = InferenceCache(model.config.num_layers)
    logits = model(ids, attention_mask=mask if padded else None, cache=cache)[:, -1]  # (B, V)
    batch = len(prompts)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    outputs = [[] for _ in range(batch)]
    for step in range(params.max_new_tokens):
        logits = logits.float()
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits[:, vocab_limit:] = float("-inf")
        tokens = sample_next_token(logits, params, generator)
        if sync_tokens is not None:
            tokens = sync_tokens(tokens)
        tokens = torch.where(done, torch.full_like(tokens, pad_id), tokens)
        for row in range(batch):
            if not done[row]:
                outputs[row].append(int(tokens[row]))
        done |= tokens == eod_id
        if bool(done.all()) or step == params.max_new_tokens - 1:
            break
        if padded:
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.bool, device=device)], dim=1)
        logits = model(tokens[:, None], attention_mask=mask if padded else None, cache=cache)[:, -1]
    return outputs
