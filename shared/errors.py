"""Errors the engine raises on bad requests; the services map each class to one gRPC status."""
from __future__ import annotations


class DeltaspecError(Exception):
    """Base class. `field` names the request field at fault, when there is one."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidArgument(DeltaspecError, ValueError):
    """The request itself is wrong (token out of vocabulary, k over the limit, empty prompt...).

    Also a ValueError: engine types (e.g. `SamplingParams`) raise it for in-process callers too."""


class NotFound(DeltaspecError):
    """Unknown session or round."""


class FailedPrecondition(DeltaspecError):
    """Valid request, wrong moment: stale base version, another round pending, a round id reused with other input."""


class ResourceExhausted(DeltaspecError):
    """Too many sessions, too long a prompt."""


class RateLimited(ResourceExhausted):
    """A caller over its call rate: its next call may go in `retry_after_s` seconds."""

    def __init__(self, message: str, field: str | None, retry_after_s: float) -> None:
        super().__init__(message, field)
        self.retry_after_s = retry_after_s
