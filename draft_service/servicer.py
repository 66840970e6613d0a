"""DraftService: convert messages, call the engine (`DraftSession`), convert back.

Draft probabilities travel only when the session samples (temperature > 0): greedy verification
never reads them, and they cost k * vocab * 4 bytes a round.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from deltaspec.v1 import draft_service_pb2 as pb
from deltaspec.v1 import draft_service_pb2_grpc
from shared.decoding.draft_session import DraftSession, Outcome
from shared.decoding.session_table import Limits, SessionTable
from shared.decoding.target import MAX_DRAFT_TOKENS
from shared.model.hybrid import HybridLM
from shared.rpc.convert import probs_to_proto, sampling_from_proto
from shared.rpc.server import Service

NAME = pb.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServicer(draft_service_pb2_grpc.DraftServiceServicer):
    def __init__(self, load: Callable[[], HybridLM], limits: Limits = Limits()) -> None:
        self._load, self.limits = load, limits
        self.sessions: SessionTable[DraftSession] = SessionTable(limits)

    def load(self) -> None:
        self.model = self._load()

    async def CreateSession(self, request: pb.DraftServiceCreateSessionRequest,
                            context) -> pb.DraftServiceCreateSessionResponse:
        sampling = sampling_from_proto(request.sampling)
        self.limits.check_prompt(len(request.token_ids), "token_ids")
        self.sessions.reserve()
        session = await asyncio.to_thread(DraftSession, self.model, list(request.token_ids), sampling)
        return pb.DraftServiceCreateSessionResponse(session_id=self.sessions.add(session),
                                                    max_draft_tokens=MAX_DRAFT_TOKENS)

    async def Propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        previous = _outcome(request.previous) if request.HasField("previous") else None
        with self.sessions.use(request.session_id) as session:
            proposal = await asyncio.to_thread(session.propose, request.round_id, request.k, previous)
            greedy = session.drafter.sampling.greedy
        return pb.ProposeResponse(draft_tokens=proposal.tokens, draft_probs=probs_to_proto(proposal.probs, greedy))

    async def Commit(self, request: pb.DraftServiceCommitRequest, context) -> pb.DraftServiceCommitResponse:
        with self.sessions.use(request.session_id) as session:
            await asyncio.to_thread(session.commit, _outcome(request.outcome))
        return pb.DraftServiceCommitResponse()

    async def Revert(self, request: pb.DraftServiceRevertRequest, context) -> pb.DraftServiceRevertResponse:
        with self.sessions.use(request.session_id) as session:
            await asyncio.to_thread(session.revert, request.round_id)
        return pb.DraftServiceRevertResponse()

    async def CloseSession(self, request: pb.DraftServiceCloseSessionRequest,
                           context) -> pb.DraftServiceCloseSessionResponse:
        self.sessions.remove(request.session_id)
        return pb.DraftServiceCloseSessionResponse()


def _outcome(msg: pb.RoundOutcome) -> Outcome:
    return Outcome(msg.round_id, msg.accepted, msg.next_token)


def service(load: Callable[[], HybridLM], limits: Limits = Limits()) -> Service:
    servicer = DraftServicer(load, limits)
    return Service(NAME, lambda server: draft_service_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server),
                   servicer.load)
