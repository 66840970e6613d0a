"""One mapping from engine errors to gRPC statuses with google.rpc details, and back.

Server side, `ErrorInterceptor` wraps every handler: a `DeltaspecError` becomes its status with
details naming the field at fault (BadRequest for INVALID_ARGUMENT, ResourceInfo for NOT_FOUND,
PreconditionFailure, QuotaFailure) and an ErrorInfo (the error's stable `reason`, domain `deltaspec.io`, the
field in its metadata); a request that does not parse (invalid UTF-8 in a string) becomes
INVALID_ARGUMENT naming the field, not gRPC's INTERNAL; any other exception becomes INTERNAL; a
service that is still loading answers UNAVAILABLE. Client side, `field_of` reads the field back from a
failed call.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2, empty_pb2, unknown_fields
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from deltaspec.shared.errors import (DeltaspecError, FailedPrecondition, InvalidArgument, NotFound, RateLimited,
                                     ResourceExhausted)

log = logging.getLogger(__name__)


DOMAIN = "deltaspec.io"


def _bad_request(err: DeltaspecError) -> Message:
    return error_details_pb2.BadRequest(
        field_violations=[error_details_pb2.BadRequest.FieldViolation(field=err.field, description=str(err))])


def _resource_info(err: DeltaspecError) -> Message:
    """The kind of resource (a session or a round, by the field that named it) and the id not found."""
    kind = "deltaspec.io/Round" if err.field.endswith("round_id") else "deltaspec.io/Session"
    return error_details_pb2.ResourceInfo(resource_type=kind, resource_name=getattr(err, "resource_name", ""),
                                          description=str(err))


def _precondition(err: DeltaspecError) -> Message:
    return error_details_pb2.PreconditionFailure(violations=[error_details_pb2.PreconditionFailure.Violation(
        type=err.reason, subject=err.field, description=str(err))])


def _quota(err: DeltaspecError) -> Message:
    return error_details_pb2.QuotaFailure(
        violations=[error_details_pb2.QuotaFailure.Violation(subject=err.field, description=str(err))])


MAPPING: dict[type[DeltaspecError], tuple[int, Callable[[DeltaspecError], Message]]] = {
    InvalidArgument: (code_pb2.INVALID_ARGUMENT, _bad_request),
    NotFound: (code_pb2.NOT_FOUND, _resource_info),
    FailedPrecondition: (code_pb2.FAILED_PRECONDITION, _precondition),
    ResourceExhausted: (code_pb2.RESOURCE_EXHAUSTED, _quota),
}


def to_status(err: DeltaspecError) -> grpc.Status:
    """The error's status: an ErrorInfo always, the field's detail when one is named, and for a `RateLimited`
    a RetryInfo (when the next call may go)."""
    code, detail = next(v for cls, v in MAPPING.items() if isinstance(err, cls))
    status = status_pb2.Status(code=code, message=str(err))
    details = [error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN,
                                           metadata={"field": err.field} if err.field else {})]
    if err.field:
        details.append(detail(err))
    if isinstance(err, RateLimited):
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(max(1, round(err.retry_after_s * 1e9)))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    for message in details:
        packed = any_pb2.Any()
        packed.Pack(message)
        status.details.append(packed)
    return rpc_status.to_status(status)


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo (domain deltaspec.io) a refused call carries: its stable `reason` and the `field` at fault
    in its metadata; None where gRPC or the security layer refused before a service read the request."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for packed in status.details if status else ():
        info = error_details_pb2.ErrorInfo()
        if packed.Unpack(info) and info.domain == DOMAIN:
            return info
    return None


def field_of(err: grpc.RpcError) -> str | None:
    """The request field a refused call names, or None."""
    info = error_info(err)
    return (info.metadata.get("field") or None) if info else None


def reason_of(err: grpc.RpcError) -> str | None:
    """The stable reason a refused call carries, or None."""
    info = error_info(err)
    return info.reason if info else None


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps engine errors to statuses, and answers UNAVAILABLE for a service `ready` says is not up."""

    def __init__(self, ready: Callable[[str], bool]) -> None:
        self.ready = ready

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service = handler_call_details.method.split("/")[1]
        if handler.request_deserializer is not None:
            handler = handler._replace(request_deserializer=_lenient(handler.request_deserializer))
        if handler.unary_unary:
            return handler._replace(unary_unary=self._unary(service, handler.unary_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._stream(service, handler.unary_stream))
        return handler

    def _unary(self, service: str, behavior):
        async def wrapped(request, context: grpc.aio.ServicerContext):
            await self._check_ready(service, context)
            try:
                _check_decoded(request)
                return await behavior(request, context)
            except DeltaspecError as e:
                await context.abort_with_status(to_status(e))
            except Exception as e:  # noqa: BLE001 - the one place unexpected errors become a status
                await _internal(context, e)
        return wrapped

    def _stream(self, service: str, behavior):
        async def wrapped(request, context: grpc.aio.ServicerContext):
            await self._check_ready(service, context)
            try:
                _check_decoded(request)
                responses = behavior(request, context)
                if hasattr(responses, "__aiter__"):
                    async for response in responses:
                        yield response
                else:  # a coroutine that writes its responses itself (health's Watch)
                    await responses
            except DeltaspecError as e:
                await context.abort_with_status(to_status(e))
            except Exception as e:  # noqa: BLE001
                await _internal(context, e)
        return wrapped

    async def _check_ready(self, service: str, context: grpc.aio.ServicerContext) -> None:
        if not self.ready(service):
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{service} is not serving (loading or draining)")


@dataclass(frozen=True)
class _Undecodable:
    """A request that did not parse; it reaches the handler wrapper, which refuses it with INVALID_ARGUMENT."""

    raw: bytes
    message: type[Message] | None


def _lenient(deserialize: Callable[[bytes], Message]) -> Callable[[bytes], Message | _Undecodable]:
    """gRPC answers a request that fails to parse with INTERNAL; this hands it on to be refused properly."""
    def parse(raw: bytes) -> Message | _Undecodable:
        try:
            return deserialize(raw)
        except DecodeError:
            return _Undecodable(raw, getattr(deserialize, "__self__", None))
    return parse


def _check_decoded(request: object) -> None:
    if not isinstance(request, _Undecodable):
        return
    name = request.message.DESCRIPTOR.full_name if request.message else "request"
    field = _invalid_utf8_field(request.raw, request.message) if request.message else None
    reason = f"field {field!r} is not valid UTF-8" if field else "it does not parse"
    raise InvalidArgument(f"the request is not a valid {name}: {reason}", field, "UNPARSEABLE_REQUEST")


def _invalid_utf8_field(raw: bytes, message: type[Message]) -> str | None:
    """The top-level string field holding invalid UTF-8 (the usual reason a well-framed request fails), or None."""
    holder = empty_pb2.Empty()
    try:
        holder.ParseFromString(raw)  # every field lands in the unknown set, where strings are not checked
    except DecodeError:
        return None
    for f in unknown_fields.UnknownFieldSet(holder):
        fd = message.DESCRIPTOR.fields_by_number.get(f.field_number)
        if fd is not None and fd.type == fd.TYPE_STRING and f.wire_type == 2:
            try:
                f.data.decode("utf-8")
            except UnicodeDecodeError:
                return fd.name
    return None


async def _internal(context: grpc.aio.ServicerContext, e: Exception) -> None:
    if isinstance(e, grpc.aio.AbortError):  # an abort the handler chose: let it through
        raise e
    log.exception("unexpected error in handler")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
