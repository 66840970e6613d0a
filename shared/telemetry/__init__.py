"""Tracing (OpenTelemetry) and metrics (Prometheus) for the client and both services.

A `Telemetry` is what one process role carries: its tracer provider (None when tracing is off,
the default) and its metrics. The CLI builds one from the environment per command; tests build
one per in-process server so that each has its own service name and registry.

The SDK and the gRPC instrumentation are imported only when used: the decoding loop imports
`deltaspec.shared.telemetry.attributes` and stays free of gRPC.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deltaspec.shared.telemetry.metrics import Metrics

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

CLIENT, TARGET, DRAFT, OPENAI = "deltaspec-client", "deltaspec-target", "deltaspec-draft", "deltaspec-openai"


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
        from deltaspec.shared.telemetry import tracing

        return tracing.tracer(self.provider)

    def server_interceptors(self) -> list:
        from deltaspec.shared.telemetry import tracing

        return tracing.server_interceptors(self.provider)

    def channel(self, channel):
        from deltaspec.shared.telemetry import tracing

        return tracing.traced_channel(channel, self.provider)

    def aio_interceptors(self) -> list:
        """Client interceptors for a grpc.aio channel (`ClientSecurity.aio_channel`): `channel` for asyncio."""
        from deltaspec.shared.telemetry import tracing

        return tracing.aio_interceptors(self.provider)

    def shutdown(self) -> None:
        """Flush and stop the exporters (spans still batched are sent); safe to call twice."""
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = None


def setup_tracing(default_service_name: str, install: bool = True) -> TracerProvider | None:
    from deltaspec.shared.telemetry import tracing

    return tracing.setup_tracing(default_service_name, install)


__all__ = ["CLIENT", "DRAFT", "OPENAI", "TARGET", "Metrics", "Telemetry", "setup_tracing"]
