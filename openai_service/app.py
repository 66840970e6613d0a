"""The ASGI app: OpenAI's endpoints over the target service's `Generate`, on uvicorn.

FastAPI (on Starlette) because it gives what the front needs without code of ours: JSON bodies parsed into typed
pydantic models with errors that name the field, a lifespan in which the `grpc.aio` channel is made and closed on
the server's own event loop, and streamed responses that stop (cancelling the gRPC call, which stops the target's
loop within a round and frees its session) when the client goes away.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models` (and `/v1/models/{id}`), open ones
`GET /health` (the target's gRPC health) and `GET /metrics` (Prometheus). With an API key every /v1 route needs
`Authorization: Bearer <key>`.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import uvicorn
from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Status, StatusCode, use_span
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from deltaspec.shared.rpc.generation import Resume, aio_server_stream
from deltaspec.shared.rpc.recovery import TARGET_SERVICE
from deltaspec.shared.rpc.security import ClientSecurity
from deltaspec.shared.telemetry import Telemetry
from deltaspec.v1 import target_service_pb2 as pb
from deltaspec.v1 import target_service_pb2_grpc
from deltaspec.openai_service.errors import APIError, from_rpc_error, from_validation, invalid
from deltaspec.openai_service.metrics import FrontMetrics, TokenClock
from deltaspec.openai_service.responses import DONE, Reply, sse
from deltaspec.openai_service.schema import ChatBody, CompletionBody, Request


@dataclass(frozen=True)
class Settings:
    """Where the target is and how to dial it; what the front requires and assumes."""

    target_address: str
    security: ClientSecurity = ClientSecurity()
    api_key: str | None = None
    served_model_name: str | None = None  # None: the name the target gives (GetModel)
    num_draft_tokens: int = 4  # a request's `num_draft_tokens` overrides it
    timeout_s: float | None = None  # a generation's deadline
    recovery_window_s: float | None = None  # how long a target that is gone or loading is waited for
    telemetry: Telemetry = field(default_factory=Telemetry)


class Target:
    """The target service on the app's channel, and its model's description (asked once it answers)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = target_service_pb2_grpc.TargetServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self._model: pb.GetModelResponse | None = None

    async def model(self) -> pb.GetModelResponse:
        if self._model is None:
            try:
                self._model = await self.stub.GetModel(pb.GetModelRequest(), timeout=10)
            except grpc.RpcError as e:
                raise from_rpc_error(e, "model") from None
        return self._model


def make_app(settings: Settings) -> FastAPI:
    metrics = FrontMetrics()
    tracer = settings.telemetry.tracer

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        channel = settings.security.aio_channel(settings.target_address, settings.telemetry.aio_interceptors())
        app.state.target = Target(channel)
        try:
            yield
        finally:
            await channel.close()

    app = FastAPI(title="deltaspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Arrival)
    app.state.metrics = metrics

    async def authorized(http: HTTPRequest) -> None:
        if settings.api_key is None:
            return
        given = http.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {settings.api_key}".encode()):
            raise APIError(401, "a valid API key is needed: Authorization: Bearer <key>", None, "invalid_api_key")

    @app.exception_handler(APIError)
    async def refused(http: HTTPRequest, e: APIError) -> JSONResponse:
        metrics.requests.labels(http.url.path, str(e.status)).inc()
        return JSONResponse(e.body(), e.status, e.headers())

    @app.exception_handler(HTTPException)
    async def http_error(http: HTTPRequest, e: HTTPException) -> JSONResponse:
        return await refused(http, APIError(e.status_code, str(e.detail), None, None))

    @app.exception_handler(Exception)
    async def internal(http: HTTPRequest, e: Exception) -> JSONResponse:
        return await refused(http, APIError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error"))

    async def model_info(http: HTTPRequest) -> tuple[str, pb.GetModelResponse]:
        info = await http.app.state.target.model()
        return settings.served_model_name or info.name, info

    def model_card(name: str, info: pb.GetModelResponse) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "deltaspec",
                "max_model_len": info.max_model_len}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models(http: HTTPRequest) -> dict:
        return {"object": "list", "data": [model_card(*await model_info(http))]}

    @app.get("/v1/models/{model}", dependencies=[Depends(authorized)])
    async def model(model: str, http: HTTPRequest) -> dict:
        name, info = await model_info(http)
        if model != name:
            raise _unknown_model(model)
        return model_card(name, info)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(http: HTTPRequest) -> Response:
        return await answer(http, await _body(http, ChatBody), "messages")

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(http: HTTPRequest) -> Response:
        return await answer(http, await _body(http, CompletionBody), "prompt")

    @app.get("/health")
    async def health(http: HTTPRequest) -> JSONResponse:
        try:
            reply = await http.app.state.target.health.Check(
                health_pb2.HealthCheckRequest(service=TARGET_SERVICE), timeout=2)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            serving = False
        return JSONResponse({"status": "ok" if serving else "unavailable"}, 200 if serving else 503)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def answer(http: HTTPRequest, body: ChatBody | CompletionBody, prompt_param: str) -> Response:
        """Open the target's Generate for the request; its first message (the prompt's ids) says the target took
        it, so a refusal still gets its HTTP status; then the whole response, or its stream."""
        started = http.scope[ARRIVED]
        name, info = await model_info(http)
        if body.model != name:
            raise _unknown_model(body.model)
        request = Request.make(body, info.max_model_len)
        k = settings.num_draft_tokens if request.num_draft_tokens is None else request.num_draft_tokens
        deadline = None if settings.timeout_s is None else time.monotonic() + settings.timeout_s
        resume = Resume(request.prompt_ids, request.prompt_text, request.max_new_tokens, k, request.sampling,
                        deadline, settings.recovery_window_s, request.messages, request.stop,
                        address=settings.target_address, fields=request.fields)
        span = tracer.start_span(f"POST {http.url.path}", context=propagate.extract(http.headers), kind=SpanKind.SERVER)
        messages = aio_server_stream(http.app.state.target.stub, resume)
        reply, clock = Reply(request, name), TokenClock(metrics, started)
        try:
            with use_span(span, end_on_exit=False):
                clock.call()
                reply.add(await anext(messages))
        except grpc.RpcError as e:
            await messages.aclose()
            _end(span, e)
            raise from_rpc_error(e, prompt_param) from None
        metrics.prompt_tokens.inc(reply.prompt_tokens)
        if not request.stream:
            try:
                with use_span(span, end_on_exit=False):
                    await _until_disconnect(http, _collect(messages, reply, clock))
            except grpc.RpcError as e:
                raise from_rpc_error(e, prompt_param) from None
            finally:
                _end(span)
            metrics.requests.labels(http.url.path, "200").inc()
            return JSONResponse(reply.whole())

        async def events() -> AsyncIterator[bytes]:
            try:
                with use_span(span, end_on_exit=False):
                    if first := reply.first_chunk():
                        yield first
                    async for msg in messages:
                        reply.add(msg)
                        clock.tokens(len(msg.token_ids))
                        if chunk := reply.chunk(msg):
                            yield chunk  # back here once it is written
                            clock.out()
                    yield reply.last_chunks()
            except grpc.RpcError as e:  # the stream began: the error is an event, then [DONE]
                yield sse(from_rpc_error(e, prompt_param).body()) + DONE
            finally:
                await messages.aclose()  # a client that went away cancels the call here
                _end(span)
                metrics.requests.labels(http.url.path, "200").inc()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})

    return app


