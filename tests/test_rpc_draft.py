"""DraftService semantics over real gRPC: proposals match the in-process drafter, retries, refusals."""
from __future__ import annotations

import grpc
import pytest
import torch

from deltaspec.v1 import draft_service_pb2 as pb
from deltaspec.v1 import sampling_pb2
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.decoding.session_table import Limits
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.rpc.generation import generate_on_server
from deltaspec.shared.rpc.convert import probs_from_proto
from test_rpc_support import (PROMPT, draft_service, draft_stub, one_torch_thread, pair, refused, start,  # noqa: F401
                              target_service)

Code = grpc.StatusCode


@pytest.fixture(scope="module")
def stub(pair):
    with start(draft_service(pair[1], Limits(max_sessions=3))) as server:
        yield draft_stub(server.address)


def open_session(stub, sparse_probs: bool = False, **sampling) -> str:
    return stub.CreateSession(pb.DraftServiceCreateSessionRequest(
        token_ids=PROMPT, sampling=sampling_pb2.SamplingParams(**sampling), sparse_probs=sparse_probs)).session_id


def outcome(round_id: str, accepted: int, next_token: int) -> pb.RoundOutcome:
    return pb.RoundOutcome(round_id=round_id, accepted=accepted, next_token=next_token)


def test_propose_carries_the_previous_outcome_and_retries_are_safe(stub, pair):
    reference = ModelDrafter(load_model(pair[1]))
    reference.start(PROMPT)
    sid = open_session(stub)
    r1 = pb.ProposeRequest(session_id=sid, round_id="r1", k=3)
    first = stub.Propose(r1)
    assert list(first.draft_tokens) == reference.propose(3).tokens and not first.draft_probs
    assert stub.Propose(r1) == first
    refused(lambda: stub.Propose(pb.ProposeRequest(session_id=sid, round_id="r1", k=2)),
            Code.FAILED_PRECONDITION, "round_id")
    refused(lambda: stub.Propose(pb.ProposeRequest(session_id=sid, round_id="r2", k=3)),
            Code.FAILED_PRECONDITION, "previous")  # r1 is still open
    for previous, code, field in [(outcome("r1", 4, 9), Code.INVALID_ARGUMENT, "previous.accepted"),
                                  (outcome("r1", 1, 257), Code.INVALID_ARGUMENT, "previous.next_token"),
                                  (outcome("r0", 1, 9), Code.NOT_FOUND, "previous.round_id")]:
        refused(lambda: stub.Propose(pb.ProposeRequest(session_id=sid, round_id="r2", k=3, previous=previous)),
                code, field)
    refused(lambda: stub.Propose(pb.ProposeRequest(session_id=sid, round_id="r2", k=17, previous=outcome("r1", 1, 9))),
            Code.INVALID_ARGUMENT, "k")
    r2 = pb.ProposeRequest(session_id=sid, round_id="r2", k=3, previous=outcome("r1", 1, 9))
    second = stub.Propose(r2)
    assert stub.Propose(r2) == second  # no second advance
    reference.advance(1, 9)
    assert list(second.draft_tokens) == reference.propose(3).tokens  # refusals changed nothing

    stub.Commit(pb.DraftServiceCommitRequest(session_id=sid, outcome=outcome("r2", 2, 11)))
    stub.Commit(pb.DraftServiceCommitRequest(session_id=sid, outcome=outcome("r2", 2, 11)))  # retry
    refused(lambda: stub.Commit(pb.DraftServiceCommitRequest(session_id=sid, outcome=outcome("r2", 0, 11))),
            Code.FAILED_PRECONDITION)
    reference.advance(2, 11)
    third = stub.Propose(pb.ProposeRequest(session_id=sid, round_id="r3", k=2))
    stub.Revert(pb.DraftServiceRevertRequest(session_id=sid, round_id="r3"))
    refused(lambda: stub.Commit(pb.DraftServiceCommitRequest(session_id=sid, outcome=outcome("r3", 0, 1))),
            Code.FAILED_PRECONDITION)
    fourth = stub.Propose(pb.ProposeRequest(session_id=sid, round_id="r4", k=2))
    assert list(third.draft_tokens) == list(fourth.draft_tokens) == reference.propose(2).tokens
    refused(lambda: stub.Revert(pb.DraftServiceRevertRequest(session_id=sid, round_id="r3")), Code.NOT_FOUND)
    stub.CloseSession(pb.DraftServiceCloseSessionRequest(session_id=sid))
    refused(lambda: stub.Propose(pb.ProposeRequest(session_id=sid, round_id="r5", k=1)), Code.NOT_FOUND, "session_id")


