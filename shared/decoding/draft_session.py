"""The draft side of a speculative round: a `ModelDrafter` behind round ids, safe to retry.

`propose(round_id, k, previous)` first applies the previous round's outcome (accepted count and
next token), then proposes; so one round costs one call. `commit` applies an outcome on its own
and `revert` drops a proposal, for callers that drive the loop step by step. As on the target,
the same round id with the same input returns the same answer without advancing twice, the same
round id with other input is refused, and refused calls change nothing: every check runs before
the first mutation.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from shared.decoding.drafters import Proposal
from shared.decoding.drafters.model_drafter import ModelDrafter
from shared.decoding.sampling import SamplingParams
from shared.decoding.target import MAX_DRAFT_TOKENS, check_tokens
from shared.errors import FailedPrecondition, InvalidArgument, NotFound
from shared.model.hybrid import HybridLM


@dataclass(frozen=True)
class Outcome:
    round_id: str
    accepted: int
    next_token: int


@dataclass
class DraftRound:
    round_id: str
    k: int
    previous: Outcome | None
    proposal: Proposal
    state: str = "proposed"  # proposed | committed | reverted
    outcome: Outcome | None = None


class DraftSession:
    """One sequence on the draft. Thread-safe: every public method holds the session lock."""

    def __init__(self, model: HybridLM, history: list[int], sampling: SamplingParams = SamplingParams()) -> None:
        if not history:
            raise InvalidArgument("the token history is empty", "token_ids")
        check_tokens(history, model.config.vocab_size, "token_ids")
        self.vocab_size = model.config.vocab_size
        self.drafter = ModelDrafter(model, sampling)
        self.drafter.start(list(history))
        self.length = len(history)  # committed tokens the draft knows of
        self.round: DraftRound | None = None  # the open proposal, or the last finished one (for retries)
        self.lock = threading.RLock()

    def propose(self, round_id: str, k: int, previous: Outcome | None = None) -> Proposal:
        with self.lock:
            rnd = self.round
            if rnd is not None and rnd.round_id == round_id:
                if (rnd.k, rnd.previous) != (k, previous):
                    raise FailedPrecondition(f"round {round_id!r} was already proposed with other input", "round_id")
                return rnd.proposal
            if not 0 <= k <= MAX_DRAFT_TOKENS:
                raise InvalidArgument(f"k = {k} is outside [0, {MAX_DRAFT_TOKENS}]", "k")
            if previous is not None:
                apply = self._check_outcome(previous, "previous")
            elif rnd is not None and rnd.state == "proposed":
                raise FailedPrecondition(f"round {rnd.round_id!r} is still open: pass its outcome first", "previous")
            else:
                apply = False
            if apply:
                self._apply(previous)  # type: ignore[arg-type]
            self.round = DraftRound(round_id, k, previous, self.drafter.propose(k))
            return self.round.proposal

    def commit(self, outcome: Outcome) -> None:
        with self.lock:
            if self._check_outcome(outcome, "outcome"):
                self._apply(outcome)

    def revert(self, round_id: str) -> None:
        with self.lock:
            rnd = self._round(round_id, "round_id")
            if rnd.state == "committed":
                raise FailedPrecondition(f"round {round_id!r} is already committed", "round_id")
            rnd.state = "reverted"  # the next proposal starts again from the same history

    def _check_outcome(self, outcome: Outcome, field_name: str) -> bool:
        """Validate an outcome; True when it still has to be applied, False for a repeat."""
        rnd = self._round(outcome.round_id, f"{field_name}.round_id")
        if rnd.state == "committed":
            if rnd.outcome != outcome:
                raise FailedPrecondition(f"round {outcome.round_id!r} was committed with another outcome",
                                         field_name)
            return False
        if rnd.state == "reverted":
            raise FailedPrecondition(f"round {outcome.round_id!r} was reverted", f"{field_name}.round_id")
        if not 0 <= outcome.accepted <= len(rnd.proposal.tokens):
            raise InvalidArgument(f"accept count {outcome.accepted} is outside [0, {len(rnd.proposal.tokens)}] "
                                  f"proposed in round {outcome.round_id!r}", f"{field_name}.accepted")
        check_tokens([outcome.next_token], self.vocab_size, f"{field_name}.next_token")
        return True

    def _apply(self, outcome: Outcome) -> None:
        self.drafter.advance(outcome.accepted, outcome.next_token)
        self.length += outcome.accepted + 1
        self.round.state, self.round.outcome = "committed", outcome  # type: ignore[union-attr]

    def _round(self, round_id: str, field_name: str) -> DraftRound:
        if self.round is None or self.round.round_id != round_id:
            raise NotFound(f"no round {round_id!r} in this draft session", field_name)
        return self.round
