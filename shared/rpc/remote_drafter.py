"""A DraftService peer behind the `Drafter` protocol: the loop never knows the draft is remote.

Failure never stops decoding. When the peer is unreachable, slower than its per-round timeout,
or answers something malformed, the round runs without drafts (target-only rounds give the same
tokens), and the rounds of the next 10 ms go without the draft, the pause doubling with each failure in a row up
to `max_backoff_s` (4 s; a time, not a count of rounds, so it is the same on a fast and a slow target;
`deltaspec.shared.rpc.recovery`), so a dead or slow draft costs little, and one that comes back is tried again at
most 4 s later. The draft session is then rebuilt from the committed history, which
this class keeps, so speculation resumes exactly where the sequence is.

Each round costs one Propose: it carries the previous round's outcome. The session is asked for at
`start`, without waiting, so its round trip overlaps what the caller does next (the target prefilling
the prompt); the first Propose waits for it, and `close` closes it even if no Propose came.

Pipelined rounds (`speculate_async`): a speculative Propose asks the peer for the next round on top
of the open one, as if the open round kept every draft and were followed by the peer's guess (returned
with the proposal). `advance` makes it the open round when the outcome matches; the outcome then
travels with the next Propose, which the peer reads as confirming the speculation. The draft works
two rounds ahead: `speculate_async(k, after=(a, t))` asks, before the first speculation is answered,
for the round after it, carrying the open round's outcome (a, t) and naming the first speculation as
its parent (`parent_round_id`): the peer applies the outcome, and when it confirms the first
speculation, proposes on top of it; otherwise it refuses and changes nothing. After a miss,
`propose_and_speculate` sends the plain Propose and the speculation on top of it together, and a second
speculation naming the first once the first is answered, so the peer never sees it first. Requests
leave in call order without waiting for replies. A speculation no longer wanted is not waited for when
it names its round (by the outcome that opened it, or as its parent): the peer then refuses it if it
arrives after a newer round; a normal Propose waits only for the others (a first round's speculation,
which has neither), so no late speculation lands on a newer round. A refused speculation costs only the
pipelining; a failed one is handled like a failed Propose, unless it was no longer wanted (a plain round asked for
since, or the session closed: `close` cancels those in flight), which is nobody's failure.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc

from deltaspec.v1 import draft_service_pb2, draft_service_pb2_grpc
from deltaspec.shared.decoding.drafters import Proposal
from deltaspec.shared.decoding.pipelined import NOTHING
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.errors import InvalidArgument
from deltaspec.shared.rpc.convert import probs_from_proto, sampling_to_proto
from deltaspec.shared.rpc import recovery

log = logging.getLogger(__name__)


class MalformedProposal(ValueError):
    """The draft answered something no honest draft would."""


@dataclass
class _Speculation:
    """A speculative Propose sent to the peer; `done` resolves to (guess, proposal), or None when refused or failed."""

    round_id: str
    delivers: draft_service_pb2.RoundOutcome | None  # the outcome it carried
    builds_on: str = ""  # the round it names as its parent ("": none named, the open round)
    behind: grpc.Future | None = None  # the plain Propose it was sent with: a failure of both is one failure
    call: grpc.Future | None = None  # its own Propose, once sent
    abandoned: bool = False  # no longer wanted: its failure is not the peer's
    done: Future = field(default_factory=Future)
    answered: bool = False  # the peer accepted it (and applied `delivers`)
    guess: int = 0
    tokens: list[int] = field(default_factory=list)

    @property
    def guarded(self) -> bool:
        """It names its round (by the outcome that opened it, or as its parent): the peer refuses it late."""
        return self.delivers is not None or bool(self.builds_on)


class RemoteDrafter:
    def __init__(self, stub: draft_service_pb2_grpc.DraftServiceStub, sampling: SamplingParams, vocab_size: int,
                 timeout_s: float = 1.0, deadline: float | None = None,
                 max_backoff_s: float = recovery.DRAFT_PAUSE_CAP_S,
                 open_early: bool = True) -> None:
        """`open_early`: ask for the peer's session at `start` (its round trip overlaps the target's prefill); else
        at the first proposal, for a loop that may draft nothing for a while (a cost model's k = 0)."""
        self.stub, self.sampling, self.vocab_size = stub, sampling, vocab_size
        self.open_early = open_early
        self.timeout_s, self.deadline, self.max_backoff_s = timeout_s, deadline, max_backoff_s
        self.failures = 0  # rounds in which the peer failed
        self.lock = threading.RLock()  # replies are folded in on gRPC's threads
        self.closing: set[grpc.Future] = set()  # CloseSession calls in flight: gRPC cancels a call it collects
        self.session_id: str | None = None
        self.opening: grpc.Future | None = None  # the peer's session, asked for at `start` and not yet used
        self.speculations: list[_Speculation] = []  # set again by `start`: here for the `close` it begins with
        self.abandoned: list[_Speculation] = []
        self.start([])

    def start(self, prompt_ids: list[int]) -> None:
        self.close()  # a drafter used again: its last session goes first
        self.history = list(prompt_ids)  # committed tokens; a new draft session starts from them
        self.rounds = 0
        self.round_id: str | None = None  # this round's proposal, when the peer made one
        self.proposed: list[int] = []
        self.previous: draft_service_pb2.RoundOutcome | None = None
        self.opened_by: draft_service_pb2.RoundOutcome | None = None  # the outcome the open round was proposed with
        self.speculations: list[_Speculation] = []  # sent on top of the open round, each on the one before
        self.abandoned: list[_Speculation] = []  # in flight, no longer wanted: answered before the next Propose
        self.consecutive_failures = 0
        self.paused_until = 0.0  # time.monotonic() before which rounds go without the draft (after a failure)
        timeout = self._timeout()  # the session is asked for at once: its round trip overlaps the target's prefill
        if self.history and timeout > 0 and self.open_early:
            self.opening = self.stub.CreateSession.future(self._create_request(), timeout=timeout)

    def propose(self, k: int) -> Proposal:
        return self.propose_and_speculate(k, 0)[0]

    def drafts_dynamically(self) -> bool:
        """Whether the peer ends proposals early where it is unsure (a dynamic draft length), as the session
        opened at `start` says; waits for it. False when it did not open (the rounds then run without drafts)."""
        try:
            return self.opening is not None and self.opening.result().stop_below > 0
        except grpc.RpcError:
            return False

    def propose_and_speculate(self, k: int, k_next: int, k_third: int = 0) -> tuple[Proposal, Future, Future]:
        """`propose(k)`, and with k_next > 0 the speculative request for the round after it (k_next tokens) sent right
        behind it, before its answer is back: a future of (guess, proposal) | None; with k_third > 0 also the one on
        top of that (sent once the first is answered). After a miss this saves the caller round trips: the
        speculations are made while the target verifies the new round, not after. The peer answers them once the
        proposal is made: the first waits there for the plain request should it overtake it, the second leaves
        only once the first is answered."""
        for spec in [*self.abandoned, *self.speculations]:  # a late speculation must not land on the new round
            spec.abandoned = True
            if not spec.guarded:
                spec.done.result()
        self.abandoned, self.speculations = [], []
        self.rounds += 1
        self.round_id, self.proposed = None, []
        timeout = self._timeout()
        if k == 0 or self.paused_s > 0 or timeout <= 0:
            self.close(wait=False)  # it misses this round's outcome: free it now (a dropped id would hold a slot
            # until its TTL; the last round of every generation has k = 0), rebuild it next time; the round does not
            # wait for the answer
            return Proposal([]), NOTHING, NOTHING
        round_id = f"r{self.rounds}"
        speculation = third = NOTHING
        try:
            if self.session_id is None:
                opening, self.opening = self.opening, None
                self.session_id = (opening.result() if opening is not None else
                                   self.stub.CreateSession(self._create_request(), timeout=timeout)).session_id
                self.previous = None
            call = self.stub.Propose.future(draft_service_pb2.ProposeRequest(
                session_id=self.session_id, round_id=round_id, k=k, previous=self.previous), timeout=self._timeout())
            if k_next:
                with self.lock:  # on top of the round asked for: named by the outcome that opens it, when there is one
                    speculation = self._send_speculation(k_next, self.previous, behind=call)
                    if k_third and self.speculations and self.speculations[-1].done is speculation:
                        third = self._send_speculation(k_third, None, self.speculations[-1], after_answer=True)
            proposal = self._check(call.result(), k)
        except (grpc.RpcError, MalformedProposal) as e:
            for spec in self.speculations:
                spec.abandoned = True
            self.abandoned, self.speculations = self.speculations, []
            self._failed(e)
            return Proposal([]), NOTHING, NOTHING
        self.consecutive_failures = 0
        self.round_id, self.proposed = round_id, proposal.tokens
        self.opened_by, self.previous = self.previous, None  # the outcome is folded in
        return proposal, speculation, third

    def speculate(self, k: int) -> tuple[int, Proposal] | None:
        """The next round's proposal if the open one keeps every draft, and the token the peer assumes after them."""
        return self.speculate_async(k).result()

    def speculate_async(self, k: int, after: tuple[int, int] | None = None) -> Future:
        """Send a speculative Propose now; a future of (guess, proposal), or None. Without `after`: the round on
        top of the open one. With `after` = (accepted, next token) of the open round, while the first speculation
        is unanswered: the round on top of that speculation, if the outcome confirms it."""
        with self.lock:
            self.speculations = [s for s in self.speculations if not s.done.done() or s.answered]
            if (self.session_id is None or self.round_id is None
                    or len(self.speculations) != (0 if after is None else 1)):
                return NOTHING
            if after is None:
                return self._send_speculation(k, self.opened_by if self.previous is None else self.previous)
            outcome = draft_service_pb2.RoundOutcome(round_id=self.round_id, accepted=after[0], next_token=after[1])
            return self._send_speculation(k, outcome, self.speculations[0])

    def _send_speculation(self, k: int, previous: draft_service_pb2.RoundOutcome | None,
                          parent: _Speculation | None = None, after_answer: bool = False,
                          behind: grpc.Future | None = None) -> Future:
        """Send a speculative Propose carrying `previous` and naming `parent` as the round it builds on (under the
        lock); with `after_answer` it leaves once `parent` is answered (the peer knows it then), and not at all if
        that one is refused. `behind`: the plain Propose sent just before it."""
        timeout = self._timeout()
        if k == 0 or timeout <= 0:
            return NOTHING
        self.rounds += 1
        spec = _Speculation(f"r{self.rounds}", previous, parent.round_id if parent else "", behind=behind)
        self.speculations.append(spec)
        if after_answer and parent is not None:
            parent.done.add_done_callback(lambda _: self._request(spec, k, parent))
        else:
            self._request(spec, k, None)
        return spec.done

    def _request(self, spec: _Speculation, k: int, parent: _Speculation | None) -> None:
        with self.lock:
            if parent is not None and (not parent.answered or spec.abandoned or self.session_id is None):
                spec.done.set_result(None)
                return
            call = spec.call = self.stub.Propose.future(draft_service_pb2.ProposeRequest(
                session_id=self.session_id, round_id=spec.round_id, k=k, previous=spec.delivers, speculative=True,
                parent_round_id=spec.builds_on), timeout=self._timeout())
        call.add_done_callback(lambda c: self._answered(spec, c, k))

    def _answered(self, spec: _Speculation, call, k: int) -> None:
        result = None
        try:
            reply = call.result()
            proposal = self._check(reply, k)
            if not reply.HasField("assumed_next_token") or reply.assumed_next_token >= self.vocab_size:
                raise MalformedProposal("a speculative proposal without a valid assumed next token")
        except grpc.RpcError as e:
            # refused (the outcome did not confirm the round below, it came after a newer round, or before the
            # round it names): nothing changed on the peer; the answer to one no longer wanted does not matter
            refused = e.code() == grpc.StatusCode.FAILED_PRECONDITION or \
                (spec.builds_on and e.code() == grpc.StatusCode.NOT_FOUND)
            if not refused:  # behind a plain Propose, it fails with it (it waits for it at the peer): counted once
                (spec.behind or NOTHING).add_done_callback(  # `e` is unbound once this block ends: bind it
                    lambda plain, error=e: self._failed_alone(spec, plain, error))
        except MalformedProposal as e:
            with self.lock:
                self._failed(e)
        except grpc.FutureCancelledError:
            pass  # `close` cancelled it
        else:
            with self.lock:
                self.consecutive_failures = 0
                spec.answered, spec.guess, spec.tokens = True, reply.assumed_next_token, proposal.tokens
                if self.previous == spec.delivers:
                    self.previous = None  # the peer applied it
            result = (reply.assumed_next_token, proposal)
        spec.done.set_result(result)

    def _failed_alone(self, spec: _Speculation, plain: Future, e: grpc.RpcError) -> None:
        """A speculation failed: a failure unless it is no longer wanted or the plain Propose before it failed too."""
        with self.lock:
            if not spec.abandoned and plain.exception() is None:
                self._failed(e)

    def advance(self, accepted: int, next_token: int) -> None:
        """The open round's outcome. Call it once its first speculation, if any, is answered, unless the outcome
        keeps fewer than all drafts (the speculation is dropped then)."""
        with self.lock:
            self.history += [*self.proposed[:accepted], next_token]
            outcome = (draft_service_pb2.RoundOutcome(round_id=self.round_id, accepted=accepted, next_token=next_token)
                       if self.round_id else None)
            first = self.speculations[0] if self.speculations else None
            if first is not None and first.answered and accepted == len(self.proposed) and next_token == first.guess:
                self.round_id, self.proposed = first.round_id, first.tokens  # the peer's speculation is the open round
                self.opened_by = outcome
                self.speculations.pop(0)
                delivered = any(s.answered and s.delivers == outcome for s in self.speculations)
                self.previous = None if delivered else outcome  # else still to deliver
            else:
                self.previous = outcome
                for spec in self.speculations:
                    spec.abandoned = True
                self.abandoned += [s for s in self.speculations if not s.done.done()]
                self.speculations = []

    @property
    def paused_s(self) -> float:
        """Seconds left before the draft is tried again (0: it is tried this round)."""
        return max(0.0, self.paused_until - time.monotonic())

    def _failed(self, e: Exception) -> None:
        self.failures += 1
        self.consecutive_failures += 1
        pause = min(recovery.DRAFT_PAUSE_START_S * 2 ** (self.consecutive_failures - 1), self.max_backoff_s)
        self.paused_until = time.monotonic() + pause
        self.close(wait=False)  # a session is rebuilt later: free this one now (else it holds a slot to its TTL)
        log.warning("draft failed (%s); no speculation for %.2f s", _describe(e), pause)

    def _create_request(self) -> draft_service_pb2.DraftServiceCreateSessionRequest:
        return draft_service_pb2.DraftServiceCreateSessionRequest(token_ids=self.history, sparse_probs=True,
                                                                  sampling=sampling_to_proto(self.sampling))

    def close(self, wait: bool = True) -> None:
        """Free the peer's session; best effort (it expires on its own anyway). `wait=False`: send and go on.
        Speculations still in flight are no longer wanted: cancelled, so none fails (and counts) after the end."""
        with self.lock:
            unwanted = [*self.abandoned, *self.speculations]
            for spec in unwanted:
                spec.abandoned = True
        for spec in unwanted:
            if spec.call is not None:
                spec.call.cancel()
        opening, self.opening = self.opening, None
        if opening is not None:  # opened at `start` and never used: it is closed as soon as it exists
            try:
                self.session_id = opening.result().session_id
            except grpc.RpcError:
                pass
        if self.session_id is not None:
            request = draft_service_pb2.DraftServiceCloseSessionRequest(session_id=self.session_id)
            if wait:
                try:
                    self.stub.CloseSession(request, timeout=min(self.timeout_s, 1.0))
                except grpc.RpcError:
                    pass
            else:
                call = self.stub.CloseSession.future(request, timeout=min(self.timeout_s, 1.0))
                self.closing.add(call)
                call.add_done_callback(self.closing.discard)
            self.session_id = None

    def _timeout(self) -> float:
        return self.timeout_s if self.deadline is None else min(self.timeout_s, self.deadline - time.monotonic())

    def _check(self, reply: draft_service_pb2.ProposeResponse, k: int) -> Proposal:
        tokens = list(reply.draft_tokens)
        if len(tokens) > k or any(t >= self.vocab_size for t in tokens):
            raise MalformedProposal(f"{len(tokens)} tokens for k = {k}, or a token outside the vocabulary")
        if self.sampling.greedy:
            return Proposal(tokens)
        try:
            return Proposal(tokens, probs_from_proto(reply, tokens, self.vocab_size))
        except InvalidArgument as e:
            raise MalformedProposal(str(e)) from None


def _describe(e: Exception) -> str:
    return f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)  # type: ignore[attr-defined]


