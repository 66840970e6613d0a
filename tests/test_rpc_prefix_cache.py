"""The prefix cache as served: real target and draft services on loopback (batched, pipelined rounds, their
default prefix caches), real gRPC calls.

- Generate (server-side loop against the draft service) and the client-driven loop: requests sharing a system
  prompt hit, run concurrently, and give the tokens of in-process target-only decoding; speculation on or off
  hits the same cached tokens;
- ExtendSession continues a session with a user's next turn without prefilling its history, and a session
  opened again on the whole history (after its replica lost it) hits what the first one cached;
- metrics (hits, tokens, entries, bytes, the roots a router reads) and span attributes on CreateSession and
  Generate say what the cache served.
"""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from deltaspec.draft_service import servicer as draft_servicer
from deltaspec.shared.decoding.session_table import Limits
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer
from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server
from deltaspec.shared.rpc.server import BackgroundServer
from deltaspec.shared.state.prefix_cache import block_key
from deltaspec.shared.telemetry import Telemetry
from deltaspec.shared.telemetry import attributes as attr
from deltaspec.target_service import servicer as target_servicer
from deltaspec.v1 import target_service_pb2 as pb
from test_rpc_support import one_torch_thread, pair, target_stub  # noqa: F401

BLOCK, N = 16, 16  # the services' default block


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


SYSTEM = ids(3 * BLOCK + 5, seed=1)  # ends inside the fourth block


@pytest.fixture(scope="module")
def served(pair):
    target_dir, draft_dir = pair
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "target"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry(provider)
    with BackgroundServer([draft_servicer.service(lambda: load_model(draft_dir))]).wait_loaded(60) as draft:
        target_svc = target_servicer.service(lambda: (load_model(target_dir), load_tokenizer(target_dir)),
                                             draft=target_servicer.DraftPeer(draft.address, 5.0), telemetry=telemetry)
        with BackgroundServer([target_svc], telemetry=telemetry).wait_loaded(60) as target:
            yield target.address, draft.address, telemetry, exporter


@pytest.fixture(scope="module")
def cold(pair):
    model = load_model(pair[0])
    return lambda prompt, n=N: generate(model, prompt, n).token_ids


def test_generate_and_client_loops_hit_and_stay_exact(served, cold):
    target, draft, _, _ = served
    first, _ = generate_on_server(target, SYSTEM + ids(7, seed=2), "", N, num_draft_tokens=4)
    assert first.token_ids == cold(SYSTEM + ids(7, seed=2)) and first.stats.cached_prompt_tokens == 0
    prompts = [SYSTEM + ids(5 + i, seed=10 + i) for i in range(4)]
    with ThreadPoolExecutor(4) as workers:  # concurrent sessions: their passes batch
        results = list(workers.map(lambda p: generate_on_server(target, p, "", N, num_draft_tokens=4)[0], prompts))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == cold(prompt)
        assert result.stats.cached_prompt_tokens == len(SYSTEM) // BLOCK * BLOCK
        assert result.stats.drafted > 0
    client_prompt = SYSTEM + ids(9, seed=3)
    result, _ = generate_client_driven(target, draft, client_prompt, "", N, num_draft_tokens=4)
    assert result.token_ids == cold(client_prompt)
    assert result.stats.cached_prompt_tokens == len(SYSTEM) // BLOCK * BLOCK


def test_speculation_on_or_off_hits_the_same_cached_tokens(served):
    target, _, _, _ = served
    system = ids(2 * BLOCK + 3, seed=4)
    generate_on_server(target, system + [1], "", 4, num_draft_tokens=0)
    hits = [generate_on_server(target, system + ids(6, seed=20 + k), "", N, num_draft_tokens=k)[0]
            .stats.cached_prompt_tokens for k in (0, 4, 0, 2)]
    assert hits == [2 * BLOCK] * 4


