"""The Python client library: what an application imports to call deltaspec's services.

    from deltaspec.shared.client import Client

    with Client("127.0.0.1:50051") as client:
        for piece in client.stream("def fib(n):", max_new_tokens=64):
            print(piece.text, end="", flush=True)

`Client` is synchronous, `AsyncClient` the same for asyncio. Both dial with TLS (a CA; a certificate and key for
mutual TLS) and a bearer token when given, plaintext only to loopback addresses (`insecure=True` elsewhere).
`stream` runs `Generate` (the target runs the speculative loop against its own drafter) and yields text and
token pieces as rounds commit; a stream broken by a restart or a reset is reopened on the prompt plus the
tokens already received, which gives the same tokens (greedy, and sampled: draws are keyed by seed and
position). `generate` returns the whole completion; with `draft=` it runs the loop in this process against a
draft service (client-driven rounds, pipelined), retrying each round by its id, which the services make
idempotent. A prompt is text, token ids, or `messages=[{"role": "user", "content": ...}]` (OpenAI-style), which
the target renders with its checkpoint's chat template; `stop_strings=` end a generation on `Generate` where its
text first contains one (the text stops before it). Every refusal is raised as a `DeltaspecRpcError` subclass
carrying the status code, the stable reason and the field at fault (see protos/deltaspec/v1/target_service.proto
for the contract).

A target that is gone, restarting or still loading its model (a rollout, a crash) is waited for, on every path:
until the generation's deadline (`timeout_s`), or the recovery window when there is none (`recovery_window_s`, 300 s
by default; a given window ends at the deadline if that comes first), watching the target's grpc.health.v1 status
between tries (`deltaspec.shared.rpc.recovery`). Past it the call raises `UnavailableError` saying how long it waited.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2_grpc
from grpc_status import rpc_status

from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import Generation
from deltaspec.shared.rpc.generation import (Messages, Resume, StreamTotals, aio_server_stream, generate_client_driven,
                                             generate_on_server, server_stream)
from deltaspec.shared.rpc.recovery import check_window
from deltaspec.shared.rpc.security import ClientSecurity
from deltaspec.shared.rpc.status import error_info, field_of
from deltaspec.v1 import target_service_pb2, target_service_pb2_grpc

__all__ = ["AsyncClient", "Client", "Completion", "DeltaspecRpcError", "FailedPreconditionError",
           "InvalidArgumentError", "NotFoundError", "PermissionDeniedError", "Piece", "ResourceExhaustedError",
           "UnauthenticatedError", "UnavailableError"]


@dataclass(frozen=True)
class Piece:
    """Tokens committed by one round (and their text) as the stream delivers them."""

    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class Completion:
    """A finished generation: the prompt as tokens, the new tokens and their text, the loop's statistics."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    stats: dict = field(default_factory=dict)


class DeltaspecRpcError(Exception):
    """A call the service refused: `code` (grpc.StatusCode), `reason` (ErrorInfo's stable string, or None where
    gRPC or the security layer refused before the service read the request), `field` (the request field at
    fault, or None), `retry_after_s` (RetryInfo, when rate limited), `details` (every google.rpc detail)."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str | None, field: str | None,
                 retry_after_s: float | None, details: list) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message, self.reason, self.field = code, message, reason, field
        self.retry_after_s, self.details = retry_after_s, details

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> DeltaspecRpcError:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
        details = []
        for packed in status.details if status else ():
            for kind in _DETAIL_KINDS:
                detail = kind()
                if packed.Unpack(detail):
                    details.append(detail)
        info = error_info(err)
        retry = next((d.retry_delay.ToNanoseconds() / 1e9 for d in details
                      if isinstance(d, error_details_pb2.RetryInfo)), None)
        code, message = err.code(), err.details() or ""  # type: ignore[attr-defined]
        return _BY_CODE.get(code, DeltaspecRpcError)(code, message, info.reason if info else None, field_of(err),
                                                     retry, details)


_DETAIL_KINDS = (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.ResourceInfo,
                 error_details_pb2.PreconditionFailure, error_details_pb2.QuotaFailure, error_details_pb2.RetryInfo)


class InvalidArgumentError(DeltaspecRpcError):
    """The request is wrong; sending it again will not help."""


class NotFoundError(DeltaspecRpcError):
    """Unknown, closed, expired or someone else's session, or an unknown round."""


