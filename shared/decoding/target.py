"""The target side of a speculative round: a session with a versioned head and at most one pending round.

Round protocol (the services expose exactly this):
- `verify(round_id, base_version, drafts)` stages `[pending, d_1..d_k]` on top of the head and
  decides the verdict; the head does not move.
- `commit(round_id, accepted)` makes `pending, d_1..d_a` part of the head in one step and returns
  the new version; the next token (recovered, bonus, or d_{a+1} when the caller keeps fewer than
  the verdict allowed) becomes the new pending input.
- `revert(round_id)` drops the staged round.
Pipelined rounds: `verify(..., parent=r, guess=g)` stages round r+1 on top of the pending round r,
assuming r is fully accepted and followed by token g (r+1's first input), while r is still
pending (at most one such chained round). It is refused at once when r's verdict already says
otherwise. `commit(r)` with full acceptance and next token g keeps r+1 staged as the new pending
round (a pointer swap); any other commit or revert of r drops r+1 in the same step, and later
calls naming r+1 are refused. Nothing of r+1 reaches the head before `commit(r+1)`.
A verify naming a parent that is itself still chained (r+2 on r+1 while r is pending, r+1's
verdict keeping the assumption) waits, staging nothing, until r's commit makes r+1 the pending
round (it then goes on) or drops it (it is then refused): a remote caller sends it as soon as r's
verdict keeps r+1, without waiting for Commit(r) and r+1's verdict to come back. At most
`MAX_WAITING` calls wait per session, each at most `WAIT_S`. Served, a chained verify starts once the
verdicts and commits already made have left the service (`deltaspec.shared.decoding.answers`).
Retries are safe: the same call with the same input returns the same answer and never advances
the head twice; the same round id with other input is refused. Refused calls change nothing.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from deltaspec.shared.decoding.answers import Answers
from deltaspec.shared.decoding.logprobs import TokenLogprob, round_logprobs
from deltaspec.shared.decoding.sampling import SamplingParams, probabilities
from deltaspec.shared.decoding.verify import Verdict, accept_greedy, accept_rejection
from deltaspec.shared.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.state.prefix_cache import Cursor, PrefixCache, commit_head

MAX_DRAFT_TOKENS = 16
MAX_WAITING = 2  # verifies waiting for their chained parent to become the pending round, per session
WAIT_S = 5.0  # how long one waits before it is refused (a commit normally comes within a round trip)


@dataclass
class Round:
    round_id: str
    base_version: int
    drafts: tuple[int, ...]
    verdict: Verdict
    staged_bytes: int
    hidden: Tensor = field(repr=False)  # (k+1, hidden) last-layer states of the verified positions
    parent: str | None = None  # a pipelined round: the round it was staged on, and the token assumed after it
    guess: int | None = None
    outcome: str = "pending"  # pending | committed | reverted | dropped (its parent ended otherwise)
    committed: int | None = None  # accept count actually committed
    new_version: int | None = None
    committed_tokens: list[int] = field(default_factory=list)  # what the commit appended
    logprobs: list[TokenLogprob] | None = None  # rows 0..accepted's emitted tokens, when the session keeps them
    collective_s: float = 0.0  # rank 0's time in a tensor-parallel group's collectives: its verify, its commit


def check_num_draft_tokens(k: int) -> None:
    """Refuse a count of drafts a round (`num_draft_tokens`) outside 0 to `MAX_DRAFT_TOKENS`, naming the count asked
    for: checked before any round, so a drafter's own, smaller ceiling is never what the caller reads."""
    if not 0 <= k <= MAX_DRAFT_TOKENS:
        raise InvalidArgument(f"num_draft_tokens = {k} is outside 0 to {MAX_DRAFT_TOKENS}", "num_draft_tokens")


def check_tokens(tokens: list[int] | tuple[int, ...], vocab_size: int, field_name: str) -> None:
    if tokens and 0 <= min(tokens) and max(tokens) < vocab_size:  # the common case, without a Python loop
        return
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"{field_name}[{i}] = {t} is outside the vocabulary [0, {vocab_size})", field_name)


