"""Who may call: TLS or mutual TLS on the ports, bearer tokens per call, and the caller's identity.

Server side (`ServerSecurity`):
- TLS from a certificate and key; with a client CA, mutual TLS (a client without a certificate
  signed by it is refused in the handshake). The files are read again when they change, at the
  next new connection: a renewed certificate is served without a restart (a half-written pair is
  ignored until it loads).
- Bearer tokens (`TokenStore`): `authorization: Bearer <token>` on every call of the model
  services, compared in constant time; health and reflection stay open. A missing or unknown
  token is refused UNAUTHENTICATED. The token file is read again when it changes.
- Plaintext needs no flag on a loopback address (127.0.0.1, ::1, localhost: development) and
  `insecure=True` on any other.
- The caller's identity (`caller()`): the token's name, else the client certificate's subject
  under mutual TLS, else "anonymous". Sessions belong to it (`deltaspec.shared.decoding.session_table`).
- Grants (`Grants`, off by default): the methods each caller may call, from a file read again when it
  changes; a call outside them is refused PERMISSION_DENIED naming the caller and the method.
- A call rate per caller (`calls_per_second`, off by default): a token bucket per identity, bursts of
  one second's worth; a call over it is refused RESOURCE_EXHAUSTED with QuotaFailure (subject `caller`)
  and RetryInfo (when the next call may go), before it reaches the service. Health and reflection
  are not counted; a target's calls to its draft count against the target's own identity there.

Client side (`ClientSecurity`): the same rule for plaintext, TLS with a CA (and a certificate and
key for mutual TLS), and the token sent as metadata on every call. A long-lived client (the target's
channel to its draft) dials through `Redialing`: when its TLS files change (a renewed client
certificate) the next call goes on a new channel made from them, without a restart.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from deltaspec.shared.decoding.session_table import ANONYMOUS
from deltaspec.shared.errors import RateLimited
from deltaspec.shared.rpc.options import CHANNEL_OPTIONS
from deltaspec.shared.rpc.status import to_status

log = logging.getLogger(__name__)

PLACEHOLDER = "replace-me"  # the token value in deploy/k8s/base: never accepted
MIN_TOKEN_CHARS = 16
OPEN_SERVICES = {health.SERVICE_NAME, reflection.SERVICE_NAME}  # answered without a token
_CALLER: ContextVar[str] = ContextVar("deltaspec_caller", default=ANONYMOUS)


def caller() -> str:
    """The identity of the caller of the current call (set by `AuthInterceptor`)."""
    return _CALLER.get()


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0] if ":" in address else address


class _Watched:
    """Files read again when their modification time or size changes (a Secret volume swaps them whole)."""

    def __init__(self, *paths: Path | str) -> None:
        self.paths = [Path(p) for p in paths]
        self.seen: tuple | None = None

    def signature(self) -> tuple:
        files = [f for p in self.paths for f in ([p, *sorted(p.iterdir())] if p.is_dir() else [p])]
        return tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)

    def changed(self) -> bool:
        try:
            now = self.signature()
        except OSError:
            return False  # mid-swap: look again next time
        changed, self.seen = now != self.seen, now
        return changed


class _Reloaded:
    """What a file (or a directory) holds, read again when it changes. The first read's error goes to the caller
    (start-up); a later one is logged, and what was read before stays in force."""

    what = "file"  # for the log: "token file", "grants file"

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._watch = _Watched(self.path)
        self._watch.changed()
        self.held = self._read()

    def current(self):
        if self._watch.changed():
            try:
                self.held = self._read()
            except (OSError, ValueError) as e:
                log.error("%s %s not reloaded, the previous one stays in force: %s", self.what, self.path, e)
        return self.held

    def _read(self):
        raise NotImplementedError


class TokenStore(_Reloaded):
    """Accepted bearer tokens by caller name, from a file or a directory, read again when it changes.

    File: one `name:token` or bare `token` a line (a bare token is named `token-` and the first 8 hex
    of its SHA-256); blank lines and `#` comments are skipped. Directory (a mounted Kubernetes
    Secret): each file is one token, named for the file; Kubernetes' `..data` entries are skipped.
    A placeholder or short token refuses the whole file: at start-up an error, on a reload a logged
    error, the previous tokens staying in force.
    """

    what = "token file"

    def lookup(self, token: str) -> str | None:
        """The name of `token`, or None; every entry is compared, in constant time."""
        found = None
        for name, known in self.current().items():
            if hmac.compare_digest(known.encode(), token.encode()):
                found = name
        return found

    def _read(self) -> dict[str, str]:
        if self.path.is_dir():
            entries = [(f.name, f.read_text().strip()) for f in sorted(self.path.iterdir())
                       if not f.name.startswith(".") and f.is_file()]
        else:
            entries = [_name_token(line) for line in self.path.read_text().splitlines()
                       if line.strip() and not line.lstrip().startswith("#")]
        tokens: dict[str, str] = {}
        for name, token in entries:
            check_token(token, f"{self.path}: {name}")
            if name in tokens:
                raise ValueError(f"{self.path}: the name {name!r} is given twice")
            tokens[name] = token
        if not tokens:
            raise ValueError(f"{self.path} holds no token")
        return tokens


def _name_token(line: str) -> tuple[str, str]:
    name, sep, token = line.strip().partition(":")
    if sep:
        return name.strip(), token.strip()
    return f"token-{hashlib.sha256(name.encode()).hexdigest()[:8]}", name


def check_token(token: str, where: str) -> None:
    """ValueError for a placeholder or a token too short to guess at (a bearer token, an API key)."""
    if PLACEHOLDER in token.lower():
        raise ValueError(f"{where} is the placeholder {PLACEHOLDER!r}, not a token: put generated tokens there "
                         "(openssl rand -hex 32); on Kubernetes, replace the deltaspec-auth Secret with an overlay's "
                         "secretGenerator (behavior: replace; docs/operations.md, TLS and tokens on Kubernetes)")
    if len(token) < MIN_TOKEN_CHARS or not token.isascii() or any(c.isspace() for c in token):
        raise ValueError(f"{where}: a token must be at least {MIN_TOKEN_CHARS} ASCII characters without spaces "
                         "(e.g. openssl rand -hex 32)")


def _method_names() -> frozenset[str]:
    """Every method of the deltaspec.v1 services, by its own name (`Generate`, `Propose`...)."""
    from deltaspec.v1 import draft_service_pb2, target_service_pb2

    return frozenset(m.name for module in (target_service_pb2, draft_service_pb2)
                     for service in module.DESCRIPTOR.services_by_name.values() for m in service.methods)


class Grants(_Reloaded):
    """The methods each caller may call, from a file read again when it changes.

    One `caller: Method, Method` a line, the caller as `caller()` names it (a token's name, `cert:<subject>`,
    `anonymous`); `*` for a method grants every one; a `*` caller is the rule for callers not listed (without
    it, they may call every method). Blank lines and `#` comments are skipped. A method no deltaspec service
    has, a caller given twice or a line without methods refuses the whole file: at start-up an error, on a
    reload a logged error, the previous grants staying in force. Health and reflection stay open.
    """

    ALL = "*"
    what = "grants file"

    def allowed(self, caller: str) -> frozenset[str] | None:
        """The methods `caller` may call; None: every one."""
        grants = self.current()
        methods = grants.get(caller, grants.get(self.ALL))
        return None if methods is None or self.ALL in methods else methods

    def _read(self) -> dict[str, frozenset[str]]:
        known, grants = _method_names(), {}
        for n, line in enumerate(self.path.read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            caller, sep, listed = line.rpartition(":")
            caller, methods = caller.strip(), frozenset(m.strip() for m in listed.split(",") if m.strip())
            where = f"{self.path}, line {n}"
            if not sep or not caller or not methods:
                raise ValueError(f"{where}: expected 'caller: Method, Method' (or '*' for every method), got {line!r}")
            unknown = sorted(methods - known - {self.ALL})
            if unknown:
                raise ValueError(f"{where}: no deltaspec service has {', '.join(unknown)} "
                                 f"(methods: {', '.join(sorted(known))})")
            if caller in grants:
                raise ValueError(f"{where}: caller {caller!r} is given twice")
            grants[caller] = methods
        return grants


class CallRate:
    """A token bucket per caller: `rate` calls a second on average, in bursts of up to one second's worth."""

    MAX_CALLERS = 4096  # beyond, idle callers' buckets (full again) are forgotten

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0:
            raise ValueError(f"a call rate must be > 0 calls a second, got {rate}")
        self.rate, self.burst, self.clock = rate, max(1.0, rate), clock
        self.buckets: dict[str, tuple[float, float]] = {}  # caller -> (calls left, when counted)

    def take(self, who: str) -> float:
        """0 when `who` may call now (a call is counted); else the seconds until it may."""
        now = self.clock()
        left, then = self.buckets.get(who, (self.burst, now))
        left = min(self.burst, left + (now - then) * self.rate)
        if len(self.buckets) >= self.MAX_CALLERS and who not in self.buckets:
            full = self.burst / self.rate
            self.buckets = {k: v for k, v in self.buckets.items() if now - v[1] < full}
        if left >= 1.0:
            self.buckets[who] = (left - 1.0, now)
            return 0.0
        self.buckets[who] = (left, now)
        return (1.0 - left) / self.rate


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token (when tokens are on), sets the caller's identity for the handler, holds each caller
    to its grants (when there are any) and to its call rate (when one is set)."""

    def __init__(self, tokens: TokenStore | None, rate: CallRate | None = None, grants: Grants | None = None) -> None:
        self.tokens, self.rate, self.grants = tokens, rate, grants

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        if handler is None or service in OPEN_SERVICES:
            return handler
        if handler.unary_unary:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, method))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._stream(handler.unary_stream, method))
        return handler

    def _unary(self, behavior, method: str):
        async def wrapped(request, context: grpc.aio.ServicerContext):
            await self._admit(context, method)
            return await behavior(request, context)
        return wrapped

    def _stream(self, behavior, method: str):
        async def wrapped(request, context: grpc.aio.ServicerContext):
            await self._admit(context, method)
            async for response in behavior(request, context):
                yield response
        return wrapped

    async def _admit(self, context: grpc.aio.ServicerContext, method: str) -> None:
        who = await self._identify(context)
        _CALLER.set(who)  # this call's task only
        allowed = self.grants.allowed(who) if self.grants is not None else None
        if allowed is not None and method not in allowed:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"caller {who!r} may not call {method} on this server (its grants: "
                                f"{', '.join(sorted(allowed))})")
        wait = self.rate.take(who) if self.rate is not None else 0.0
        if wait:
            await context.abort_with_status(to_status(RateLimited(
                f"caller {who!r} is over its rate of {self.rate.rate:g} calls a second: retry in "  # type: ignore[union-attr]
                f"{wait * 1e3:.0f} ms", "caller", wait)))

    async def _identify(self, context: grpc.aio.ServicerContext) -> str:
        if self.tokens is not None:
            header = dict(context.invocation_metadata() or ()).get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "missing bearer token: send metadata 'authorization: Bearer <token>' "
                                    "(deltaspec generate: --token-file or DELTASPEC_TOKEN)")
            name = self.tokens.lookup(token.strip())
            if name is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not accepted by this server")
            return name  # type: ignore[return-value]
        subject = (context.auth_context() or {}).get("x509_subject") or \
            (context.auth_context() or {}).get("x509_common_name")
        return f"cert:{subject[0].decode()}" if subject else ANONYMOUS


@dataclass(frozen=True)
class ServerTLS:
    """The server's certificate chain and key (PEM files), and the CA that signs client certificates (mTLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        watch = _Watched(*self._files())
        watch.changed()

        def fetch() -> grpc.ServerCertificateConfiguration | None:  # before every handshake, in gRPC's thread
            if not watch.changed():
                return None
            try:
                config = self._config()
            except ValueError as e:
                log.warning("TLS files changed but do not load yet (%s); serving the previous certificate", e)
                watch.seen = None  # try again at the next connection
                return None
            log.info("TLS certificate reloaded from %s", self.cert)
            return config

        return grpc.dynamic_ssl_server_credentials(self._config(), fetch,
                                                   require_client_authentication=self.client_ca is not None)

    def _files(self) -> list[Path]:
        return [self.cert, self.key, *([self.client_ca] if self.client_ca else [])]

    def _config(self) -> grpc.ServerCertificateConfiguration:
        _check_pair(self.cert, self.key)
        return grpc.ssl_server_certificate_configuration(
            [(_read(self.key), _read(self.cert))], _read(self.client_ca) if self.client_ca else None)


