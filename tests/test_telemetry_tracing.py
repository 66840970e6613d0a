"""One generation is one trace across client, target and draft, on both loops (SDK in-memory exporter).

Each in-process role has its own tracer provider and service name, as three processes would; the
trace context crosses only through gRPC metadata. Also: metrics agree with the stats, tracing
off installs nothing, and the OTEL_* variables are read as the specification says.
"""
from __future__ import annotations

import os
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from deltaspec.draft_service import servicer as draft_servicer
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer
from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server
from deltaspec.shared.rpc.options import channel
from deltaspec.shared.rpc.server import BackgroundServer
from deltaspec.shared.telemetry import CLIENT, DRAFT, TARGET, Telemetry, tracing
from deltaspec.shared.telemetry import attributes as attr
from deltaspec.target_service import servicer as target_servicer
from test_rpc_support import PROMPT, one_torch_thread, pair  # noqa: F401

N = 20


class Role:
    """A tracer provider with its own service name and an in-memory exporter: one 'process'."""

    def __init__(self, name: str) -> None:
        self.name, self.exporter = name, InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.telemetry = Telemetry(provider)


@pytest.fixture(scope="module")
def roles():
    return {name: Role(name) for name in (CLIENT, TARGET, DRAFT)}


@pytest.fixture(scope="module")
def servers(pair, roles):
    target_dir, draft_dir = pair
    draft_svc = draft_servicer.service(lambda: load_model(draft_dir), telemetry=roles[DRAFT].telemetry)
    with BackgroundServer([draft_svc], telemetry=roles[DRAFT].telemetry).wait_loaded(60) as draft:
        target_svc = target_servicer.service(lambda: (load_model(target_dir), load_tokenizer(target_dir)),
                                             draft=target_servicer.DraftPeer(draft.address, 5.0),
                                             telemetry=roles[TARGET].telemetry)
        with BackgroundServer([target_svc], telemetry=roles[TARGET].telemetry).wait_loaded(60) as target:
            yield target.address, draft.address


def spans_of(roles, trace_id: int, settle_s: float = 5.0) -> list:
    """Every role's finished spans of one trace (server spans end just after the client has its answer)."""
    def collect():
        return [s for r in roles.values() for s in r.exporter.get_finished_spans() if s.context.trace_id == trace_id]

    deadline, found = time.monotonic() + settle_s, collect()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        again = collect()
        if len(again) == len(found) and _complete(again):
            return again
        found = again
    return found


def _complete(spans) -> bool:
    ids = {s.context.span_id for s in spans}
    return all(s.parent is None or s.parent.span_id in ids for s in spans)


def generation_root(roles, loop: str):
    roots = [s for s in roles[CLIENT].exporter.get_finished_spans() if s.attributes.get(attr.LOOP) == loop]
    assert len(roots) == 1, [s.name for s in roots]
    return roots[0]


def check_trace(roles, loop: str, result) -> list:
    root = generation_root(roles, loop)
    spans = spans_of(roles, root.context.trace_id)
    services = {s.resource.attributes["service.name"] for s in spans}
    assert services == {CLIENT, TARGET, DRAFT}, services
    assert root.parent is None and root.name == f"{attr.OPERATION} deltaspec-target"
    assert root.attributes[attr.GEN_AI_OPERATION_NAME] == attr.OPERATION
    assert root.attributes[attr.GEN_AI_REQUEST_MODEL] == "deltaspec-target"
    assert root.attributes[attr.GEN_AI_USAGE_INPUT_TOKENS] == len(PROMPT)
    assert root.attributes[attr.GEN_AI_USAGE_OUTPUT_TOKENS] == len(result.token_ids) == N
    ids = {s.context.span_id for s in spans}
    orphans = [s.name for s in spans if s.parent is not None and s.parent.span_id not in ids]
    assert not orphans, orphans
    assert [s for s in spans if s.parent is None] == [root]

    rounds = [s for s in spans if s.name == "round"]
    stats = result.stats
    assert len(rounds) == stats.rounds
    assert sum(s.attributes[attr.DRAFT_TOKENS] for s in rounds) == stats.drafted
    assert sum(s.attributes[attr.ACCEPTED_TOKENS] for s in rounds) == stats.accepted
    assert sum(s.attributes[attr.STAGED_BYTES] for s in rounds) == stats.staged_bytes
    assert sum(s.attributes[attr.DRAFT_TOKENS] > 0 for s in rounds) == stats.drafts
    for r in sorted(rounds, key=lambda s: s.start_time):
        assert r.attributes[attr.SESSION_ID] and r.attributes[attr.ROUND_ID]
        assert r.attributes[attr.NEW_VERSION] == r.attributes[attr.BASE_VERSION] + 1
        phases = sorted((s for s in spans if s.parent is not None and s.parent.span_id == r.context.span_id),
                        key=lambda s: s.start_time)
        # pipelined rounds (the default) also propose after the verdict, while the commit is in flight
        assert [s.name for s in phases if s.name != "propose"] == ["verify", "commit"]
        assert "propose" in {s.name for s in phases}
        verify, commit = (s for s in phases if s.name != "propose")
        assert verify.attributes[attr.STAGED_BYTES] == r.attributes[attr.STAGED_BYTES]
        assert commit.attributes[attr.NEW_VERSION] == r.attributes[attr.NEW_VERSION]
    return spans


