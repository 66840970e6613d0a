"""The client library (`from deltaspec import Client`), the examples under examples/ and the README's first example,
against real loopback servers.

Greedy output through every path (streamed, whole, client-driven, asyncio) equals in-process target-only
decoding; refusals arrive as typed errors with the status, the stable reason and the field; the asyncio
channel carries the bearer token.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from deltaspec import AsyncClient, Client, InvalidArgumentError, UnauthenticatedError
from deltaspec.shared.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from deltaspec.shared.rpc.security import ServerSecurity, TokenStore
from deltaspec.shared.rpc.server import BackgroundServer
from support import reference  # noqa: F401 - a fixture
from test_rpc_support import PROMPT, draft_service, one_torch_thread, pair, start, target_service  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
N = 20


@pytest.fixture(scope="module")
def servers(pair):  # noqa: F811
    with start(draft_service(pair[1])) as draft:
        with start(target_service(pair[0], draft_address=draft.address)) as target:
            yield target.address, draft.address


def test_every_path_gives_the_target_only_tokens(servers, reference):
    target, draft = servers
    with Client(target) as client:
        pieces = list(client.stream(PROMPT, max_new_tokens=N))
        assert [t for p in pieces for t in p.token_ids] == reference and len(pieces) > 1
        whole = client.generate(PROMPT, max_new_tokens=N)
        assert (whole.prompt_ids, whole.token_ids) == (PROMPT, reference)
        assert whole.stats["drafted"] > 0 and whole.text == "".join(p.text for p in pieces)
    with Client(target, draft=draft) as client:
        driven = client.generate(PROMPT, max_new_tokens=N, num_draft_tokens=3)
        assert driven.token_ids == reference and driven.stats["drafted"] > 0

    async def run():
        async with AsyncClient(target) as client:
            streamed = [p async for p in client.stream(PROMPT, max_new_tokens=N)]
            return streamed, await asyncio.gather(*(client.generate(PROMPT, max_new_tokens=N) for _ in range(3)))
    streamed, many = asyncio.run(run())
    assert [t for p in streamed for t in p.token_ids] == reference
    assert all(c.token_ids == reference and c.stats["rounds"] > 0 for c in many)


def test_refusals_are_typed_errors_with_reason_and_field(servers):
    with Client(servers[0]) as client, pytest.raises(InvalidArgumentError) as info:
        list(client.stream([1, 10**6], max_new_tokens=4))
    err = info.value
    assert (err.code, err.reason, err.field) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD", "prompt_ids")
    assert "vocabulary" in err.message

    async def run():
        async with AsyncClient(servers[0]) as client:
            await client.generate([1, 10**6], max_new_tokens=4)
    with pytest.raises(InvalidArgumentError) as info:
        asyncio.run(run())
    assert info.value.field == "prompt_ids"
    with pytest.raises(ValueError, match="plaintext"):
        Client("10.1.2.3:50051")  # no TLS and not loopback: refused before dialling


def test_tokens_reach_the_service_from_both_clients(pair, tmp_path, reference):  # noqa: F811
    token = secrets.token_hex(16)
    (tmp_path / "tokens").write_text(f"app:{token}\n")
    security = ServerSecurity(tokens=TokenStore(tmp_path / "tokens"))
    with BackgroundServer([target_service(pair[0])], security=security).wait_loaded(60) as server:
        with Client(server.address, token=token) as client:
            assert client.generate(PROMPT, max_new_tokens=N).token_ids == reference
        with Client(server.address, token="x" * 32) as client, pytest.raises(UnauthenticatedError):
            client.generate(PROMPT, max_new_tokens=N)

        async def run(tok: str):
            async with AsyncClient(server.address, token=tok) as client:
                return await client.generate(PROMPT, max_new_tokens=N)
        assert asyncio.run(run(token)).token_ids == reference
        with pytest.raises(UnauthenticatedError):
            asyncio.run(run("y" * 32))


def test_examples_run_against_real_servers(servers):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    streamed = subprocess.run([sys.executable, str(ROOT / "examples" / "stream_completion.py"), servers[0], "ab"],
                              capture_output=True, text=True, timeout=120, env=env)
    assert streamed.returncode == 0, streamed.stderr
    concurrent = subprocess.run([sys.executable, str(ROOT / "examples" / "async_completion.py"), servers[0]],
                                capture_output=True, text=True, timeout=120, env=env)
    assert concurrent.returncode == 0, concurrent.stderr
    lengths = [len(json.loads(line)["token_ids"]) for line in concurrent.stdout.splitlines()]
    assert len(lengths) == 3 and all(0 < n <= 48 for n in lengths), lengths  # sampled: an EOS may end one early


def test_the_readme_example_prints_code_from_the_embedded_pair():
    """The README's first Python example, run as written against the embedded pair (the pair its output shows): it
    prints code, not the blanks a greedy continuation of a short prompt gives."""
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", readme[readme.index(code):], re.S).group(1)
    with start(draft_service(DEFAULT_DRAFT)) as draft:
        with start(target_service(DEFAULT_TARGET, draft_address=draft.address)) as target:
            assert "127.0.0.1:50051" in code
            out = subprocess.run([sys.executable, "-c", code.replace("127.0.0.1:50051", target.address)],
                                 capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    prompt = shown.splitlines()[0]
    assert out.stdout.startswith(prompt)
    assert len("".join(out.stdout.split())) > 150  # 256 bytes of code, not whitespace
