"""Bad input as a measured matrix over real gRPC, both services: every kind gets its documented status.

Each row is one kind of bad call: where in a round it is made, the status it must get, and the
field or resource its `google.rpc` detail must name (BadRequest for INVALID_ARGUMENT, ResourceInfo
for NOT_FOUND, PreconditionFailure, QuotaFailure). Never UNKNOWN or INTERNAL. The call is made in
the middle of a live generation (a target session and a draft session driven round by round);
afterwards the target session is as it was, and the generation finishes on exactly the tokens of
in-process target-only decoding, with the draft proposing exactly what it proposes in a run
without the bad call. The last test prints how many kinds were tried.
"""
from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from deltaspec.v1 import draft_service_pb2 as dpb
from deltaspec.v1 import sampling_pb2
from deltaspec.v1 import target_service_pb2 as pb
from deltaspec.shared.decoding.session_table import Limits
from deltaspec.shared.rpc.options import MAX_MESSAGE_BYTES
from deltaspec.shared.rpc.status import field_of, reason_of
from support import reference  # noqa: F401 - a fixture
from test_rpc_support import (PROMPT, draft_service, draft_stub, one_torch_thread, pair, start,  # noqa: F401
                              target_service, target_stub)

Code = grpc.StatusCode
K, N, VOCAB, MAX_PROMPT = 3, 10, 257, 64
U32 = 2**32 - 1
TTL_S = 0.3
TARGET, DRAFT = "/deltaspec.v1.TargetService/", "/deltaspec.v1.DraftService/"


@dataclass
class Servers:
    address: str
    target: object
    draft: object
    ttl_target: object  # the same services with a short idle TTL, for expired sessions
    ttl_draft: object


@pytest.fixture(scope="module")
def servers(pair):
    limits = Limits(max_prompt_tokens=MAX_PROMPT)
    with start(target_service(pair[0], limits), draft_service(pair[1], limits)) as main, \
            start(target_service(pair[0], Limits(ttl_s=TTL_S)), draft_service(pair[1], Limits(ttl_s=TTL_S))) as ttl:
        yield Servers(main.address, target_stub(main.address), draft_stub(main.address),
                      target_stub(ttl.address), draft_stub(ttl.address))


