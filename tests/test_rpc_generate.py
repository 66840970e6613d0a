"""Both client paths and the server path give the tokens of in-process decoding, also when things go wrong.

Greedy: every path equals target-only decoding. Sampling: every path equals in-process
speculative decoding with the same seed (the same random draws, in the same order). A draft
that is unreachable, too slow or talks garbage costs speculation, never tokens; a target that
restarts mid-generation costs a session, never tokens.
"""
from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest

from deltaspec.v1 import draft_service_pb2 as dpb
from deltaspec.v1 import draft_service_pb2_grpc, sampling_pb2
from deltaspec.v1 import target_service_pb2 as pb
from deltaspec.v1 import target_service_pb2_grpc
from deltaspec.draft_service.servicer import NAME as DRAFT_NAME, DraftServicer
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer
from deltaspec.shared.rpc import recovery
from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server
from deltaspec.shared.rpc.options import channel
from deltaspec.shared.rpc.remote_drafter import RemoteDrafter
from deltaspec.shared.rpc.server import BackgroundServer, Service
from deltaspec.target_service import servicer as target_servicer_module
from deltaspec.target_service.servicer import NAME as TARGET_NAME, TargetServicer
from support import reference  # noqa: F401 - a fixture
from test_rpc_support import (PROMPT, one_torch_thread, pair, start, target_service,  # noqa: F401
                              target_stub)

N = 24
SLACK = 0.02  # deadlines travel rounded to the clock's resolution


class FlakyDraft(DraftServicer):
    """A real draft service that misbehaves on demand and records the deadline of every Propose."""

    def __init__(self, load) -> None:
        super().__init__(load)
        # one per coming plain Propose: "slow", "garbage", "bad-probs" or "error" (one per round: a pipelined loop's
        # speculative requests, which a plain one may have right behind it, pass)
        self.faults: list[str] = []
        self.deadlines: list[float | None] = []

    async def Propose(self, request, context):
        self.deadlines.append(context.time_remaining())
        fault = self.faults.pop(0) if self.faults and not request.speculative else None
        if fault == "slow":
            await asyncio.sleep(0.6)
        if fault == "error":
            await context.abort(grpc.StatusCode.INTERNAL, "injected")
        reply = await super().Propose(request, context)
        if fault == "bad-probs":  # plausible tokens, probabilities no sampler could have drawn them from
            del reply.draft_probs[:]
            reply.draft_probs.extend([float("nan")] * (len(reply.draft_tokens) * 257))
        return dpb.ProposeResponse(draft_tokens=[10**6] * request.k) if fault == "garbage" else reply


@pytest.fixture(scope="module")
def flaky(pair):
    servicer = FlakyDraft(lambda: load_model(pair[1]))
    service = Service(DRAFT_NAME, lambda s: draft_service_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s),
                      servicer.load)
    with start(service) as server:
        yield servicer, server.address


@pytest.fixture(scope="module")
def target(pair, flaky):
    with start(target_service(pair[0], draft_address=flaky[1], draft_timeout_s=0.3)) as server:
        yield server.address


def final_stats(address: str, **request) -> tuple[list[int], pb.GenerateResponse]:
    messages = list(target_stub(address).Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=N, **request)))
    return [t for m in messages for t in m.token_ids], messages[-1]


def test_every_path_equals_target_only_decoding(target, flaky, reference):
    server_path, text = generate_on_server(target, PROMPT, "", N)
    assert server_path.token_ids == reference and server_path.prompt_ids == PROMPT
    assert server_path.stats.drafted > 0 and server_path.stats.accepted > 0  # it did speculate
    assert generate_on_server(target, PROMPT, "", N, num_draft_tokens=0)[0].token_ids == reference
    client_path, client_text = generate_client_driven(target, flaky[1], PROMPT, "", N)
    assert client_path.token_ids == reference and client_text == text
    assert client_path.stats.accepted > 0
    assert generate_client_driven(target, None, PROMPT, "", N)[0].token_ids == reference
    tokens, last = final_stats(target, num_draft_tokens=4)
    assert tokens == reference and last.finish_reason == pb.FINISH_REASON_LENGTH


