"""Shared pieces of the gRPC tests (no tests here): a tiny model pair on disk, servers on loopback.

The pair is random: a 4-layer hybrid target and, as draft, the same weights with 2% noise, so
rounds see full, partial and zero acceptance. Servers are real grpc.aio servers on port 0 in
this process (`BackgroundServer`); clients use real channels.
"""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from deltaspec.v1 import draft_service_pb2_grpc, target_service_pb2_grpc
from deltaspec.draft_service import servicer as draft_servicer
from deltaspec.shared.decoding.session_table import Limits
from deltaspec.shared.model.checkpoint import hf_config, random_model, save_checkpoint
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer
from deltaspec.shared.rpc.options import channel
from deltaspec.shared.rpc.server import BackgroundServer
from deltaspec.shared.rpc.status import field_of
from deltaspec.target_service import servicer as target_servicer

PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models on 2 shared cores: intra-op threads only add contention (10x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    target = random_model(hf_config(), seed=11)
    draft = random_model(hf_config(), seed=11)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02 * p.abs().mean())
    return save_checkpoint(target, root / "target"), save_checkpoint(draft, root / "draft")


def target_service(directory: Path, limits: Limits = Limits(), draft_address: str | None = None,
                   draft_timeout_s: float = 1.0):
    peer = target_servicer.DraftPeer(draft_address, draft_timeout_s) if draft_address else None
    return target_servicer.service(lambda: (load_model(directory), load_tokenizer(directory)), limits, peer)


def draft_service(directory: Path, limits: Limits = Limits(), stop_below: float = 0.0, branches: int = 0,
                  telemetry=None):
    return draft_servicer.service(lambda: load_model(directory), limits, telemetry, stop_below=stop_below,
                                  branches=branches)


def start(*services) -> BackgroundServer:
    return BackgroundServer(list(services)).wait_loaded(60)


def target_stub(address: str) -> target_service_pb2_grpc.TargetServiceStub:
    return target_service_pb2_grpc.TargetServiceStub(channel(address))


def draft_stub(address: str) -> draft_service_pb2_grpc.DraftServiceStub:
    return draft_service_pb2_grpc.DraftServiceStub(channel(address))


def refused(call, code: grpc.StatusCode, field: str | None = None) -> grpc.RpcError:
    """Run `call`, expect it refused with `code` (and details naming `field`), return the error."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    if field is not None:
        assert field_of(info.value) == field, info.value.details()
    return info.value