class Loop:
    """One greedy generation driven call by call: Propose on the draft, Verify and Commit on the target."""

    def __init__(self, s: Servers) -> None:
        self.s, self.t, self.d = s, s.target, s.draft
        self.sid = self.t.CreateSession(pb.CreateSessionRequest(prompt_ids=PROMPT)).session_id
        self.dsid = self.d.CreateSession(dpb.DraftServiceCreateSessionRequest(token_ids=PROMPT)).session_id
        self.tokens, self.version, self.n = list(PROMPT), 0, 0
        self.dround = self.tround = ""
        self.drafts: list[int] | None = None  # this round's proposal, until committed
        self.verdict: pb.VerifyResponse | None = None  # this round's verdict, until committed
        self.previous: dpb.RoundOutcome | None = None  # the last outcome the draft has not heard of yet
        self.proposals: dict[int, list[int]] = {}  # history length -> what the draft proposed there

    def _id(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def propose(self) -> None:
        self.dround = self._id("d")
        reply = self.d.Propose(dpb.ProposeRequest(session_id=self.dsid, round_id=self.dround, k=K,
                                                  previous=self.previous))
        self.drafts, self.previous = list(reply.draft_tokens), None
        self.proposals[len(self.tokens)] = self.drafts

    def verify(self) -> None:
        self.tround = self._id("t")
        self.verdict = self.t.Verify(self.verify_request())

    def verify_request(self, **changes) -> pb.VerifyRequest:
        fields = dict(session_id=self.sid, round_id=self.tround, base_version=self.version, draft_tokens=self.drafts)
        return pb.VerifyRequest(**{**fields, **changes})

    def commit(self) -> None:
        self.committed(self.t.Commit(pb.CommitRequest(session_id=self.sid, round_id=self.tround,
                                                      accepted=self.verdict.accepted)))

    def committed(self, reply: pb.CommitResponse) -> None:
        self.tokens += reply.committed_tokens
        self.version = reply.head_version
        self.previous = dpb.RoundOutcome(round_id=self.dround, accepted=self.verdict.accepted,
                                         next_token=self.verdict.next_token)
        self.drafts = self.verdict = None

    def outcome(self, **changes) -> dpb.RoundOutcome:
        """The outcome the draft is about to hear, with `changes`."""
        fields = dict(round_id=self.previous.round_id, accepted=self.previous.accepted,
                      next_token=self.previous.next_token)
        return dpb.RoundOutcome(**{**fields, **changes})

    def revert_target(self) -> None:
        self.t.Revert(pb.RevertRequest(session_id=self.sid, round_id=self.tround))
        self.verdict = None  # verified again under a new round id

    def revert_draft(self) -> None:
        self.d.Revert(dpb.DraftServiceRevertRequest(session_id=self.dsid, round_id=self.dround))
        self.drafts = None  # proposed again from the same history

    def run_to(self, phase: str) -> Loop:
        """One whole round, then up to `phase`: 'committed' (the draft not yet told), 'proposed' or 'verified'."""
        self.propose(), self.verify(), self.commit()
        if phase in ("proposed", "verified"):
            self.propose()
        if phase == "verified":
            self.verify()
        return self

    def finish(self) -> list[int]:
        while len(self.tokens) - len(PROMPT) < N:
            if self.drafts is None:
                self.propose()
            if self.verdict is None:
                self.verify()
            self.commit()
        self.t.CloseSession(pb.CloseSessionRequest(session_id=self.sid))
        self.d.CloseSession(dpb.DraftServiceCloseSessionRequest(session_id=self.dsid))
        return self.tokens[len(PROMPT):len(PROMPT) + N]

    def snapshot(self) -> pb.GetSessionResponse:
        return self.t.GetSession(pb.GetSessionRequest(session_id=self.sid))


def refused(call: Callable[[], object]) -> list[grpc.RpcError]:
    try:
        result = call()
    except grpc.RpcError as e:
        return [e]
    raise AssertionError(f"accepted: {result}")


def raw(s: Servers, method: str, payload: bytes, stream: bool = False, limit: int = MAX_MESSAGE_BYTES) -> object:
    """Send bytes as they are (the Python client refuses to build invalid messages), on a channel of its own."""
    with grpc.insecure_channel(s.address, options=[("grpc.max_send_message_length", limit)]) as ch:
        if stream:
            return list(ch.unary_stream(method)(payload, timeout=30))
        return ch.unary_unary(method)(payload, timeout=30)


def string_field(number: int, data: bytes) -> bytes:
    """A length-delimited protobuf field, bytes as given (no UTF-8 check)."""
    n, varint = len(data), b""
    while True:
        varint += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return bytes([number << 3 | 2]) + varint + data


BAD_UTF8 = b"def \xff\xfe(x):"
OVERSIZED = MAX_MESSAGE_BYTES + 1


def closed_target(s: Servers) -> str:
    sid = s.target.CreateSession(pb.CreateSessionRequest(prompt_ids=PROMPT)).session_id
    s.target.CloseSession(pb.CloseSessionRequest(session_id=sid))
    return sid


def closed_draft(s: Servers) -> str:
    sid = s.draft.CreateSession(dpb.DraftServiceCreateSessionRequest(token_ids=PROMPT)).session_id
    s.draft.CloseSession(dpb.DraftServiceCloseSessionRequest(session_id=sid))
    return sid


def expired(stub, request) -> str:
    sid = stub.CreateSession(request).session_id
    time.sleep(TTL_S * 1.5)
    return sid


def sampling(**fields) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(**fields)


def probs(L: Loop, row: Callable[[int], list[float]]) -> list[float]:
    return [p for i in range(len(L.drafts)) for p in row(L.drafts[i])]


def sparse(L: Loop, rows: int = 0, extra_id: bool = False, second: int | None = None,
           p: float = 0.5) -> sampling_pb2.SparseDistributions:
    """Rows of two entries, the drafted token (`p`) and another (`second`; -1: the drafted token again);
    `rows` more or fewer rows than drafts, `extra_id` one id too many for the sizes."""
    drafts = [*L.drafts, *L.drafts[:1] * max(rows, 0)][:len(L.drafts) + rows]
    others = [(t + 1) % VOCAB if second is None else t if second == -1 else second for t in drafts]
    ids = [i for t, o in zip(drafts, others) for i in (t, o)]
    return sampling_pb2.SparseDistributions(row_sizes=[2] * len(drafts), token_ids=ids + [0] * extra_id,
                                            probs=[x for _ in drafts for x in (p, 0.5)] + [0.0] * extra_id)


def one_hot(token: int, scale: float = 1.0) -> list[float]:
    return [scale if t == token else 0.0 for t in range(VOCAB)]


def concurrent_commit_and_revert(L: Loop) -> list[grpc.RpcError]:
    """16 threads: 8 commit the pending round, 8 revert it. One kind wins; the other is refused; never both."""
    barrier = threading.Barrier(16)
    commit = pb.CommitRequest(session_id=L.sid, round_id=L.tround, accepted=L.verdict.accepted)
    revert = pb.RevertRequest(session_id=L.sid, round_id=L.tround)

    def call(i: int):
        barrier.wait()
        try:
            return L.t.Commit(commit) if i % 2 else L.t.Revert(revert)
        except grpc.RpcError as e:
            return e
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, range(16)))
    won = {type(r) for r in results if not isinstance(r, grpc.RpcError)}
    assert len(won) == 1, won
    if won == {pb.CommitResponse}:
        replies = {r.head_version for r in results if isinstance(r, pb.CommitResponse)}
        assert replies == {L.version + 1}  # committed once, every retry the same answer
        L.committed(next(r for r in results if isinstance(r, pb.CommitResponse)))
    else:
        L.verdict = None
    return [r for r in results if isinstance(r, grpc.RpcError)]


