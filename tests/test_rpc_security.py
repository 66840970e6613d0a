"""Who may call, over real loopback gRPC: TLS, mutual TLS, certificate reload, bearer tokens, session ownership.

The certificates are made here (`cryptography`): a CA, a server certificate for 127.0.0.1 and
localhost, client certificates, and a second CA whose certificates the servers must refuse.
Servers are the real ones (`BackgroundServer`) on tiny random models (`test_rpc_support`).
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from grpc_status import rpc_status

from deltaspec.v1 import draft_service_pb2 as dpb
from deltaspec.v1 import draft_service_pb2_grpc, target_service_pb2_grpc
from deltaspec.v1 import target_service_pb2 as pb
from deltaspec.shared.cli import _client_security, build_parser
from deltaspec.shared.cli import main as cli_main
from deltaspec.shared.decoding.session_table import Limits
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer
from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server
from deltaspec.shared.rpc.options import channel
from deltaspec.shared.rpc.security import (PLACEHOLDER, CallRate, ClientSecurity, Grants, ServerSecurity, ServerTLS,
                                  TokenStore)
from deltaspec.shared.rpc.server import BackgroundServer
from deltaspec.target_service import servicer as target_servicer
from deltaspec.target_service.servicer import NAME as TARGET_NAME
from deltaspec.target_service.servicer import DraftPeer
from support import Served
from test_rpc_support import PROMPT, draft_service, one_torch_thread, pair, refused, target_service  # noqa: F401

Code = grpc.StatusCode


@dataclass
class Issued:
    cert: Path
    key: Path


class CA:
    """A certificate authority writing PEM files under `root`."""

    def __init__(self, root: Path, name: str) -> None:
        self.root, self.name = root, name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (_builder(subject, subject, self.key.public_key())
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.path = root / f"{name}.crt"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, common_name: str, server: bool, cert: Path | None = None, key: Path | None = None) -> Issued:
        """A leaf certificate (for 127.0.0.1 and localhost when `server`), written to `cert`/`key` or new files."""
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        builder = _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]), self.cert.subject,
                           leaf_key.public_key())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        issued = Issued(cert or self.root / f"{common_name}.crt", key or self.root / f"{common_name}.key")
        issued.key.write_bytes(leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
        issued.cert.write_bytes(builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
        return issued

    def renew(self, common_name: str, server: bool, live: Issued, stamp: float) -> None:
        """Issue into `live`'s files, as a Secret update or a cert-manager renewal does, stamped `stamp` (a
        different mtime even on a coarse clock)."""
        self.issue(common_name, server, live.cert, live.key)
        for path in (live.cert, live.key):
            os.utime(path, (stamp, stamp))


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


@dataclass
class PKI:
    ca: CA
    rogue: CA  # trusted by no server
    server: Issued
    alice: Issued
    bob: Issued
    target: Issued  # the target's client certificate towards the draft
    stranger: Issued  # a client certificate from the rogue CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    root = tmp_path_factory.mktemp("pki")
    ca, rogue = CA(root, "deltaspec-test-ca"), CA(root, "rogue-ca")
    return PKI(ca, rogue, ca.issue("server", True), ca.issue("alice", False), ca.issue("bob", False),
               ca.issue("target", False), rogue.issue("stranger", False))


TOKENS = {name: secrets.token_hex(16) for name in ("alice", "bob", "target")}


@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("# callers\n" + "".join(f"{name}:{token}\n" for name, token in TOKENS.items()))
    return path


def mtls(pki: PKI, tokens: Path | None = None) -> ServerSecurity:
    return ServerSecurity(ServerTLS(pki.server.cert, pki.server.key, pki.ca.path),
                          TokenStore(tokens) if tokens else None)


def as_client(pki: PKI, who: str | None, token: str | None = None) -> ClientSecurity:
    """`who`'s certificate (None: none), trusting the test CA, sending `token`."""
    issued: Issued | None = getattr(pki, who) if who else None
    return ClientSecurity(pki.ca.path, issued.cert if issued else None, issued.key if issued else None, token)


