"""Tracing (OpenTelemetry) and metrics (Prometheus) for the client and both services.

A `Telemetry` is what one process role carries: its tracer provider (None when tracing is off,
the default) and its metrics. The CLI builds one from the environment per command; tests build
one per in-process server so that each has its own service name and registry.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer

from shared.telemetry.metrics import Metrics
from shared.telemetry.tracing import server_interceptors, setup_tracing, traced_channel, tracer

CLIENT, TARGET, DRAFT = "deltaspec-client", "deltaspec-target", "deltaspec-draft"


@dataclass
class Telemetry:
    provider: TracerProvider | None = None
    metrics: Metrics = field(default_factory=Metrics)

    @classmethod
    def from_env(cls, default_service_name: str) -> Telemetry:
        """Tracing as OTEL_* say (installed process-wide), fresh metrics."""
        return cls(setup_tracing(default_service_name))

    @property
    def tracer(self) -> Tracer:
        return tracer(self.provider)

    def server_interceptors(self) -> list:
        return server_interceptors(self.provider)

    def channel(self, channel):
        return traced_channel(channel, self.provider)

    def shutdown(self) -> None:
        """Flush and stop the exporters (spans still batched are sent); safe to call twice."""
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = None


__all__ = ["CLIENT", "DRAFT", "TARGET", "Metrics", "Telemetry", "setup_tracing"]
