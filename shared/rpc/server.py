"""Running services: a grpc.aio server with health, reflection, error mapping and a graceful drain.

Life of a server: it listens at once with every service NOT_SERVING (health answers, calls get
UNAVAILABLE), loads its models in a worker thread, then turns each service SERVING. A drain
(SIGTERM, or `drain()`) turns everything NOT_SERVING, lets in-flight calls finish within the
grace period, and stops. `serve` runs one in the foreground for the CLI; `BackgroundServer` runs
one on its own event-loop thread, for the demo and the tests.

TLS, tokens and the caller's identity come from a `ServerSecurity` (`deltaspec.shared.rpc.security`). With
`health_port`, a second, plaintext listener answers grpc.health.v1 and nothing else: Kubernetes'
native gRPC probes cannot speak TLS.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from deltaspec.shared.decoding.answers import Answers
from deltaspec.shared.rpc.options import SERVER_OPTIONS
from deltaspec.shared.rpc.security import ServerSecurity
from deltaspec.shared.rpc.status import ErrorInterceptor
from deltaspec.shared.telemetry import Telemetry

log = logging.getLogger(__name__)

CALL_THREADS = 256  # made on demand; idle ones cost no CPU (asyncio's default, 6 on 2 cores, would cap batches)
T = TypeVar("T")


async def answered_call(answers: Answers, fn: Callable[..., T], *args) -> T:
    """`fn(*args)` on a worker thread, its answer counted in `answers` until it leaves: once the handler returns
    (its send starts in the same step), or, should the call be cancelled, once `fn` ends, so every count the engine
    took is given back whatever happens to the RPC."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    finally:
        if work.done():
            asyncio.get_running_loop().call_soon(answers.sent)
        else:
            work.add_done_callback(lambda _: answers.sent())


@dataclass
class Service:
    """One servicer: its full name, how to add it to a server, and how to load what it serves (blocking)."""

    name: str
    register: Callable[[grpc.aio.Server], None]
    load: Callable[[], None]


@dataclass(frozen=True)
class Listen:
    """Where and how a server listens."""

    host: str = "127.0.0.1"
    port: int = 0
    security: ServerSecurity = ServerSecurity()
    health_port: int | None = None  # plaintext grpc.health.v1 only (0 picks one)


class ModelServer:
    def __init__(self, services: list[Service], listen: Listen = Listen(), grace_s: float = 10.0,
                 telemetry: Telemetry | None = None) -> None:
        self.services, self.listen, self.grace_s = services, listen, grace_s
        listen.security.check(listen.host)
        self.ready: set[str] = set()
        self.health = health.aio.HealthServicer()
        interceptors = [*(telemetry.server_interceptors() if telemetry else []), *listen.security.interceptors(),
                        ErrorInterceptor(self._serving)]
        self.server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        for service in services:
            service.register(self.server)
        reflection.enable_server_reflection(
            [s.name for s in services] + [health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.health_server: grpc.aio.Server | None = None
        if listen.health_port is not None:
            self.health_server = grpc.aio.server(options=SERVER_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        self.port = self.health_port = 0

    def _serving(self, service: str) -> bool:
        """Model services answer once loaded and until drained; health and reflection always."""
        return service in self.ready or all(s.name != service for s in self.services)

    async def start(self) -> int:
        """Listen (every service NOT_SERVING until `load`); returns the bound port."""
        # engine calls block a worker thread while their pass waits for its batch: enough threads for every session
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=CALL_THREADS, thread_name_prefix="deltaspec-call"))
        for name in ["", *(s.name for s in self.services)]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.listen.host}:{self.listen.port}"
        self.port = self.listen.security.add_port(self.server, address)
        if not self.port:
            raise OSError(f"cannot listen on {address}")
        if self.health_server is not None:
            self.health_port = self.health_server.add_insecure_port(f"{self.listen.host}:{self.listen.health_port}")
            if not self.health_port:
                raise OSError(f"cannot listen on {self.listen.host}:{self.listen.health_port} (health)")
            await self.health_server.start()
        await self.server.start()
        return self.port

    async def load(self) -> None:
        for service in self.services:
            await asyncio.to_thread(service.load)
            self.ready.add(service.name)
            await self.health.set(service.name, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    async def drain(self) -> None:
        """NOT_SERVING everywhere, refuse new calls, let in-flight ones finish within the grace period."""
        self.ready.clear()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.grace_s)
        await self.stop_health()

    async def stop_health(self) -> None:
        if self.health_server is not None:
            await self.health_server.stop(None)


def serve(services: list[Service], listen: Listen, grace_s: float = 10.0, telemetry: Telemetry | None = None,
          metrics_port: int | None = None) -> int:
    """Run until SIGTERM or SIGINT, then drain and flush the spans. Announces `listening on HOST:PORT` on stderr.

    With `metrics_port`, Prometheus `/metrics` is served on it (same host) from the telemetry's registry.
    """
    telemetry = telemetry or Telemetry()
    host = listen.host

    async def main() -> None:
        server = ModelServer(services, listen, grace_s, telemetry)
        bound = await server.start()
        if metrics_port is not None:
            print(f"metrics on {host}:{telemetry.metrics.serve(metrics_port, host)}", file=sys.stderr, flush=True)
        if server.health_server is not None:
            print(f"health on {host}:{server.health_port}", file=sys.stderr, flush=True)
        loop = asyncio.get_running_loop()
        draining: set[asyncio.Task] = set()  # the loop holds tasks weakly: a drain must not be collected midway
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: draining.add(asyncio.ensure_future(server.drain())))
        tls = "plaintext" if listen.security.tls is None else (
            "mutual TLS" if listen.security.tls.client_ca else "TLS")
        auth = "bearer tokens" if listen.security.tokens else "no caller authentication"
        print(f"{tls}, {auth}", file=sys.stderr, flush=True)
        print(f"listening on {host}:{bound}", file=sys.stderr, flush=True)
        try:
            await server.load()
        except BaseException:  # the model would not load: close the port here, before the error is reported
            await server.server.stop(None)
            raise
        print(f"serving {', '.join(s.name for s in services)}", file=sys.stderr, flush=True)
        await server.server.wait_for_termination()

    try:
        asyncio.run(main())
    finally:
        telemetry.shutdown()  # after the drain: the last calls' spans are sent too
    return 0


class BackgroundServer:
    """A `ModelServer` on its own event-loop thread; a context manager that stops it on exit."""

    def __init__(self, services: list[Service], host: str = "127.0.0.1", port: int = 0, grace_s: float = 10.0,
                 telemetry: Telemetry | None = None, security: ServerSecurity = ServerSecurity(),
                 health_port: int | None = None) -> None:
        self.host = host
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-server", daemon=True)
        self.thread.start()
        listen = Listen(host, port, security, health_port)
        self.server: ModelServer = self._run(self._make(services, listen, grace_s, telemetry))
        self.port = self._run(self.server.start())
        self.loaded = asyncio.run_coroutine_threadsafe(self.server.load(), self.loop)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def wait_loaded(self, timeout: float | None = None) -> BackgroundServer:
        self.loaded.result(timeout)
        return self

    def drain(self) -> None:
        self._run(self.server.drain())

    def stop(self) -> None:
        """Stop at once (no grace): what a crash looks like to clients."""
        if self.thread.is_alive():
            self._run(self.server.server.stop(None))
            self._run(self.server.stop_health())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @staticmethod
    async def _make(services: list[Service], listen: Listen, grace_s: float, telemetry: Telemetry | None) -> ModelServer:
        return ModelServer(services, listen, grace_s, telemetry)  # grpc.aio objects must be made on their loop

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()
