"""Sessions by id, with the limits a server needs: how many, how long idle, how large a prompt.

Idle sessions expire after `ttl_s`; a session inside `use()` is never idle, however long the call.
Expiry is checked on every access, so no background task is needed.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from shared.errors import NotFound, ResourceExhausted

S = TypeVar("S")


@dataclass(frozen=True)
class Limits:
    max_sessions: int = 64
    ttl_s: float = 600.0
    max_prompt_tokens: int = 8192

    def check_prompt(self, n_tokens: int, field_name: str) -> None:
        if n_tokens > self.max_prompt_tokens:
            raise ResourceExhausted(f"the prompt has {n_tokens} tokens, the limit is {self.max_prompt_tokens}",
                                    field_name)


@dataclass
class _Entry(Generic[S]):
    session: S
    last_used: float
    in_use: int = 0


class SessionTable(Generic[S]):
    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self._entries: dict[str, _Entry[S]] = {}
        self._lock = threading.Lock()
        self.expired = 0  # sessions dropped for idleness, ever (a metric)

    def reserve(self) -> None:
        """Refuse early, before an expensive prefill, when the table is full."""
        with self._lock:
            self._expire()
            self._check_room()

    def add(self, session: S) -> str:
        with self._lock:
            self._expire()
            self._check_room()
            session_id = uuid.uuid4().hex
            self._entries[session_id] = _Entry(session, self.clock())
            return session_id

    @contextmanager
    def use(self, session_id: str) -> Iterator[S]:
        with self._lock:
            self._expire()
            entry = self._entries.get(session_id)
            if entry is None:
                raise NotFound(f"no session {session_id!r} (never opened, closed, or expired)", "session_id")
            entry.in_use += 1
        try:
            yield entry.session
        finally:
            with self._lock:
                entry.in_use -= 1
                entry.last_used = self.clock()

    def remove(self, session_id: str) -> S:
        with self._lock:
            self._expire()
            entry = self._entries.pop(session_id, None)
            if entry is None:
                raise NotFound(f"no session {session_id!r} (never opened, closed, or expired)", "session_id")
            return entry.session

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def _check_room(self) -> None:
        if len(self._entries) >= self.limits.max_sessions:
            raise ResourceExhausted(f"{len(self._entries)} sessions are open, the limit is "
                                    f"{self.limits.max_sessions}", "session_id")

    def _expire(self) -> None:
        cutoff = self.clock() - self.limits.ttl_s
        for session_id in [k for k, e in self._entries.items() if not e.in_use and e.last_used < cutoff]:
            del self._entries[session_id]
            self.expired += 1