def serve(*services, security: ServerSecurity, health_port: int | None = None) -> BackgroundServer:
    return BackgroundServer(list(services), security=security, health_port=health_port).wait_loaded(60)


def target_of(security: ClientSecurity, address: str) -> target_service_pb2_grpc.TargetServiceStub:
    return target_service_pb2_grpc.TargetServiceStub(security.channel(address))


def create(stub) -> str:
    return stub.CreateSession(pb.CreateSessionRequest(prompt_ids=PROMPT), timeout=30).session_id


def health(address: str, security: ClientSecurity | None = None, service: str = "") -> int:
    ch = security.channel(address) if security else channel(address)
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_tls_serves_encrypted_and_refuses_plaintext_with_a_plaintext_health_port(pair, pki):
    tls = ServerSecurity(ServerTLS(pki.server.cert, pki.server.key))
    with serve(target_service(pair[0]), security=tls, health_port=0) as server:
        sid = create(target_of(ClientSecurity(pki.ca.path), server.address))
        assert len(sid) == 32
        refused(lambda: create(target_stub_plain(server.address)), Code.UNAVAILABLE)
        refused(lambda: create(target_of(ClientSecurity(pki.rogue.path), server.address)), Code.UNAVAILABLE)
        health_address = f"127.0.0.1:{server.server.health_port}"
        assert health(health_address, service=TARGET_NAME) == health_pb2.HealthCheckResponse.SERVING
        refused(lambda: create(target_stub_plain(health_address)), Code.UNIMPLEMENTED)  # health only


def target_stub_plain(address: str) -> target_service_pb2_grpc.TargetServiceStub:
    return target_service_pb2_grpc.TargetServiceStub(channel(address))


def test_mutual_tls_refuses_clients_without_a_trusted_certificate(pair, pki):
    with serve(target_service(pair[0]), security=mtls(pki)) as server:
        for who in (None, "stranger"):  # no certificate; one from a CA the server does not trust
            client = ClientSecurity(pki.ca.path, *((pki.stranger.cert, pki.stranger.key) if who else (None, None)))
            refused(lambda: create(target_of(client, server.address)), Code.UNAVAILABLE)
        alice, bob = target_of(as_client(pki, "alice"), server.address), target_of(as_client(pki, "bob"), server.address)
        sid = create(alice)
        assert alice.GetSession(pb.GetSessionRequest(session_id=sid)).length == len(PROMPT)
        refused(lambda: bob.GetSession(pb.GetSessionRequest(session_id=sid)), Code.NOT_FOUND, "session_id")


def test_a_renewed_certificate_is_served_to_new_connections_without_a_restart(pair, pki, tmp_path):
    old_ca, new_ca = CA(tmp_path, "old-ca"), CA(tmp_path, "new-ca")
    live = old_ca.issue("server", True, tmp_path / "tls.crt", tmp_path / "tls.key")
    with serve(draft_service(pair[1]), security=ServerSecurity(ServerTLS(live.cert, live.key))) as server:
        assert health(server.address, ClientSecurity(old_ca.path)) == health_pb2.HealthCheckResponse.SERVING
        refused(lambda: health(server.address, ClientSecurity(new_ca.path)), Code.UNAVAILABLE)
        new_ca.renew("server", True, live, time.time() + 2)
        assert health(server.address, ClientSecurity(new_ca.path)) == health_pb2.HealthCheckResponse.SERVING
        refused(lambda: health(server.address, ClientSecurity(old_ca.path)), Code.UNAVAILABLE)


