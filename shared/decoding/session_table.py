"""Sessions by id, with the limits a server needs: how many, how long idle, how large a prompt.

Idle sessions expire after `ttl_s`; a session inside `use()` is never idle, however long the call.
Expiry is checked on every access, so no background task is needed.

Each session belongs to the caller that opened it (`owner`: a token name, a client certificate's
subject, or "anonymous" when the server authenticates no one; see `deltaspec.shared.rpc.security`). To any
other caller it does not exist: the same NOT_FOUND, word for word, as an id never issued, so a
leaked id reveals nothing. `max_sessions_per_caller` keeps one caller from taking the whole table.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from deltaspec.shared.errors import NotFound, ResourceExhausted

S = TypeVar("S")
ANONYMOUS = "anonymous"  # the caller when the server authenticates no one


@dataclass(frozen=True)
class Limits:
    max_sessions: int = 64
    ttl_s: float = 600.0
    max_prompt_tokens: int = 8192
    max_sessions_per_caller: int = 0  # 0: only `max_sessions` bounds a caller
    state_memory_bytes: int = 0  # GDN slots + attention K/V (deltaspec.shared.state.pool); 0: sized for max_sessions
    prefix_cache_block: int = 16  # tokens per prefix cache entry (deltaspec.shared.state.prefix_cache); 0: no cache
    prefix_cache_state_every: int = 1  # blocks between the GDN states it keeps off leaves and branch points

    def check_prompt(self, n_tokens: int, field_name: str) -> None:
        if n_tokens > self.max_prompt_tokens:
            raise ResourceExhausted(f"the prompt has {n_tokens} tokens, the limit is {self.max_prompt_tokens}",
                                    field_name)


@dataclass
class _Entry(Generic[S]):
    session: S
    owner: str
    last_used: float
    in_use: int = 0


class SessionTable(Generic[S]):
    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self._entries: dict[str, _Entry[S]] = {}
        self._lock = threading.Lock()
        self.expired = 0  # sessions dropped for idleness, ever (a metric)

    def reserve(self, owner: str = ANONYMOUS) -> None:
        """Refuse early, before an expensive prefill, when the table (or the caller's share) is full."""
        with self._lock:
            self._expire()
            self._check_room(owner)

    def add(self, session: S, owner: str = ANONYMOUS) -> str:
        with self._lock:
            self._expire()
            self._check_room(owner)
            session_id = uuid.uuid4().hex
            self._entries[session_id] = _Entry(session, owner, self.clock())
            return session_id

    @contextmanager
    def use(self, session_id: str, owner: str = ANONYMOUS) -> Iterator[S]:
        with self._lock:
            self._expire()
            entry = self._find(session_id, owner)
            entry.in_use += 1
        try:
            yield entry.session
        finally:
            with self._lock:
                entry.in_use -= 1
                entry.last_used = self.clock()

    def remove(self, session_id: str, owner: str = ANONYMOUS) -> S:
        with self._lock:
            self._expire()
            entry = self._find(session_id, owner)
            del self._entries[session_id]
            return entry.session

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def _find(self, session_id: str, owner: str) -> _Entry[S]:
        """The caller's own session; anyone else's is refused exactly as an unknown id is."""
        entry = self._entries.get(session_id)
        if entry is None or entry.owner != owner:
            raise NotFound(f"no session {session_id!r} (never opened, closed, or expired)", "session_id",
                           session_id)
        return entry

    def _check_room(self, owner: str) -> None:
        if len(self._entries) >= self.limits.max_sessions:
            raise ResourceExhausted(f"{len(self._entries)} sessions are open, the limit is "
                                    f"{self.limits.max_sessions}", "session_id")
        quota = self.limits.max_sessions_per_caller
        if quota and (mine := sum(e.owner == owner for e in self._entries.values())) >= quota:
            raise ResourceExhausted(f"caller {owner!r} has {mine} sessions open, the limit per caller is {quota}",
                                    "session_id")

    def _expire(self) -> None:
        cutoff = self.clock() - self.limits.ttl_s
        for session_id in [k for k, e in self._entries.items() if not e.in_use and e.last_used < cutoff]:
            del self._entries[session_id]
            self.expired += 1
