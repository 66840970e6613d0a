"""How long a deltaspec client waits for a service that is gone, restarting or loading: a time rule, not a count.

A restarted target listens at once and answers `UNAVAILABLE` ("not serving (loading or draining)") until its model
is loaded, which takes tens of seconds to minutes for a real checkpoint. Every loop that is a client of a deltaspec
service (the client-driven rounds, `RemoteTargetSession`; the `Generate` stream, `server_stream` and `AsyncClient`)
keeps trying through such an outage until

- the generation's deadline, when it has one and no window was given, else
- the **recovery window** (`DEFAULT_RECOVERY_WINDOW_S`, 300 s, long enough for a large checkpoint to load; a given
  window still ends at the generation's deadline if that comes first),

counted from the first failure of the outage (a success ends it: the next outage has a whole window again). Between
tries it asks the service's grpc.health.v1 `Watch` (open without a token) for the service's status and tries again
as soon as it says SERVING; where the health service cannot be asked (a stream that breaks because the process is
gone, a proxy that does not pass it), it backs off from 50 ms, doubling, capped at 2 s, with jitter (each delay drawn
from its upper half) so that clients of one restarted replica do not come back in step. Past the window it raises
`RecoveryExhausted`: `UNAVAILABLE`, with a message saying how long it waited and for what.

The target's calls to its draft (`RemoteDrafter`) never wait: a round without drafts gives the same tokens, so a failed
draft only pauses speculation, for a time that doubles from 10 ms with each failure in a row to at most 4 s
(`DRAFT_PAUSE_START_S`, `DRAFT_PAUSE_CAP_S`; see remote_drafter.py).
"""
from __future__ import annotations

import asyncio
import math
import random
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltaspec.v1 import target_service_pb2

TARGET_SERVICE = target_service_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name

DEFAULT_RECOVERY_WINDOW_S = 300.0
BACKOFF_START_S = 0.05
BACKOFF_CAP_S = 2.0
WATCH_SLICE_S = 10.0  # one health Watch at most this long, then another (a peer lost silently is noticed)
DRAFT_PAUSE_START_S = 0.01  # a failed draft: the rounds of the next 10 ms go without it, doubling to the cap
DRAFT_PAUSE_CAP_S = 4.0


def check_window(window_s: float | None, name: str = "recovery_window_s") -> float | None:
    """`window_s` if it is a valid recovery window (seconds, 0 or more; inf waits for ever), else ValueError."""
    if window_s is None:
        return None
    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or math.isnan(window_s) or window_s < 0:
        raise ValueError(f"{name} must be a number of seconds, 0 or more, got {window_s!r}")
    return float(window_s)


def gone(err: grpc.RpcError) -> bool:
    """A failure that means the service is gone, restarting, loading or draining: worth waiting out.
    CANCELLED: a stopping server cancels the calls in flight."""
    return err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)  # type: ignore[attr-defined]


def waits_out(err: grpc.RpcError, in_outage: bool, health: health_pb2_grpc.HealthStub | None,
              service: str) -> bool:
    """Whether a failed call is an outage to wait out, for every loop alike: the service is gone, restarting, loading
    or draining (`gone`), or the call ran out of time during an outage, or while the service cannot be reached or
    does not serve (a pod that takes longer than a call's timeout to listen again) rather than answering slowly.
    The caller has checked the generation's own deadline first."""
    if gone(err):
        return True
    if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
        return False
    return in_outage or (health is not None and not _serving(health, service))


def _serving(health: health_pb2_grpc.HealthStub, service: str) -> bool:
    """The health service's answer now, without waiting for a connection (unreachable: not serving)."""
    try:
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0, wait_for_ready=False)
    except grpc.RpcError as e:
        return not gone(e)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class RecoveryExhausted(grpc.RpcError, grpc.Call):
    """`UNAVAILABLE` after a recovery window: raised like a gRPC error, so every caller reports it as one."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self._message = message

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._message

    def trailing_metadata(self):
        return ()

    def initial_metadata(self):
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self):
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback) -> bool:
        return False

    def __str__(self) -> str:
        return f"UNAVAILABLE: {self._message}"


class Recovery:
    """One outage of `service` at `address`: when it ends (`until`), what to do between tries (`wait`, or `delay`
    for asyncio), the error past the end (`exhausted`)."""

    def __init__(self, service: str, address: str = "", window_s: float | None = None, deadline: float | None = None,
                 health: health_pb2_grpc.HealthStub | None = None, rng: random.Random | None = None) -> None:
        self.service, self.address, self.health = service, address, health
        self.started = time.monotonic()
        window = (DEFAULT_RECOVERY_WINDOW_S if deadline is None else math.inf) if window_s is None else window_s
        self.by_deadline = deadline is not None and deadline <= self.started + window
        self.window_s = window
        self.until = deadline if self.by_deadline else self.started + window  # type: ignore[assignment]
        self.tries = 0
        self.serving = False  # the last wait ended on the health service's SERVING
        self.last: grpc.RpcError | None = None
        self.rng = rng or random.Random()

    def left(self) -> float:
        return self.until - time.monotonic()

    def timeout(self, timeout: float) -> float:
        """A call's timeout during the outage: never past its end."""
        return max(0.0, min(timeout, self.left()))

    def over(self) -> bool:
        return self.left() <= 0

    def wait(self, err: grpc.RpcError) -> None:
        """Before the next try: until the health service says SERVING, else a jittered back-off (also when it said
        SERVING last time too and the call failed again); `exhausted()` raised past the end of the outage's window."""
        self.last = err
        if self.over():
            raise self.exhausted()
        serving = self._watch() if self.health is not None else False
        if self.over():
            raise self.exhausted()
        if not serving or self.serving:
            time.sleep(min(self.left(), self._backoff()))
        self.serving = serving
        self.tries += 1

    def delay(self, err: grpc.RpcError) -> float:
        """For asyncio callers (no health Watch): the back-off before the next try, or `exhausted()` raised."""
        self.last = err
        if self.over():
            raise self.exhausted()
        delay = min(self.left(), self._backoff())
        self.tries += 1
        return delay

    def exhausted(self) -> RecoveryExhausted:
        waited = time.monotonic() - self.started
        where = f" at {self.address}" if self.address else ""
        bound = ("until the generation's deadline" if self.by_deadline else
                 f"the recovery window of {self.window_s:g} s (recovery_window_s, --recovery-window)")
        last = self.last
        answer = f"{last.code().name}: {last.details()}" if last is not None else "none"  # type: ignore[attr-defined]
        return RecoveryExhausted(
            f"{self.service}{where} did not come back: waited {waited:.1f} s, {bound}, for it to serve again "
            f"(gone, restarting or loading its model; {self.tries + 1} tries, the last answered {answer})")

    def _backoff(self) -> float:
        ceiling = min(BACKOFF_CAP_S, BACKOFF_START_S * 2 ** self.tries)
        return self.rng.uniform(ceiling / 2, ceiling)

    def _watch(self) -> bool:
        """Whether the health service said SERVING within the time left (or one slice of it)."""
        try:
            for reply in self.health.Watch(health_pb2.HealthCheckRequest(service=self.service),  # type: ignore
                                           timeout=max(0.0, min(self.left(), WATCH_SLICE_S)), wait_for_ready=True):
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED,  # type: ignore
                            grpc.StatusCode.UNAUTHENTICATED):
                self.health = None  # not to be asked: blind back-off from now on
        return False


async def async_sleep_for(recovery: Recovery, err: grpc.RpcError) -> None:
    """`Recovery.delay` slept on the event loop."""
    await asyncio.sleep(recovery.delay(err))
