"""The real thing: `serve-draft` and `serve-target` as processes, OTLP/gRPC to a receiver here.

The receiver is a tiny gRPC server implementing the collector's TraceService.Export (generated
classes from opentelemetry-proto). Exporters batch with a 10-minute delay, so every span that
arrives was flushed by a clean shutdown: SIGTERM (drain) for both servers, the provider's shutdown
for the client (in this process, set up from the same OTEL_* variables as `deltaspec generate`).
Both loops are run; each generation must be one trace over the three services, with no span whose
parent is missing and round attributes equal to the stats the client printed. The target's
`/metrics` is scraped and its counters checked against the same stats.
"""
from __future__ import annotations

import os
import socket
import threading
import urllib.request
from concurrent import futures
from pathlib import Path
from unittest import mock

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server
from deltaspec.shared.telemetry import CLIENT, DRAFT, TARGET, Telemetry, setup_tracing
from deltaspec.shared.telemetry import attributes as attr
from support import Served
from test_rpc_support import PROMPT, pair  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
N = 16


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[dict]:
        out = []
        with self.lock:
            for request in self.requests:
                for rs in request.resource_spans:
                    resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            out.append({"service": resource["service.name"], "trace": s.trace_id.hex(),
                                        "id": s.span_id.hex(), "parent": s.parent_span_id.hex(), "name": s.name,
                                        "attrs": {a.key: _value(a.value) for a in s.attributes}})
        return out


def _value(v):
    return getattr(v, v.WhichOneof("value"))


@pytest.fixture(scope="module")
def receiver():
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(None)


def otel_env(port: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
               OTEL_BSP_SCHEDULE_DELAY="600000", PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS="1")  # tiny models, three processes on few cores: one torch thread each
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


@pytest.fixture(scope="module")
def run(pair, receiver):
    """Both services, one generation on each loop, a scrape, then SIGTERM; the spans as received."""
    target_dir, draft_dir = pair
    env = otel_env(receiver[1])
    draft_address = f"127.0.0.1:{free_port()}"
    draft = Served("serve-draft", draft_dir, "--grace", "2", port=draft_address.split(":")[1], env=env,
                   start_timeout_s=90)  # both load at once: startup is slow
    target = Served("serve-target", target_dir, "--metrics-port", "0", "--grace", "2", "--draft-addr", draft_address,
                    "--draft-timeout", "5", env=env, start_timeout_s=90)
    draft.wait_serving(), target.wait_serving()
    with mock.patch.dict(os.environ, env):
        client = Telemetry(setup_tracing(CLIENT, install=False))
    try:
        address = target.address
        server_loop = generate_on_server(address, PROMPT, "", N, telemetry=client)[0]
        client_loop = generate_client_driven(address, draft_address, PROMPT, "", N, telemetry=client)[0]
        metrics = scrape(target.announced["metrics"])
    finally:
        client.shutdown()
        codes = [target.terminate(), draft.terminate()]
    assert codes == [0, 0]
    results = {"server": server_loop.as_dict(), "client": client_loop.as_dict()}
    return results, metrics, receiver[0].spans()


@pytest.mark.parametrize("loop", ["server", "client"])
def test_one_trace_per_generation_across_three_processes(run, loop):
    results, _, spans = run
    stats = results[loop]["stats"]
    roots = [s for s in spans if s["service"] == CLIENT and s["attrs"].get(attr.LOOP) == loop]
    assert len(roots) == 1
    root = roots[0]
    assert root["parent"] == "" and root["attrs"][attr.GEN_AI_USAGE_OUTPUT_TOKENS] == N
    assert root["attrs"][attr.GEN_AI_USAGE_INPUT_TOKENS] == len(PROMPT)
    trace = [s for s in spans if s["trace"] == root["trace"]]
    assert {s["service"] for s in trace} == {CLIENT, TARGET, DRAFT}
    ids = {s["id"] for s in trace}
    assert not [s["name"] for s in trace if s["parent"] and s["parent"] not in ids]
    assert [s for s in trace if not s["parent"]] == [root]
    rounds = [s for s in trace if s["name"] == "round"]
    assert {s["service"] for s in rounds} == {TARGET if loop == "server" else CLIENT}
    assert len(rounds) == stats["rounds"]
    for key, stat in ((attr.DRAFT_TOKENS, "drafted"), (attr.ACCEPTED_TOKENS, "accepted"),
                      (attr.STAGED_BYTES, "staged_bytes")):
        assert sum(s["attrs"][key] for s in rounds) == stats[stat], key
    assert sum(s["attrs"][attr.DRAFT_TOKENS] > 0 for s in rounds) == stats["drafts"] > 0


def test_target_metrics_agree_with_both_generations(run):
    results, metrics, _ = run
    a, b = results["server"]["stats"], results["client"]["stats"]
    p = "deltaspec_spec_decode_"
    assert metrics[p + "num_drafts_total"] == a["drafts"] + b["drafts"]
    assert metrics[p + "num_draft_tokens_total"] == a["drafted"] + b["drafted"]
    assert metrics[p + "num_accepted_tokens_total"] == a["accepted"] + b["accepted"]
    per_pos = [x + y for x, y in zip(a["accepted_per_position"], b["accepted_per_position"], strict=False)]
    for i, want in enumerate(per_pos):
        assert metrics.get(p + f'num_accepted_tokens_per_pos_total{{position="{i}"}}', 0.0) == want
    assert metrics["deltaspec_commits_total"] == a["rounds"] + b["rounds"]
    assert metrics["deltaspec_staged_bytes_total"] == a["staged_bytes"] + b["staged_bytes"]