def test_probabilities_travel_only_when_sampling(stub):
    sid = open_session(stub, temperature=0.8, seed=3)
    reply = stub.Propose(pb.ProposeRequest(session_id=sid, round_id="r1", k=3))
    q = torch.tensor(list(reply.draft_probs)).view(len(reply.draft_tokens), 257)
    assert torch.allclose(q.sum(-1), torch.ones(len(reply.draft_tokens)), atol=1e-5)
    stub.CloseSession(pb.DraftServiceCloseSessionRequest(session_id=sid))


def test_top_k_probabilities_travel_sparse_to_a_caller_that_reads_them(stub):
    """The same proposal, dense to a caller that did not ask (an older client), sparse to one that did."""
    replies = []
    for sparse in (False, True):
        sid = open_session(stub, sparse, temperature=0.8, top_k=20, seed=3)
        replies.append(stub.Propose(pb.ProposeRequest(session_id=sid, round_id="r1", k=3)))
        stub.CloseSession(pb.DraftServiceCloseSessionRequest(session_id=sid))
    dense, sparse = replies
    assert not dense.HasField("draft_probs_sparse") and not sparse.draft_probs
    assert list(sparse.draft_probs_sparse.row_sizes) == [20] * 3 and dense.draft_tokens == sparse.draft_tokens
    tokens = list(dense.draft_tokens)
    assert torch.equal(probs_from_proto(sparse, tokens, 257), probs_from_proto(dense, tokens, 257))


def test_refused_sessions(stub):
    refused(lambda: stub.CreateSession(pb.DraftServiceCreateSessionRequest()), Code.INVALID_ARGUMENT, "token_ids")
    refused(lambda: stub.CreateSession(pb.DraftServiceCreateSessionRequest(token_ids=[999])),
            Code.INVALID_ARGUMENT, "token_ids")
    sids = [open_session(stub) for _ in range(3)]
    refused(lambda: open_session(stub), Code.RESOURCE_EXHAUSTED, "session_id")
    for sid in sids:
        stub.CloseSession(pb.DraftServiceCloseSessionRequest(session_id=sid))


def test_dynamic_draft_length_proposes_what_the_in_process_drafter_does(pair):
    """`serve-draft --stop-below p`: each proposal ends after the first token the draft gives less than p, as the
    in-process `ModelDrafter(stop_below=p)` does (a random draft is unsure: proposals shorter than k), and a
    target's Generate loop through it stays exactly target-only."""
    from deltaspec.draft_service.servicer import service

    reference = ModelDrafter(load_model(pair[1]), stop_below=0.3)
    reference.start(PROMPT)
    with start(service(lambda: load_model(pair[1]), stop_below=0.3)) as server:
        stub = draft_stub(server.address)
        sid = open_session(stub)
        lengths, previous = [], None
        for r in range(4):
            reply = stub.Propose(pb.ProposeRequest(session_id=sid, round_id=f"r{r}", k=8, previous=previous))
            want = reference.propose(8).tokens
            assert list(reply.draft_tokens) == want
            lengths.append(len(want))
            previous = outcome(f"r{r}", len(want), 3)
            reference.advance(len(want), 3)
        with start(target_service(pair[0], draft_address=server.address, draft_timeout_s=10.0)) as target:
            result, _ = generate_on_server(target.address, PROMPT, "", 40, 8)
    assert min(lengths) >= 1 and max(lengths) < 8, lengths
    assert result.token_ids == generate(load_model(pair[0]), PROMPT, 40).token_ids  # still exact
    assert result.stats.drafted < 8 * result.stats.drafts  # shorter proposals went through the loop