def test_tokens_missing_or_wrong_are_unauthenticated_and_health_stays_open(pair, pki, token_file):
    with serve(target_service(pair[0]), security=ServerSecurity(tokens=TokenStore(token_file))) as server:
        for token, words in ((None, "missing bearer token"), ("x" * 32, "not accepted")):
            err = refused(lambda: create(target_of(ClientSecurity(token=token), server.address)), Code.UNAUTHENTICATED)
            assert words in err.details()
        assert health(server.address) == health(server.address, service=TARGET_NAME) == \
            health_pb2.HealthCheckResponse.SERVING  # no token
        assert TARGET_NAME in ProtoReflectionDescriptorDatabase(channel(server.address)).get_services()
        create(target_of(ClientSecurity(token=TOKENS["alice"]), server.address))

        carol = secrets.token_hex(16)  # the file changes: a new token works, a removed one stops working
        stamp = time.time() + 2
        _rewrite(token_file, f"carol:{carol}\nbob:{TOKENS['bob']}\n", stamp)
        create(target_of(ClientSecurity(token=carol), server.address))
        refused(lambda: create(target_of(ClientSecurity(token=TOKENS["alice"]), server.address)),
                Code.UNAUTHENTICATED)
        _rewrite(token_file, f"carol:{PLACEHOLDER}-token\n", stamp + 2)  # a bad reload keeps the tokens in force
        create(target_of(ClientSecurity(token=carol), server.address))


def test_token_sources_and_the_placeholder(tmp_path, capsys):
    secret = tmp_path / "secret"  # the layout kubelet gives a mounted Secret: keys link into ..data
    data = secret / "..2026_01_01"
    data.mkdir(parents=True)
    (data / "client").write_text(TOKENS["alice"] + "\n")
    (data / "target").write_text(TOKENS["target"])
    (secret / "..data").symlink_to(data.name)
    for key in ("client", "target"):
        (secret / key).symlink_to(f"..data/{key}")
    store = TokenStore(secret)
    assert store.lookup(TOKENS["alice"]) == "client" and store.lookup(TOKENS["target"]) == "target"
    assert store.lookup(TOKENS["bob"]) is None and store.lookup("") is None

    bare = tmp_path / "bare"
    bare.write_text(TOKENS["bob"] + "\n")
    assert TokenStore(bare).lookup(TOKENS["bob"]).startswith("token-")

    placeholder = tmp_path / "placeholder"
    placeholder.write_text(f"client:{PLACEHOLDER}-generate-a-token\n")
    with pytest.raises(ValueError, match="replace the deltaspec-auth Secret"):
        TokenStore(placeholder)
    short = tmp_path / "short"
    short.write_text("client:abc\n")
    with pytest.raises(ValueError, match="at least 16"):
        TokenStore(short)
    assert cli_main(["serve-draft", "--port", "0", "--tokens", str(placeholder)]) == 2  # before loading anything
    assert "placeholder" in capsys.readouterr().err