class FailedPreconditionError(DeltaspecRpcError):
    """A valid request at the wrong moment: a stale or future base version, another round pending."""


class ResourceExhaustedError(DeltaspecRpcError):
    """A limit: sessions, prompt length, state memory, call rate (`retry_after_s` then says when to retry)."""


class UnauthenticatedError(DeltaspecRpcError):
    """No token, or one the service does not know."""


class PermissionDeniedError(DeltaspecRpcError):
    """The caller's grants do not include the method."""


class UnavailableError(DeltaspecRpcError):
    """The service is unreachable, loading or draining, after the client's own retries."""


_BY_CODE = {grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError, grpc.StatusCode.NOT_FOUND: NotFoundError,
            grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
            grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
            grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
            grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError, grpc.StatusCode.UNAVAILABLE: UnavailableError}


@dataclass(frozen=True)
class _Options:
    """What both clients share: where to dial, how, how long a call may take and a target's outage is waited out."""

    target: str
    draft: str | None
    security: ClientSecurity
    timeout_s: float | None
    recovery_window_s: float | None = None

    @staticmethod
    def make(target: str, draft: str | None, ca: str | Path | None, cert: str | Path | None,
             key: str | Path | None, token: str | None, server_name: str | None, insecure: bool,
             timeout_s: float | None, recovery_window_s: float | None = None) -> _Options:
        check_window(recovery_window_s)
        path = lambda p: None if p is None else Path(p)  # noqa: E731
        security = ClientSecurity(ca=path(ca), cert=path(cert), key=path(key), token=token,
                                  server_name=server_name, insecure=insecure)
        security.check(target)
        if draft:
            security.check(draft)
        return _Options(target, draft, security, timeout_s, recovery_window_s)

    def deadline(self) -> float | None:
        return None if self.timeout_s is None else time.monotonic() + self.timeout_s


Prompt = str | list[int] | None  # None: the prompt is `messages`


def _prompt(prompt: Prompt) -> tuple[list[int] | None, str]:
    if prompt is None or isinstance(prompt, str):
        return None, prompt or ""
    return list(prompt), ""


def _completion(generation: Generation, text: str) -> Completion:
    return Completion(generation.prompt_ids, generation.token_ids, text,
                      generation.stats.as_dict(len(generation.token_ids)))


