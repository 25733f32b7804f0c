"""Greedy parity with HF generate, row by row, with each divergence measured: is it a near-tie of the logits?

In bf16 two paths that round differently (other kernels, other fusion) can pick different tokens where the top
two logits are within rounding of each other; after that the continuations differ. For a row whose tokens differ
from HF's, divergence() reports the first differing position and HF's own logits there (one forward of the
prompt and the common prefix): the gap between HF's token and ours, in units of the bf16 spacing at the top
logit (ulps). A gap of a few ulps is a near-tie, not a bug; a large gap is a bug.
"""
import math

import torch


def bf16_ulp(value):
    """The spacing of bf16 numbers at |value| (8 significant bits): 2^(floor(log2|v|) - 7)."""
    value = abs(float(value))
    return 2.0 ** (math.floor(math.log2(value)) - 7) if value > 0 else 2.0 ** -133


@torch.no_grad()
def divergence(hf_model, prompt, ours, theirs, near_tie_ulps=2.0):
    """None if ours == theirs (token lists), else a dict describing the first difference (HF's logits there)."""
    index = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if index is None:
        return None if len(ours) == len(theirs) else {"index": min(len(ours), len(theirs)), "length_differs": True}
    device = next(hf_model.parameters()).device
    ids = torch.tensor([list(prompt) + list(theirs[:index])], device=device)
    logits = hf_model(ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()
    top = float(logits.max())
    gap = float(logits[theirs[index]] - logits[ours[index]])
    ulps = gap / bf16_ulp(top)
    return {"index": index, "ours": int(ours[index]), "hf": int(theirs[index]), "hf_logit_gap": gap,
            "gap_ulps": ulps, "near_tie": abs(ulps) <= near_tie_ulps}


def compare_rows(hf_model, prompts, ours, theirs, near_tie_ulps=2.0):
    """(rows equal, [divergence dicts with their row]) for lists of outputs of the same prompts."""
    report = []
    for row, (prompt, a, b) in enumerate(zip(prompts, ours, theirs)):
        diff = divergence(hf_model, prompt, a, b, near_tie_ulps)
        if diff is not None:
            report.append({"row": row, **diff})
    return len(prompts) - len(report), report


def describe(report):
    """One line per divergence, for logs."""
    return "; ".join(f"row {d['row']} at token {d['index']}: ours {d.get('ours')} HF {d.get('hf')}, HF's logit gap "
                     f"{d.get('hf_logit_gap', float('nan')):.4g} ({d.get('gap_ulps', float('nan')):.2f} bf16 ulps"
                     f"{', a near-tie' if d.get('near_tie') else ''})" for d in report)