def test_plaintext_only_on_loopback_unless_insecure(capsys):
    assert cli_main(["serve-draft", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--insecure" in capsys.readouterr().err
    for address in ("127.0.0.1:1", "localhost:1", "[::1]:1"):
        ClientSecurity().check(address)
    with pytest.raises(ValueError, match="plaintext"):
        ClientSecurity().check("deltaspec-target:50051")
    ClientSecurity(insecure=True).check("deltaspec-target:50051")
    ServerSecurity(insecure=True).check("0.0.0.0")
    assert cli_main(["generate", "--target-addr", "10.1.2.3:50051", "--prompt", "x"]) == 2
    assert "--tls-ca" in capsys.readouterr().err


def test_another_caller_cannot_touch_a_session_and_it_still_ends_as_target_only(pair, pki, token_file):
    n = 12
    expected = generate(load_model(pair[0]), PROMPT, n).token_ids
    with serve(target_service(pair[0]), draft_service(pair[1]), security=mtls(pki, token_file)) as server:
        alice = target_of(as_client(pki, "alice", TOKENS["alice"]), server.address)
        bob = target_of(as_client(pki, "bob", TOKENS["bob"]), server.address)
        sid = create(alice)
        first = alice.Verify(pb.VerifyRequest(session_id=sid, round_id="r0", base_version=0, draft_tokens=expected[:3]))
        bob_calls = {
            "Verify": lambda s: bob.Verify(pb.VerifyRequest(session_id=s, round_id="r0", base_version=0,
                                                            draft_tokens=expected[:3])),
            "Commit": lambda s: bob.Commit(pb.CommitRequest(session_id=s, round_id="r0", accepted=0)),
            "Revert": lambda s: bob.Revert(pb.RevertRequest(session_id=s, round_id="r0")),
            "GetSession": lambda s: bob.GetSession(pb.GetSessionRequest(session_id=s)),
            "CloseSession": lambda s: bob.CloseSession(pb.CloseSessionRequest(session_id=s)),
        }
        theirs = {name: refused(lambda: call(sid), Code.NOT_FOUND, "session_id") for name, call in bob_calls.items()}

        version = alice.Commit(pb.CommitRequest(session_id=sid, round_id="r0", accepted=first.accepted)).head_version
        for i in range(1, n):
            state = alice.GetSession(pb.GetSessionRequest(session_id=sid))
            if len(state.generated_ids) >= n:
                break
            reply = alice.Verify(pb.VerifyRequest(session_id=sid, round_id=f"r{i}", base_version=version))
            version = alice.Commit(pb.CommitRequest(session_id=sid, round_id=f"r{i}", accepted=0)).head_version
        generated = list(alice.GetSession(pb.GetSessionRequest(session_id=sid)).generated_ids)
        assert generated[:n] == expected, (generated, expected, reply)
        alice.CloseSession(pb.CloseSessionRequest(session_id=sid))

        # Bob saw exactly what anyone sees for a session that does not exist (here: closed).
        for name, call in bob_calls.items():
            gone = refused(lambda: call(sid), Code.NOT_FOUND, "session_id")
            assert (gone.details(), _status(gone)) == (theirs[name].details(), _status(theirs[name])), name

        # The draft service binds its sessions the same way.
        alice_d, bob_d = (draft_service_pb2_grpc.DraftServiceStub(as_client(pki, who, TOKENS[who]).channel(
            server.address)) for who in ("alice", "bob"))
        dsid = alice_d.CreateSession(dpb.DraftServiceCreateSessionRequest(token_ids=PROMPT)).session_id
        for call in (lambda: bob_d.Propose(dpb.ProposeRequest(session_id=dsid, round_id="p1", k=2)),
                     lambda: bob_d.Revert(dpb.DraftServiceRevertRequest(session_id=dsid, round_id="p1")),
                     lambda: bob_d.Commit(dpb.DraftServiceCommitRequest(session_id=dsid, outcome=dpb.RoundOutcome(
                         round_id="p1", accepted=0, next_token=1))),
                     lambda: bob_d.CloseSession(dpb.DraftServiceCloseSessionRequest(session_id=dsid))):
            refused(call, Code.NOT_FOUND, "session_id")
        assert len(alice_d.Propose(dpb.ProposeRequest(session_id=dsid, round_id="p1", k=2)).draft_tokens) == 2


def _status(err: grpc.RpcError) -> list:
    details = rpc_status.from_call(err).details
    assert [d.TypeName() for d in details] == ["google.rpc.ErrorInfo", "google.rpc.ResourceInfo"]
    return [d.SerializeToString() for d in details]


def test_per_caller_session_quota(pair, token_file):
    security = ServerSecurity(tokens=TokenStore(token_file))
    with serve(target_service(pair[0], Limits(max_sessions_per_caller=2)), security=security) as server:
        alice = target_of(ClientSecurity(token=TOKENS["alice"]), server.address)
        bob = target_of(ClientSecurity(token=TOKENS["bob"]), server.address)
        first, _ = create(alice), create(alice)
        err = refused(lambda: create(alice), Code.RESOURCE_EXHAUSTED, "session_id")
        assert "'alice' has 2 sessions open, the limit per caller is 2" in err.details()
        refused(lambda: list(alice.Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=1))),
                Code.RESOURCE_EXHAUSTED, "session_id")
        create(bob)  # others are not held back
        alice.CloseSession(pb.CloseSessionRequest(session_id=first))
        create(alice)