@dataclass(frozen=True)
class ServerSecurity:
    """How a server listens: TLS (or plaintext), and whether calls need a token."""

    tls: ServerTLS | None = None
    tokens: TokenStore | None = None
    insecure: bool = False  # plaintext on a non-loopback address
    calls_per_second: float = 0.0  # per caller (`CallRate`); 0: no limit
    grants: Grants | None = None  # the methods each caller may call; None: every one

    def check(self, host: str) -> None:
        if self.tls is None and not self.insecure and not is_loopback(host):
            raise ValueError(f"refusing to serve plaintext on {host}: give --tls-cert and --tls-key "
                             "(DELTASPEC_TLS_CERT, DELTASPEC_TLS_KEY), or --insecure (DELTASPEC_INSECURE=1) "
                             "on a trusted network; plaintext needs no flag only on 127.0.0.1, ::1 or localhost")

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """None when no one is authenticated and no call rate or grants are set: every caller is then "anonymous"."""
        mtls = self.tls is not None and self.tls.client_ca is not None
        rate = CallRate(self.calls_per_second) if self.calls_per_second else None
        needed = self.tokens is not None or mtls or rate or self.grants is not None
        return [AuthInterceptor(self.tokens, rate, self.grants)] if needed else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        if self.tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.tls.credentials())