class Client:
    """A synchronous client of a target service (and optionally a draft service for client-driven rounds).

    `timeout_s`: a deadline for each generation; `recovery_window_s`: how long a target that is gone, restarting or
    loading is waited for (None: until the deadline, or 300 s without one; 0 or more, else ValueError)."""

    def __init__(self, target: str, *, draft: str | None = None, ca: str | Path | None = None,
                 cert: str | Path | None = None, key: str | Path | None = None, token: str | None = None,
                 server_name: str | None = None, insecure: bool = False, timeout_s: float | None = None,
                 recovery_window_s: float | None = None) -> None:
        self._options = _Options.make(target, draft, ca, cert, key, token, server_name, insecure, timeout_s,
                                      recovery_window_s)
        self._channel = self._options.security.channel(target)
        self._stub = target_service_pb2_grpc.TargetServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def stream(self, prompt: Prompt = None, *, max_new_tokens: int, messages: Messages | None = None,
               stop_strings: Sequence[str] = (), num_draft_tokens: int = 4, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0) -> Iterator[Piece]:
        """Text, token ids or chat messages in, pieces out as rounds commit; the target runs the loop (`Generate`)."""
        ids, text = _prompt(prompt)
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        try:
            for msg in server_stream(self._stub, ids, text, max_new_tokens, num_draft_tokens, sampling,
                                     self._options.deadline(), self._options.recovery_window_s, messages=messages,
                                     stop_strings=list(stop_strings), health=self._health,
                                     address=self._options.target):
                if msg.token_ids or msg.text:
                    yield Piece(list(msg.token_ids), msg.text)
        except grpc.RpcError as e:
            raise DeltaspecRpcError.from_rpc_error(e) from e

    def generate(self, prompt: Prompt = None, *, max_new_tokens: int, messages: Messages | None = None,
                 stop_strings: Sequence[str] = (), num_draft_tokens: int = 4, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> Completion:
        """The whole completion: through `Generate`, or, with a draft service, rounds run in this process (which
        stop at the target's end-of-sequence ids; stop strings are `Generate`'s)."""
        ids, text = _prompt(prompt)
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        if self._options.draft and stop_strings:
            raise ValueError("stop_strings are applied by the target's Generate: leave out draft= to use them")
        try:
            if self._options.draft:
                generation, out = generate_client_driven(
                    self._options.target, self._options.draft, ids, text, max_new_tokens, num_draft_tokens,
                    sampling, self._options.timeout_s, security=self._options.security, messages=messages,
                    recovery_window_s=self._options.recovery_window_s)
            else:
                generation, out = generate_on_server(self._options.target, ids, text, max_new_tokens,
                                                     num_draft_tokens, sampling, self._options.timeout_s,
                                                     recovery_window_s=self._options.recovery_window_s,
                                                     security=self._options.security, messages=messages,
                                                     stop_strings=list(stop_strings))
        except grpc.RpcError as e:
            raise DeltaspecRpcError.from_rpc_error(e) from e
        return _completion(generation, out)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """`Client` for asyncio: `async for piece in client.stream(...)`, `await client.generate(...)`. A target's outage
    is waited out as `Client` does, backing off with jitter between tries (no health Watch on the event loop).
    `max_attempts` is no longer read (the wait is bounded by time: `recovery_window_s`); passing it warns."""

    def __init__(self, target: str, *, ca: str | Path | None = None, cert: str | Path | None = None,
                 key: str | Path | None = None, token: str | None = None, server_name: str | None = None,
                 insecure: bool = False, timeout_s: float | None = None, recovery_window_s: float | None = None,
                 max_attempts: int | None = None) -> None:
        if max_attempts is not None:
            warnings.warn("AsyncClient(max_attempts=) is ignored: a target's outage is waited out for a time, "
                          "recovery_window_s", DeprecationWarning, stacklevel=2)
        self._options = _Options.make(target, None, ca, cert, key, token, server_name, insecure, timeout_s,
                                      recovery_window_s)
        self._channel = self._options.security.aio_channel(target)
        self._stub = target_service_pb2_grpc.TargetServiceStub(self._channel)

    async def stream(self, prompt: Prompt = None, *, max_new_tokens: int, messages: Messages | None = None,
                     stop_strings: Sequence[str] = (), num_draft_tokens: int = 4, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> AsyncIterator[Piece]:
        async for msg in self._messages(prompt, max_new_tokens, num_draft_tokens,
                                        SamplingParams(temperature, top_k, top_p, seed), messages, stop_strings):
            if msg.token_ids or msg.text:
                yield Piece(list(msg.token_ids), msg.text)

    async def generate(self, prompt: Prompt = None, *, max_new_tokens: int, messages: Messages | None = None,
                       stop_strings: Sequence[str] = (), num_draft_tokens: int = 4, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> Completion:
        totals = StreamTotals(_prompt(prompt)[0])
        async for msg in self._messages(prompt, max_new_tokens, num_draft_tokens,
                                        SamplingParams(temperature, top_k, top_p, seed), messages, stop_strings):
            totals.add(msg)
        return _completion(*totals.finish())

    async def _messages(self, prompt: Prompt, max_new_tokens: int, num_draft_tokens: int, sampling: SamplingParams,
                        messages: Messages | None,
                        stop_strings: Sequence[str]) -> AsyncIterator[target_service_pb2.GenerateResponse]:
        """`server_stream` for asyncio: reopened after a break on the prompt plus the tokens received."""
        resume = Resume(*_prompt(prompt), max_new_tokens, num_draft_tokens, sampling, self._options.deadline(),
                        self._options.recovery_window_s, messages, list(stop_strings), address=self._options.target)
        try:
            async for msg in aio_server_stream(self._stub, resume):
                yield msg
        except grpc.RpcError as e:
            raise DeltaspecRpcError.from_rpc_error(e) from e

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
