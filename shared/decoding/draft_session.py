"""The draft side of a speculative round: a `ModelDrafter` behind round ids, safe to retry.

`propose(round_id, k, previous)` first applies the previous round's outcome (accepted count and
next token), then proposes; so one round costs one call. `commit` applies an outcome on its own
and `revert` drops a proposal, for callers that drive the loop step by step. As on the target,
the same round id with the same input returns the same answer without advancing twice, the same
round id with other input is refused, and refused calls change nothing: every check runs before
the first mutation.

Pipelined rounds: `propose(..., speculative=True)` proposes the next round on top of the open one
without committing it (the drafter's `speculate`), assuming every draft of the open round is
accepted and followed by the draft's own guess. `parent` names the round it builds on, which must
be the newest once the outcome is applied: the open round, or a speculative one (at most
`MAX_CHAINED` on top of the open round). An outcome of
the open round that matches the first speculation makes it the open round (the others stay on top);
any other outcome drops them all. An outcome may also name a speculative round: every round below
it then counts as fully accepted with the guess above it. A speculative proposal may carry again the
outcome that opened the open round (already applied): it then builds on that round only, and is
refused when a newer one is open, so a speculative call answered late (the caller did not wait for
it) cannot land on a round it did not mean; one naming a parent is refused once that parent is gone. A
speculation that names no parent and finds no round open may have overtaken the plain proposal sent just
before it (a separate HTTP/2 stream): it waits up to `OVERTAKE_WAIT_S` for a plain proposal to open a round,
one such request per session, then is refused.

Speculative work (a speculative request, or one made ahead) starts once the answers already made have
left the service (`deltaspec.shared.decoding.answers`).

Branches (`branches` > 0): after the speculation made ahead, the session also stages the next round for the
open round's likeliest misses (`ModelDrafter.stage_branches`), as many as the session's acceptance suggests
rejections per round, round(k x (1 - share of drafts kept)), at most `branches`. The plain proposal that follows
a miss one of them foresaw is then answered without a forward pass. Branches are made only while no request waits
(one arriving cuts the branch in progress short, between two forward passes) and dropped at the outcome.

Once a session has been asked for a speculative round, every proposal, plain or speculative, is
followed in the background by the speculation on top of it (same k): the caller's next speculative
request, which comes a network round trip later, then finds it made instead of waiting for k+1
forward passes. It is kept when the outcome that arrives with the request confirms the rounds below
and dropped by any other. A plain proposal (the caller's answer to a miss) drops every speculation, so it
stops one in progress, made in the background or asked for, between two forward passes instead of waiting
for it to finish (an asked-for one is answered with the drafts it has).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from deltaspec.shared.decoding.answers import Answers
from deltaspec.shared.decoding.drafters import Proposal
from deltaspec.shared.decoding.drafters.model_drafter import MAX_SPECULATIONS, ModelDrafter
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.target import MAX_DRAFT_TOKENS, check_tokens
from deltaspec.shared.errors import FailedPrecondition, InvalidArgument, NotFound
from deltaspec.shared.model.hybrid import HybridLM


MAX_CHAINED = MAX_SPECULATIONS - 1  # speculative rounds asked for on top of the open round (one more is made ahead)
OVERTAKE_WAIT_S = 1.0  # how long a speculation with no open round below it waits for the plain proposal it overtook
ACCEPTANCE_WEIGHT = 0.2  # of each round in the session's running share of drafts kept (which sizes its branches)


class _NoOpenRound(FailedPrecondition):
    """A speculation found no open round to build on: it may have overtaken the plain proposal sent before it."""


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
    guess: int | None = None  # for a speculative round: the token assumed after the round below's drafts
    parent: str | None = None  # the speculative round it was asked to build on (None: the open round)
    state: str = "proposed"  # proposed | committed | reverted | dropped
    outcome: Outcome | None = None
    opened_by: Outcome | None = None  # the outcome that made it the open round


class DraftSession:
    """One sequence on the draft. Thread-safe: every public method holds the session lock."""

    def __init__(self, model: HybridLM, history: list[int], sampling: SamplingParams = SamplingParams(),
                 stop_below: float = 0.0, answers_sent_by_caller: bool = False,
                 speculation_ended: Callable[[str, int], None] | None = None, branches: int = 0,
                 branch_ended: Callable[[str, float], None] | None = None) -> None:
        """`speculation_ended(outcome, n)`: told of speculations kept (made the open round) or dropped (a metric).
        `branches`: the most staged per round for likely misses; `branch_ended(outcome, seconds)` is told how each
        ended (used, unused, cut) and the draft's time making it (a metric)."""
        if not history:
            raise InvalidArgument("the token history is empty", "token_ids")
        check_tokens(history, model.config.vocab_size, "token_ids")
        self.vocab_size = model.config.vocab_size
        self.drafter = ModelDrafter(model, sampling, stop_below)  # stop_below: dynamic draft length
        if speculation_ended is not None:
            self.drafter.speculation_ended = speculation_ended
        if branch_ended is not None:
            self.drafter.branch_ended = branch_ended
        self.max_branches = branches
        self.drafter.branching = branches > 0
        self.acceptance = 0.5  # running share of drafts kept
        self.queued = 0  # requests waiting for the lock (read without it: a hint that stops branching)
        self.incoming: Outcome | None = None  # the outcome a waiting plain proposal carries (a hint, as `queued`)
        self.queue_lock = threading.Lock()
        self.drafter.start(list(history))
        self.length = len(history)  # committed tokens the draft knows of
        self.round: DraftRound | None = None  # the open proposal, or the last finished one (for retries)
        self.speculations: list[DraftRound] = []  # proposed on top of the open round, each on the one before
        self.earlier: DraftRound | None = None  # the round before, or the last dropped one (for retries)
        self.pipelining = False  # the caller has asked for a speculative round
        self.waiting = False  # a plain proposal waits for the lock (read without it: a hint)
        # (on round, k, guess, proposal) made ahead, on the newest round (the open one or the last speculation)
        self.ahead: tuple[DraftRound, int, int, Proposal] | None = None
        self.lock = threading.RLock()
        self.opened = threading.Condition(self.lock)  # notified when a plain proposal opens a round
        self.overtaken = False  # a speculative request waits for the plain proposal it overtook
        self.answers = Answers(answers_sent_by_caller)  # speculative work waits for them to leave
        self.sparse_probs = False  # the caller reads sparse draft distributions (a service's session)

    def propose(self, round_id: str, k: int, previous: Outcome | None = None, speculative: bool = False,
                parent: str | None = None) -> DraftRound:
        if not round_id:
            raise InvalidArgument("round_id must not be empty: it names the round the next outcome refers to",
                                  "round_id")
        deadline = time.monotonic() + OVERTAKE_WAIT_S
        if speculative:
            self.answers.wait()
        with self.answers.call():
            while True:
                if not speculative:
                    self.waiting = True  # a background speculation in progress stops at its next forward pass
                    self.incoming = previous  # ... and a branch in progress, unless it is the one this asks for
                with self.queue_lock:
                    self.queued += 1  # a branch in progress stops at its next forward pass
                with self.lock:
                    with self.queue_lock:
                        self.queued -= 1
                    self.waiting, self.incoming = False, None
                    try:
                        return self._propose(round_id, k, previous, speculative, parent)
                    except _NoOpenRound:
                        left = deadline - time.monotonic()
                        if self.overtaken or left <= 0:
                            raise
                    self.overtaken = True  # one waits per session: the caller sends one such request per plain one
                    try:
                        self.opened.wait(left)
                    finally:
                        self.overtaken = False
                self.answers.wait(own=1)  # the plain proposal that came: its answer leaves first

    def _propose(self, round_id: str, k: int, previous: Outcome | None, speculative: bool,
                 parent: str | None) -> DraftRound:
        if parent is not None and not speculative:
            raise InvalidArgument("parent_round_id names the speculative round to build on: it needs "
                                  "speculative", "parent_round_id")
        known = next((r for r in (self.round, *self.speculations) if r and r.round_id == round_id), None)
        if known is not None:
            if (known.k, known.previous, known.guess is not None, known.parent) != \
                    (k, previous, speculative, parent):
                raise FailedPrecondition(f"round {round_id!r} was already proposed with other input", "round_id")
            return known
        if not 0 <= k <= MAX_DRAFT_TOKENS:
            raise InvalidArgument(f"k = {k} is outside [0, {MAX_DRAFT_TOKENS}]", "k")
        repeat = previous is not None and self.round is not None and previous == self.round.opened_by
        apply = previous is not None and not repeat and self._check_outcome(previous, "previous")
        if apply:
            opened, chain = self._after(previous)  # type: ignore[arg-type]
        else:
            opened = self.round if self.round is not None and self.round.state == "proposed" else None
            chain = list(self.speculations)
        if speculative:
            self._check_speculation(previous, apply, opened, chain, parent)
            self._check_room(k)
        elif opened is not None and (apply or previous is None):
            raise FailedPrecondition(f"round {opened.round_id!r} is open: pass its outcome first", "previous")
        if apply:
            self._apply(previous)  # type: ignore[arg-type]
        if speculative:
            self.pipelining = True
            newest = self.speculations[-1] if self.speculations else self.round
            ahead, self.ahead = self.ahead, None
            if ahead is not None and ahead[:2] == (newest, k):
                guess, proposal = ahead[2:]
            else:
                if ahead is not None:
                    self.drafter.discard_last()  # made for another k
                # a plain proposal waiting for the lock drops every speculation: this one stops short for it
                guess, proposal = self.drafter.speculate(k, lambda: self.waiting)
            self.speculations.append(DraftRound(round_id, k, previous, proposal, guess, parent))
            self._ahead_of(self.speculations[-1], k)
            return self.speculations[-1]
        self._drop_speculative()
        self.ahead = None
        self.round = DraftRound(round_id, k, previous, self.drafter.propose(k), opened_by=previous)
        self.opened.notify_all()
        self._ahead_of(self.round, k)
        return self.round

    def _check_speculation(self, previous: Outcome | None, apply: bool, opened: DraftRound | None,
                           chain: list[DraftRound], parent: str | None) -> None:
        """Refuse a speculative request that cannot build on the newest round once `previous` is applied."""
        if opened is None:  # without a parent it may have overtaken the plain proposal: `propose` waits for it then
            raise (_NoOpenRound if parent is None else FailedPrecondition)(
                "no open round to propose on top of (after the previous outcome)", "speculative")
        if previous is not None and not apply and opened.opened_by != previous:
            raise FailedPrecondition(f"round {previous.round_id!r} is not the round before the open one: a newer "
                                     "round is open", "previous.round_id")
        newest = (chain[-1] if chain else opened).round_id
        if parent == newest or (parent is None and not chain):
            if len(chain) >= MAX_CHAINED:
                raise FailedPrecondition(f"{len(chain)} rounds are already proposed on top of the open round "
                                         f"{opened.round_id!r}, the most", "parent_round_id")
            return
        if parent is None:
            raise FailedPrecondition(f"round {newest!r} is already proposed on top of the open round", "speculative")
        if all(r.round_id != parent for r in (self.round, *self.speculations, self.earlier) if r is not None):
            raise NotFound(f"no round {parent!r} in this draft session to build on", "parent_round_id", parent)
        raise FailedPrecondition(f"round {parent!r} is not the newest round ({newest!r} is)", "parent_round_id")

    def _check_room(self, k: int) -> None:
        """Refuse a speculation of k drafts the drafter cannot hold on top of what is staged (asked before the outcome
        is applied, which only frees room; one made ahead is taken or replaced, so its room counts as free)."""
        if not self.drafter.can_speculate(k, replacing_last=self.ahead is not None):
            capacity = self.drafter.state.recurrent.log_capacity
            raise FailedPrecondition(f"no room in the draft's logs ({capacity} tokens) "
                                     f"for another round of {k} drafts", "k")

    def _ahead_of(self, rnd: DraftRound, k: int) -> None:
        if self.pipelining and k:
            threading.Thread(target=self._speculate_ahead, args=(rnd, k), daemon=True).start()

    def _speculate_ahead(self, rnd: DraftRound, k: int) -> None:
        """Speculate on `rnd` before the caller asks, if it is still the newest round (the open one with nothing on
        top, or the last speculation) and there is room."""
        self.answers.wait()
        with self.lock:
            newest = self.speculations[-1] if self.speculations else self.round
            if newest is not rnd or rnd.state != "proposed" or self.waiting:
                return
            if self.ahead is None and self.drafter.can_speculate(k):
                made = self.drafter.speculate(k, lambda: self.waiting)
                if self.waiting:
                    self.drafter.discard_last()  # a plain proposal is waiting: it would drop this one
                    return
                self.ahead = (rnd, k, *made)
            self._branch()

    def _branch(self) -> None:
        """Stage the next round for the open round's likeliest misses, as many as its running acceptance suggests
        rejections per round, while no request waits (under the lock)."""
        rnd = self.round
        if not self.max_branches or rnd is None or rnd.state != "proposed" or not rnd.proposal.tokens:
            return
        n = min(self.max_branches, round(rnd.k * (1 - self.acceptance)))
        if n:
            self.drafter.stage_branches(n, rnd.k, lambda accepted, token: (self.waiting or self.queued > 0)
                                        and not self._asks_for(rnd, accepted, token))

    def _asks_for(self, rnd: DraftRound, accepted: int, token: int) -> bool:
        """Whether the plain proposal waiting comes with this outcome of `rnd`: the branch for it goes on."""
        incoming = self.incoming
        return incoming is not None and incoming == Outcome(rnd.round_id, accepted, token)

    def commit(self, outcome: Outcome) -> None:
        with self.lock:
            if self._check_outcome(outcome, "outcome"):
                self._apply(outcome)

    def revert(self, round_id: str) -> None:
        with self.lock:
            rnd = self._round(round_id, "round_id")
            if rnd.state == "committed":
                raise FailedPrecondition(f"round {round_id!r} is already committed", "round_id")
            if rnd in self.speculations:  # it and every round on top of it go
                i = self.speculations.index(rnd)
                for _ in range(len(self.speculations) - i + (self.ahead is not None)):
                    self.drafter.discard_last()
                for above in self.speculations[i + 1:]:
                    above.state = "dropped"
                self.speculations, self.ahead = self.speculations[:i], None
            elif rnd.state == "proposed":
                self._drop_speculative()
            rnd.state = "reverted"  # the next proposal starts again from the same history

    def _after(self, outcome: Outcome) -> tuple[DraftRound | None, list[DraftRound]]:
        """The open round and the speculations on top of it once `outcome` (checked, new) is applied: a speculation
        is opened when the round below keeps every draft and is followed by its guess; all are dropped otherwise."""
        rounds = [self.round, *self.speculations]
        i = next(i for i, r in enumerate(rounds) if r is not None and r.round_id == outcome.round_id)
        rnd, above = rounds[i], rounds[i + 1:]
        if above and outcome.accepted == len(rnd.proposal.tokens) and outcome.next_token == above[0].guess:  # type: ignore[union-attr]
            return above[0], above[1:]
        return None, []

    def _check_outcome(self, outcome: Outcome, field_name: str) -> bool:
        """Validate an outcome; True when it still has to be applied, False for a repeat."""
        rnd = self._round(outcome.round_id, f"{field_name}.round_id")
        if rnd.state == "committed":
            if rnd.outcome != outcome:
                raise FailedPrecondition(f"round {outcome.round_id!r} was committed with another outcome",
                                         field_name)
            return False
        if rnd.state in ("reverted", "dropped"):
            raise FailedPrecondition(f"round {outcome.round_id!r} was {rnd.state}", f"{field_name}.round_id")
        if not 0 <= outcome.accepted <= len(rnd.proposal.tokens):
            raise InvalidArgument(f"accept count {outcome.accepted} is outside [0, {len(rnd.proposal.tokens)}] "
                                  f"proposed in round {outcome.round_id!r}", f"{field_name}.accepted")
        check_tokens([outcome.next_token], self.vocab_size, f"{field_name}.next_token")
        return True

    def _apply(self, outcome: Outcome) -> None:
        for above in list(self.speculations):  # an outcome naming a speculation: every round below kept all, then
            if outcome.round_id == self.round.round_id:  # type: ignore[union-attr]  # the guess above it
                break
            self._apply(Outcome(self.round.round_id, len(self.round.proposal.tokens), above.guess))  # type: ignore
        rnd = self.round
        if rnd.proposal.tokens:  # type: ignore[union-attr]
            kept = outcome.accepted / len(rnd.proposal.tokens)  # type: ignore[union-attr]
            self.acceptance += ACCEPTANCE_WEIGHT * (kept - self.acceptance)
        opened, _ = self._after(outcome)
        if self.ahead is not None and opened is None:
            self.ahead = None  # made ahead, never asked for, on a round the outcome drops: it ends
            self.drafter.discard_last()
        self.drafter.advance(outcome.accepted, outcome.next_token)  # keeps the first speculation or drops all
        self.length += outcome.accepted + 1
        rnd.state, rnd.outcome = "committed", outcome  # type: ignore[union-attr]
        if opened is not None:
            self.earlier, self.round = rnd, self.speculations.pop(0)
            self.round.opened_by = outcome
        else:
            self._drop_speculative()

    def _drop_speculative(self) -> None:
        for spec in self.speculations:
            spec.state = "dropped"
        if self.speculations:
            self.earlier, self.speculations = self.speculations[0], []

    def _round(self, round_id: str, field_name: str) -> DraftRound:
        for rnd in (self.round, *self.speculations, self.earlier):
            if rnd is not None and rnd.round_id == round_id:
                return rnd
        raise NotFound(f"no round {round_id!r} in this draft session", field_name, round_id)