def _check_pair(cert: Path, key: Path) -> None:
    """ValueError unless `cert` and `key` load as a certificate and its key (a half-written pair does not)."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise ValueError(f"{cert} and {key} are not a certificate and its key: {e}") from None
    except OSError as e:
        raise ValueError(f"cannot read the TLS certificate or key: {e}") from None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None


class Redialing:
    """A channel to `address`, made again from the client's TLS files when they change: each `channel()` looks
    (a stat per file); calls in flight finish on the channel they started on. Files that do not load yet (a
    half-written pair) keep the last channel until they do. `wrap` decorates each new channel (tracing)."""

    def __init__(self, security: ClientSecurity, address: str,
                 wrap: Callable[[grpc.Channel], grpc.Channel] = lambda ch: ch) -> None:
        self.security, self.address, self.wrap = security, address, wrap
        self.watch = _Watched(*security.files())
        self.watch.changed()
        self.current = wrap(security.channel(address))

    def channel(self) -> grpc.Channel:
        if self.watch.paths and self.watch.changed():
            try:
                self.security.check_files()
            except ValueError as e:
                log.warning("%s; dialling %s with the previous ones", e, self.address)
                self.watch.seen = None  # look again next time
                return self.current
            self.current = self.wrap(self.security.channel(self.address))
            log.info("client TLS files changed: dialling %s with the new ones", self.address)
        return self.current


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call."""

    def __init__(self, token: Callable[[], str]) -> None:
        self.token = token

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {self.token()}")]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)


