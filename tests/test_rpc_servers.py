"""The servers as operators see them: health, reflection, drain on SIGTERM, the CLI, the contract's hygiene."""
from __future__ import annotations

import filecmp
import json
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from deltaspec.v1 import target_service_pb2 as pb
from deltaspec.draft_service.servicer import NAME as DRAFT_NAME
from deltaspec.shared.cli import main as cli_main
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.rpc.options import channel
from deltaspec.shared.rpc.server import BackgroundServer, Service
from deltaspec.target_service.servicer import NAME as TARGET_NAME
from support import Served
from test_rpc_support import (PROMPT, draft_service, one_torch_thread, pair, refused, start,  # noqa: F401
                              target_service, target_stub)

ROOT = Path(__file__).resolve().parents[1]
Status = health_pb2.HealthCheckResponse


def health_of(address: str, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel(address)).Check(health_pb2.HealthCheckRequest(service=service)).status


def test_health_while_loading_serving_and_draining(pair):
    gate = threading.Event()
    inner = target_service(pair[0])
    slow = Service(inner.name, inner.register, lambda: (gate.wait(30), inner.load()))
    with BackgroundServer([slow, draft_service(pair[1])]) as server:
        address = server.address
        assert health_of(address) == health_of(address, TARGET_NAME) == Status.NOT_SERVING
        refused(lambda: target_stub(address).CreateSession(pb.CreateSessionRequest(prompt_ids=PROMPT)),
                grpc.StatusCode.UNAVAILABLE)
        gate.set()
        server.wait_loaded(60)
        assert health_of(address) == health_of(address, TARGET_NAME) == health_of(address, DRAFT_NAME) == Status.SERVING

        watch = health_pb2_grpc.HealthStub(channel(address)).Watch(health_pb2.HealthCheckRequest(service=TARGET_NAME))
        assert next(watch).status == Status.SERVING
        stream = target_stub(address).Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=64))
        next(stream)  # the generation is in flight
        drain = threading.Thread(target=server.drain)
        drain.start()
        assert next(watch).status == Status.NOT_SERVING
        watch.cancel()  # an open watch would hold the drain for its whole grace period
        rest = list(stream)  # in-flight work finishes
        assert rest[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert sum(len(m.token_ids) for m in rest) == 64
        drain.join()
        refused(lambda: health_of(address), grpc.StatusCode.UNAVAILABLE)


def test_reflection_lists_the_services(pair):
    with start(target_service(pair[0])) as server:
        db = ProtoReflectionDescriptorDatabase(channel(server.address))
        assert {TARGET_NAME, "grpc.health.v1.Health"} <= set(db.get_services())
        assert db.FindFileContainingSymbol("deltaspec.v1.VerifyRequest").name == "deltaspec/v1/target_service.proto"


def test_cli_paths_print_the_in_process_json_and_sigterm_drains(pair, capsys):
    draft = Served("serve-draft", pair[1])  # the target starts while the draft loads
    target = Served("serve-target", pair[0], "--draft-addr", draft.address, "--grace", "20",
                    "--draft-length", "fixed")  # drafts every round: a random pair would not pay
    draft_address, target_address = draft.wait_serving().address, target.wait_serving().address
    try:
        common = ["generate", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "16", "--json"]
        outputs = []
        for extra in (["--target", str(pair[0])], ["--target-addr", target_address],
                      ["--target-addr", target_address, "--draft-addr", draft_address]):
            assert cli_main(common + extra) == 0
            outputs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
        in_process, server_path, client_path = outputs
        assert in_process["token_ids"] == generate(load_model(pair[0]), PROMPT, 16).token_ids
        for out in (server_path, client_path):
            assert out.keys() == in_process.keys() and out["stats"].keys() == in_process["stats"].keys()
            assert (out["prompt_ids"], out["token_ids"], out["text"]) == \
                (in_process["prompt_ids"], in_process["token_ids"], in_process["text"])
        assert client_path["stats"]["drafted"] > 0 and server_path["stats"]["drafted"] > 0

        stream = target_stub(target_address).Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=64,
                                                                          num_draft_tokens=4))
        next(stream)
        target.proc.send_signal(signal.SIGTERM)
        assert sum(len(m.token_ids) for m in stream) == 64  # the in-flight generation finished
        assert target.proc.wait(30) == 0
    finally:
        for served in (target, draft):
            served.proc.kill()
            served.proc.wait()


def test_protos_pass_buf_lint():
    buf = ROOT / ".venv/buf/node_modules/.bin/buf"
    buf = str(buf) if buf.exists() else shutil.which("buf")
    if buf is None:
        if shutil.which("npm") is None:
            pytest.skip("neither buf nor npm is installed")
        pytest.fail("buf is missing: scripts/setup.sh installs it with npm into .venv/buf")
    result = subprocess.run([buf, "lint"], cwd=ROOT / "protos", capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_code_is_built_from_the_protos_and_not_committed(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    *sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos/deltaspec/v1").glob("*.proto"))],
                   cwd=ROOT / "protos", check=True)
    built = sorted(p.name for p in (tmp_path / "deltaspec/v1").iterdir())
    assert filecmp.cmpfiles(tmp_path / "deltaspec/v1", ROOT / "deltaspec/v1", built, shallow=False)[0] == built
    tracked = subprocess.run(["git", "ls-files", "deltaspec/v1"], cwd=ROOT, capture_output=True, text=True).stdout
    assert tracked == ""  # the package root deltaspec/ is committed (public names); the generated code never is


def test_requests_carry_no_path_or_address():
    """The target dials only the draft it was started with and opens only its own model directory."""
    allowed = {"session_id", "round_id", "parent_round_id", "prompt_text", "append_text", "stop_strings"}
    for method in pb.DESCRIPTOR.services_by_name["TargetService"].methods:
        strings = {f.name for f in method.input_type.fields if f.type == f.TYPE_STRING}
        assert strings <= allowed, (method.name, strings - allowed)
