"""Tracing: the OpenTelemetry SDK from the standard OTEL_* variables, and gRPC context propagation.

- `OTEL_TRACES_EXPORTER`: `otlp`, `console` or `none` (default `none`; a comma list is allowed).
- `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`), headers, timeout: read by the OTLP
  exporter itself; `OTEL_EXPORTER_OTLP_PROTOCOL` (or `..._TRACES_PROTOCOL`): `grpc` (default, port 4317)
  or `http/protobuf` (port 4318, `/v1/traces` appended to a base endpoint).
- `OTEL_SERVICE_NAME`, then `service.name` in `OTEL_RESOURCE_ATTRIBUTES`, then the default
  (`deltaspec-client`, `deltaspec-target`, `deltaspec-draft`).

Tracing off (the default) installs nothing: no provider, no gRPC interceptors; the loop's spans
come from the API's no-op tracer. Context crosses every hop in gRPC metadata (W3C `traceparent`)
through opentelemetry-instrumentation-grpc's interceptors; health checks make no spans.
"""
from __future__ import annotations

import os
import sys

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor, client_interceptor
from opentelemetry.instrumentation.grpc.filters import health_check, negate
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import NoOpTracer, Tracer

NO_TRACER = NoOpTracer()
INSTRUMENTATION = "deltaspec"


def exporters_from_env() -> list[SpanExporter]:
    """The span exporters `OTEL_TRACES_EXPORTER` names; empty when tracing is off."""
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "none").split(",") if n.strip()]
    exporters: list[SpanExporter] = []
    for name in names:
        if name == "none":
            continue
        if name == "console":
            exporters.append(ConsoleSpanExporter(out=sys.stderr))  # stdout stays the command's output (--json)
        elif name == "otlp":
            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                                      os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            elif protocol == "http/protobuf":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
            else:
                raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: expected grpc or http/protobuf")
            exporters.append(OTLPSpanExporter())
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: expected otlp, console or none")
    return exporters


def resource(default_service_name: str) -> Resource:
    """OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME (which wins), else the default service name."""
    env = Resource.create()
    if str(env.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        env = env.merge(Resource({SERVICE_NAME: default_service_name}))
    return env


def make_provider(default_service_name: str, exporters: list[SpanExporter]) -> TracerProvider:
    provider = TracerProvider(resource=resource(default_service_name))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def setup_tracing(default_service_name: str, install: bool = True) -> TracerProvider | None:
    """A provider exporting where the environment says, or None when tracing is off.

    `install` makes it the process-wide provider (what the CLI does); tests that run several
    services in one process keep one provider per service instead.
    """
    exporters = exporters_from_env()
    if not exporters:
        return None
    provider = make_provider(default_service_name, exporters)
    if install:
        trace.set_tracer_provider(provider)
    return provider


def tracer(provider: TracerProvider | None) -> Tracer:
    return provider.get_tracer(INSTRUMENTATION) if provider is not None else NO_TRACER


def server_interceptors(provider: TracerProvider | None) -> list[grpc.aio.ServerInterceptor]:
    """A span per call, continuing the caller's trace; none for health checks, none at all when off."""
    if provider is None:
        return []
    return [aio_server_interceptor(provider, filter_=negate(health_check()))]


def traced_channel(channel: grpc.Channel, provider: TracerProvider | None) -> grpc.Channel:
    """`channel`, sending the current trace context with each call when tracing is on."""
    if provider is None:
        return channel
    from opentelemetry.instrumentation.grpc import grpcext

    return grpcext.intercept_channel(channel, client_interceptor(provider, filter_=negate(health_check())))


def aio_interceptors(provider: TracerProvider | None) -> list:
    """For a grpc.aio channel: the current trace context sent with each call when tracing is on; none when off."""
    if provider is None:
        return []
    return aio_client_interceptors(provider, filter_=negate(health_check()))
