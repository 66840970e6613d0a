"""Deciding how many draft tokens the target accepts, and which token comes next.

Terms (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023): the target scores `[last, d_1..d_k]` in one pass, giving p_1..p_{k+1}.
- *accepted*: d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)), stopping at the first refusal;
- *recovered*: after a refusal at i the next token is drawn from normalise(max(0, p_i - q_i));
- *bonus*: when all k are kept, the next token is drawn from p_{k+1}.
This makes every emitted token distributed exactly as the target alone would draw it. A drafter
that gives no q (n-gram lookup) proposes deterministically: q_i is one-hot on d_i. Greedy
decoding is the temperature-0 case: p is one-hot, so d_i is kept iff it is the argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from deltaspec.shared.decoding.sampling import draw


@dataclass(frozen=True)
class Verdict:
    accepted: int  # a: how many draft tokens are kept
    next_token: int  # the recovered or bonus token, fed first in the next round


def accept_greedy(target_scores: Tensor, drafts: list[int]) -> Verdict:
    """target_scores `(k+1, V)`: logits or probabilities (only their argmax counts)."""
    best = target_scores.argmax(-1).tolist()  # (k+1,)
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return Verdict(a, best[a])


def accept_rejection(
    target_probs: Tensor, drafts: list[int], draft_probs: Tensor | None, generator: torch.Generator
) -> Verdict:
    """target_probs `(k+1, V)`, draft_probs `(k, V)` or None for a deterministic proposal; q is read where p is
    (draft probabilities arrive on the CPU, from the wire or a drafter on another device)."""
    if draft_probs is not None:
        draft_probs = draft_probs.to(target_probs.device)
    for i, token in enumerate(drafts):
        p = target_probs[i]
        q = draft_probs[i] if draft_probs is not None else torch.nn.functional.one_hot(
            torch.tensor(token, device=p.device), p.shape[-1]).float()
        ratio = float(p[token]) / max(float(q[token]), 1e-30)
        if float(torch.rand((), generator=generator)) >= min(1.0, ratio):
            residual = (p - q).clamp_min(0.0)
            total = float(residual.sum())
            return Verdict(i, draw(residual / total if total > 0 else p, generator))
    return Verdict(len(drafts), draw(target_probs[len(drafts)], generator))
