"""The front's Prometheus metrics, in a registry of its own, served on its own `/metrics`.

Time to first token runs from the request's arrival to the first message that brings tokens. Time per output token
is counted per token, not per chunk: a speculative round commits several tokens in one message, and each of them
is observed once with its share of the time since the message before (the first message's tokens all count as
first).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from deltaspec.shared.telemetry.metrics import TOKEN_BUCKETS


class FrontMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("deltaspec_openai_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("deltaspec_openai_time_to_first_token_seconds", "Request to its first token",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("deltaspec_openai_time_per_output_token_seconds", "Time per output token after the "
                              "first message, one observation per token", buckets=TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("deltaspec_openai_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.generation_tokens = Counter("deltaspec_openai_generation_tokens", "Tokens generated", registry=r)


class TokenClock:
    """One generation's token timings into `FrontMetrics`."""

    def __init__(self, metrics: FrontMetrics, started: float) -> None:
        self.metrics, self.last = metrics, started
        self.first = True

    def tokens(self, n: int) -> None:
        """A message brought `n` tokens now."""
        if not n:
            return
        now = time.perf_counter()
        if self.first:
            self.metrics.ttft.observe(now - self.last)
            self.first = False
        else:
            for _ in range(n):
                self.metrics.tpot.observe((now - self.last) / n)
        self.last = now
        self.metrics.generation_tokens.inc(n)
