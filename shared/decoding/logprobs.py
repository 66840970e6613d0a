"""The target's log-probabilities of the tokens a round emits, read from the verify pass that decided them.

A verify pass scores `[pending, d_1..d_k]` and gives a distribution per position; the round emits
`d_1..d_a` and then the next token (or `d_{c+1}` when the caller keeps c < a drafts), so row i's emitted token
is `d_{i+1}` for i < a and the next token at row a. Target-only decoding scores the same positions one at a
time, so these are its log-probabilities too (to float rounding). They are of the raw logits: before
temperature, top-k and top-p, as vLLM reports by default, so they do not depend on how tokens are drawn.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MAX_TOP_LOGPROBS = 20  # what OpenAI's API allows


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely (token, log-probability) at this position, best first


def round_logprobs(logits: Tensor, drafts: tuple[int, ...], accepted: int, next_token: int,
                   top_n: int) -> list[TokenLogprob]:
    """logits `(k+1, V)`: the emitted token of each row 0..accepted with its log-probability and the `top_n` most
    likely; a commit of c drafts emits rows 0..c. One device-to-host copy."""
    rows = accepted + 1
    lp = torch.log_softmax(logits[:rows].float(), dim=-1)  # (a+1, V)
    tokens = torch.tensor([*drafts[:accepted], next_token], device=lp.device)
    chosen = lp.gather(-1, tokens[:, None])[:, 0].tolist()  # (a+1,)
    top_lp, top_ids = lp.topk(top_n, dim=-1) if top_n else (lp[:, :0], lp[:, :0].long())
    top = [tuple(zip(ids, vals)) for ids, vals in zip(top_ids.tolist(), top_lp.tolist())]
    return [TokenLogprob(t, c, row) for t, c, row in zip(tokens.tolist(), chosen, top)]