def concurrent_verify(L: Loop) -> list[grpc.RpcError]:
    """8 threads verify 8 different rounds on one session: one is staged, the others are refused."""
    barrier = threading.Barrier(8)

    def call(i: int):
        barrier.wait()
        try:
            return f"c{i}", L.t.Verify(L.verify_request(round_id=f"c{i}"))
        except grpc.RpcError as e:
            return e
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(8)))
    winners = [r for r in results if not isinstance(r, grpc.RpcError)]
    assert len(winners) == 1
    L.tround, L.verdict = winners[0]
    return [r for r in results if isinstance(r, grpc.RpcError)]


def resource_info(err: grpc.RpcError) -> error_details_pb2.ResourceInfo:
    info = error_details_pb2.ResourceInfo()
    assert any(d.Unpack(info) for d in rpc_status.from_call(err).details)
    return info


@dataclass
class Case:
    name: str
    service: str  # TargetService | DraftService
    at: str  # where in the round the bad call comes: committed | proposed | verified
    call: Callable[[Loop], object]  # the bad call (or, when `concurrent`, many at once returning the refused ones)
    code: Code
    field: str | None  # None only where gRPC itself refuses before any handler runs (message size)
    setup: Callable[[Loop], None] | None = None  # valid calls made first
    concurrent: bool = False  # one of the calls wins and may move the session; the others are refused
    reason: str | None = None  # the ErrorInfo reason, where it is finer than the status's default


T, D = "TargetService", "DraftService"
CREATE = pb.CreateSessionRequest
DCREATE = dpb.DraftServiceCreateSessionRequest
CHAT = pb.ChatMessage(role="user", content="hi")
IA, NF, FP, RE = Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.FAILED_PRECONDITION, Code.RESOURCE_EXHAUSTED
DEFAULT_REASON = {IA: "INVALID_FIELD", NF: "NOT_FOUND", FP: "WRONG_STATE", RE: "QUOTA_EXCEEDED"}

