"""DraftService: convert messages, call the engine (`DraftSession`), convert back.

Draft probabilities travel only when the session samples (temperature > 0): greedy verification
never reads them, and they cost k * vocab * 4 bytes a round.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from opentelemetry import trace

from deltaspec.v1 import draft_service_pb2 as pb
from deltaspec.v1 import draft_service_pb2_grpc
from deltaspec.shared.decoding.batcher import BatchConfig, serving
from deltaspec.shared.decoding.draft_session import DraftSession, Outcome
from deltaspec.shared.decoding.session_table import Limits, SessionTable
from deltaspec.shared.decoding.target import MAX_DRAFT_TOKENS
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.state.spec import CHAIN_LOG_CAPACITY
from deltaspec.shared.rpc.convert import put_probs, sampling_from_proto
from deltaspec.shared.rpc.security import caller
from deltaspec.shared.rpc.server import Service, answered_call
from deltaspec.shared.telemetry import Telemetry
from deltaspec.shared.telemetry import attributes as attr

NAME = pb.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServicer(draft_service_pb2_grpc.DraftServiceServicer):
    def __init__(self, load: Callable[[], HybridLM], limits: Limits = Limits(), telemetry: Telemetry | None = None,
                 batching: BatchConfig | None = BatchConfig(), stop_below: float = 0.0, branches: int = 0) -> None:
        self._load, self.limits, self.batching = load, limits, batching
        self.stop_below = stop_below  # dynamic draft length (`ModelDrafter`): 0 proposes exactly k
        self.branches = branches  # next rounds staged per round for likely misses, at most (`DraftSession`)
        self.sessions: SessionTable[DraftSession] = SessionTable(limits)
        self.telemetry = telemetry or Telemetry()
        self.telemetry.metrics.watch_sessions([self.sessions])

    def load(self) -> None:
        self.model = serving(self._load(), self.limits, self.batching, self.telemetry.metrics, CHAIN_LOG_CAPACITY)

    async def CreateSession(self, request: pb.DraftServiceCreateSessionRequest,
                            context) -> pb.DraftServiceCreateSessionResponse:
        sampling = sampling_from_proto(request.sampling)
        self.limits.check_prompt(len(request.token_ids), "token_ids")
        self.sessions.reserve(caller())
        session = await asyncio.to_thread(DraftSession, self.model, list(request.token_ids), sampling, self.stop_below,
                                          answers_sent_by_caller=True,
                                          speculation_ended=self.telemetry.metrics.speculation_ended,
                                          branches=self.branches, branch_ended=self.telemetry.metrics.branch_ended)
        session.sparse_probs = request.sparse_probs
        return pb.DraftServiceCreateSessionResponse(session_id=self.sessions.add(session, caller()),
                                                    max_draft_tokens=MAX_DRAFT_TOKENS, stop_below=self.stop_below)

    async def Propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        previous = _outcome(request.previous) if request.HasField("previous") else None
        with self.sessions.use(request.session_id, caller()) as session:
            started = time.perf_counter()
            rnd = await answered_call(session.answers, session.propose, request.round_id, request.k, previous,
                                      request.speculative, request.parent_round_id or None)
            self.telemetry.metrics.propose_seconds.observe(time.perf_counter() - started)
            greedy = session.drafter.sampling.greedy
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({attr.SESSION_ID: request.session_id, attr.ROUND_ID: request.round_id,
                                 attr.DRAFT_TOKENS: len(rnd.proposal.tokens)})
        reply = pb.ProposeResponse(draft_tokens=rnd.proposal.tokens, assumed_next_token=rnd.guess)
        put_probs(reply, rnd.proposal.probs, greedy, session.sparse_probs)
        return reply

    async def Commit(self, request: pb.DraftServiceCommitRequest, context) -> pb.DraftServiceCommitResponse:
        with self.sessions.use(request.session_id, caller()) as session:
            await asyncio.to_thread(session.commit, _outcome(request.outcome))
        return pb.DraftServiceCommitResponse()

    async def Revert(self, request: pb.DraftServiceRevertRequest, context) -> pb.DraftServiceRevertResponse:
        with self.sessions.use(request.session_id, caller()) as session:
            await asyncio.to_thread(session.revert, request.round_id)
        return pb.DraftServiceRevertResponse()

    async def CloseSession(self, request: pb.DraftServiceCloseSessionRequest,
                           context) -> pb.DraftServiceCloseSessionResponse:
        self.sessions.remove(request.session_id, caller())
        return pb.DraftServiceCloseSessionResponse()


def _outcome(msg: pb.RoundOutcome) -> Outcome:
    return Outcome(msg.round_id, msg.accepted, msg.next_token)


def service(load: Callable[[], HybridLM], limits: Limits = Limits(), telemetry: Telemetry | None = None,
            batching: BatchConfig | None = BatchConfig(), stop_below: float = 0.0, branches: int = 0) -> Service:
    servicer = DraftServicer(load, limits, telemetry, batching, stop_below, branches)
    return Service(NAME, lambda server: draft_service_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server),
                   servicer.load)