def test_generation_over_mutual_tls_and_tokens_with_the_draft_channel_authenticated(pair, pki, token_file, tmp_path):
    """Both servers demand a client certificate and a token; the target dials its draft with its own, and the
    draft grants it only the calls a target's `Generate` makes."""
    n = 16
    expected = generate(load_model(pair[0]), PROMPT, n).token_ids
    grants = tmp_path / "grants"
    grants.write_text("target: CreateSession, Propose, CloseSession\nalice: *\n")
    draft_security = ServerSecurity(mtls(pki, token_file).tls, TokenStore(token_file), grants=Grants(grants))
    with serve(draft_service(pair[1]), security=draft_security) as draft:
        peer = DraftPeer(draft.address, 30.0, as_client(pki, "target", TOKENS["target"]))
        target_svc = target_servicer.service(lambda: (load_model(pair[0]), load_tokenizer(pair[0])), draft=peer)
        with serve(target_svc, security=mtls(pki, token_file)) as target:
            alice = as_client(pki, "alice", TOKENS["alice"])
            result, _ = generate_on_server(target.address, PROMPT, "", n, security=alice)
            assert result.token_ids == expected and result.stats.drafted > 0  # the draft answered the target
            result, _ = generate_client_driven(target.address, draft.address, PROMPT, "", n, security=alice)
            assert result.token_ids == expected and result.stats.drafted > 0


