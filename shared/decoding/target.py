"""The target side of a speculative round: a session with a versioned head and at most one pending round.

Round protocol (the services expose exactly this):
- `verify(round_id, base_version, drafts)` stages `[pending, d_1..d_k]` on top of the head and
  decides the verdict; the head does not move.
- `commit(round_id, accepted)` makes `pending, d_1..d_a` part of the head in one step and returns
  the new version; the next token (recovered, bonus, or d_{a+1} when the caller keeps fewer than
  the verdict allowed) becomes the new pending input.
- `revert(round_id)` drops the staged round.
Retries are safe: the same call with the same input returns the same answer and never advances
the head twice; the same round id with other input is refused. Refused calls change nothing.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor

from shared.decoding.sampling import SamplingParams, probabilities
from shared.decoding.verify import Verdict, accept_greedy, accept_rejection
from shared.errors import FailedPrecondition, InvalidArgument, NotFound
from shared.model.hybrid import HybridLM

MAX_DRAFT_TOKENS = 16


@dataclass
class Round:
    round_id: str
    base_version: int
    drafts: tuple[int, ...]
    verdict: Verdict
    staged_bytes: int
    hidden: Tensor = field(repr=False)  # (k+1, hidden) last-layer states of the verified positions
    outcome: str = "pending"  # pending | committed | reverted
    committed: int | None = None  # accept count actually committed
    new_version: int | None = None


def check_tokens(tokens: list[int] | tuple[int, ...], vocab_size: int, field_name: str) -> None:
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"{field_name}[{i}] = {t} is outside the vocabulary [0, {vocab_size})", field_name)


class TargetSession:
    """One sequence on the target. Thread-safe: every public method holds the session lock."""

    def __init__(self, model: HybridLM, prompt_ids: list[int], sampling: SamplingParams = SamplingParams()) -> None:
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty", "prompt")
        check_tokens(prompt_ids, model.config.vocab_size, "prompt_ids")
        self.model, self.sampling = model, sampling
        self.tokens = list(prompt_ids)  # committed history; the last one is the pending input
        self.prompt_len = len(prompt_ids)
        self.version = 0
        self.round: Round | None = None  # the pending round, or the last finished one (for retries)
        self.lock = threading.RLock()
        self.state = model.new_state(capacity=max(256, 2 * len(prompt_ids)))
        # last-layer states of the prompt's prefilled positions (for drafters that read the trunk: MTP)
        self.prefill_hidden = torch.empty(0, model.config.hidden_size, device=model.device, dtype=model.dtype)
        if len(prompt_ids) > 1:  # prefill all but the pending token, then commit it as version 0
            _, self.prefill_hidden = model(torch.tensor(prompt_ids[:-1]), self.state)
            self.state.commit(self.state.staged)

    @property
    def pending(self) -> Round | None:
        return self.round if self.round is not None and self.round.outcome == "pending" else None

    def verify(self, round_id: str, drafts: list[int], base_version: int | None = None,
               draft_probs: Tensor | None = None) -> Round:
        with self.lock:
            drafts_t = tuple(drafts)
            if self.round is not None and self.round.round_id == round_id:
                if self.round.drafts != drafts_t or (base_version is not None and base_version != self.round.base_version):
                    raise FailedPrecondition(f"round {round_id!r} was already verified with other input", "round_id")
                if self.round.outcome == "reverted":  # its verdict no longer stands: staging is gone
                    raise FailedPrecondition(f"round {round_id!r} was reverted: verify under a new round id",
                                             "round_id")
                return self.round
            if self.pending is not None:
                raise FailedPrecondition(
                    f"round {self.pending.round_id!r} is still pending: commit or revert it first", "round_id")
            if base_version is not None and base_version != self.version:
                raise FailedPrecondition(f"base version {base_version} is stale: the head is at {self.version}",
                                         "base_version")
            if len(drafts) > MAX_DRAFT_TOKENS:
                raise InvalidArgument(f"{len(drafts)} draft tokens, the limit is {MAX_DRAFT_TOKENS}", "draft_tokens")
            check_tokens(drafts, self.model.config.vocab_size, "draft_tokens")
            if draft_probs is not None and tuple(draft_probs.shape) != (len(drafts), self.model.config.vocab_size):
                raise InvalidArgument(f"draft probabilities have shape {tuple(draft_probs.shape)}, expected "
                                      f"({len(drafts)}, {self.model.config.vocab_size})", "draft_probs")
            logits, hidden = self.model(torch.tensor([self.tokens[-1], *drafts]), self.state)
            probs = probabilities(logits, self.sampling)
            if self.sampling.greedy:
                verdict = accept_greedy(probs, list(drafts))
            else:
                verdict = accept_rejection(probs, list(drafts), draft_probs, self.sampling.generator(len(self.tokens)))
            self.round = Round(round_id, self.version, drafts_t, verdict, self.state.staged_bytes(), hidden)
            return self.round

    def commit(self, round_id: str, accepted: int) -> int:
        """Keep `accepted` draft tokens of the pending round; returns the new head version."""
        with self.lock:
            rnd = self._round(round_id)
            if rnd.outcome == "committed":
                if rnd.committed != accepted:
                    raise FailedPrecondition(
                        f"round {round_id!r} was committed with {rnd.committed} accepted, not {accepted}", "accepted")
                return rnd.new_version  # type: ignore[return-value]
            if rnd.outcome == "reverted":
                raise FailedPrecondition(f"round {round_id!r} was reverted", "round_id")
            if not 0 <= accepted <= rnd.verdict.accepted:
                raise InvalidArgument(
                    f"accept count {accepted} is outside [0, {rnd.verdict.accepted}] verified for round {round_id!r}",
                    "accepted")
            next_token = rnd.verdict.next_token if accepted == rnd.verdict.accepted else rnd.drafts[accepted]
            self.state.commit(accepted + 1)
            self.tokens.extend([*rnd.drafts[:accepted], next_token])
            self.version += 1
            rnd.outcome, rnd.committed, rnd.new_version = "committed", accepted, self.version
            return self.version

    def revert(self, round_id: str) -> int:
        with self.lock:
            rnd = self._round(round_id)
            if rnd.outcome == "committed":
                raise FailedPrecondition(f"round {round_id!r} is already committed", "round_id")
            if rnd.outcome == "pending":
                self.state.revert()
                rnd.outcome = "reverted"
            return self.version

    def _round(self, round_id: str) -> Round:
        if self.round is None or self.round.round_id != round_id:
            raise NotFound(f"no round {round_id!r} in this session", "round_id")
        return self.round

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]
