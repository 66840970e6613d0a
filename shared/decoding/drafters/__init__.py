"""Drafters behind one small protocol, so the decoding loop never asks which one it has.

A drafter follows one sequence. `start` gives it the prompt; `propose(k)` returns up to k
tokens (and their draft distributions q, or None for a deterministic proposal); `advance`
tells it how the round ended: how many proposals were accepted and the next token. Proposing
fewer than k tokens, or none, is always allowed.

One optional hook: a drafter that reads the target's own hidden states (MTP) defines
`attach_session(session)`; whoever creates the target session calls `attach(drafter, session)`
right after `start`, for every drafter, and the loop itself never asks which drafter it has.

`make_drafter(spec, target, sampling)` resolves `--draft`: 'none', 'ngram', 'mtp' or a checkpoint
directory (a separate draft model with the target's vocabulary).
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


def attach(drafter: Drafter, session: object) -> None:
    """Hand the target session to a drafter that reads the trunk's hidden states; a no-op for the others."""
    hook = getattr(drafter, "attach_session", None)
    if hook is not None:
        hook(session)


def make_drafter(spec: str | None, target: object, sampling: object = None, stop_below: float = 0.0) -> Drafter:
    """'none' | 'ngram' | 'mtp' | a checkpoint directory -> a drafter for `target` (a `HybridLM`)."""
    from deltaspec.shared.decoding.sampling import SamplingParams

    sampling = sampling or SamplingParams()
    if spec is None or spec == "none":
        return NoDrafter()
    if spec == "ngram":
        from deltaspec.shared.decoding.drafters.ngram import NgramDrafter

        return NgramDrafter()
    if spec == "mtp":
        from deltaspec.shared.decoding.drafters.mtp import MTPDrafter

        return MTPDrafter(target, sampling)  # type: ignore[arg-type]
    from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
    from deltaspec.shared.model.loader import load_model

    draft = load_model(spec, device=getattr(target, "device", "cpu"))  # beside the target: q meets p there
    if draft.config.vocab_size != target.config.vocab_size:  # type: ignore[attr-defined]
        raise ValueError(f"draft vocabulary {draft.config.vocab_size} differs from the target's "
                         f"{target.config.vocab_size}")  # type: ignore[attr-defined]
    return ModelDrafter(draft, sampling, stop_below)  # type: ignore[arg-type]
