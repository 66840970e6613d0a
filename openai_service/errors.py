"""Refusals in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status a client
expects: from the front's own checks, from a request that does not parse, and from the target's gRPC status.

A gRPC refusal keeps what the target said: its message, and the field its ErrorInfo names as `param`, in the
request's own terms (`sampling.temperature` is `temperature`, `stop_strings` is `stop`). A prompt past the
target's limits is a 400 `context_length_exceeded` (sending it again cannot help), not a 429.
"""
from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from deltaspec.shared.rpc.status import error_info, field_of

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 429: "rate_limit_error", 499: "cancelled", 503: "service_unavailable_error",
              504: "timeout_error"}
PROMPT_FIELDS = ("prompt_ids", "prompt_text", "messages", "max_total_tokens")


class APIError(Exception):
    """A refusal the front answers with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPE.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"retry-after": f"{max(1, round(self.retry_after_s))}"} if self.retry_after_s is not None else {}


def invalid(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_rpc_error(err: grpc.RpcError, prompt_param: str) -> APIError:
    """The target's refusal as an OpenAI error; `prompt_param` is where this endpoint takes the prompt
    (`messages` or `prompt`)."""
    code: grpc.StatusCode = err.code()  # type: ignore[attr-defined]
    status, message = HTTP_STATUS.get(code, 500), err.details() or code.name  # type: ignore[attr-defined]
    info, field = error_info(err), field_of(err)
    reason = info.reason.lower() if info else code.name.lower()
    if field in PROMPT_FIELDS or (field or "").startswith("messages["):
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED or field == "max_total_tokens":
            return APIError(400, message, prompt_param, "context_length_exceeded")
        return APIError(status, message, prompt_param if field in PROMPT_FIELDS else field, reason)
    return APIError(status, message, param(field), reason, _retry_after(err))


def param(field: str | None) -> str | None:
    """A request field of GenerateRequest in the terms of OpenAI's request."""
    if field is None:
        return None
    field = field.removeprefix("sampling.")
    return {"stop_strings": "stop", "max_new_tokens": "max_tokens", "top_logprobs": "top_logprobs"}.get(field, field)


def _retry_after(err: grpc.RpcError) -> float | None:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for packed in status.details if status else ():
        retry = error_details_pb2.RetryInfo()
        if packed.Unpack(retry):
            return retry.retry_delay.ToNanoseconds() / 1e9
    return None


def from_validation(errors: list[dict]) -> APIError:
    """pydantic's most specific complaint about the body (of a union's, the one that went deepest): the field it
    names (`messages[0].content[1].type`), and what it says."""
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    where = ""
    for part in first.get("loc", ()):
        if isinstance(part, int):
            where += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            where += f".{part}" if where else part
    return invalid(f"{where or 'body'}: {first.get('msg')}", where or None, "invalid_value")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function_after", "function_before"}