def test_sampled_paths_equal_in_process_speculation(pair, target, flaky):
    sampling = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=4)
    expected = generate(load_model(pair[0]), PROMPT, N, ModelDrafter(load_model(pair[1]), sampling), 4, sampling)
    assert expected.stats.accepted > 0
    assert generate_on_server(target, PROMPT, "", N, 4, sampling)[0].token_ids == expected.token_ids
    assert generate_client_driven(target, flaky[1], PROMPT, "", N, 4, sampling)[0].token_ids == expected.token_ids


@pytest.fixture
def no_draft_pause(monkeypatch):
    """A failed draft is tried again the next round: the pause after a failure is a time (10 ms, doubling), here
    as long as a few of the whole generation's ~15 ms rounds, so each queued fault would not surely meet a proposal."""
    monkeypatch.setattr(recovery, "DRAFT_PAUSE_START_S", 0.0)


def test_draft_outage_costs_speculation_not_tokens(pair, target, flaky, reference, no_draft_pause):
    servicer, address = flaky
    before = len(servicer.sessions)
    servicer.faults = ["slow", "garbage", "error"]
    tokens, last = final_stats(target, num_draft_tokens=4)
    assert tokens == reference
    assert last.stats.draft_failures == 3 and last.stats.accepted > 0  # speculation resumed afterwards
    servicer.faults = ["garbage", "slow"]
    assert generate_client_driven(target, address, PROMPT, "", N, draft_timeout_s=0.3)[0].token_ids == reference
    assert not servicer.faults
    # each failure closed its draft session without waiting: the close must still arrive (a dropped call is cancelled)
    waited = time.monotonic() + 2
    while len(servicer.sessions) != before and time.monotonic() < waited:
        time.sleep(0.01)
    assert len(servicer.sessions) == before

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with start(target_service(pair[0], draft_address=dead, draft_timeout_s=0.3)) as lonely:
        tokens, last = final_stats(lonely.address, num_draft_tokens=4)
        assert tokens == reference and last.stats.drafted == 0 and last.stats.draft_failures > 0
        assert generate_client_driven(lonely.address, dead, PROMPT, "", N)[0].token_ids == reference


def test_draft_garbage_probabilities_cost_speculation_when_sampling(target, flaky, no_draft_pause):
    servicer, _ = flaky
    servicer.faults = ["bad-probs", "bad-probs"]
    sampling = sampling_pb2.SamplingParams(temperature=0.9, seed=4)
    tokens, last = final_stats(target, num_draft_tokens=4, sampling=sampling)
    assert len(tokens) == N and not servicer.faults
    assert last.stats.draft_failures == 2 and last.stats.accepted > 0  # refused, then speculation resumed


def test_deadlines_reach_the_draft(target, flaky):
    servicer, address = flaky
    servicer.deadlines.clear()
    final_stats(target, num_draft_tokens=2)
    assert servicer.deadlines and all(d is not None and d <= 0.3 + SLACK for d in servicer.deadlines)  # per-round budget
    servicer.deadlines.clear()
    generate_client_driven(target, address, PROMPT, "", 4, timeout_s=20.0, draft_timeout_s=60.0)
    assert servicer.deadlines and all(d is not None and d <= 20.0 + SLACK for d in servicer.deadlines)  # the caller's
    servicer.deadlines.clear()
    list(target_stub(target).Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=4, num_draft_tokens=2),
                                      timeout=0.25))
    assert servicer.deadlines and all(d is not None and d <= 0.25 + SLACK for d in servicer.deadlines)


class CountingTarget(TargetServicer):
    """A real target service that counts the sessions and streams it opens."""

    def __init__(self, load) -> None:
        super().__init__(load)
        self.opened: list[int] = []  # prompt length of every CreateSession and Generate

    async def CreateSession(self, request, context):
        self.opened.append(len(request.prompt_ids))
        return await super().CreateSession(request, context)

    def Generate(self, request, context):
        self.opened.append(len(request.prompt_ids))
        return super().Generate(request, context)


def counting_target(directory, port: int = 0) -> tuple[CountingTarget, BackgroundServer]:
    servicer = CountingTarget(lambda: (load_model(directory), load_tokenizer(directory)))
    service = Service(TARGET_NAME, lambda s: target_service_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s),
                      servicer.load)
    return servicer, BackgroundServer([service], port=port).wait_loaded(60)


