"""The prefix routing key (deltaspec.shared.rpc.routing): what it names, and that the clients send it.

A balancer routes by the key alone, so the key must be the same for every request that repeats a prefix (every
turn of a conversation, every request behind one system prompt), the same in every client process and version
(a literal below pins it), and differ where the prefixes do. The calls are checked against a real target service
on loopback whose server records each call's metadata.
"""
from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from deltaspec.shared.client import AsyncClient
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.rpc.generation import Resume, generate_client_driven, generate_on_server
from deltaspec.shared.rpc.routing import HEADER, IDS, TEXT_CHARS, prefix_key
from deltaspec.shared.rpc.server import BackgroundServer
from deltaspec.shared.telemetry import Telemetry
from deltaspec.v1 import target_service_pb2 as pb
from test_rpc_support import PROMPT, one_torch_thread, pair, target_service  # noqa: F401

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer in one sentence."}
CHAT = [SYSTEM, {"role": "user", "content": "What is a prefix cache?"}]


class MetadataRecorder(grpc.aio.ServerInterceptor):
    """Each call's method name and metadata, before any handler runs (so refused calls count too)."""

    def __init__(self, calls: list[tuple[str, dict[str, str]]]) -> None:
        self.calls = calls

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        self.calls.append((details.method.rpartition("/")[2], dict(details.invocation_metadata or ())))
        return await continuation(details)


@dataclass
class RecordingTelemetry(Telemetry):
    """The server's telemetry, with the recorder as its one interceptor: the way to add one to a `ModelServer`."""

    calls: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    def server_interceptors(self) -> list:
        return [MetadataRecorder(self.calls)]


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):  # noqa: F811
    """The tiny target, with a chat template so messages render, behind a recording server."""
    directory = Path(shutil.copytree(pair[0], tmp_path_factory.mktemp("chat") / "target"))
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    telemetry = RecordingTelemetry()
    with BackgroundServer([target_service(directory)], telemetry=telemetry).wait_loaded(60) as running:
        yield running.address, telemetry.calls


def sent(calls: list[tuple[str, dict[str, str]]], method: str) -> list[str | None]:
    """The routing header of every `method` call recorded, in order (None where it was missing)."""
    return [metadata.get(HEADER) for name, metadata in calls if name == method]


def test_the_key_is_short_hex_and_the_same_in_every_process():
    key = prefix_key(messages=CHAT)
    assert len(key) == 16 and int(key, 16) >= 0
    assert key == prefix_key(messages=[dict(m) for m in CHAT])  # same input, same key, call after call
    assert prefix_key(PROMPT) == "9fc6c17f33de68dc"  # pinned: clients of every version must route alike


def test_a_conversation_keeps_its_key_turn_after_turn():
    later = [*CHAT, {"role": "assistant", "content": "A store of computed states."},
             {"role": "user", "content": "Why?"}]
    assert prefix_key(messages=later) == prefix_key(messages=CHAT) == prefix_key(messages=[SYSTEM])
    other_user = [SYSTEM, {"role": "user", "content": "Something else entirely"}]
    assert prefix_key(messages=other_user) == prefix_key(messages=CHAT)  # one application, one system prompt


def test_different_system_prompts_or_roles_get_different_keys():
    other = [{"role": "system", "content": SYSTEM["content"] + "!"}, CHAT[1]]
    as_user = [{"role": "user", "content": SYSTEM["content"]}, CHAT[1]]
    assert len({prefix_key(messages=CHAT), prefix_key(messages=other), prefix_key(messages=as_user)}) == 3


def test_text_is_keyed_by_its_first_characters_ids_by_their_first_ids():
    head = "x" * (TEXT_CHARS - 1)
    assert prefix_key(prompt_text=head + "a tail") == prefix_key(prompt_text=head + "another")
    assert prefix_key(prompt_text=head[:-1] + "ya") != prefix_key(prompt_text=head + "a")
    ids = list(range(IDS))
    assert prefix_key(ids + [1, 2]) == prefix_key(ids + [3]) == prefix_key(ids)
    assert prefix_key(ids[:-1] + [10**6]) != prefix_key(ids)
    assert prefix_key(prompt_text="ab") != prefix_key([97, 98])  # each form hashed in its own domain


def test_a_reopened_stream_keeps_the_first_openings_key():
    resume = Resume(None, "def fib(n):", 8, 4, SamplingParams(), None, 8)
    before = resume.metadata
    resume.seen(pb.GenerateResponse(prompt_ids=[1, 2, 3], token_ids=[4]))
    assert resume.request().prompt_ids == [1, 2, 3, 4] and resume.metadata == before
    assert before == [(HEADER, prefix_key(prompt_text="def fib(n):"))]


def test_generate_and_create_session_carry_the_key(server):
    address, calls = server
    generate_on_server(address, PROMPT, "", 4, num_draft_tokens=0)
    generate_on_server(address, None, "", 4, num_draft_tokens=0, messages=CHAT)
    generate_client_driven(address, None, None, "def fib(n):", 4)

    async def stream() -> None:
        async with AsyncClient(address) as client:
            await client.generate(messages=CHAT, max_new_tokens=4)
    asyncio.run(stream())
    assert sent(calls, "Generate") == [prefix_key(PROMPT), prefix_key(messages=CHAT), prefix_key(messages=CHAT)]
    assert sent(calls, "CreateSession") == [prefix_key(prompt_text="def fib(n):")]