ARRIVED = "deltaspec.arrived"  # the scope's key for a request's arrival at the app (time.perf_counter)


class Arrival:
    """Notes in the scope when a request reaches the app, before routing, the API key's check and the body's reading:
    where its time to first token and the front's added time start (metrics.TokenClock)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[ARRIVED] = time.perf_counter()
        await self.app(scope, receive, send)


async def _body(http: HTTPRequest, model: type[ChatBody] | type[CompletionBody]) -> ChatBody | CompletionBody:
    """The JSON body as `model`, whatever the content type says (curl's -d sends a form's); anything that does not
    parse or validate is a 400 naming the field."""
    try:
        data = json.loads(await http.body())
    except (ValueError, RecursionError) as e:  # bad JSON, invalid UTF-8, nesting past the parser's depth
        raise invalid(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation(e.errors()) from None


async def _collect(messages: AsyncIterator[pb.GenerateResponse], reply: Reply, clock: TokenClock) -> None:
    async for msg in messages:
        reply.add(msg)
        clock.tokens(len(msg.token_ids))
        if msg.token_ids:
            clock.out()


async def _until_disconnect(http: HTTPRequest, work: Awaitable[None]) -> None:
    """`work`, cancelled should the client go away first (the body is read, so the next ASGI message is the
    disconnect): a non-streamed request stops its generation as a streamed one does."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        await task
    finally:
        watcher.cancel()


def _unknown_model(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist", "model", "model_not_found")


def _end(span, err: grpc.RpcError | None = None) -> None:
    if err is not None:
        span.set_status(Status(StatusCode.ERROR, f"{err.code().name}: {err.details()}"))  # type: ignore[attr-defined]
    span.end()


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound and listening before uvicorn starts, so port 0's pick is known (and announced) at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, reuse_port=False)
    sock.set_inheritable(True)
    return sock


def uvicorn_server(app: FastAPI, tls: tuple[str, str] | None = None) -> uvicorn.Server:
    """uvicorn picks httptools and uvloop (dependencies, for the CPU they save per chunk: docs/openai.md) where they
    are installed; grpc.aio runs on either loop (the tests run on uvloop)."""
    cert, key = tls or (None, None)
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", ssl_certfile=cert,
                                         ssl_keyfile=key, timeout_graceful_shutdown=10))


def serve(settings: Settings, host: str, port: int, tls: tuple[str, str] | None = None) -> int:
    """Run in the foreground until SIGTERM or SIGINT; announces `listening on HOST:PORT` on stderr."""
    sock = listening_socket(host, port)
    bound = sock.getsockname()[1]
    print(f"OpenAI API at http{'s' if tls else ''}://{host}:{bound}/v1 over the target service at "
          f"{settings.target_address}", file=sys.stderr, flush=True)
    print(f"listening on {host}:{bound}", file=sys.stderr, flush=True)
    try:
        uvicorn_server(make_app(settings), tls).run(sockets=[sock])
    finally:
        settings.telemetry.shutdown()
    return 0


class BackgroundFront:
    """The app on uvicorn in a thread of its own, on a free loopback port (tests, the bench); stopped on exit."""

    def __init__(self, settings: Settings, host: str = "127.0.0.1") -> None:
        self.sock = listening_socket(host, 0)
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.app = make_app(settings)
        self.server = uvicorn_server(self.app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            time.sleep(0.01)

    @property
    def base_url(self) -> str:
        return f"http://{self.address}/v1"

    def __enter__(self) -> BackgroundFront:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
