"""A TargetService session behind the loop's `Session` protocol, surviving a target restart.

Calls are retried on UNAVAILABLE and CANCELLED (safe: every call is idempotent under its round id) for as long as
the recovery rule allows (`deltaspec.shared.rpc.recovery`): until the generation's deadline, or the recovery window
(300 s by default, `recovery_window_s`) from the outage's first failure, waiting on the target's grpc.health.v1
`Watch` (`health`) between tries, or backing off with jitter where it cannot be asked; a restarted target listens
before its model is loaded and answers UNAVAILABLE meanwhile. When the target no longer knows the session
(it restarted, or the session expired), a new one is opened on the committed history this class keeps,
the round in flight is verified again, and the call goes on; with greedy decoding the final tokens are
exactly those of an uninterrupted run.

Session pinning (several target replicas behind one load-balanced address): when CreateSession
names the replica that holds the session (`target_address`) and a `dial` function is given, every
later call of the session goes to that replica directly, without waiting for it to be ready. If the
replica is gone (UNAVAILABLE) or no longer holds the session (NOT_FOUND), the session is opened
again on the committed history through the load-balanced address, on whichever replica answers.
CreateSession carries the prompt's routing key (`deltaspec.shared.rpc.routing`), the same at every opening, so a
balancer that hashes it opens the session on the replica whose prefix cache holds the start of the prompt.

A pipelined round (`verify(..., parent=, guess=)`) is one attempt: any refusal or failure only
loses the pipelining (FailedPrecondition; NotFound when the target does not know the parent round
yet, which the loop answers by sending it again after the parent's verdict), and the loop verifies
the round again the plain way. When the session is opened again, pipelined verifies still in flight on the old one
are cancelled: a replica that went away without closing its connections would otherwise hold each for the call
timeout, and the loop with it.
Once its parent is committed, its commit goes through the usual retries; a round staged in a session that the
parent's commit had to open again is first verified again in the new one.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import grpc
import torch
from grpc_health.v1 import health_pb2_grpc
from torch import Tensor

from deltaspec.v1 import target_service_pb2 as pb
from deltaspec.v1 import target_service_pb2_grpc
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.target import Round
from deltaspec.shared.decoding.verify import Verdict
from deltaspec.shared.errors import FailedPrecondition, NotFound
from deltaspec.shared.rpc.convert import put_probs, sampling_to_proto
from deltaspec.shared.rpc.recovery import TARGET_SERVICE, Recovery, check_window, gone, waits_out
from deltaspec.shared.rpc.routing import prefix_metadata
from deltaspec.shared.rpc.status import field_of


class RemoteTargetSession:
    def __init__(self, stub: target_service_pb2_grpc.TargetServiceStub, prompt_ids: list[int] | None = None,
                 prompt_text: str = "", sampling: SamplingParams = SamplingParams(), deadline: float | None = None,
                 call_timeout_s: float = 30.0, recovery_window_s: float | None = None,
                 dial: Callable[[str], target_service_pb2_grpc.TargetServiceStub] | None = None,
                 messages: Sequence[pb.ChatMessage] = (), health: health_pb2_grpc.HealthStub | None = None,
                 address: str = "") -> None:
        """`recovery_window_s`: how long an outage of the target is waited out (None: until `deadline`, or 300 s
        without one; see `deltaspec.shared.rpc.recovery`); `health`: the grpc.health.v1 stub on the channel of
        `stub` (the address sessions are opened through, named `address` in errors), asked between tries."""
        self.stub, self.sampling, self.prompt_text, self.messages = stub, sampling, prompt_text, list(messages)
        self.entry_stub, self.dial = stub, dial  # the address sessions are opened through; a stub for a replica
        self.pinned: str | None = None  # the replica holding the session, when it advertised one
        self.routing = prefix_metadata(prompt_ids, prompt_text, [{"role": m.role, "content": m.content}
                                                                 for m in self.messages[:1]])
        self.deadline, self.call_timeout_s = deadline, call_timeout_s
        self.recovery_window_s, self.health, self.address = check_window(recovery_window_s), health, address
        self._outage: Recovery | None = None  # the target's outage being waited out, if any
        self.outages: list[float] = []  # how long each outage waited out lasted, seconds
        self.tokens: list[int] = list(prompt_ids or [])  # committed history, prompt first
        self.session_id: str | None = None
        self.version = 0
        self.reopened = -1  # times the session had to be opened again
        self._in_flight: tuple[str, list[int], Tensor | None] | None = None  # the round verified, not yet committed
        self._round: Round | None = None
        # pipelined rounds by id: the round, what to verify it again with, the session that staged it
        self._chained: dict[str, tuple[Round, tuple[str, list[int], Tensor | None], str | None]] = {}
        self._lock = threading.Lock()
        self._pipelined: set[grpc.Future] = set()  # pipelined verifies in flight
        self._call(lambda: None)  # opens the session, with the usual retries
        self.prompt_len = len(self.tokens)
        self.vocab_size: int = self._created.vocab_size
        self.eos = set(self._created.eos_token_ids)
        self.max_draft_tokens: int = self._created.max_draft_tokens

    @property
    def sparse_probs(self) -> bool:
        """Whether the target that holds the session reads sparse draft distributions (older ones do not)."""
        return self._created.sparse_probs

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def verify(self, round_id: str, drafts: list[int], base_version: int | None = None,
               draft_probs: Tensor | None = None, parent: str | None = None, guess: int | None = None) -> Round:
        if parent is not None:
            return self._verify_chained(round_id, drafts, base_version, draft_probs, parent, guess)
        self._in_flight = (round_id, list(drafts), draft_probs)
        return self._call(self._verify)

    def _verify_chained(self, round_id: str, drafts: list[int], base_version: int | None,
                        draft_probs: Tensor | None, parent: str, guess: int | None) -> Round:
        session_id, stub = self.session_id, self.stub
        if session_id is None:
            raise FailedPrecondition(f"round {round_id!r} was not staged on {parent!r}: the session is being opened "
                                     "again", "parent_round_id")
        try:
            request = pb.VerifyRequest(session_id=session_id, round_id=round_id, base_version=base_version,
                                       draft_tokens=drafts, parent_round_id=parent, parent_next_token=guess)
            put_probs(request, draft_probs, self.sampling.greedy, self.sparse_probs)
            # one attempt (a pipelined verify is never retried: the session would be opened elsewhere)
            call = stub.Verify.future(request, **self._opts())
            with self._lock:
                self._pipelined.add(call)
            try:
                reply = call.result()
            finally:
                with self._lock:
                    self._pipelined.discard(call)
        except grpc.FutureCancelledError:
            raise FailedPrecondition(f"round {round_id!r} was not staged on {parent!r}: its session was lost",
                                     "parent_round_id") from None
        except grpc.RpcError as e:
            message = f"round {round_id!r} was not staged on {parent!r}: {e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(message, "parent_round_id", parent) from None
            raise FailedPrecondition(message, "parent_round_id") from None
        rnd = Round(round_id, base_version or 0, tuple(drafts), Verdict(reply.accepted, reply.next_token),
                    reply.round.staged_bytes, hidden=torch.empty(0), parent=parent, guess=guess)
        with self._lock:  # a chained verify may return while the loop commits
            recent = dict(list(self._chained.items())[-3:])  # older ones were dropped: forget them
            self._chained = {**recent, round_id: (rnd, (round_id, list(drafts), draft_probs), session_id)}
        return rnd

    def commit(self, round_id: str, accepted: int) -> int:
        with self._lock:
            chained = self._chained.pop(round_id, None)
        if chained is not None:  # a pipelined round whose parent is committed: it is the round in flight now
            self._round, self._in_flight, staged_in = chained
            if staged_in != self.session_id:  # its session was lost since (the parent's commit opened another)
                self._call(self._verify)
        reply = self._call(lambda: self.stub.Commit(pb.CommitRequest(
            session_id=self.session_id, round_id=round_id,
            accepted=min(accepted, self._round.verdict.accepted)), **self._opts()))  # type: ignore[union-attr]
        self.tokens += reply.committed_tokens
        self.version = reply.head_version
        self._in_flight = None
        return self.version

    def text(self) -> str:
        return self._call(lambda: self.stub.GetSession(pb.GetSessionRequest(session_id=self.session_id),
                                                       **self._opts())).text

    def close(self) -> None:
        try:
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session_id), timeout=1.0)
        except grpc.RpcError:
            pass

    def _verify(self) -> Round:
        round_id, drafts, probs = self._in_flight  # type: ignore[misc]
        request = pb.VerifyRequest(session_id=self.session_id, round_id=round_id, base_version=self.version,
                                   draft_tokens=drafts)
        put_probs(request, probs, self.sampling.greedy, self.sparse_probs)
        reply = self.stub.Verify(request, **self._opts())
        self._round = Round(round_id, self.version, tuple(drafts), Verdict(reply.accepted, reply.next_token),
                            reply.round.staged_bytes, hidden=torch.empty(0))
        return self._round

    @property
    def cached_tokens(self) -> int:
        """Prompt positions the target took from its prefix cache when it opened the session."""
        return self._created.cached_tokens

    def extend(self, ids: list[int]) -> int:
        """Append `ids` to the session's history (a user's next turn); the new head version. A session lost with its
        replica is opened again on the history first (served by the prefix cache where it holds it)."""

        def rpc() -> int:
            reply = self.stub.ExtendSession(pb.ExtendSessionRequest(session_id=self.session_id, append_ids=ids),
                                            **self._opts())
            self.tokens += ids
            self.version = reply.head_version
            return reply.head_version

        return self._call(rpc)

    def _open(self) -> None:
        """A new session on the committed history (the prompt text or messages only the first time), then the round
        in flight."""
        with self._lock:
            for call in self._pipelined:  # rounds of the session lost
                call.cancel()
        self.pinned = None
        created = self.entry_stub.CreateSession(pb.CreateSessionRequest(
            prompt_ids=self.tokens, prompt_text="" if self.tokens else self.prompt_text,
            messages=[] if self.tokens else self.messages, sampling=sampling_to_proto(self.sampling)), **self._opts(),
            metadata=self.routing)
        pinned = created.target_address if created.target_address and self.dial is not None else None
        # the stub before the session id: a pipelined verify on another thread must not reach the session
        # through the load-balanced address
        self.stub, self.pinned = (self.dial(pinned), pinned) if pinned else (self.entry_stub, None)
        self._created, self.session_id, self.version = created, created.session_id, created.head_version
        self.tokens = self.tokens or list(self._created.prompt_ids)
        self.reopened += 1
        if self._in_flight is not None:
            try:
                self._verify()
            except grpc.RpcError:
                self.session_id = None  # it lacks the round in flight: the next attempt opens another and replays it
                raise

    def _call(self, rpc: Callable):
        lost = 0  # sessions found lost in a row (NOT_FOUND): a target that forgets every new one at once is an error
        try:
            while True:
                try:
                    if self.session_id is None:
                        self._open()
                    result = rpc()
                    if self._outage is not None:
                        self.outages.append(time.monotonic() - self._outage.started)
                    return result
                except grpc.RpcError as e:
                    code = e.code()
                    outage = self._outage
                    if code == grpc.StatusCode.NOT_FOUND and field_of(e) == "session_id" and lost < 8:
                        lost += 1
                        self.session_id = None
                    elif gone(e) and self.pinned is not None:
                        self.session_id = None  # the replica holding the session is gone or draining: open it again
                    elif not self._past_deadline() and waits_out(e, outage is not None, self.health, TARGET_SERVICE):
                        # gone, restarting or loading (a restarted target listens, and answers UNAVAILABLE, before its
                        # model is loaded), or not there at all
                        if outage is None:
                            outage = self._outage = Recovery(TARGET_SERVICE, self.address, self.recovery_window_s,
                                                             self.deadline, self.health)
                        outage.wait(e)
                    else:
                        raise
        finally:
            self._outage = None

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _opts(self) -> dict:
        timeout = self.call_timeout_s if self.deadline is None else self.deadline - time.monotonic()
        if self._outage is not None:  # the calls that find out whether the target is back end with the outage's window
            timeout = self._outage.timeout(timeout)
        # never waiting for a connection: a target that is gone fails the call at once (UNAVAILABLE), and the outage's
        # waiting (`Recovery`) is the one place that waits for it, within the window, not a call's 30 s each
        return {"timeout": max(timeout, 0.0), "wait_for_ready": False}