CASES = [
    # TargetService.CreateSession / Generate: prompts and sampling settings
    Case("prompt id = vocab size", T, "committed", lambda L: L.t.CreateSession(CREATE(prompt_ids=[1, VOCAB])),
         IA, "prompt_ids"),
    Case("prompt id 2^32-1", T, "committed", lambda L: L.t.CreateSession(CREATE(prompt_ids=[U32])), IA, "prompt_ids"),
    Case("empty prompt", T, "committed", lambda L: L.t.CreateSession(CREATE()), IA, "prompt_ids"),
    Case("prompt ids over the limit", T, "committed",
         lambda L: L.t.CreateSession(CREATE(prompt_ids=[1] * (MAX_PROMPT + 1))), RE, "prompt_ids"),
    Case("prompt ids and text both set", T, "committed",
         lambda L: L.t.CreateSession(CREATE(prompt_ids=[1], prompt_text="x")), IA, "prompt_ids"),
    Case("prompt text invalid UTF-8", T, "committed",
         lambda L: raw(L.s, TARGET + "CreateSession", string_field(2, BAD_UTF8)), IA, "prompt_text",
         reason="UNPARSEABLE_REQUEST"),
    Case("huge unicode prompt text", T, "committed",
         lambda L: L.t.CreateSession(CREATE(prompt_text="€𝄞日本" * 100_000)), RE, "prompt_text"),
    Case("temperature < 0", T, "committed",
         lambda L: L.t.CreateSession(CREATE(prompt_ids=PROMPT, sampling=sampling(temperature=-0.5))),
         IA, "sampling.temperature"),
    Case("temperature NaN", T, "committed",
         lambda L: L.t.CreateSession(CREATE(prompt_ids=PROMPT, sampling=sampling(temperature=float("nan")))),
         IA, "sampling.temperature"),
    Case("temperature 1e-300 (too small to sample with)", T, "committed",
         lambda L: L.t.CreateSession(CREATE(prompt_ids=PROMPT, sampling=sampling(temperature=1e-300))),
         IA, "sampling.temperature"),
    Case("temperature subnormal", T, "committed",
         lambda L: list(L.t.Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=4,
                                                        sampling=sampling(temperature=5e-324)))),
         IA, "sampling.temperature"),
    Case("temperature inf", T, "committed",
         lambda L: L.t.CreateSession(CREATE(prompt_ids=PROMPT, sampling=sampling(temperature=float("inf")))),
         IA, "sampling.temperature"),
    Case("top-p > 1", T, "committed",
         lambda L: L.t.CreateSession(CREATE(prompt_ids=PROMPT, sampling=sampling(temperature=1, top_p=1.5))),
         IA, "sampling.top_p"),
    Case("top-p < 0", T, "committed",
         lambda L: L.t.CreateSession(CREATE(prompt_ids=PROMPT, sampling=sampling(temperature=1, top_p=-0.1))),
         IA, "sampling.top_p"),
    Case("top-p NaN", T, "committed",
         lambda L: L.t.CreateSession(CREATE(prompt_ids=PROMPT, sampling=sampling(temperature=1, top_p=float("nan")))),
         IA, "sampling.top_p"),
    Case("CreateSession over the message size limit", T, "committed",
         lambda L: raw(L.s, TARGET + "CreateSession", string_field(2, b"a" * OVERSIZED), limit=-1), RE, None),
    Case("Generate k above the limit", T, "committed",
         lambda L: list(L.t.Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=2, num_draft_tokens=17))),
         IA, "num_draft_tokens"),
    Case("Generate prompt id 2^32-1", T, "committed",
         lambda L: list(L.t.Generate(pb.GenerateRequest(prompt_ids=[U32], max_new_tokens=2))), IA, "prompt_ids"),
    Case("Generate temperature NaN", T, "committed",
         lambda L: list(L.t.Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=2,
                                                        sampling=sampling(temperature=float("nan"))))),
         IA, "sampling.temperature"),
    Case("Generate prompt text invalid UTF-8", T, "committed",
         lambda L: raw(L.s, TARGET + "Generate", string_field(2, BAD_UTF8), stream=True), IA, "prompt_text",
         reason="UNPARSEABLE_REQUEST"),
    Case("chat messages and prompt ids both set", T, "committed",
         lambda L: L.t.CreateSession(CREATE(prompt_ids=PROMPT, messages=[CHAT])), IA, "prompt_ids"),
    Case("chat message with an empty role", T, "committed",
         lambda L: L.t.CreateSession(CREATE(messages=[CHAT, pb.ChatMessage(content="x")])), IA, "messages[1].role"),
    Case("chat messages to a checkpoint without a chat template", T, "committed",
         lambda L: L.t.CreateSession(CREATE(messages=[CHAT])), FP, "messages", reason="NO_CHAT_TEMPLATE"),
    Case("Generate chat messages without a chat template", T, "committed",
         lambda L: list(L.t.Generate(pb.GenerateRequest(messages=[CHAT], max_new_tokens=2))), FP, "messages",
         reason="NO_CHAT_TEMPLATE"),
    Case("Generate empty stop string", T, "committed",
         lambda L: list(L.t.Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=2, stop_strings=[""]))),
         IA, "stop_strings"),
    Case("Generate 17 stop strings", T, "committed",
         lambda L: list(L.t.Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=2,
                                                        stop_strings=["a"] * 17))), IA, "stop_strings"),
    Case("Generate top_logprobs without logprobs", T, "committed",
         lambda L: list(L.t.Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=2, top_logprobs=2))),
         IA, "top_logprobs"),
    Case("Generate 21 top_logprobs", T, "committed",
         lambda L: list(L.t.Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=2, logprobs=True,
                                                        top_logprobs=21))), IA, "top_logprobs"),
    Case("Generate a prompt that fills max_total_tokens", T, "committed",
         lambda L: list(L.t.Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=2,
                                                        max_total_tokens=len(PROMPT)))), IA, "max_total_tokens"),
    # TargetService sessions
    Case("Verify on an unknown session", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(session_id="nope", round_id="x")), NF, "session_id"),
    Case("Verify with session id invalid UTF-8", T, "proposed",
         lambda L: raw(L.s, TARGET + "Verify", string_field(1, b"\xc3\x28")), IA, "session_id",
         reason="UNPARSEABLE_REQUEST"),
    Case("Verify on a closed session", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(session_id=closed_target(L.s), round_id="x", base_version=0)),
         NF, "session_id"),
    Case("Commit on a closed session", T, "committed",
         lambda L: L.t.Commit(pb.CommitRequest(session_id=closed_target(L.s), round_id="x")), NF, "session_id"),
    Case("GetSession on a closed session", T, "committed",
         lambda L: L.t.GetSession(pb.GetSessionRequest(session_id=closed_target(L.s))), NF, "session_id"),
    Case("CloseSession twice", T, "committed",
         lambda L: L.t.CloseSession(pb.CloseSessionRequest(session_id=closed_target(L.s))), NF, "session_id"),
    # TargetService.ExtendSession
    Case("ExtendSession with nothing to append", T, "committed",
         lambda L: L.t.ExtendSession(pb.ExtendSessionRequest(session_id=L.sid)), IA, "append_ids"),
    Case("ExtendSession with ids and text both set", T, "committed",
         lambda L: L.t.ExtendSession(pb.ExtendSessionRequest(session_id=L.sid, append_ids=[1], append_text="x")),
         IA, "append_ids"),
    Case("ExtendSession id = vocab size", T, "committed",
         lambda L: L.t.ExtendSession(pb.ExtendSessionRequest(session_id=L.sid, append_ids=[1, VOCAB])),
         IA, "append_ids"),
    Case("ExtendSession past the prompt limit", T, "committed",
         lambda L: L.t.ExtendSession(pb.ExtendSessionRequest(session_id=L.sid, append_text="x" * MAX_PROMPT)),
         RE, "append_text"),
    Case("ExtendSession text invalid UTF-8", T, "committed",
         lambda L: raw(L.s, TARGET + "ExtendSession", string_field(3, BAD_UTF8)), IA, "append_text",
         reason="UNPARSEABLE_REQUEST"),
    Case("ExtendSession with a round pending", T, "verified",
         lambda L: L.t.ExtendSession(pb.ExtendSessionRequest(session_id=L.sid, append_ids=[1])), FP, "session_id"),
    Case("ExtendSession on a closed session", T, "committed",
         lambda L: L.t.ExtendSession(pb.ExtendSessionRequest(session_id=closed_target(L.s), append_ids=[1])),
         NF, "session_id"),
    Case("Verify on an expired session", T, "committed",
         lambda L: L.s.ttl_target.Verify(pb.VerifyRequest(
             session_id=expired(L.s.ttl_target, CREATE(prompt_ids=PROMPT)), round_id="x")), NF, "session_id"),
    # TargetService.Verify
    Case("draft id = vocab size", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_tokens=[1, VOCAB])), IA, "draft_tokens"),
    Case("draft id 2^32-1", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_tokens=[U32])), IA, "draft_tokens"),
    Case("k above the limit", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_tokens=[1] * 17)), IA, "draft_tokens"),
    Case("stale base version", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", base_version=L.version - 1)), FP, "base_version",
         reason="STALE_VERSION"),
    Case("base version ahead of the head", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", base_version=2**64 - 1)), FP, "base_version",
         reason="VERSION_AHEAD"),
    Case("base version one ahead of the head", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", base_version=L.version + 1)), FP, "base_version",
         reason="VERSION_AHEAD"),
    Case("empty round id", T, "proposed", lambda L: L.t.Verify(L.verify_request(round_id="")), IA, "round_id"),
    Case("parent_next_token without parent_round_id", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", parent_next_token=1)), IA, "parent_next_token"),
    Case("Verify bytes that do not parse", T, "proposed",
         lambda L: raw(L.s, TARGET + "Verify", b"\xff\xff\xff\xff"), IA, None, reason="UNPARSEABLE_REQUEST"),
    Case("Verify while a round is pending", T, "verified",
         lambda L: L.t.Verify(L.verify_request(round_id="other")), FP, "round_id"),
    Case("round id repeated with other drafts", T, "verified",
         lambda L: L.t.Verify(L.verify_request(draft_tokens=[*L.drafts, 1])), FP, "round_id"),
    Case("committed round id verified again with other input", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(draft_tokens=[9])), FP, "round_id"),
    Case("reverted round verified again", T, "verified",
         lambda L: L.t.Verify(L.verify_request(round_id=L.reverted)), FP, "round_id",
         setup=lambda L: (setattr(L, "reverted", L.tround), L.revert_target(), L.verify())),
    Case("draft probabilities of the wrong length", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_probs=[0.5] * 3)), IA, "draft_probs"),
    Case("draft probabilities NaN", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_probs=probs(L, lambda t: [float("nan")] * VOCAB))),
         IA, "draft_probs"),
    Case("draft probabilities negative", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_probs=probs(
             L, lambda t: [2.0 if i == t else -1.0 / (VOCAB - 1) for i in range(VOCAB)]))), IA, "draft_probs"),
    Case("draft probabilities unnormalised", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_probs=probs(L, lambda t: one_hot(t, 2.0)))),
         IA, "draft_probs"),
    Case("draft probabilities zero on the drafted token", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_probs=probs(L, lambda t: one_hot((t + 1) % VOCAB)))),
         IA, "draft_probs"),
    Case("draft probabilities dense and sparse both", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_probs=probs(L, one_hot),
                                               draft_probs_sparse=sparse(L))), IA, "draft_probs_sparse"),
    Case("sparse draft probabilities: a row missing", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_probs_sparse=sparse(L, rows=-1))), IA,
         "draft_probs_sparse.row_sizes"),
    Case("sparse draft probabilities: sizes and entries disagree", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_probs_sparse=sparse(L, extra_id=True))), IA,
         "draft_probs_sparse"),
    Case("sparse draft probabilities: token id = vocab size", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_probs_sparse=sparse(L, second=VOCAB))), IA,
         "draft_probs_sparse.token_ids"),
    Case("sparse draft probabilities: a token twice in a row", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_probs_sparse=sparse(L, second=-1))), IA,
         "draft_probs_sparse.token_ids"),
    Case("sparse draft probabilities unnormalised", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_probs_sparse=sparse(L, p=0.7))), IA,
         "draft_probs_sparse"),
    Case("sparse draft probabilities NaN", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_probs_sparse=sparse(L, p=float("nan")))), IA,
         "draft_probs_sparse.probs"),
    Case("sparse draft probabilities negative", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_probs_sparse=sparse(L, p=-0.5))), IA,
         "draft_probs_sparse.probs"),
    Case("sparse draft probabilities zero on the drafted token", T, "proposed",
         lambda L: L.t.Verify(L.verify_request(round_id="x", draft_probs_sparse=sparse(L, p=0.0))), IA,
         "draft_probs_sparse"),
    Case("Verify over the message size limit", T, "proposed",
         lambda L: raw(L.s, TARGET + "Verify", L.verify_request(round_id="x").SerializeToString()
                       + string_field(2, b"r" * OVERSIZED), limit=-1), RE, None),
    Case("concurrent Verify of different rounds", T, "proposed", concurrent_verify, FP, "round_id",
         concurrent=True),
    # TargetService.Commit / Revert
    Case("accept count above the verdict", T, "verified",
         lambda L: L.t.Commit(pb.CommitRequest(session_id=L.sid, round_id=L.tround, accepted=L.verdict.accepted + 1)),
         IA, "accepted"),
    Case("accept count 2^32-1", T, "verified",
         lambda L: L.t.Commit(pb.CommitRequest(session_id=L.sid, round_id=L.tround, accepted=U32)), IA, "accepted"),
    Case("Commit of an unknown round", T, "verified",
         lambda L: L.t.Commit(pb.CommitRequest(session_id=L.sid, round_id="never")), NF, "round_id"),
    Case("Commit repeated with another accept count", T, "committed",
         lambda L: L.t.Commit(pb.CommitRequest(session_id=L.sid, round_id=L.tround, accepted=L.last_accepted + 1)),
         FP, "accepted", setup=lambda L: setattr(L, "last_accepted", len(L.tokens) - len(PROMPT) - 1)),
    Case("Commit after Revert", T, "verified",
         lambda L: L.t.Commit(pb.CommitRequest(session_id=L.sid, round_id=L.reverted)), FP, "round_id",
         setup=lambda L: (setattr(L, "reverted", L.tround), L.revert_target())),
    Case("Revert after Commit", T, "committed",
         lambda L: L.t.Revert(pb.RevertRequest(session_id=L.sid, round_id=L.tround)), FP, "round_id"),
    Case("Revert of an unknown round", T, "verified",
         lambda L: L.t.Revert(pb.RevertRequest(session_id=L.sid, round_id="never")), NF, "round_id"),
    Case("concurrent Commit and Revert of one round", T, "verified", concurrent_commit_and_revert, FP, "round_id",
         concurrent=True),
    # DraftService
    Case("draft history id = vocab size", D, "committed",
         lambda L: L.d.CreateSession(DCREATE(token_ids=[1, VOCAB])), IA, "token_ids"),
    Case("draft history id 2^32-1", D, "committed", lambda L: L.d.CreateSession(DCREATE(token_ids=[U32])),
         IA, "token_ids"),
    Case("empty draft history", D, "committed", lambda L: L.d.CreateSession(DCREATE()), IA, "token_ids"),
    Case("draft history over the limit", D, "committed",
         lambda L: L.d.CreateSession(DCREATE(token_ids=[1] * (MAX_PROMPT + 1))), RE, "token_ids"),
    Case("draft temperature NaN", D, "committed",
         lambda L: L.d.CreateSession(DCREATE(token_ids=PROMPT, sampling=sampling(temperature=float("nan")))),
         IA, "sampling.temperature"),
    Case("draft temperature 1e-39", D, "committed",
         lambda L: L.d.CreateSession(DCREATE(token_ids=PROMPT, sampling=sampling(temperature=1e-39))),
         IA, "sampling.temperature"),
    Case("Propose with an empty round id", D, "committed",
         lambda L: L.d.Propose(dpb.ProposeRequest(session_id=L.dsid, round_id="", k=2, previous=L.previous)),
         IA, "round_id"),
    Case("draft top-p > 1", D, "committed",
         lambda L: L.d.CreateSession(DCREATE(token_ids=PROMPT, sampling=sampling(temperature=1, top_p=2))),
         IA, "sampling.top_p"),
    Case("draft CreateSession over the message size limit", D, "committed",
         lambda L: raw(L.s, DRAFT + "CreateSession", string_field(1, b"\x01" * OVERSIZED), limit=-1), RE, None),
    Case("Propose k above the limit", D, "committed",
         lambda L: L.d.Propose(dpb.ProposeRequest(session_id=L.dsid, round_id="x", k=17, previous=L.previous)),
         IA, "k"),
    Case("Propose k 2^32-1", D, "committed",
         lambda L: L.d.Propose(dpb.ProposeRequest(session_id=L.dsid, round_id="x", k=U32, previous=L.previous)),
         IA, "k"),
    Case("Propose on an unknown session", D, "committed",
         lambda L: L.d.Propose(dpb.ProposeRequest(session_id="nope", round_id="x", k=K)), NF, "session_id"),
    Case("Propose on a closed session", D, "committed",
         lambda L: L.d.Propose(dpb.ProposeRequest(session_id=closed_draft(L.s), round_id="x", k=K)), NF, "session_id"),
    Case("Propose on an expired session", D, "committed",
         lambda L: L.s.ttl_draft.Propose(dpb.ProposeRequest(
             session_id=expired(L.s.ttl_draft, DCREATE(token_ids=PROMPT)), round_id="x", k=K)), NF, "session_id"),
    Case("Propose with session id invalid UTF-8", D, "committed",
         lambda L: raw(L.s, DRAFT + "Propose", string_field(1, b"\xed\xa0\x80")), IA, "session_id",
         reason="UNPARSEABLE_REQUEST"),
    Case("previous accept count above the proposal", D, "committed",
         lambda L: L.d.Propose(dpb.ProposeRequest(session_id=L.dsid, round_id="x", k=K,
                                                  previous=L.outcome(accepted=K + 1))), IA, "previous.accepted"),
    Case("previous next token outside the vocabulary", D, "committed",
         lambda L: L.d.Propose(dpb.ProposeRequest(session_id=L.dsid, round_id="x", k=K,
                                                  previous=L.outcome(next_token=U32))), IA, "previous.next_token"),
    Case("previous names an unknown round", D, "committed",
         lambda L: L.d.Propose(dpb.ProposeRequest(session_id=L.dsid, round_id="x", k=K,
                                                  previous=L.outcome(round_id="never"))), NF, "previous.round_id"),
    Case("Propose naming a parent round without speculative", D, "committed",
         lambda L: L.d.Propose(dpb.ProposeRequest(session_id=L.dsid, round_id="x", k=K, previous=L.previous,
                                                  parent_round_id=L.dround)), IA, "parent_round_id"),
    Case("speculative Propose on an unknown parent round", D, "proposed",
         lambda L: L.d.Propose(dpb.ProposeRequest(session_id=L.dsid, round_id="x", k=K, speculative=True,
                                                  parent_round_id="never")), NF, "parent_round_id"),
    Case("Propose while a round is open, no outcome", D, "committed",
         lambda L: L.d.Propose(dpb.ProposeRequest(session_id=L.dsid, round_id="x", k=K)), FP, "previous"),
    Case("Propose round id repeated with other k", D, "proposed",
         lambda L: L.d.Propose(dpb.ProposeRequest(session_id=L.dsid, round_id=L.dround, k=K - 1)), FP, "round_id"),
    Case("draft Commit accept count above the proposal", D, "committed",
         lambda L: L.d.Commit(dpb.DraftServiceCommitRequest(session_id=L.dsid, outcome=L.outcome(accepted=K + 1))),
         IA, "outcome.accepted"),
    Case("draft Commit next token outside the vocabulary", D, "committed",
         lambda L: L.d.Commit(dpb.DraftServiceCommitRequest(session_id=L.dsid, outcome=L.outcome(next_token=U32))),
         IA, "outcome.next_token"),
    Case("draft Commit repeated with another outcome", D, "committed",
         lambda L: L.d.Commit(dpb.DraftServiceCommitRequest(session_id=L.dsid, outcome=L.outcome(
             next_token=(L.previous.next_token + 1) % VOCAB))), FP, "outcome",
         setup=lambda L: L.d.Commit(dpb.DraftServiceCommitRequest(session_id=L.dsid, outcome=L.previous))),
    Case("draft Revert after Commit", D, "committed",
         lambda L: L.d.Revert(dpb.DraftServiceRevertRequest(session_id=L.dsid, round_id=L.dround)), FP, "round_id",
         setup=lambda L: L.d.Commit(dpb.DraftServiceCommitRequest(session_id=L.dsid, outcome=L.previous))),
    Case("draft Commit after Revert", D, "proposed",
         lambda L: L.d.Commit(dpb.DraftServiceCommitRequest(session_id=L.dsid, outcome=dpb.RoundOutcome(
             round_id=L.reverted))), FP, "outcome.round_id",
         setup=lambda L: (setattr(L, "reverted", L.dround), L.revert_draft())),
    Case("draft Revert of an unknown round", D, "proposed",
         lambda L: L.d.Revert(dpb.DraftServiceRevertRequest(session_id=L.dsid, round_id="never")), NF, "round_id"),
    Case("draft CloseSession twice", D, "committed",
         lambda L: L.d.CloseSession(dpb.DraftServiceCloseSessionRequest(session_id=closed_draft(L.s))),
         NF, "session_id"),
]