@pytest.mark.parametrize("path", ["client-driven", "server"])
def test_target_restart_mid_generation(pair, reference, path):
    first, server = counting_target(pair[0])
    restarted: list[tuple[CountingTarget, BackgroundServer]] = []
    received = 0

    def crash_early(ids: list[int], text: str) -> None:
        nonlocal received
        received += len(ids)
        if received >= 2 and not restarted:
            server.stop()  # no grace: sessions and streams are lost
            restarted.append(counting_target(pair[0], port=server.port))

    try:
        if path == "client-driven":
            result, _ = generate_client_driven(server.address, None, PROMPT, "", N, on_tokens=crash_early)
        else:
            result, _ = generate_on_server(server.address, PROMPT, "", N, num_draft_tokens=0, on_tokens=crash_early)
    finally:
        server.stop()
        for _, again in restarted:
            again.stop()
    assert result.token_ids == reference and result.prompt_ids == PROMPT
    assert first.opened == [len(PROMPT)]
    reopened = restarted[0][0].opened  # the new target saw the committed history, not just the prompt
    assert len(reopened) == 1 and len(PROMPT) + 2 <= reopened[0] < len(PROMPT) + N


@pytest.mark.parametrize("local_draft", ["ngram", "mtp"])
def test_in_process_drafters_behind_the_server_loop(tmp_path, local_draft):
    """`serve-target --draft ngram|mtp`: the Generate loop drafts in the target process, tokens unchanged."""
    from deltaspec.shared.decoding.drafters.mtp import random_mtp_weights
    from deltaspec.shared.model.checkpoint import hf_config, random_model, save_checkpoint

    model = random_model(hf_config(mtp_num_hidden_layers=1), seed=11)
    model.mtp = random_mtp_weights(model.config, 1, seed=1)
    directory = save_checkpoint(model, tmp_path / "target")
    service = target_servicer_module.service(lambda: (load_model(directory), load_tokenizer(directory)),
                                             local_draft=local_draft)
    want = generate(load_model(directory), PROMPT * 3, N).token_ids
    with start(service) as server:
        got, _ = generate_on_server(server.address, PROMPT * 3, "", N, num_draft_tokens=4)
    assert got.token_ids == want
    assert got.stats.drafted > 0


def test_draft_session_asked_for_at_start_is_closed_without_a_proposal(pair, flaky):
    """The remote drafter asks for its session at `start` without waiting (its round trip overlaps the target's
    prefill): a proposal then uses it, and a close before any proposal, or a second `start`, frees it all the same."""
    draft, address = flaky
    before = len(draft.sessions)
    stub = draft_service_pb2_grpc.DraftServiceStub(channel(address))
    drafter = RemoteDrafter(stub, SamplingParams(), load_model(pair[1]).config.vocab_size, timeout_s=5.0)
    drafter.start(PROMPT)
    drafter.start(PROMPT * 2)  # used again: the first session goes
    assert len(drafter.propose(3).tokens) == 3
    assert len(draft.sessions) == before + 1
    drafter.close()
    drafter.start(PROMPT)  # asked for, never used
    drafter.close()
    assert len(draft.sessions) == before and drafter.failures == 0


def test_no_session_outlives_its_generation(pair, flaky):
    """Generate's own target session, and the draft sessions of both loops, end with the generation
    (the last round drafts nothing: its draft session used to be dropped without CloseSession)."""
    draft, address = flaky
    servicer = TargetServicer(lambda: (load_model(pair[0]), load_tokenizer(pair[0])),
                              draft=target_servicer_module.DraftPeer(address, 0.3))
    service = Service(TARGET_NAME, lambda s: target_service_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s),
                      servicer.load)
    before = len(draft.sessions)
    with start(service) as server:
        assert generate_on_server(server.address, PROMPT, "", N)[0].stats.accepted > 0
        assert generate_client_driven(server.address, address, PROMPT, "", N)[0].stats.accepted > 0
        assert len(servicer.sessions) == 0 and len(draft.sessions) == before
