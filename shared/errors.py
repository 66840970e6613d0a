"""Errors the engine raises on bad requests; the services map each class to one gRPC status.

Each error has a `reason`: a stable upper-snake string sent as `google.rpc.ErrorInfo.reason` (domain
`deltaspec.io`), and as the `PreconditionFailure` violation type, so clients branch on it rather than on messages.
A class gives the default; a raise site names a finer one where a client would act differently.
"""
from __future__ import annotations


class DeltaspecError(Exception):
    """Base class. `field` names the request field at fault, when there is one."""

    reason = "ERROR"

    def __init__(self, message: str, field: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        if reason is not None:
            self.reason = reason


class InvalidArgument(DeltaspecError, ValueError):
    """The request itself is wrong (token out of vocabulary, k over the limit, empty prompt...).

    Also a ValueError: engine types (e.g. `SamplingParams`) raise it for in-process callers too."""

    reason = "INVALID_FIELD"


class NotFound(DeltaspecError):
    """Unknown session or round; `resource_name` is the id that was not found."""

    reason = "NOT_FOUND"

    def __init__(self, message: str, field: str, resource_name: str) -> None:
        super().__init__(message, field)
        self.resource_name = resource_name


class FailedPrecondition(DeltaspecError):
    """Valid request, wrong moment: stale base version, another round pending, a round id reused with other input."""

    reason = "WRONG_STATE"


class ResourceExhausted(DeltaspecError):
    """Too many sessions, too long a prompt."""

    reason = "QUOTA_EXCEEDED"


class RateLimited(ResourceExhausted):
    """A caller over its call rate: its next call may go in `retry_after_s` seconds."""

    reason = "RATE_LIMITED"

    def __init__(self, message: str, field: str | None, retry_after_s: float) -> None:
        super().__init__(message, field)
        self.retry_after_s = retry_after_s
