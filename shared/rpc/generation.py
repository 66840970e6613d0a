"""Generating over gRPC, on either path, with the result shaped as in-process `generate` returns it.

- `generate_on_server`: one `Generate` stream; the target runs the loop against its own draft
  peer. If the stream breaks (the target restarted, the network reset it), it is opened again on the
  prompt plus the tokens received so far, for the tokens still missing, for as long as the recovery rule allows
  (`deltaspec.shared.rpc.recovery`: the generation's deadline, or a window of 300 s by default from the first break
  that brought no token, `recovery_window_s`; between tries it waits on the target's grpc.health.v1 `Watch`).
- `generate_client_driven`: this process runs the loop (`deltaspec.shared.decoding.speculative.decode`)
  with the target and the draft as remote peers: one Propose, one Verify and one Commit a round.
  A session is opened through `target_address` (which may be a load-balanced service) and its
  later calls go straight to the replica that holds it when that replica advertises an address.
  With a draft and `pipeline` (the default) the rounds are pipelined
  (`deltaspec.shared.decoding.pipelined`): the draft proposes round r+1 while the target verifies round r.
  A target that is gone, restarting or loading is waited out under the same recovery rule (`RemoteTargetSession`).

Both paths send the prompt's routing key (`deltaspec.shared.rpc.routing`) on `Generate` and `CreateSession`, so a
balancer that hashes it sends requests sharing a prefix to the replica whose prefix cache holds it.

Every channel is dialled as `security` says (`deltaspec.shared.rpc.security.ClientSecurity`: TLS, mutual TLS,
the bearer token); the default is plaintext, which it allows only to loopback addresses.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack

import grpc
from grpc_health.v1 import health_pb2_grpc

from deltaspec.v1 import draft_service_pb2_grpc, target_service_pb2, target_service_pb2_grpc
from deltaspec.shared.decoding.drafters import NoDrafter
from deltaspec.shared.decoding.pipelined import decode_pipelined
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import Generation, Stats, decode
from deltaspec.shared.rpc.convert import sampling_to_proto, stats_from_proto
from deltaspec.shared.rpc.remote_drafter import RemoteDrafter
from deltaspec.shared.rpc.recovery import TARGET_SERVICE, Recovery, check_window, waits_out
from deltaspec.shared.rpc.remote_target import RemoteTargetSession
from deltaspec.shared.rpc.routing import prefix_metadata
from deltaspec.shared.rpc.security import ClientSecurity
from deltaspec.shared.telemetry import Telemetry
from deltaspec.shared.telemetry.spans import generation_span, record_usage

OnTokens = Callable[[list[int], str], None]
Messages = list[dict[str, str]]  # OpenAI-style chat messages: [{"role": "user", "content": "..."}]


def chat_messages(messages: Messages | None) -> list[target_service_pb2.ChatMessage]:
    return [target_service_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()]


def generate_on_server(target_address: str, prompt_ids: list[int] | None, prompt_text: str, max_new_tokens: int,
                       num_draft_tokens: int = 4, sampling: SamplingParams = SamplingParams(),
                       timeout_s: float | None = None, on_tokens: OnTokens | None = None,
                       recovery_window_s: float | None = None, telemetry: Telemetry | None = None,
                       model: str = "deltaspec-target", security: ClientSecurity = ClientSecurity(),
                       messages: Messages | None = None, stop_strings: list[str] = ()) -> tuple[Generation, str]:
    """`messages` is the prompt as a conversation (instead of ids or text), rendered by the target's chat
    template; the generation ends where its text reaches one of `stop_strings`. `recovery_window_s`: how long a
    target that is gone, restarting or loading is waited for (None: until the deadline, or 300 s without one)."""
    check_window(recovery_window_s)
    telemetry = telemetry or Telemetry()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    totals = StreamTotals(prompt_ids)
    with generation_span(telemetry.tracer, "server", model, max_new_tokens) as span, \
            telemetry.channel(security.channel(target_address)) as ch:
        stub = target_service_pb2_grpc.TargetServiceStub(ch)
        for msg in server_stream(stub, prompt_ids, prompt_text, max_new_tokens, num_draft_tokens, sampling,
                                 deadline, recovery_window_s, messages, stop_strings,
                                 health=health_pb2_grpc.HealthStub(ch), address=target_address):
            totals.add(msg)
            if on_tokens and (msg.token_ids or msg.text):
                on_tokens(list(msg.token_ids), msg.text)
        record_usage(span, totals.prompt, totals.out)
    return totals.finish()


class StreamTotals:
    """A `Generate` stream's messages added up (over every reopening) into the result in-process `generate`
    returns: the prompt as tokens, the new tokens, their text, the merged stats timed from construction."""

    def __init__(self, prompt_ids: list[int] | None) -> None:
        self.started = time.perf_counter()
        self.prompt, self.out, self.text, self.stats = list(prompt_ids or []), [], "", Stats()

    def add(self, msg: target_service_pb2.GenerateResponse) -> None:
        self.prompt = self.prompt or list(msg.prompt_ids)
        self.out += msg.token_ids
        self.text += msg.text
        if self.out and not self.stats.first_token_seconds:
            self.stats.first_token_seconds = time.perf_counter() - self.started
        if msg.HasField("stats"):
            merge_stats(self.stats, stats_from_proto(msg.stats))

    def finish(self) -> tuple[Generation, str]:
        self.stats.seconds = time.perf_counter() - self.started
        return Generation(self.prompt, self.out, self.stats), self.text


class Resume:
    """What reopening a broken `Generate` stream needs, for the sync and asyncio loops alike: the request for
    the tokens still missing (the prompt, text or messages until the server has tokenized it, followed by what
    arrived), its routing header (the original prompt's, so a reopened stream is routed as the first one was),
    the time left, and the wait after a break (`deltaspec.shared.rpc.recovery`: an outage begins at a break and ends
    with the first token a reopened stream brings; it is waited out until the deadline or the recovery window).
    Draws are keyed by (seed, position), so a resumed generation is the one an unbroken stream would have made,
    sampled too (a stop string that straddles the break is not seen: the reopened stream searches the new text
    only). `fields`: other GenerateRequest fields (logprobs, top_logprobs, ignore_eos), sent on every opening."""

    def __init__(self, prompt_ids: list[int] | None, prompt_text: str, max_new_tokens: int, num_draft_tokens: int,
                 sampling: SamplingParams, deadline: float | None, recovery_window_s: float | None = None,
                 messages: Messages | None = None, stop_strings: list[str] = (),
                 health: health_pb2_grpc.HealthStub | None = None, address: str = "",
                 fields: dict | None = None) -> None:
        self.prompt, self.out, self.prompt_text = list(prompt_ids or []), [], prompt_text
        self.messages, self.stop_strings = chat_messages(messages), list(stop_strings)
        self.metadata = prefix_metadata(prompt_ids, prompt_text, messages)
        self.max_new_tokens, self.num_draft_tokens, self.sampling = max_new_tokens, num_draft_tokens, sampling
        self.deadline, self.recovery_window_s = deadline, check_window(recovery_window_s)
        self.health, self.address, self.fields = health, address, fields or {}
        self.outage: Recovery | None = None  # the target's outage being waited out: from a break to the next token
        self.outages: list[float] = []  # how long each outage lasted, seconds

    def request(self) -> target_service_pb2.GenerateRequest:
        return target_service_pb2.GenerateRequest(
            prompt_ids=self.prompt + self.out, prompt_text="" if self.prompt else self.prompt_text,
            messages=[] if self.prompt else self.messages, sampling=sampling_to_proto(self.sampling),
            max_new_tokens=self.max_new_tokens - len(self.out), num_draft_tokens=self.num_draft_tokens,
            stop_strings=self.stop_strings, **self.fields)

    def timeout(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def seen(self, msg: target_service_pb2.GenerateResponse) -> None:
        self.prompt = self.prompt or list(msg.prompt_ids)
        self.out += msg.token_ids
        if msg.token_ids and self.outage is not None:  # the target is back
            self.outages.append(time.monotonic() - self.outage.started)
            self.outage = None

    def _outage(self, err: grpc.RpcError) -> Recovery:
        """The outage a break belongs to, or `err` raised again where waiting will not help."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise err
        if not waits_out(err, self.outage is not None, self.health, TARGET_SERVICE):
            raise err
        if self.outage is None:
            self.outage = Recovery(TARGET_SERVICE, self.address, self.recovery_window_s, self.deadline, self.health)
        return self.outage

    def wait_after_break(self, err: grpc.RpcError) -> None:
        """Before reopening: until the target's health service says SERVING, or a jittered back-off; `err` raised
        again where waiting will not help (`RecoveryExhausted` past the window)."""
        self._outage(err).wait(err)

    def after_break(self, err: grpc.RpcError) -> float:
        """`wait_after_break` for asyncio: the delay before reopening (a jittered back-off, no health Watch)."""
        return self._outage(err).delay(err)


def server_stream(stub: target_service_pb2_grpc.TargetServiceStub, prompt_ids: list[int] | None, prompt_text: str,
                  max_new_tokens: int, num_draft_tokens: int, sampling: SamplingParams, deadline: float | None,
                  recovery_window_s: float | None = None, messages: Messages | None = None,
                  stop_strings: list[str] = (), health: health_pb2_grpc.HealthStub | None = None,
                  address: str = "") -> Iterator[target_service_pb2.GenerateResponse]:
    """`Generate`'s messages, the stream opened again after a break (`UNAVAILABLE`, see `Resume`); `health`: the
    grpc.health.v1 stub on `stub`'s channel, asked between tries."""
    resume = Resume(prompt_ids, prompt_text, max_new_tokens, num_draft_tokens, sampling, deadline, recovery_window_s,
                    messages, stop_strings, health, address)
    while True:
        try:
            # never waiting for a connection: a target that is not there fails the call at once, and the outage's
            # waiting (bounded by its window) is the one place that waits for it
            for msg in stub.Generate(resume.request(), timeout=resume.timeout(), wait_for_ready=False,
                                     metadata=resume.metadata):
                resume.seen(msg)
                yield msg
            return
        except grpc.RpcError as e:
            resume.wait_after_break(e)


async def aio_server_stream(stub: target_service_pb2_grpc.TargetServiceStub,
                            resume: Resume) -> AsyncIterator[target_service_pb2.GenerateResponse]:
    """`server_stream` for asyncio (`stub` on a grpc.aio channel): the stream reopened after a break as `resume`
    says, backing off with jitter between tries (no health Watch on the event loop); the last error raised as it
    came. Closing the iterator, or cancelling the task reading it, cancels the call."""
    while True:
        call = stub.Generate(resume.request(), timeout=resume.timeout(), wait_for_ready=False, metadata=resume.metadata)
        try:
            async for msg in call:
                resume.seen(msg)
                yield msg
            return
        except grpc.RpcError as e:
            delay = resume.after_break(e)
        finally:
            call.cancel()
        await asyncio.sleep(delay)


def generate_client_driven(target_address: str, draft_address: str | None, prompt_ids: list[int] | None,
                           prompt_text: str, max_new_tokens: int, num_draft_tokens: int = 4,
                           sampling: SamplingParams = SamplingParams(), timeout_s: float | None = None,
                           draft_timeout_s: float = 1.0, on_tokens: OnTokens | None = None,
                           telemetry: Telemetry | None = None, model: str = "deltaspec-target",
                           security: ClientSecurity = ClientSecurity(), pipeline: bool = True,
                           messages: Messages | None = None,
                           recovery_window_s: float | None = None) -> tuple[Generation, str]:
    """`recovery_window_s`: how long a target that is gone, restarting or loading is waited for (None: until the
    deadline, or 300 s without one; `deltaspec.shared.rpc.recovery`)."""
    check_window(recovery_window_s)
    telemetry = telemetry or Telemetry()
    started = time.perf_counter()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with ExitStack() as stack:
        span = stack.enter_context(generation_span(telemetry.tracer, "client", model, max_new_tokens))
        target_ch = stack.enter_context(telemetry.channel(security.channel(target_address)))
        # closed after the session, which may use one
        replicas = stack.enter_context(_ReplicaChannels(telemetry, security))
        session = RemoteTargetSession(target_service_pb2_grpc.TargetServiceStub(target_ch), prompt_ids, prompt_text,
                                      sampling, deadline, recovery_window_s=recovery_window_s, dial=replicas.stub,
                                      messages=chat_messages(messages), health=health_pb2_grpc.HealthStub(target_ch),
                                      address=target_address)
        stack.callback(session.close)
        remote = None
        if draft_address:
            draft_stub = draft_service_pb2_grpc.DraftServiceStub(
                stack.enter_context(telemetry.channel(security.channel(draft_address))))
            remote = RemoteDrafter(draft_stub, sampling, session.vocab_size, draft_timeout_s, deadline)
            stack.callback(remote.close)
        drafter = remote or NoDrafter()
        drafter.start(list(session.tokens))
        stats = Stats(cached_prompt_tokens=session.cached_tokens)
        rounds = decode_pipelined if remote and pipeline else decode
        for new in rounds(session, drafter, max_new_tokens, num_draft_tokens, session.eos, stats, telemetry.tracer):
            stats.first_token_seconds = stats.first_token_seconds or time.perf_counter() - started
            if on_tokens:
                on_tokens(new, "")
        text = session.text()
        record_usage(span, session.tokens[:session.prompt_len], session.generated)
    stats.seconds = time.perf_counter() - started
    return Generation(session.tokens[:session.prompt_len], session.generated, stats), text


class _ReplicaChannels(ExitStack):
    """Stubs for the target replicas sessions are pinned to: one channel per address, all closed on exit."""

    def __init__(self, telemetry: Telemetry, security: ClientSecurity) -> None:
        super().__init__()
        self.telemetry, self.security = telemetry, security
        self.stubs: dict[str, target_service_pb2_grpc.TargetServiceStub] = {}

    def stub(self, address: str) -> target_service_pb2_grpc.TargetServiceStub:
        if address not in self.stubs:
            self.stubs[address] = target_service_pb2_grpc.TargetServiceStub(
                self.enter_context(self.telemetry.channel(self.security.channel(address))))
        return self.stubs[address]


def merge_stats(total: Stats, part: Stats) -> None:
    """Add the stats of one stream (a generation resumed after a restart has several)."""
    total.rounds += part.rounds
    total.drafts += part.drafts
    total.drafted += part.drafted
    total.accepted += part.accepted
    total.staged_bytes += part.staged_bytes
    total.cached_prompt_tokens += part.cached_prompt_tokens
    total.speculations_kept += part.speculations_kept
    total.speculations_missed += part.speculations_missed
    width = max(len(total.accepted_per_position), len(part.accepted_per_position))
    total.accepted_per_position = [
        (total.accepted_per_position[i] if i < len(total.accepted_per_position) else 0)
        + (part.accepted_per_position[i] if i < len(part.accepted_per_position) else 0) for i in range(width)]
