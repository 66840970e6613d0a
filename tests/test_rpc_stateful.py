"""Property-based RPC sequences against a live TargetService on loopback (hypothesis stateful testing).

Any interleaving of valid and invalid Verify, Commit, Revert and GetSession calls (new rounds,
retries, stale versions, unknown and reused round ids, over-accepts, tokens outside the
vocabulary, a round while another is pending) must leave the committed tokens a prefix of
target-only greedy decoding, and every answer must be the one the round protocol documents.
The model below is that documentation, written as a state machine.
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from deltaspec.v1 import target_service_pb2 as pb
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.rpc.status import field_of
from test_rpc_support import PROMPT, one_torch_thread, pair, start, target_service, target_stub  # noqa: F401

Code = grpc.StatusCode
VOCAB, REFERENCE_LEN = 257, 160


@dataclass
class Round:
    round_id: str
    base_version: int
    drafts: list[int]
    accepted: int  # the verdict
    next_token: int
    outcome: str = "pending"  # pending | committed | reverted
    committed: int | None = None
    new_version: int | None = None


class Sequences(RuleBasedStateMachine):
    stub = None  # set by the test: one live server for all examples
    reference: list[int] = []  # target-only greedy continuation of PROMPT

    @initialize()
    def open(self) -> None:
        self.sid = self.stub.CreateSession(pb.CreateSessionRequest(prompt_ids=PROMPT)).session_id
        self.tokens, self.version = list(PROMPT), 0
        self.round: Round | None = None  # the pending round or the last finished one, as the server keeps it
        self.n = 0

    def teardown(self) -> None:
        if hasattr(self, "sid"):
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.sid))

    @property
    def pending(self) -> Round | None:
        return self.round if self.round and self.round.outcome == "pending" else None

    def refused(self, call, code: Code, field: str) -> None:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert (info.value.code(), field_of(info.value)) == (code, field), info.value.details()

    def expected(self, drafts: list[int]) -> tuple[int, int]:
        """Greedy verdict: the drafts that match the target's own continuation, then its next token."""
        at = len(self.tokens) - len(PROMPT)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == self.reference[at + accepted]:
            accepted += 1
        return accepted, self.reference[at + accepted]

    @rule(correct=st.integers(0, 5), tail=st.lists(st.integers(0, VOCAB - 1), max_size=3))
    def verify_new_round(self, correct: int, tail: list[int]) -> None:
        at = len(self.tokens) - len(PROMPT)
        drafts = self.reference[at:at + correct] + tail
        self.n += 1
        round_id = f"r{self.n}"
        call = lambda: self.stub.Verify(pb.VerifyRequest(  # noqa: E731
            session_id=self.sid, round_id=round_id, base_version=self.version, draft_tokens=drafts))
        if self.pending:
            return self.refused(call, Code.FAILED_PRECONDITION, "round_id")
        reply = call()
        accepted, next_token = self.expected(drafts)
        assert (reply.accepted, reply.next_token, reply.round.base_version) == (accepted, next_token, self.version)
        self.round = Round(round_id, self.version, drafts, accepted, next_token)

    @precondition(lambda self: self.round is not None)
    @rule(same_input=st.booleans())
    def verify_again(self, same_input: bool) -> None:
        """A retry (same input) returns the same verdict; other input under the same id is refused."""
        rnd = self.round
        drafts = rnd.drafts if same_input else [*rnd.drafts, 0]
        call = lambda: self.stub.Verify(pb.VerifyRequest(  # noqa: E731
            session_id=self.sid, round_id=rnd.round_id, base_version=rnd.base_version, draft_tokens=drafts))
        if not same_input or rnd.outcome == "reverted":
            return self.refused(call, Code.FAILED_PRECONDITION, "round_id")
        reply = call()
        assert (reply.accepted, reply.next_token) == (rnd.accepted, rnd.next_token)

    @rule(offset=st.sampled_from([-3, -1, 1, 7]))
    def verify_stale_version(self, offset: int) -> None:
        self.n += 1
        base = self.version + offset if self.version + offset >= 0 else self.version + 2
        call = lambda: self.stub.Verify(pb.VerifyRequest(  # noqa: E731
            session_id=self.sid, round_id=f"r{self.n}", base_version=base))
        self.refused(call, Code.FAILED_PRECONDITION, "round_id" if self.pending else "base_version")

    @rule(token=st.sampled_from([VOCAB, 10_000, 2**32 - 1]))
    def verify_outside_vocabulary(self, token: int) -> None:
        self.n += 1
        call = lambda: self.stub.Verify(pb.VerifyRequest(  # noqa: E731
            session_id=self.sid, round_id=f"r{self.n}", base_version=self.version, draft_tokens=[1, token]))
        if self.pending:  # one pending round comes first: the request is not looked at further
            return self.refused(call, Code.FAILED_PRECONDITION, "round_id")
        self.refused(call, Code.INVALID_ARGUMENT, "draft_tokens")

    @precondition(lambda self: self.round is not None)
    @rule(fewer=st.integers(0, 6), over=st.integers(1, 3), overaccept=st.booleans())
    def commit(self, fewer: int, over: int, overaccept: bool) -> None:
        rnd = self.round
        accepted = rnd.accepted + over if overaccept else max(rnd.accepted - fewer, 0)
        call = lambda: self.stub.Commit(pb.CommitRequest(session_id=self.sid, round_id=rnd.round_id,  # noqa: E731
                                                         accepted=accepted))
        if rnd.outcome == "reverted":
            return self.refused(call, Code.FAILED_PRECONDITION, "round_id")
        if rnd.outcome == "committed":
            if accepted != rnd.committed:
                return self.refused(call, Code.FAILED_PRECONDITION, "accepted")
            assert call().head_version == rnd.new_version  # a retry: no second advance
            return
        if overaccept:
            return self.refused(call, Code.INVALID_ARGUMENT, "accepted")
        reply = call()
        next_token = rnd.next_token if accepted == rnd.accepted else rnd.drafts[accepted]
        assert list(reply.committed_tokens) == [*rnd.drafts[:accepted], next_token]
        assert reply.head_version == self.version + 1
        self.tokens += reply.committed_tokens
        self.version = rnd.new_version = reply.head_version
        rnd.outcome, rnd.committed = "committed", accepted

    @precondition(lambda self: self.round is not None)
    @rule()
    def revert(self) -> None:
        rnd = self.round
        call = lambda: self.stub.Revert(pb.RevertRequest(session_id=self.sid, round_id=rnd.round_id))  # noqa: E731
        if rnd.outcome == "committed":
            return self.refused(call, Code.FAILED_PRECONDITION, "round_id")
        assert call().head_version == self.version  # also a retry of a revert
        rnd.outcome = "reverted"

    @rule(which=st.sampled_from(["commit", "revert"]))
    def unknown_round(self, which: str) -> None:
        if which == "commit":
            call = lambda: self.stub.Commit(pb.CommitRequest(session_id=self.sid, round_id="never"))  # noqa: E731
        else:
            call = lambda: self.stub.Revert(pb.RevertRequest(session_id=self.sid, round_id="never"))  # noqa: E731
        self.refused(call, Code.NOT_FOUND, "round_id")

    @rule()
    def unknown_session(self) -> None:
        self.refused(lambda: self.stub.Verify(pb.VerifyRequest(session_id="nope", round_id="x")),
                     Code.NOT_FOUND, "session_id")

    @invariant()
    def committed_tokens_are_target_only_greedy(self) -> None:
        if not hasattr(self, "sid"):
            return
        got = self.stub.GetSession(pb.GetSessionRequest(session_id=self.sid))
        generated = list(got.generated_ids)
        assert generated == self.tokens[len(PROMPT):] == self.reference[:len(generated)]
        assert got.head_version == self.version
        assert got.HasField("pending_round") == (self.pending is not None)
        if self.pending:
            assert got.pending_round.round_id == self.pending.round_id


def test_any_interleaving_keeps_target_only_greedy_tokens(pair):
    with start(target_service(pair[0])) as server:
        Sequences.stub = target_stub(server.address)
        Sequences.reference = generate(load_model(pair[0]), PROMPT, REFERENCE_LEN).token_ids
        run_state_machine_as_test(Sequences, settings=settings(
            max_examples=25, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