tried: dict[str, str] = {}  # kinds that ran to the end, by service
pytestmark = pytest.mark.xdist_group("bad_input")  # test_how_many_kinds counts what the others tried



@pytest.fixture(scope="module")
def baseline(servers, reference) -> dict[int, list[int]]:
    """An undisturbed run: target-only tokens, and the draft's proposals to compare every other run with."""
    loop = Loop(servers)
    assert loop.finish() == reference
    assert any(loop.proposals.values())
    return loop.proposals


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_and_changes_nothing(servers, reference, baseline, case):
    loop = Loop(servers).run_to(case.at)
    if case.setup:
        case.setup(loop)
    before = loop.snapshot()
    errors = case.call(loop) if case.concurrent else refused(lambda: case.call(loop))
    assert errors
    for e in errors:
        assert e.code() not in (Code.UNKNOWN, Code.INTERNAL), e.details()
        assert e.code() == case.code, e.details()
        assert field_of(e) == case.field, e.details()
        if case.field is not None or case.reason:  # every refusal a handler makes carries an ErrorInfo
            assert reason_of(e) == (case.reason or DEFAULT_REASON[case.code]), e.details()
        if e.code() == Code.NOT_FOUND:  # google.rpc's convention: the kind of resource and its id
            info = resource_info(e)
            assert info.resource_type in ("deltaspec.io/Session", "deltaspec.io/Round") and info.resource_name
    if not case.concurrent:
        assert loop.snapshot() == before
    assert loop.finish() == reference
    assert loop.proposals == baseline
    tried[case.name] = case.service