class _AioBearerToken:
    """`_BearerToken` for `grpc.aio` channels. grpc.aio files an interceptor under its first call kind only,
    so each kind gets its own subclass."""

    def __init__(self, token: Callable[[], str]) -> None:
        self.token = token

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), ("authorization", f"Bearer {self.token()}"))
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _AioBearerTokenUnary(_AioBearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _AioBearerTokenStream(_AioBearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _TokenFile:
    """A client's token file (the token alone), read again when it changes."""

    def __init__(self, path: Path) -> None:
        self.path, self.watch, self.token = path, _Watched(path), ""

    def __call__(self) -> str:
        if self.watch.changed() or not self.token:
            self.token = _read(self.path).decode().strip()
        return self.token


@dataclass(frozen=True)
class ClientSecurity:
    """How a client dials: TLS with a CA (mTLS with a certificate and key) or plaintext, and its token."""

    ca: Path | None = None  # None with TLS on: the system's roots
    cert: Path | None = None
    key: Path | None = None
    token: str | None = None
    token_file: Path | None = None
    server_name: str | None = None  # the name the server's certificate must carry, when not the dialled host
    insecure: bool = False  # plaintext to a non-loopback address

    @property
    def tls(self) -> bool:
        return self.ca is not None or self.cert is not None

    def check(self, address: str) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key, and a key its certificate (--tls-cert, --tls-key)")
        if not self.tls and not self.insecure and not is_loopback(_host(address)):
            raise ValueError(f"refusing to dial {address} in plaintext: give --tls-ca (DELTASPEC_TLS_CA) for TLS, "
                             "or --insecure (DELTASPEC_INSECURE=1) on a trusted network; plaintext needs no flag "
                             "only to 127.0.0.1, ::1 or localhost")

    def channel(self, address: str) -> grpc.Channel:
        self.check(address)
        if self.tls:
            creds = grpc.ssl_channel_credentials(*(_read(p) if p else None for p in (self.ca, self.key, self.cert)))
            override = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
            ch = grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS + override)
        else:
            ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        token = self._token_source()
        return grpc.intercept_channel(ch, _BearerToken(token)) if token else ch

    def aio_channel(self, address: str, interceptors: Sequence = ()) -> grpc.aio.Channel:
        """The same channel for asyncio callers (`grpc.aio`), the token added by an aio interceptor, after
        `interceptors` (tracing's: `Telemetry.aio_interceptors`)."""
        self.check(address)
        token = self._token_source()
        chain = [*interceptors, *([_AioBearerTokenUnary(token), _AioBearerTokenStream(token)] if token else [])]
        if self.tls:
            creds = grpc.ssl_channel_credentials(*(_read(p) if p else None for p in (self.ca, self.key, self.cert)))
            override = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
            return grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS + override,
                                           interceptors=chain or None)
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=chain or None)

    def files(self) -> list[Path]:
        """The TLS files a channel is made from."""
        return [p for p in (self.ca, self.cert, self.key) if p is not None]

    def check_files(self) -> None:
        """ValueError unless the TLS files load: the CA, and the certificate with its key (a matching pair)."""
        if self.cert is not None:
            _check_pair(self.cert, self.key)  # type: ignore[arg-type]
        if self.ca is not None:
            try:
                ssl.create_default_context(cafile=self.ca)
            except (ssl.SSLError, OSError) as e:
                raise ValueError(f"{self.ca} is not a readable CA bundle: {e}") from None

    def _token_source(self) -> Callable[[], str] | None:
        if self.token_file is not None:
            return _TokenFile(self.token_file)
        if self.token:
            return lambda: self.token  # type: ignore[return-value]
        return None

