"""Session routing as deployed (deploy/k8s): sessions stay on their target replica, and survive it going away.

In the cluster the target is a StatefulSet: a normal Service spreads new connections over the
replicas (CreateSession goes there), and each replica advertises its stable pod DNS name through
the headless Service (`--advertise-address`), which CreateSession returns; the client sends every
later call of the session straight to that replica. Here two target replicas run on loopback, and
`TcpProxy` (benchmarks.fault_proxy) stands in for the Service: a TCP proxy that sends each new connection
to the next ready endpoint, round robin, and drops an endpoint when its pod goes (what kube-proxy does once
the EndpointSlice controller removes it). The replica holding a session is killed mid-generation:
the client opens the session again on the committed history through the Service, on the other
replica, and the tokens are those of an uninterrupted in-process run.
"""
from __future__ import annotations

import grpc
import pytest

from deltaspec.v1 import target_service_pb2 as pb
from deltaspec.v1 import target_service_pb2_grpc
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer
from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server
from deltaspec.shared.rpc.server import BackgroundServer, Service
from deltaspec.target_service.servicer import NAME as TARGET_NAME, TargetServicer
from benchmarks.fault_proxy import TcpProxy
from support import reference  # noqa: F401 - a fixture
from test_rpc_support import PROMPT, draft_service, one_torch_thread, pair, refused, start, target_stub  # noqa: F401

N = 24


class Replica(TargetServicer):
    """A real target service that records, per call, the method and the client port it came from."""

    def __init__(self, load) -> None:
        super().__init__(load)
        self.calls: list[tuple[str, int]] = []

    def _record(self, method: str, context) -> None:
        self.calls.append((method, int(context.peer().rsplit(":", 1)[1])))

    async def CreateSession(self, request, context):
        self._record("CreateSession", context)
        return await super().CreateSession(request, context)

    async def Verify(self, request, context):
        self._record("Verify", context)
        return await super().Verify(request, context)

    async def Commit(self, request, context):
        self._record("Commit", context)
        return await super().Commit(request, context)

    def Generate(self, request, context):
        self._record("Generate", context)
        return super().Generate(request, context)


def start_replica(directory) -> tuple[Replica, BackgroundServer]:
    servicer = Replica(lambda: (load_model(directory), load_tokenizer(directory)))
    service = Service(TARGET_NAME, lambda s: target_service_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s),
                      servicer.load)
    server = BackgroundServer([service]).wait_loaded(60)
    servicer.advertise_address = server.address  # in the cluster: POD.HEADLESS-SERVICE.NAMESPACE.svc...:PORT
    return servicer, server



@pytest.fixture
def cluster(pair):
    """Two target replicas behind a TcpProxy; yields (replicas, servers, proxy); stops them all."""
    started = [start_replica(pair[0]), start_replica(pair[0])]
    replicas, servers = [r for r, _ in started], [s for _, s in started]
    proxy = TcpProxy([s.address for s in servers])
    yield replicas, servers, proxy
    proxy.close()
    for server in servers:
        server.stop()


def test_create_session_names_its_replica_and_other_replicas_refuse_it(cluster):
    replicas, servers, proxy = cluster
    created = target_stub(proxy.address).CreateSession(pb.CreateSessionRequest(prompt_ids=PROMPT))
    assert created.target_address in {s.address for s in servers}
    other = next(s.address for s in servers if s.address != created.target_address)
    err = refused(lambda: target_stub(other).Verify(pb.VerifyRequest(session_id=created.session_id, round_id="r0")),
                  grpc.StatusCode.NOT_FOUND, "session_id")
    assert created.session_id in err.details() and "never opened" in err.details()
    target_stub(created.target_address).CloseSession(pb.CloseSessionRequest(session_id=created.session_id))


@pytest.mark.parametrize("how", ["crash", "drain"])
def test_losing_the_replica_holding_a_session_keeps_the_tokens(pair, cluster, reference, how):
    """crash: the pod dies with its sessions; drain: SIGTERM's path (NOT_SERVING, new calls UNAVAILABLE, stop)."""
    replicas, servers, proxy = cluster
    with start(draft_service(pair[1])) as draft:
        killed: list[int] = []
        received = 0

        def kill_holder(ids: list[int], text: str) -> None:
            nonlocal received
            received += len(ids)
            if received >= 2 and not killed:
                holder = next(i for i, r in enumerate(replicas) if any(m == "CreateSession" for m, _ in r.calls))
                killed.append(holder)
                proxy.remove(servers[holder].address)  # out of the Service's endpoints first (preStop pause)
                servers[holder].drain() if how == "drain" else servers[holder].stop()

        result, _ = generate_client_driven(proxy.address, draft.address, PROMPT, "", N, num_draft_tokens=4,
                                           on_tokens=kill_holder)
    assert result.token_ids == reference and result.prompt_ids == PROMPT
    first, second = replicas[killed[0]], replicas[1 - killed[0]]
    for replica in (first, second):  # opened through the Service, then pinned: rounds go straight to the replica
        opened = [port for method, port in replica.calls if method == "CreateSession"]
        rounds = [port for method, port in replica.calls if method in ("Verify", "Commit")]
        assert len(opened) == 1 and opened[0] in proxy.upstream_ports
        assert rounds and not set(rounds) & proxy.upstream_ports
    assert len(first.calls) < len(second.calls)  # the rest of the generation ran on the surviving replica


def test_server_loop_stream_resumes_through_the_service(pair, cluster, reference):
    replicas, servers, proxy = cluster
    killed: list[int] = []
    received = 0

    def kill_streamer(ids: list[int], text: str) -> None:
        nonlocal received
        received += len(ids)
        if received >= 2 and not killed:
            holder = next(i for i, r in enumerate(replicas) if r.calls)
            killed.append(holder)
            servers[holder].stop()
            proxy.remove(servers[holder].address)

    result, _ = generate_on_server(proxy.address, PROMPT, "", N, num_draft_tokens=0, on_tokens=kill_streamer)
    assert result.token_ids == reference
    assert [m for m, _ in replicas[1 - killed[0]].calls] == ["Generate"]
