"""Answers not yet sent: speculative work waits for them, so it does not delay them.

A service's engine call returns on a worker thread; the answer then leaves from the serving thread.
Work started at that moment on another thread (a speculation, a chained verify) holds a core and the
interpreter lock between its tensor ops, and the serving thread, which needs the lock, waits: one answer
in ten came 3-7 ms late. So a session counts the calls whose answers have not left, and speculative work
waits (at most `WAIT_S`) until there are none. A served session is told by the servicer when an answer has
left (`sent`, called once its handler returns); in process, a call's answer is out when the call returns.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

WAIT_S = 0.05  # the longest speculative work waits for answers to leave


class Answers:
    def __init__(self, sent_by_caller: bool = False) -> None:
        self.sent_by_caller = sent_by_caller
        self.unsent = 0
        self.changed = threading.Condition()

    @contextmanager
    def call(self) -> Iterator[None]:
        """A call whose answer is to leave: counted from now until `sent` (by the caller when `sent_by_caller`, once
        per call, whatever its outcome)."""
        with self.changed:
            self.unsent += 1
        try:
            yield
        finally:
            if not self.sent_by_caller:
                self.sent()

    def sent(self) -> None:
        with self.changed:
            self.unsent = max(0, self.unsent - 1)  # a stray `sent` must not let a later answer's count go unseen
            self.changed.notify_all()

    def wait(self, own: int = 0) -> None:
        """Until every answer but the caller's `own` has left, or `WAIT_S`."""
        with self.changed:
            self.changed.wait_for(lambda: self.unsent <= own, WAIT_S)