# Request fields for which every value the wire can carry is valid, each with its documented meaning
ANY_VALUE = {
    "sampling": "a message; its fields are checked one by one",
    "sampling.top_k": "0 turns top-k off; a k at or above the vocabulary keeps every token",
    "sampling.seed": "any 64-bit value is a seed",
    "messages.content": "any text, empty included",
    "max_new_tokens": "0 generates none",
    "sparse_probs": "a switch: dense or sparse draft distributions",
    "speculative": "a switch; a parent round without it is refused (parent_round_id)",
    "logprobs": "a switch: the emitted tokens' log-probabilities, or none",
    "ignore_eos": "a switch: whether EOS ends the generation",
}


def request_fields(message, prefix: str = ""):
    for f in message.fields:
        yield prefix + f.name
        if f.message_type is not None:
            yield from request_fields(f.message_type, f"{prefix}{f.name}.")


def test_every_field_of_every_request_is_in_the_table():
    """Each field of each request of both services is named by a refusal above, or listed in ANY_VALUE."""
    named = {re.sub(r"\[\d+\]", "", c.field) for c in CASES if c.field}
    missing = [f"{service.name}.{method.name}: {path}"
               for module in (pb, dpb) for service in module.DESCRIPTOR.services_by_name.values()
               for method in service.methods for path in request_fields(method.input_type)
               if path not in named and path.rsplit(".", 1)[-1] not in named and path not in ANY_VALUE]
    assert not missing


def test_how_many_kinds(capsys):
    """Prints the figure docs/reliability.md quotes (this module's other tests must run first, as they do in file
    order, on one worker: the module is one xdist group)."""
    services = list(tried.values())
    with capsys.disabled():
        print(f"\nbad input: {len(tried)} of {len(CASES)} kinds refused as documented and without effect "
              f"({services.count(T)} TargetService, {services.count(D)} DraftService)")
    assert len(CASES) >= 40 and {c.service for c in CASES} == {T, D}
