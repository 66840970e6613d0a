"""TargetService semantics over real gRPC: the round protocol, retries, refusals, limits, expiry, concurrency."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from deltaspec.v1 import sampling_pb2
from deltaspec.v1 import target_service_pb2 as pb
from deltaspec.shared.decoding.session_table import Limits
from deltaspec.shared.errors import FailedPrecondition, NotFound
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.rpc.remote_target import RemoteTargetSession
from test_rpc_support import PROMPT, one_torch_thread, pair, refused, start, target_service, target_stub  # noqa: F401

Code = grpc.StatusCode


@pytest.fixture(scope="module")
def stub(pair):
    with start(target_service(pair[0], Limits(max_prompt_tokens=64))) as server:
        yield target_stub(server.address)


def open_session(stub, **sampling) -> str:
    return stub.CreateSession(pb.CreateSessionRequest(prompt_ids=PROMPT,
                                                      sampling=sampling_pb2.SamplingParams(**sampling))).session_id


def snapshot(stub, sid: str) -> pb.GetSessionResponse:
    return stub.GetSession(pb.GetSessionRequest(session_id=sid))


def test_round_protocol_with_retries(stub):
    created = stub.CreateSession(pb.CreateSessionRequest(prompt_ids=PROMPT))
    sid = created.session_id
    assert (created.head_version, list(created.prompt_ids), created.vocab_size, list(created.eos_token_ids)) == \
        (0, PROMPT, 257, [256])
    verify = pb.VerifyRequest(session_id=sid, round_id="a", base_version=0, draft_tokens=[7, 8, 9])
    first = stub.Verify(verify)
    assert stub.Verify(verify) == first  # a retry: same answer
    assert snapshot(stub, sid).pending_round.round_id == "a" and snapshot(stub, sid).head_version == 0
    before = snapshot(stub, sid)
    refused(lambda: stub.Verify(pb.VerifyRequest(session_id=sid, round_id="a", base_version=0, draft_tokens=[7])),
            Code.FAILED_PRECONDITION, "round_id")  # same round id, other input
    refused(lambda: stub.Verify(pb.VerifyRequest(session_id=sid, round_id="b", base_version=0)),
            Code.FAILED_PRECONDITION, "round_id")  # one pending round per session
    refused(lambda: stub.Commit(pb.CommitRequest(session_id=sid, round_id="a", accepted=first.accepted + 1)),
            Code.INVALID_ARGUMENT, "accepted")
    assert snapshot(stub, sid) == before  # refused calls changed nothing

    commit = pb.CommitRequest(session_id=sid, round_id="a", accepted=first.accepted)
    committed = stub.Commit(commit)
    assert committed.head_version == 1
    assert list(committed.committed_tokens) == [7, 8, 9][:first.accepted] + [first.next_token]
    assert stub.Commit(commit) == committed  # a retry: no second advance
    after = snapshot(stub, sid)
    assert (after.length, after.head_version, after.HasField("pending_round")) == \
        (len(PROMPT) + first.accepted + 1, 1, False)
    refused(lambda: stub.Commit(pb.CommitRequest(session_id=sid, round_id="a", accepted=0)) if first.accepted
            else stub.Revert(pb.RevertRequest(session_id=sid, round_id="a")), Code.FAILED_PRECONDITION)

    refused(lambda: stub.Verify(pb.VerifyRequest(session_id=sid, round_id="b", base_version=0)),
            Code.FAILED_PRECONDITION, "base_version")  # stale base
    stub.Verify(pb.VerifyRequest(session_id=sid, round_id="b", base_version=1, draft_tokens=[3]))
    assert stub.Revert(pb.RevertRequest(session_id=sid, round_id="b")).head_version == 1
    assert stub.Revert(pb.RevertRequest(session_id=sid, round_id="b")).head_version == 1  # retry
    refused(lambda: stub.Commit(pb.CommitRequest(session_id=sid, round_id="b")), Code.FAILED_PRECONDITION)
    assert snapshot(stub, sid) == after
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_unknown_session_and_round_are_not_found(stub):
    sid = open_session(stub)
    refused(lambda: stub.Verify(pb.VerifyRequest(session_id="nope", round_id="a")), Code.NOT_FOUND, "session_id")
    refused(lambda: stub.Commit(pb.CommitRequest(session_id=sid, round_id="never")), Code.NOT_FOUND, "round_id")
    refused(lambda: stub.Revert(pb.RevertRequest(session_id=sid, round_id="never")), Code.NOT_FOUND, "round_id")
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    refused(lambda: stub.GetSession(pb.GetSessionRequest(session_id=sid)), Code.NOT_FOUND, "session_id")
    refused(lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=sid)), Code.NOT_FOUND, "session_id")


@pytest.mark.parametrize("request_, field", [
    (pb.VerifyRequest(round_id="r", draft_tokens=[5, 257]), "draft_tokens"),
    (pb.VerifyRequest(round_id="r", draft_tokens=[1] * 17), "draft_tokens"),
    (pb.VerifyRequest(round_id="r", draft_tokens=[1, 2], draft_probs=[0.5] * 3), "draft_probs"),
    (pb.CreateSessionRequest(), "prompt_ids"),
    (pb.CreateSessionRequest(prompt_ids=[1, 300]), "prompt_ids"),
    (pb.CreateSessionRequest(prompt_ids=[1], prompt_text="x"), "prompt_ids"),
    (pb.CreateSessionRequest(prompt_ids=[1], sampling=sampling_pb2.SamplingParams(top_p=2.0)), "sampling.top_p"),
    (pb.GenerateRequest(prompt_ids=[1], max_new_tokens=2, num_draft_tokens=17), "num_draft_tokens"),
], ids=["token-out-of-vocab", "k-over-limit", "probs-shape", "empty-prompt", "prompt-out-of-vocab",
        "two-prompts", "bad-sampling", "generate-k-over-limit"])
def test_invalid_arguments_carry_bad_request(stub, request_, field):
    sid = open_session(stub, temperature=1.0)
    before = snapshot(stub, sid)
    if isinstance(request_, pb.VerifyRequest):
        request_.session_id = sid
        call = lambda: stub.Verify(request_)  # noqa: E731
    elif isinstance(request_, pb.GenerateRequest):
        call = lambda: list(stub.Generate(request_))  # noqa: E731
    else:
        call = lambda: stub.CreateSession(request_)  # noqa: E731
    err = refused(call, Code.INVALID_ARGUMENT, field)
    details = rpc_status.from_call(err).details
    assert [d.TypeName() for d in details] == ["google.rpc.ErrorInfo", "google.rpc.BadRequest"]
    info = error_details_pb2.ErrorInfo()
    details[0].Unpack(info)
    assert (info.reason, info.domain, info.metadata["field"]) == ("INVALID_FIELD", "deltaspec.io", field)
    assert snapshot(stub, sid) == before
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_resource_limits(pair):
    with start(target_service(pair[0], Limits(max_sessions=2, max_prompt_tokens=8))) as server:
        stub = target_stub(server.address)
        refused(lambda: stub.CreateSession(pb.CreateSessionRequest(prompt_ids=[1] * 9)),
                Code.RESOURCE_EXHAUSTED, "prompt_ids")
        refused(lambda: list(stub.Generate(pb.GenerateRequest(prompt_ids=[1] * 9, max_new_tokens=1))),
                Code.RESOURCE_EXHAUSTED, "prompt_ids")
        first, _ = open_session(stub), open_session(stub)
        refused(lambda: open_session(stub), Code.RESOURCE_EXHAUSTED, "session_id")
        refused(lambda: list(stub.Generate(pb.GenerateRequest(prompt_ids=[1], max_new_tokens=1))),
                Code.RESOURCE_EXHAUSTED, "session_id")
        stub.CloseSession(pb.CloseSessionRequest(session_id=first))
        open_session(stub)


def test_idle_sessions_expire_after_ttl(pair):
    with start(target_service(pair[0], Limits(ttl_s=0.6))) as server:
        stub = target_stub(server.address)
        idle, busy = open_session(stub), open_session(stub)
        for _ in range(6):  # touch `busy` every 0.2 s, leave `idle` alone
            time.sleep(0.2)
            snapshot(stub, busy)
        refused(lambda: snapshot(stub, idle), Code.NOT_FOUND, "session_id")
        assert snapshot(stub, busy).head_version == 0


def test_concurrent_calls_are_atomic(stub):
    sid = open_session(stub)
    barrier = threading.Barrier(6)

    def verify(i: int):
        barrier.wait()
        try:
            return stub.Verify(pb.VerifyRequest(session_id=sid, round_id=f"r{i}", base_version=0, draft_tokens=[i]))
        except grpc.RpcError as e:
            return e.code()

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(verify, range(6)))
    winners = [i for i, r in enumerate(results) if isinstance(r, pb.VerifyResponse)]
    assert len(winners) == 1 and all(r == Code.FAILED_PRECONDITION for i, r in enumerate(results) if i != winners[0])

    commit = pb.CommitRequest(session_id=sid, round_id=f"r{winners[0]}", accepted=0)

    def retry(_: int):
        barrier.wait()
        return stub.Commit(commit)

    with ThreadPoolExecutor(6) as pool:
        commits = list(pool.map(retry, range(6)))
    assert all(c == commits[0] for c in commits) and commits[0].head_version == 1
    assert snapshot(stub, sid).length == len(PROMPT) + 1  # advanced once


def test_prompt_as_text(stub):
    created = stub.CreateSession(pb.CreateSessionRequest(prompt_text="hi"))
    assert list(created.prompt_ids) == [104, 105]  # the byte tokenizer


def test_remote_chained_verify_on_an_unknown_parent_is_not_found_naming_it(pair):
    """The client-side session rebuilds the target's refusal of a pipelined round as the engine's own error."""
    with start(target_service(pair[0])) as server:
        session = RemoteTargetSession(target_stub(server.address), PROMPT)
        with pytest.raises(NotFound) as info:
            session.verify("r2", [1, 2], base_version=1, parent="r1", guess=3)
        assert (info.value.field, info.value.resource_name) == ("parent_round_id", "r1")
        session.close()


def test_a_pipelined_verify_is_one_attempt_never_waiting_for_a_target_to_come_back(pair):
    """To a target that is gone, a pipelined verify fails UNAVAILABLE at once (waiting for it to be ready held a
    generation for the whole call timeout after it lost a replica); while another thread opens the session again,
    none is sent. Either way the loop only loses the pipelining (FailedPrecondition)."""
    expected = generate(load_model(pair[0]), PROMPT, 6).token_ids
    with start(target_service(pair[0])) as server:
        session = RemoteTargetSession(target_stub(server.address), PROMPT, call_timeout_s=120)
        parent = session.verify("p0", expected[:2])
    chained = dict(base_version=parent.base_version + 1, parent="p0", guess=expected[2])
    with pytest.raises(FailedPrecondition, match="UNAVAILABLE"):
        session.verify("p1", expected[3:5], **chained)
    session.session_id = None  # what the loop's thread sees while the session is being opened again
    with pytest.raises(FailedPrecondition, match="being opened again"):
        session.verify("p1", expected[3:5], **chained)


def test_a_pipelined_round_staged_on_a_lost_session_is_verified_again_before_its_commit(pair):
    """The parent's commit opens the session again (the target lost it); the round staged on it in the old session
    is verified again in the new one, and the history is the target's own."""
    expected = generate(load_model(pair[0]), PROMPT, 6).token_ids
    with start(target_service(pair[0])) as server:
        stub = target_stub(server.address)
        session = RemoteTargetSession(stub, PROMPT)
        parent = session.verify("p0", expected[:2])
        assert (parent.verdict.accepted, parent.verdict.next_token) == (2, expected[2])
        session.verify("p1", expected[3:5], base_version=parent.base_version + 1, parent="p0", guess=expected[2])
        lost = session.session_id
        stub.CloseSession(pb.CloseSessionRequest(session_id=lost))
        session.commit("p0", 2)
        session.commit("p1", 2)
        assert session.session_id != lost and session.generated == expected
        session.close()