def test_server_side_loop_is_one_trace_across_three_services(servers, roles):
    target, _ = servers
    result, _ = generate_on_server(target, PROMPT, "", N, telemetry=roles[CLIENT].telemetry)
    spans = check_trace(roles, "server", result)
    rounds = [s for s in spans if s.name == "round"]
    assert {s.resource.attributes["service.name"] for s in rounds} == {TARGET}  # the loop runs in the target
    proposes = [s for s in spans if s.name == "/deltaspec.v1.DraftService/Propose"]
    assert {s.resource.attributes["service.name"] for s in proposes} == {TARGET, DRAFT}  # client and server side
    assert result.stats.drafts > 0 and 0 < result.stats.accepted < result.stats.drafted  # partial acceptance seen


def test_client_driven_loop_is_one_trace_across_three_services(servers, roles):
    target, draft = servers
    result, _ = generate_client_driven(target, draft, PROMPT, "", N, telemetry=roles[CLIENT].telemetry)
    spans = check_trace(roles, "client", result)
    rounds = [s for s in spans if s.name == "round"]
    assert {s.resource.attributes["service.name"] for s in rounds} == {CLIENT}
    verifies = [s for s in spans if s.name == "/deltaspec.v1.TargetService/Verify"
                and s.resource.attributes["service.name"] == TARGET and attr.ROUND_ID in s.attributes]
    assert len(verifies) == result.stats.rounds  # refused pipelined verifies carry no round
    commits = [s for s in spans if s.name == "/deltaspec.v1.TargetService/Commit"
               and s.resource.attributes["service.name"] == TARGET]
    assert sum(s.attributes[attr.ACCEPTED_TOKENS] for s in commits) == result.stats.accepted
    assert sum(s.attributes[attr.STAGED_BYTES] for s in commits) == result.stats.staged_bytes


def test_health_checks_make_no_spans(servers, roles):
    target, _ = servers
    before = len(roles[TARGET].exporter.get_finished_spans())
    with channel(target) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    time.sleep(0.2)
    after = roles[TARGET].exporter.get_finished_spans()[before:]
    assert not [s.name for s in after if "grpc.health" in s.name]


