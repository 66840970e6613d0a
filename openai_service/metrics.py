"""The front's Prometheus metrics, in a registry of its own, served on its own `/metrics`.

Time to first token runs from the request's arrival to the first message that brings tokens. Time per output token
is counted per token, not per chunk: a speculative round commits several tokens in one message, and each of them
is observed once with its share of the time since the message before (the first message's tokens all count as
first).

The front's added time is what it spends of a request's time to first token: (the first token out, from the request's
arrival at the app) less (the first token's message, from the gRPC call's issue), both read in the same request, so
the target's time (templating, tokenising, queueing, prefill, rounds) cancels and the figure is free of its noise.
It is the time from the arrival to the call (routing, the key's check, reading and validating the body) plus the time
from the message to its chunk's write (streamed) or to its addition to the answer (not streamed).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from deltaspec.shared.telemetry.metrics import TOKEN_BUCKETS

# 0.1 ms steps to 5 ms (the front's added time is about a millisecond: the steps resolve a 2 ms goal), then coarser
ADDED_BUCKETS = (*(round(i * 1e-4, 4) for i in range(1, 51)), 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25,
                 0.5, 1.0)


class FrontMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("deltaspec_openai_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("deltaspec_openai_time_to_first_token_seconds", "Request to its first token",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("deltaspec_openai_time_per_output_token_seconds", "Time per output token after the "
                              "first message, one observation per token", buckets=TOKEN_BUCKETS, registry=r)
        self.front_added = Histogram(
            "deltaspec_openai_front_added_seconds", "Time the front adds before a request's first token: from its "
            "arrival to the gRPC call, and from the first token's message to its chunk's write; the target's own time "
            "excluded", buckets=ADDED_BUCKETS, registry=r)
        self.prompt_tokens = Counter("deltaspec_openai_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.generation_tokens = Counter("deltaspec_openai_generation_tokens", "Tokens generated", registry=r)


class TokenClock:
    """One generation's token timings into `FrontMetrics`. `started`: the request's arrival at the app."""

    def __init__(self, metrics: FrontMetrics, started: float) -> None:
        self.metrics, self.started, self.last = metrics, started, started
        self.called = self.arrived = started
        self.first = self.waiting = True  # waiting: the first token is not out yet

    def call(self) -> None:
        """The gRPC call is issued now."""
        self.called = time.perf_counter()

    def tokens(self, n: int) -> None:
        """A message brought `n` tokens (maybe none: its time is kept all the same, it may bring the first text)."""
        now = self.arrived = time.perf_counter()
        if not n:
            return
        if self.first:
            self.metrics.ttft.observe(now - self.last)
            self.first = False
        else:
            for _ in range(n):
                self.metrics.tpot.observe((now - self.last) / n)
        self.last = now
        self.metrics.generation_tokens.inc(n)

    def out(self) -> None:
        """The last message's content is out now (its chunk written, or added to the whole answer); the first time,
        the front's added time is observed."""
        if self.waiting:
            self.waiting = False
            self.metrics.front_added.observe(self.called - self.started + time.perf_counter() - self.arrived)