def test_extend_session_continues_without_prefilling_the_history(served, cold):
    target, _, _, _ = served
    stub = target_stub(target)
    prompt = ids(2 * BLOCK + 9, seed=5)
    created = stub.CreateSession(pb.CreateSessionRequest(prompt_ids=prompt))
    sid, tokens, version = created.session_id, list(prompt), [0]

    def rounds(n: int, prefix: str) -> None:
        for i in range(n):
            stub.Verify(pb.VerifyRequest(session_id=sid, round_id=f"{prefix}{i}", base_version=version[0]))
            reply = stub.Commit(pb.CommitRequest(session_id=sid, round_id=f"{prefix}{i}"))
            tokens.extend(reply.committed_tokens)
            version[0] = reply.head_version

    rounds(6, "a")
    turn = ids(11, seed=6)
    extended = stub.ExtendSession(pb.ExtendSessionRequest(session_id=sid, append_ids=turn))
    tokens += turn
    version[0] = extended.head_version
    assert extended.head_version == 7 and extended.length == len(tokens) and list(extended.appended_ids) == turn
    rounds(N, "b")
    assert tokens[-N:] == cold(tokens[:-N])
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    history = tokens[:-N]
    again = stub.CreateSession(pb.CreateSessionRequest(prompt_ids=history))  # opened again on its whole history
    assert again.cached_tokens == (len(history) - 1) // BLOCK * BLOCK


def test_a_served_cache_with_sparse_states_resumes_at_the_grid_then_at_the_branch(pair, cold):
    """`--prefix-cache-state-every 2` on a served target (blocks of 16, a state every 32 positions): sessions
    diverging after 48 positions resume at 32, then, once the branch point holds a state, at 48; the generations
    (the server loop against the draft service, batched and pipelined) equal target-only decoding."""
    target_dir, draft_dir = pair
    limits = Limits(prefix_cache_state_every=2)
    with BackgroundServer([draft_servicer.service(lambda: load_model(draft_dir))]).wait_loaded(60) as draft, \
            BackgroundServer([target_servicer.service(lambda: (load_model(target_dir), load_tokenizer(target_dir)),
                                                      limits, target_servicer.DraftPeer(draft.address, 5.0))]
                             ).wait_loaded(60) as target:
        system = ids(3 * BLOCK + 4, seed=30)
        served = [generate_on_server(target.address, system + ids(6, seed=31 + i), "", N, num_draft_tokens=4)[0]
                  for i in range(3)]
        assert [r.stats.cached_prompt_tokens for r in served] == [0, 2 * BLOCK, 3 * BLOCK]
        assert [r.token_ids for r in served] == [cold(system + ids(6, seed=31 + i)) for i in range(3)]


def test_metrics_and_spans_say_what_the_cache_served(served):
    target, _, telemetry, exporter = served
    registry = telemetry.metrics.registry
    prompt = ids(2 * BLOCK + 1, seed=7)
    hits = registry.get_sample_value("deltaspec_prefix_cache_hits_total") or 0.0
    stub = target_stub(target)
    stub.CreateSession(pb.CreateSessionRequest(prompt_ids=prompt))
    reply = stub.CreateSession(pb.CreateSessionRequest(prompt_ids=prompt))
    assert reply.cached_tokens == 2 * BLOCK
    assert registry.get_sample_value("deltaspec_prefix_cache_hits_total") == hits + 1
    assert registry.get_sample_value("deltaspec_prefix_cache_tokens_total") >= 2 * BLOCK
    assert registry.get_sample_value("deltaspec_prefix_cache_entries") > 0
    assert registry.get_sample_value("deltaspec_prefix_cache_bytes") > 0
    assert registry.get_sample_value("deltaspec_prefix_cache_block_tokens") == BLOCK
    assert registry.get_sample_value("deltaspec_prefix_cache_states") \
        == registry.get_sample_value("deltaspec_prefix_cache_entries")  # a state every block by default
    root = block_key(b"", prompt[:BLOCK]).hex()  # what a router computes from the prompt's first block
    assert registry.get_sample_value("deltaspec_prefix_cache_root_tokens", {"root": root}) == 2 * BLOCK
    creates = [s for s in exporter.get_finished_spans() if s.name.endswith("TargetService/CreateSession")]
    assert creates[-1].attributes[attr.CACHED_TOKENS] == 2 * BLOCK
    assert creates[-1].attributes[attr.PREFILLED_TOKENS] == 0
    generate_on_server(target, prompt + [3], "", 4)
    span = [s for s in exporter.get_finished_spans() if s.name.endswith("TargetService/Generate")][-1]
    assert span.attributes[attr.CACHED_TOKENS] == 2 * BLOCK and span.attributes[attr.PREFILLED_TOKENS] == 1