def scrape(port: int) -> dict[str, float]:
    """`/metrics` as {sample name with labels: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_agree_with_the_stats(servers, roles):
    """Target counters after one Generate and one client-driven generation equal their stats summed."""
    target, draft = servers
    metrics = roles[TARGET].telemetry.metrics
    port = metrics.serve(0, "127.0.0.1")
    draft_metrics = roles[DRAFT].telemetry.metrics.registry

    def speculations() -> float:
        return sum(draft_metrics.get_sample_value("deltaspec_draft_speculations_total", {"outcome": o}) or 0.0
                   for o in ("kept", "dropped"))

    before, speculated = scrape(port), speculations()
    a, _ = generate_on_server(target, PROMPT, "", N)
    b, _ = generate_client_driven(target, draft, PROMPT, "", N)
    after = scrape(port)
    assert speculations() > speculated  # both loops pipeline: the draft counts how its speculations ended

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    p = "deltaspec_spec_decode_"
    assert grew(p + "num_drafts_total") == a.stats.drafts + b.stats.drafts
    assert grew(p + "num_draft_tokens_total") == a.stats.drafted + b.stats.drafted
    assert grew(p + "num_accepted_tokens_total") == a.stats.accepted + b.stats.accepted
    for i in range(max(len(a.stats.accepted_per_position), len(b.stats.accepted_per_position))):
        want = sum(s.accepted_per_position[i] for s in (a.stats, b.stats) if i < len(s.accepted_per_position))
        assert grew(p + f'num_accepted_tokens_per_pos_total{{position="{i}"}}') == want
    assert grew("deltaspec_commits_total") == a.stats.rounds + b.stats.rounds
    assert grew("deltaspec_staged_bytes_total") == a.stats.staged_bytes + b.stats.staged_bytes
    assert grew("deltaspec_round_verify_seconds_count") == a.stats.rounds + b.stats.rounds
    assert grew("deltaspec_round_commit_seconds_count") == a.stats.rounds + b.stats.rounds
    assert grew("deltaspec_round_propose_seconds_count") == a.stats.rounds  # the server-side loop's rounds
    assert grew("deltaspec_time_to_first_token_seconds_count") == 1  # Generate only
    for outcome, count in (("kept", a.stats.speculations_kept), ("missed", a.stats.speculations_missed)):
        assert grew(f'deltaspec_generate_speculations_total{{outcome="{outcome}"}}') == count  # the server loop's
    assert a.stats.speculations_kept + a.stats.speculations_missed > 0
    assert b.stats.speculations_kept + b.stats.speculations_missed > 0  # the client loop's, in its own stats
    assert grew("deltaspec_time_per_output_token_seconds_count") == 1
    assert "deltaspec_sessions" in after and "deltaspec_sessions_expired_total" in after
    assert b.stats.first_token_seconds > 0 and a.as_dict()["stats"]["time_per_output_token_s"] > 0


def test_tracing_off_installs_nothing(monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert tracing.setup_tracing(TARGET, install=False) is None
    off = Telemetry()
    assert off.provider is None and off.server_interceptors() == [] and not off.tracer.start_span("x").is_recording()
    ch = grpc.insecure_channel("127.0.0.1:1")
    assert off.channel(ch) is ch
    ch.close()


@pytest.mark.parametrize("env, name", [
    ({}, TARGET),
    ({"OTEL_SERVICE_NAME": "svc"}, "svc"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs,deployment.environment=dev"}, "from-attrs"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs", "OTEL_SERVICE_NAME": "svc"}, "svc"),
], ids=["default", "service-name", "resource-attributes", "service-name-wins"])
def test_service_name_from_the_environment(monkeypatch, env, name):
    for key in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    provider = tracing.setup_tracing(TARGET, install=False)
    assert provider.resource.attributes["service.name"] == name
    if "deployment.environment" in env.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        assert provider.resource.attributes["deployment.environment"] == "dev"
    provider.shutdown()


@pytest.mark.parametrize("env", [{"OTEL_TRACES_EXPORTER": "zipkin"},
                                 {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}],
                         ids=["unknown-exporter", "json-protocol"])
def test_unsupported_settings_are_refused(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="OTEL_"):
        tracing.setup_tracing(TARGET, install=False)


class _OtlpHttp(BaseHTTPRequestHandler):
    """A collector's OTLP/HTTP traces endpoint: POST /v1/traces, a protobuf ExportTraceServiceRequest."""

    received: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf":
            self.received.append(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
        else:
            self.send_response(404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_otlp_over_http_reaches_a_collector(servers, monkeypatch):
    """OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf: a generation's client spans arrive at a real HTTP endpoint."""
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _OtlpHttp)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.server_address[1]}")
    client = Telemetry(tracing.setup_tracing(CLIENT, install=False))
    try:
        result, _ = generate_on_server(servers[0], PROMPT, "", N, telemetry=client)
    finally:
        client.shutdown()  # flushes the batch
        receiver.shutdown()
    spans = [(rs.resource, span) for request in _OtlpHttp.received for rs in request.resource_spans
             for ss in rs.scope_spans for span in ss.spans]
    assert {a.value.string_value for resource, _ in spans for a in resource.attributes
            if a.key == "service.name"} == {CLIENT}
    roots = [span for _, span in spans if not span.parent_span_id]
    assert [r.name for r in roots] == [f"{attr.OPERATION} deltaspec-target"] and len(result.token_ids) == N
    assert {span.trace_id for _, span in spans} == {roots[0].trace_id} and len(spans) > 1


def test_in_process_generation_is_one_trace_of_rounds(pair):
    """`generate` with a tracer (what `deltaspec generate` passes in process): a root span over its rounds."""
    role = Role(CLIENT)
    target, draft = (load_model(d) for d in pair)
    tracer = role.telemetry.tracer
    result = generate(target, PROMPT, N, ModelDrafter(draft), 4, tracer=tracer, model="target")
    spans = role.exporter.get_finished_spans()
    root = next(s for s in spans if s.parent is None)
    assert [s for s in spans if s.parent is None] == [root] and root.name == f"{attr.OPERATION} target"
    assert root.attributes[attr.LOOP] == "in_process"
    assert root.attributes[attr.GEN_AI_USAGE_OUTPUT_TOKENS] == len(result.token_ids) == N
    assert {s.context.trace_id for s in spans} == {root.context.trace_id}
    rounds = [s for s in spans if s.name == "round"]
    assert len(rounds) == result.stats.rounds and all(r.parent.span_id == root.context.span_id for r in rounds)
    assert sum(r.attributes[attr.ACCEPTED_TOKENS] for r in rounds) == result.stats.accepted
    for r in rounds:
        assert sorted(s.name for s in spans if s.parent is not None and s.parent.span_id == r.context.span_id) == \
            ["commit", "propose", "verify"]