class TargetSession:
    """One sequence on the target. Thread-safe: every public method holds the session lock."""

    def __init__(self, model: HybridLM, prompt_ids: list[int], sampling: SamplingParams = SamplingParams(),
                 max_chain: int = 1, answers_sent_by_caller: bool = False,
                 chain_ended: Callable[[str], None] | None = None, top_logprobs: int | None = None) -> None:
        """`chain_ended(outcome)` is told how each chained round ended: kept (its parent's commit made it the
        pending round), dropped (the commit kept fewer drafts or another next token) or reverted (a metric).
        `top_logprobs`: None keeps no log-probabilities; n keeps, in `logprobs`, each committed token's and the n
        most likely at its position (`deltaspec.shared.decoding.logprobs`)."""
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty", "prompt")
        check_tokens(prompt_ids, model.config.vocab_size, "prompt_ids")
        self.model, self.sampling = model, sampling
        self.tokens = list(prompt_ids)  # committed history; the last one is the pending input
        self.prompt_len = len(prompt_ids)
        self.top_logprobs = top_logprobs
        self.logprobs: list[TokenLogprob] = []  # with top_logprobs: one per committed token after the prompt
        self.version = 0
        self.round: Round | None = None  # the pending round, or the last finished one (for retries)
        self.chained: Round | None = None  # a pipelined round staged on top of the pending one
        self.earlier: tuple[Round, ...] = ()  # rounds kept for retries: the one before, the last dropped
        self.max_chain = max_chain  # pipelined rounds staged at once: 0 (refused) or 1
        self.chain_ended = chain_ended or (lambda outcome: None)
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)  # notified when a commit or revert ends the pending round
        self.waiting = 0  # verifies waiting for their parent to become the pending round
        self.answers = Answers(answers_sent_by_caller)  # a chained verify waits for the verdicts to leave
        self.state = model.new_state(capacity=max(256, 2 * len(prompt_ids)))
        cache: PrefixCache | None = model.prefix_cache
        self.cursor = Cursor(cache, self.state) if cache is not None else None  # its place in the prefix cache
        # last-layer states of the prompt's prefilled positions (for drafters that read the trunk: MTP); None when
        # a prefix cache that keeps none served some
        self.prefill_hidden: Tensor | None = torch.empty(0, model.config.hidden_size, device=model.device,
                                                         dtype=model.dtype)
        if len(prompt_ids) > 1:  # prefill all but the pending token, then commit it as version 0
            self.prefill_hidden = self._prefill(prompt_ids[:-1])

    @property
    def cached_tokens(self) -> int:
        """Prompt positions taken from the prefix cache instead of prefilled."""
        return self.cursor.cached_tokens if self.cursor is not None else 0

    def extend(self, ids: list[int], field_name: str = "append_ids") -> int:
        """Append `ids` to the committed history (a user's next turn), prefilled on top of the head: the new
        head version. Needs no round pending."""
        with self.lock:
            if not ids:
                raise InvalidArgument("no tokens to append", field_name)
            check_tokens(ids, self.model.config.vocab_size, field_name)
            if self.pending is not None:
                raise FailedPrecondition(f"round {self.pending.round_id!r} is still pending: commit or revert it "
                                         "before extending the session", "session_id")
            self._prefill([self.tokens[-1], *ids[:-1]])
            self.tokens += ids
            self.version += 1
            self.changed.notify_all()
            return self.version

    def finish(self) -> None:
        """The generation is over and nobody will call the session again: with a prefix cache, cache the block its
        pending token completes (one forward pass of that token, only when it completes one), so that a
        conversation's next turn, which resends the whole history, finds all of it."""
        with self.lock:
            if self.cursor is None or not self.cursor.completes_block(1):
                return
            self.state.revert()
            try:
                _, hidden = self.model(torch.tensor(self.tokens[-1:]), self.state)
            except ResourceExhausted:  # no memory for one more position: the block stays uncached
                return
            commit_head(self.cursor, self.tokens[-1:], lambda: self.state.commit(1), hidden)
            self.cursor = None

    def _prefill(self, ids: list[int]) -> Tensor | None:
        """Stage and commit `ids` after the head (from the longest cached prefix on a new session's prompt)."""
        if self.cursor is not None:
            return self.cursor.prefill(self.model, ids)
        _, hidden = self.model(torch.tensor(ids), self.state)
        self.state.commit(self.state.staged)
        return hidden

    @property
    def pending(self) -> Round | None:
        return self.round if self.round is not None and self.round.outcome == "pending" else None

    def find(self, round_id: str) -> Round | None:
        return next((r for r in (self.round, self.chained, *self.earlier) if r and r.round_id == round_id), None)

    def verify(self, round_id: str, drafts: list[int], base_version: int | None = None,
               draft_probs: Tensor | None = None, parent: str | None = None, guess: int | None = None) -> Round:
        if parent is not None:
            self.answers.wait()
        if not round_id:
            raise InvalidArgument("round_id must not be empty: it names the round that Commit or Revert ends",
                                  "round_id")
        with self.answers.call(), self.lock:
            if parent is not None and self.find(round_id) is None:
                self._await_parent(round_id, parent, guess)
            drafts_t = tuple(drafts)
            known = self.find(round_id)
            if known is not None:
                if known.drafts != drafts_t or (base_version is not None and base_version != known.base_version) \
                        or (parent is not None and (parent, guess) != (known.parent, known.guess)):
                    raise FailedPrecondition(f"round {round_id!r} was already verified with other input", "round_id")
                if known.outcome == "reverted":  # its verdict no longer stands: staging is gone
                    raise FailedPrecondition(f"round {round_id!r} was reverted: verify under a new round id",
                                             "round_id")
                if known.outcome == "dropped":
                    raise FailedPrecondition(f"round {round_id!r} was dropped: round {known.parent!r} it was staged "
                                             "on ended otherwise; verify under a new round id", "round_id")
                return known
            if parent is not None:
                if guess is None:
                    raise InvalidArgument(f"round {round_id!r} names parent round {parent!r} but no token assumed "
                                          "after it", "parent_next_token")
                check_tokens([guess], self.model.config.vocab_size, "parent_next_token")
                if not self._committed_as_assumed(parent, guess):
                    return self._verify_chained(round_id, drafts_t, base_version, draft_probs, parent, guess)
            if self.pending is not None:
                raise FailedPrecondition(
                    f"round {self.pending.round_id!r} is still pending: commit or revert it first", "round_id")
            if base_version is not None and base_version < self.version:
                raise FailedPrecondition(f"base version {base_version} is stale: the head is at {self.version}",
                                         "base_version", "STALE_VERSION")
            if base_version is not None and base_version > self.version:
                raise FailedPrecondition(f"base version {base_version} is ahead of the head ({self.version}): "
                                         "no round has made it yet", "base_version", "VERSION_AHEAD")
            self._check_input(drafts, draft_probs)
            collective_s = self.state.collective_s
            logits, hidden = self.model(torch.tensor([self.tokens[-1], *drafts]), self.state)
            verdict = self._verdict(logits, drafts_t, draft_probs, len(self.tokens))
            self.earlier = tuple(r for r in (self.round, *self.earlier[1:]) if r)
            self.round = Round(round_id, self.version, drafts_t, verdict, self.state.staged_bytes(), hidden, parent,
                               guess, logprobs=self._logprobs(logits, drafts_t, verdict),
                               collective_s=self.state.collective_s - collective_s)
            return self.round

    def _await_parent(self, round_id: str, parent: str, guess: int | None) -> None:
        """Wait while `parent` is the chained round and its verdict keeps the assumption: until a commit or revert
        of the pending round decides it (the checks that follow then stage or refuse), or `WAIT_S`."""
        chained = self.chained
        if chained is None or chained.round_id != parent or guess is None or not _keeps(chained, guess):
            return
        if self.waiting >= MAX_WAITING:
            raise FailedPrecondition(f"{self.waiting} verifies already wait for round {parent!r} to be committed; "
                                     f"round {round_id!r} cannot wait too", "parent_round_id")
        self.waiting += 1
        try:
            self.changed.wait_for(lambda: self.chained is not chained, WAIT_S)
        finally:
            self.waiting -= 1

    def _check_input(self, drafts: list[int] | tuple[int, ...], draft_probs: Tensor | None) -> None:
        if len(drafts) > MAX_DRAFT_TOKENS:
            raise InvalidArgument(f"{len(drafts)} draft tokens, the limit is {MAX_DRAFT_TOKENS}", "draft_tokens")
        check_tokens(drafts, self.model.config.vocab_size, "draft_tokens")
        if draft_probs is not None and tuple(draft_probs.shape) != (len(drafts), self.model.config.vocab_size):
            raise InvalidArgument(f"draft probabilities have shape {tuple(draft_probs.shape)}, expected "
                                  f"({len(drafts)}, {self.model.config.vocab_size})", "draft_probs")

    def _verdict(self, logits: Tensor, drafts: tuple[int, ...], draft_probs: Tensor | None, position: int) -> Verdict:
        if self.sampling.greedy:  # the argmax of the logits is the argmax of their one-hot distribution
            return accept_greedy(logits, list(drafts))
        probs = probabilities(logits, self.sampling)
        return accept_rejection(probs, list(drafts), draft_probs, self.sampling.generator(position))

    def _logprobs(self, logits: Tensor, drafts: tuple[int, ...], verdict: Verdict) -> list[TokenLogprob] | None:
        if self.top_logprobs is None:
            return None
        return round_logprobs(logits, drafts, verdict.accepted, verdict.next_token, self.top_logprobs)

    def _committed_as_assumed(self, parent: str, guess: int) -> bool:
        """The parent is the last round, committed with every draft kept and `guess` after them."""
        rnd = self.round
        return (rnd is not None and rnd.round_id == parent and rnd.outcome == "committed"
                and rnd.committed == len(rnd.drafts) and rnd.committed_tokens[-1] == guess)

    def _verify_chained(self, round_id: str, drafts: tuple[int, ...], base_version: int | None,
                        draft_probs: Tensor | None, parent: str, guess: int) -> Round:
        """Stage `[guess, *drafts]` on top of the pending round `parent`, as if it were fully accepted."""
        if self.max_chain < 1:
            raise FailedPrecondition("this target stages no pipelined rounds (pipeline depth 0): verify round "
                                     f"{round_id!r} after committing {parent!r}", "parent_round_id")
        pending, chained = self.pending, self.chained
        rnd = pending if pending is not None and pending.round_id == parent else \
            chained if chained is not None and chained.round_id == parent else None
        if rnd is None:
            if self.find(parent) is None:
                raise NotFound(f"no round {parent!r} to stage round {round_id!r} on", "parent_round_id", parent)
            raise FailedPrecondition(f"round {parent!r} ended otherwise than round {round_id!r} assumed",
                                     "parent_round_id")
        if rnd is pending and chained is not None:
            raise FailedPrecondition(f"round {chained.round_id!r} is already staged on round {parent!r}",
                                     "parent_round_id")
        if rnd.verdict.accepted < len(rnd.drafts):
            raise FailedPrecondition(f"round {parent!r} accepts {rnd.verdict.accepted} of {len(rnd.drafts)} drafts; "
                                     f"round {round_id!r} assumed all", "parent_round_id")
        if rnd.verdict.next_token != guess:
            raise FailedPrecondition(f"round {parent!r} is followed by token {rnd.verdict.next_token}, not "
                                     f"{guess} as round {round_id!r} assumed", "parent_next_token")
        if base_version is not None and base_version != rnd.base_version + 1:
            raise FailedPrecondition(f"base version {base_version} is not the one after round {parent!r} "
                                     f"({rnd.base_version + 1})", "base_version")
        if rnd is chained:
            raise FailedPrecondition(f"round {parent!r} is still staged on round {pending.round_id!r}, "  # type: ignore
                                     f"which was not committed within {WAIT_S:g} s", "parent_round_id")
        self._check_input(drafts, draft_probs)
        capacity = self.state.recurrent.log_capacity
        if self.state.staged + len(drafts) + 1 > capacity:
            raise FailedPrecondition(f"rounds {parent!r} and {round_id!r} together stage more than {capacity} "
                                     "tokens", "draft_tokens")
        self.state.mark()
        collective_s = self.state.collective_s
        logits, hidden = self.model(torch.tensor([guess, *drafts]), self.state)
        verdict = self._verdict(logits, drafts, draft_probs, len(self.tokens) + len(rnd.drafts) + 1)
        self.chained = Round(round_id, rnd.base_version + 1, drafts, verdict,
                             self.state.staged_bytes() - rnd.staged_bytes, hidden, parent, guess,
                             logprobs=self._logprobs(logits, drafts, verdict),
                             collective_s=self.state.collective_s - collective_s)
        return self.chained

    def commit(self, round_id: str, accepted: int) -> int:
        """Keep `accepted` draft tokens of the pending round; returns the new head version."""
        with self.answers.call(), self.lock:
            rnd = self._round(round_id)
            if rnd.outcome == "committed":
                if rnd.committed != accepted:
                    raise FailedPrecondition(
                        f"round {round_id!r} was committed with {rnd.committed} accepted, not {accepted}", "accepted")
                return rnd.new_version  # type: ignore[return-value]
            if rnd.outcome in ("reverted", "dropped"):
                raise FailedPrecondition(f"round {round_id!r} was {rnd.outcome}", "round_id")
            if rnd is self.chained:
                raise FailedPrecondition(f"round {round_id!r} is staged on round {rnd.parent!r}, which is not "
                                         "committed yet", "round_id")
            if not 0 <= accepted <= rnd.verdict.accepted:
                raise InvalidArgument(
                    f"accept count {accepted} is outside [0, {rnd.verdict.accepted}] verified for round {round_id!r}",
                    "accepted")
            next_token = rnd.verdict.next_token if accepted == rnd.verdict.accepted else rnd.drafts[accepted]
            child = self.chained
            keep_child = child is not None and accepted == len(rnd.drafts) and next_token == child.guess
            collective_s = self.state.collective_s
            if keep_child:
                commit_head(self.cursor, [self.tokens[-1], *rnd.drafts], self.state.commit_marked, rnd.hidden)
            else:
                commit_head(self.cursor, [self.tokens[-1], *rnd.drafts[:accepted]], lambda: self.state.commit(accepted + 1),
                                  rnd.hidden[:accepted + 1])
                self._drop_chained()
            rnd.collective_s += self.state.collective_s - collective_s
            rnd.committed_tokens = [*rnd.drafts[:accepted], next_token]
            self.tokens.extend(rnd.committed_tokens)
            if rnd.logprobs is not None:
                self.logprobs += rnd.logprobs[:accepted + 1]
            self.version += 1
            rnd.outcome, rnd.committed, rnd.new_version = "committed", accepted, self.version
            if keep_child:
                self.earlier = (rnd, *self.earlier[1:])
                self.round, self.chained = child, None
                self.chain_ended("kept")
            self.changed.notify_all()
            return self.version

    def revert(self, round_id: str) -> int:
        with self.lock:
            rnd = self._round(round_id)
            if rnd.outcome == "committed":
                raise FailedPrecondition(f"round {round_id!r} is already committed", "round_id")
            if rnd is self.chained:
                self.state.drop_marked()
                self._drop_chained("reverted")
            elif rnd.outcome == "pending":
                self.state.revert()
                self._drop_chained()
                rnd.outcome = "reverted"
            self.changed.notify_all()
            return self.version

    def _drop_chained(self, outcome: str = "dropped") -> None:
        if self.chained is not None:
            self.chained.outcome = outcome
            self.earlier = (*self.earlier[:1], self.chained)
            self.chained = None
            self.chain_ended(outcome)

    def _round(self, round_id: str) -> Round:
        rnd = self.find(round_id)
        if rnd is None:
            raise NotFound(f"no round {round_id!r} in this session", "round_id", round_id)
        return rnd

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


def _keeps(rnd: Round, guess: int) -> bool:
    """The round's verdict keeps every draft and is followed by `guess`."""
    return rnd.verdict.accepted == len(rnd.drafts) and rnd.verdict.next_token == guess
