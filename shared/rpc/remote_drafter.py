"""A DraftService peer behind the `Drafter` protocol: the loop never knows the draft is remote.

Failure never stops decoding. When the peer is unreachable, slower than its per-round timeout,
or answers something malformed, the round runs without drafts (target-only rounds give the same
tokens), and the next attempts wait 1, 2, 4 ... up to `max_backoff_rounds` rounds so a dead or
slow draft costs little. The draft session is then rebuilt from the committed history, which
this class keeps, so speculation resumes exactly where the sequence is.

Each round costs one Propose: it carries the previous round's outcome.

Pipelined rounds (`speculate`): a speculative Propose asks the peer for the next round on top of
the open one, as if the open round kept every draft and were followed by the peer's guess (returned
with the proposal). `advance` makes it the open round when the outcome matches; the outcome then
travels with the next Propose, which the peer reads as confirming the speculation. A failed
speculation costs only the pipelining: it is handled like a failed Propose.
"""
from __future__ import annotations

import logging
import time

import grpc

from deltaspec.v1 import draft_service_pb2, draft_service_pb2_grpc
from shared.decoding.drafters import Proposal
from shared.decoding.sampling import SamplingParams
from shared.errors import InvalidArgument
from shared.rpc.convert import probs_from_proto, sampling_to_proto

log = logging.getLogger(__name__)


class MalformedProposal(ValueError):
    """The draft answered something no honest draft would."""


class RemoteDrafter:
    def __init__(self, stub: draft_service_pb2_grpc.DraftServiceStub, sampling: SamplingParams, vocab_size: int,
                 timeout_s: float = 1.0, deadline: float | None = None, max_backoff_rounds: int = 32) -> None:
        self.stub, self.sampling, self.vocab_size = stub, sampling, vocab_size
        self.timeout_s, self.deadline, self.max_backoff_rounds = timeout_s, deadline, max_backoff_rounds
        self.failures = 0  # rounds in which the peer failed
        self.start([])

    def start(self, prompt_ids: list[int]) -> None:
        self.history = list(prompt_ids)  # committed tokens; a new draft session starts from them
        self.session_id: str | None = None
        self.rounds = 0
        self.round_id: str | None = None  # this round's proposal, when the peer made one
        self.proposed: list[int] = []
        self.previous: draft_service_pb2.RoundOutcome | None = None
        self.speculation: tuple[str, int, list[int]] | None = None  # (round id, guess, tokens) on the open round
        self.skip = self.consecutive_failures = 0

    def propose(self, k: int) -> Proposal:
        self.rounds += 1
        self.round_id, self.proposed, self.speculation = None, [], None
        timeout = self._timeout()
        if k == 0 or self.skip or timeout <= 0:
            self.skip = max(0, self.skip - 1)
            self.close()  # it misses this round's outcome: free it now (a dropped id would hold a slot until
            # its TTL; the last round of every generation has k = 0), rebuild it next time
            return Proposal([])
        round_id = f"r{self.rounds}"
        try:
            if self.session_id is None:
                self.session_id = self.stub.CreateSession(draft_service_pb2.DraftServiceCreateSessionRequest(
                    token_ids=self.history, sampling=sampling_to_proto(self.sampling)), timeout=timeout).session_id
                self.previous = None
            reply = self.stub.Propose(draft_service_pb2.ProposeRequest(
                session_id=self.session_id, round_id=round_id, k=k, previous=self.previous), timeout=self._timeout())
            proposal = self._check(reply, k)
        except (grpc.RpcError, MalformedProposal) as e:
            self._failed(e)
            return Proposal([])
        self.consecutive_failures = 0
        self.round_id, self.proposed, self.previous = round_id, proposal.tokens, None  # the outcome is folded in
        return proposal

    def speculate(self, k: int) -> tuple[int, Proposal] | None:
        """The next round's proposal if the open one keeps every draft, and the token the peer assumes after them."""
        timeout = self._timeout()
        if k == 0 or self.session_id is None or self.round_id is None or timeout <= 0:
            return None
        self.rounds += 1
        round_id = f"r{self.rounds}"
        try:
            reply = self.stub.Propose(draft_service_pb2.ProposeRequest(
                session_id=self.session_id, round_id=round_id, k=k, previous=self.previous, speculative=True),
                timeout=timeout)
            proposal = self._check(reply, k)
            if not reply.HasField("assumed_next_token") or reply.assumed_next_token >= self.vocab_size:
                raise MalformedProposal("a speculative proposal without a valid assumed next token")
        except (grpc.RpcError, MalformedProposal) as e:
            self._failed(e)
            return None
        self.consecutive_failures = 0
        self.previous = None
        self.speculation = (round_id, reply.assumed_next_token, proposal.tokens)
        return reply.assumed_next_token, proposal

    def advance(self, accepted: int, next_token: int) -> None:
        self.history += [*self.proposed[:accepted], next_token]
        self.previous = (draft_service_pb2.RoundOutcome(round_id=self.round_id, accepted=accepted,
                                                         next_token=next_token) if self.round_id else None)
        spec, self.speculation = self.speculation, None
        if spec is not None and accepted == len(self.proposed) and next_token == spec[1]:
            self.round_id, self.proposed = spec[0], spec[2]  # the peer's speculation is the open round now

    def _failed(self, e: Exception) -> None:
        self.failures += 1
        self.consecutive_failures += 1
        self.skip = min(2 ** (self.consecutive_failures - 1), self.max_backoff_rounds)
        self.session_id = None
        log.warning("draft failed (%s); %d round(s) without speculation", _describe(e), self.skip)

    def close(self) -> None:
        """Free the peer's session; best effort (it expires on its own anyway)."""
        if self.session_id is not None:
            try:
                self.stub.CloseSession(draft_service_pb2.DraftServiceCloseSessionRequest(session_id=self.session_id),
                                       timeout=min(self.timeout_s, 1.0))
            except grpc.RpcError:
                pass
            self.session_id = None

    def _timeout(self) -> float:
        return self.timeout_s if self.deadline is None else min(self.timeout_s, self.deadline - time.monotonic())

    def _check(self, reply: draft_service_pb2.ProposeResponse, k: int) -> Proposal:
        tokens = list(reply.draft_tokens)
        if len(tokens) > k or any(t >= self.vocab_size for t in tokens):
            raise MalformedProposal(f"{len(tokens)} tokens for k = {k}, or a token outside the vocabulary")
        if self.sampling.greedy or not reply.draft_probs:
            return Proposal(tokens)
        try:
            return Proposal(tokens, probs_from_proto(reply.draft_probs, tokens, self.vocab_size, "draft_probs"))
        except InvalidArgument as e:
            raise MalformedProposal(str(e)) from None


def _describe(e: Exception) -> str:
    return f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)  # type: ignore[attr-defined]