def test_serve_and_generate_commands_with_mutual_tls_and_tokens(pair, pki, token_file, tmp_path, capsys):
    """The same through the command line: the servers as processes, `deltaspec generate` here."""
    n = 16
    expected = generate(load_model(pair[0]), PROMPT, n).token_ids
    (tmp_path / "target.token").write_text(TOKENS["target"] + "\n")
    (tmp_path / "alice.token").write_text(TOKENS["alice"] + "\n")
    tls = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key), "--tls-client-ca", str(pki.ca.path),
           "--tokens", str(token_file)]
    draft = Served("serve-draft", pair[1], *tls)
    target = Served("serve-target", pair[0], *tls, "--draft-addr", draft.address, "--draft-timeout", "30",
                    "--draft-length", "fixed", "--draft-tls-ca", str(pki.ca.path), "--draft-tls-cert", str(pki.target.cert),
                    "--draft-tls-key", str(pki.target.key), "--draft-token-file", str(tmp_path / "target.token"))
    try:
        draft.wait_serving(), target.wait_serving()
        client = ["--tls-ca", str(pki.ca.path), "--tls-cert", str(pki.alice.cert), "--tls-key", str(pki.alice.key),
                  "--token-file", str(tmp_path / "alice.token")]
        assert cli_main(["generate", "--target-addr", target.address, "--prompt-ids", ",".join(map(str, PROMPT)),
                         "--max-new-tokens", str(n), "--json", *client]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["token_ids"] == expected and out["stats"]["drafted"] > 0  # target -> draft authenticated
        assert cli_main(["generate", "--target-addr", target.address, "--prompt-ids", "1", "--max-new-tokens", "1",
                         "--tls-ca", str(pki.ca.path), "--tls-cert", str(pki.alice.cert),
                         "--tls-key", str(pki.alice.key)]) == 2  # no token
        assert "UNAUTHENTICATED" in capsys.readouterr().err
    finally:
        for served in (target, draft):
            served.proc.kill()
            served.proc.wait()

def test_flags_and_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DELTASPEC_TOKEN", TOKENS["alice"])
    monkeypatch.setenv("DELTASPEC_DRAFT_TOKEN_FILE", str(tmp_path / "target"))
    monkeypatch.setenv("DELTASPEC_TLS_CERT", str(tmp_path / "missing.crt"))
    monkeypatch.setenv("DELTASPEC_TLS_KEY", str(tmp_path / "missing.key"))
    args = build_parser().parse_args(["generate", "--target-addr", "127.0.0.1:1", "--prompt", "x"])
    assert _client_security(args, "").token == TOKENS["alice"]
    args = build_parser().parse_args(["serve-target", "--port", "0", "--draft-addr", "127.0.0.1:1"])
    assert _client_security(args, "draft_").token_file == tmp_path / "target" and args.tls_cert.endswith("missing.crt")
    assert cli_main(["serve-draft", "--port", "0"]) == 2  # a missing certificate stops it with one line
    assert "cannot read the TLS certificate or key" in capsys.readouterr().err


def test_call_rate_counts_each_caller_in_its_own_bucket():
    now = [0.0]
    rate = CallRate(4, clock=lambda: now[0])
    assert [rate.take("alice") for _ in range(4)] == [0.0] * 4  # a second's worth at once
    assert rate.take("alice") == pytest.approx(0.25)  # then one call every 1/4 s
    assert rate.take("bob") == 0.0  # others have their own bucket
    now[0] = 0.2
    assert rate.take("alice") == pytest.approx(0.05)
    now[0] = 0.25
    assert rate.take("alice") == 0.0 and rate.take("alice") == pytest.approx(0.25)
    now[0] = 100.0  # long idle: a full burst again, never more
    assert [rate.take("alice") for _ in range(5)][-2:] == [0.0, pytest.approx(0.25)]
    with pytest.raises(ValueError, match="calls a second"):
        CallRate(0)


def test_a_caller_over_its_call_rate_is_refused_with_retry_info(pair, token_file):
    security = ServerSecurity(tokens=TokenStore(token_file), calls_per_second=3)
    with serve(target_service(pair[0]), security=security) as server:
        alice = target_of(ClientSecurity(token=TOKENS["alice"]), server.address)
        bob = target_of(ClientSecurity(token=TOKENS["bob"]), server.address)
        close = pb.CloseSessionRequest(session_id="nobody")
        for _ in range(3):  # counted, then answered as ever
            refused(lambda: alice.CloseSession(close), Code.NOT_FOUND)
        err = refused(lambda: alice.CloseSession(close), Code.RESOURCE_EXHAUSTED, "caller")
        assert "'alice' is over its rate of 3 calls a second" in err.details()
        retry = next(d for d in rpc_status.from_call(err).details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR))
        info = error_details_pb2.RetryInfo()
        retry.Unpack(info)
        assert 0 < info.retry_delay.ToTimedelta().total_seconds() <= 1 / 3
        refused(lambda: list(alice.Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=1))),
                Code.RESOURCE_EXHAUSTED, "caller")  # streams too
        assert health(server.address, service=TARGET_NAME) == health_pb2.HealthCheckResponse.SERVING  # not counted
        refused(lambda: bob.CloseSession(close), Code.NOT_FOUND)  # others are not held back
        time.sleep(info.retry_delay.ToTimedelta().total_seconds() + 0.05)
        refused(lambda: alice.CloseSession(close), Code.NOT_FOUND)


def _rewrite(path: Path, text: str, stamp: float) -> None:
    """Replace a watched file's content, stamped `stamp` (a different mtime even on a coarse clock)."""
    path.write_text(text)
    os.utime(path, (stamp, stamp))


def test_grants_hold_each_caller_to_its_methods_and_reload(pair, token_file, tmp_path):
    grants = tmp_path / "grants"
    grants.write_text("# alice only generates\nalice: Generate\n")
    security = ServerSecurity(tokens=TokenStore(token_file), grants=Grants(grants))
    with serve(target_service(pair[0]), security=security) as server:
        alice = target_of(ClientSecurity(token=TOKENS["alice"]), server.address)
        bob = target_of(ClientSecurity(token=TOKENS["bob"]), server.address)
        generate = pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=2)
        assert [m.token_ids for m in alice.Generate(generate) if m.token_ids]  # granted
        err = refused(lambda: create(alice), Code.PERMISSION_DENIED)
        assert "caller 'alice' may not call CreateSession on this server (its grants: Generate)" == err.details()
        create(bob)  # not listed, and no '*' rule: every method
        assert health(server.address, service=TARGET_NAME) == health_pb2.HealthCheckResponse.SERVING  # open

        stamp = time.time() + 2  # the file changes: alice may call everything, the others only Generate
        _rewrite(grants, "alice: *\n*: Generate\n", stamp)
        create(alice)
        refused(lambda: create(bob), Code.PERMISSION_DENIED)
        assert [m.token_ids for m in bob.Generate(generate) if m.token_ids]
        _rewrite(grants, "alice: Generat\n", stamp + 2)  # a bad reload keeps the grants in force
        create(alice)
        refused(lambda: create(bob), Code.PERMISSION_DENIED)


