"""Drafters behind one small protocol, so the decoding loop never asks which one it has.

A drafter follows one sequence. `start` gives it the prompt; `propose(k)` returns up to k
tokens (and their draft distributions q, or None for a deterministic proposal); `advance`
tells it how the round ended: how many proposals were accepted and the next token. Proposing
fewer than k tokens, or none, is always allowed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    probs: Tensor | None = None  # (len(tokens), vocab) draft distributions q, None when deterministic


class Drafter(Protocol):
    def start(self, prompt_ids: list[int]) -> None: ...

    def propose(self, k: int) -> Proposal: ...

    def advance(self, accepted: int, next_token: int) -> None: ...


class NoDrafter:
    """Target-only decoding: every round verifies zero drafts."""

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, k: int) -> Proposal:
        return Proposal([])

    def advance(self, accepted: int, next_token: int) -> None:
        pass