def test_grants_files_are_checked_and_the_flag_reaches_the_server(tmp_path, capsys):
    from deltaspec.shared.cli import _listen

    path = tmp_path / "grants"
    for text, words in (("alice: Generat\n", "line 1: no deltaspec service has Generat"),
                        ("alice Generate\n", "line 1: expected 'caller: Method, Method'"),
                        ("# who\nalice: \n", "line 2: expected"),
                        ("alice: Generate\nalice: Verify\n", "line 2: caller 'alice' is given twice")):
        path.write_text(text)
        with pytest.raises(ValueError, match=words):
            Grants(path)
    assert cli_main(["serve-draft", "--port", "0", "--grants", str(path)]) == 2  # before loading anything
    assert "given twice" in capsys.readouterr().err

    path.write_text("cert:CN=target: Propose, Commit  # the target's certificate subject\nbob: *\n")
    grants = Grants(path)
    assert grants.allowed("cert:CN=target") == {"Propose", "Commit"}
    assert grants.allowed("bob") is None and grants.allowed("anyone else") is None
    listen = _listen(build_parser().parse_args(["serve-draft", "--port", "0", "--grants", str(path)]))
    assert listen.security.interceptors()[0].grants.allowed("cert:CN=target") == {"Propose", "Commit"}


def test_the_call_rate_flag_reaches_the_server_and_refuses_a_negative_rate():
    from deltaspec.shared.cli import _listen

    parser = build_parser()
    listen = _listen(parser.parse_args(["serve-draft", "--port", "0", "--max-calls-per-second-per-caller", "50"]))
    assert listen.security.calls_per_second == 50
    assert isinstance(listen.security.interceptors()[0].rate, CallRate)
    with pytest.raises(ValueError, match="--max-calls-per-second-per-caller"):
        _listen(parser.parse_args(["serve-draft", "--port", "0", "--max-calls-per-second-per-caller", "-1"]))


def test_a_renewed_client_certificate_dials_the_draft_without_a_restart(pair, pki, tmp_path):
    """The target's certificate towards its draft is replaced under it: the next generation dials with the new one."""
    n = 12
    expected = generate(load_model(pair[0]), PROMPT, n).token_ids
    live = pki.ca.issue("target", False, tmp_path / "client.crt", tmp_path / "client.key")

    with serve(draft_service(pair[1]), security=mtls(pki)) as draft:
        peer = DraftPeer(draft.address, 5.0, ClientSecurity(pki.ca.path, live.cert, live.key))
        target_svc = target_servicer.service(lambda: (load_model(pair[0]), load_tokenizer(pair[0])), draft=peer)
        with serve(target_svc, security=ServerSecurity()) as target:
            def run():
                result, _ = generate_on_server(target.address, PROMPT, "", n)
                assert result.token_ids == expected  # whatever the draft does
                return result.stats

            assert run().drafted > 0
            pki.rogue.renew("target", False, live, time.time() + 2)  # one the draft does not trust: no speculation
            assert run().drafted == 0
            live.key.write_text("not a key")  # half-written: the channel it has stays (and fails), no crash
            os.utime(live.key, (time.time() + 4, time.time() + 4))
            assert run().drafted == 0
            pki.ca.renew("target", False, live, time.time() + 6)  # trusted again
            assert run().drafted > 0
