"""State slots under a memory budget (`deltaspec.shared.state.pool`).

In process, on a random config other than the embedded pair's (GDN first, one K/V head, d_k != d_v):
slots never share memory (random data, one slot written, the others compared), a returned slot
comes back zeroed, a pooled sequence stages, commits, marks and grows exactly as an unpooled one,
speculative decoding (serial and pipelined) is token-identical with and without pools, and K/V
growth past the budget is refused before anything changes, then succeeds once another session
ends. Over real loopback gRPC: a full pool refuses CreateSession and Generate with
RESOURCE_EXHAUSTED naming the budget, on the target and the draft; closing, expiry, a finished
Generate, a failed one and a cancelled one give the slot back; a Verify whose K/V growth the budget cannot cover is
refused the same way, leaves the session as it was, and succeeds on retry once another session closes.
"""
from __future__ import annotations

import copy
import time

import grpc
import pytest
import torch

from deltaspec.v1 import draft_service_pb2 as dpb
from deltaspec.v1 import target_service_pb2 as pb
from benchmarks import session_memory
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.pipelined import decode_pipelined
from deltaspec.shared.decoding.session_table import Limits
from deltaspec.shared.decoding.speculative import Stats, decode, generate
from deltaspec.shared.decoding.target import TargetSession
from deltaspec.shared.errors import ResourceExhausted
from deltaspec.shared.model.checkpoint import hf_config, random_model
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.state.pool import MIN_CONTEXT, StatePool, attach
from deltaspec.shared.state.rollback import ModelState
from deltaspec.shared.state.spec import CHAIN_LOG_CAPACITY, LOG_CAPACITY
from deltaspec.shared.telemetry.metrics import Metrics
from test_rpc_support import (PROMPT, draft_service, draft_stub, one_torch_thread, pair, refused, start,  # noqa: F401
                              target_service, target_stub)

Code = grpc.StatusCode
CFG = hf_config(vocab_size=113, hidden_size=48, num_key_value_heads=1, head_dim=24, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=12, linear_value_head_dim=20,
                layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
PLAIN = random_model(CFG, seed=3)
NOISY = random_model(CFG, seed=3)  # the draft: the target with 5 % noise, so rounds see full, partial and no acceptance
with torch.no_grad():
    for p in NOISY.parameters():
        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.05 * p.abs().mean())
GDN_NAMES = tuple(PLAIN.config.state_spec.recurrent_buffers(torch.float32))
PROMPT_A = [int(t) for t in torch.randint(0, 113, (120,), generator=torch.Generator().manual_seed(0))]


def pooled(source: HybridLM, sessions: int, extra_positions: int = 0) -> tuple[HybridLM, StatePool]:
    """A copy of `source` with a pool of `sessions` slots, K/V for 256 positions each plus `extra_positions`."""
    model = copy.deepcopy(source)
    spec = model.config.state_spec
    budget = sessions * spec.bytes(torch.float32, MIN_CONTEXT) + extra_positions * spec.kv_bytes_per_position(torch.float32)
    pool = StatePool(spec, budget, sessions)
    attach(model, pool)
    return model, pool


def buffers(state: ModelState) -> dict[str, torch.Tensor]:
    """Every tensor a state holds (GDN buffers, mark snapshot included, and K/V), copied."""
    out = {name: getattr(state.recurrent, name).clone() for name in GDN_NAMES}
    out.update({f"attn{i}.{kv}": getattr(layer, kv).clone() for i, layer in enumerate(state.attn) for kv in "kv"})
    return out


def fill(state: ModelState, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in [getattr(state.recurrent, name) for name in GDN_NAMES] + [t for layer in state.attn for t in (layer.k, layer.v)]:
        t.copy_(torch.randn(t.shape, generator=gen))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", list(session_memory.models()))
def test_what_the_pool_charges_is_what_a_pooled_session_holds(name):
    """The bench's figures (embedded pair, Qwen3.5-0.8B shape) are the bytes real pooled sessions hold."""
    cfg, dtype, log_capacity = session_memory.models()[name]
    for positions in (MIN_CONTEXT, 1000):
        charged = cfg.state_spec.bytes(dtype, positions, log_capacity)
        assert session_memory.measured_bytes(cfg, dtype, positions, log_capacity) == charged


def test_slots_are_independent_and_come_back_zeroed():
    _, pool = pooled(PLAIN, sessions=3)
    states = [pool.new_state() for _ in range(3)]
    for i, st in enumerate(states):
        fill(st, seed=i)
    before = [buffers(st) for st in states]
    fill(states[1], seed=99)
    assert same(buffers(states[0]), before[0]) and same(buffers(states[2]), before[2])
    assert not same(buffers(states[1]), before[1])
    assert all(t.abs().sum() > 0 for t in buffers(states[1]).values())
    index = states[1].attn[0].lease.index
    with pytest.raises(ResourceExhausted):
        pool.new_state()
    del states[1]  # the last reference: the slot returns at once
    assert pool.in_use == 2
    again = pool.new_state()
    assert again.attn[0].lease.index == index
    assert all(not t.any() for t in buffers(again).values())


def test_pool_metrics_follow_admissions_releases_and_refusals():
    _, pool = pooled(PLAIN, sessions=2)
    metrics = Metrics()
    metrics.watch_state_pool(pool)

    def value(name: str) -> float | None:
        return metrics.registry.get_sample_value(name)

    assert (value("deltaspec_state_slots"), value("deltaspec_state_slots_in_use")) == (2, 0)
    assert (value("deltaspec_state_memory_used_bytes"), value("deltaspec_state_memory_budget_bytes")) == (0, pool.budget)
    first, _ = pool.new_state(), pool.new_state()
    with pytest.raises(ResourceExhausted):
        pool.new_state()
    assert value("deltaspec_state_memory_used_bytes") == pool.budget == 2 * pool.session_bytes(MIN_CONTEXT)
    assert (value("deltaspec_state_slots_in_use"), value("deltaspec_state_memory_refusals_total")) == (2, 1)
    del first
    assert value("deltaspec_state_slots_in_use") == 1
    assert value("deltaspec_state_memory_used_bytes") == pool.session_bytes(MIN_CONTEXT)


def test_pooled_state_stages_commits_marks_and_grows_as_an_unpooled_one():
    model, pool = pooled(PLAIN, sessions=1, extra_positions=64)
    gen = torch.Generator().manual_seed(7)
    mine, ref = model.new_state(capacity=4), ModelState(PLAIN.config.state_spec, capacity=4)  # small: K/V grows
    steps = [("forward", 9), ("commit", 9), ("forward", 4), ("commit", 2), ("forward", 3), ("revert", 0),
             ("forward", 5), ("mark", 0), ("forward", 3), ("commit_marked", 0), ("forward", 2), ("mark", 0),
             ("forward", 4), ("drop_marked", 0), ("commit", 3), ("forward", 30), ("commit", 30), ("forward", 1)]
    for op, n in steps:
        if op == "forward":
            ids = torch.randint(0, 113, (n,), generator=gen)
            (got, got_h), (want, want_h) = model(ids, mine), PLAIN(ids, ref)
            assert torch.equal(got, want) and torch.equal(got_h, want_h), op
        else:
            for st in (mine, ref):
                getattr(st, op)(*([n] if op == "commit" else []))
        assert (mine.length, mine.staged, mine.marked) == (ref.length, ref.staged, ref.marked)
    assert pool.in_use == 1 and mine.attn[0].k.shape[1] >= mine.length + mine.staged


@pytest.mark.parametrize("pipelined", [False, True])
def test_pooled_speculative_decoding_is_token_identical(pipelined):
    n, k = 150, 3  # past the 256 positions a 120-token prompt asks for: K/V grows inside the budget
    target, _ = pooled(PLAIN, sessions=1, extra_positions=512)
    draft, _ = pooled(NOISY, sessions=1, extra_positions=512)

    def run(target_model, draft_model) -> tuple[TargetSession, Stats]:
        session, drafter, stats = TargetSession(target_model, PROMPT_A), ModelDrafter(draft_model), Stats()
        drafter.start(PROMPT_A)
        for _ in (decode_pipelined if pipelined else decode)(session, drafter, n, k, set(), stats):
            pass
        return session, stats

    (got, stats), (want, _) = run(target, draft), run(PLAIN, NOISY)
    assert got.generated == want.generated == generate(PLAIN, PROMPT_A, n, None, 0).token_ids
    assert 0 < stats.accepted < stats.drafted and got.state.attn[0].k.shape[1] > MIN_CONTEXT


def test_kv_growth_past_the_budget_is_refused_cleanly_and_works_after_a_session_ends():
    model, pool = pooled(PLAIN, sessions=2, extra_positions=40)  # two sessions of 256 positions, 40 to share
    want = generate(PLAIN, PROMPT_A, 200, None, 0).token_ids
    session, other = TargetSession(model, PROMPT_A), TargetSession(model, PROMPT_A[:7])
    rounds = 0
    while True:
        drafts = want[len(session.generated):][:8]  # the target's own tokens: every round keeps them all
        before, version = buffers(session.state), session.version
        try:
            rnd = session.verify(f"r{rounds}", drafts)
        except ResourceExhausted as e:
            refusal = e
            break
        session.commit(rnd.round_id, rnd.verdict.accepted)
        rounds += 1
    # refused where K/V ran out: the round needs positions up to len(tokens) + 8, the one before fitted
    assert len(session.tokens) - 1 <= MIN_CONTEXT + 40 < len(session.tokens) + 8
    assert "state memory budget" in str(refusal) and "2 of 2 session slots" in str(refusal)
    assert refusal.field == "state_memory"
    assert same(buffers(session.state), before) and session.version == version and session.pending is None
    assert session.state.staged == 0 and session.find(f"r{rounds}") is None
    del other  # a session ends: its K/V comes back
    while len(session.generated) < len(want):
        rnd = session.verify(f"r{rounds}", want[len(session.generated):][:8])
        session.commit(rnd.round_id, rnd.verdict.accepted)
        rounds += 1
    assert session.generated[:200] == want and pool.in_use == 1


def session_budget(directory, sessions: int, log_capacity: int = LOG_CAPACITY) -> int:
    """Bytes for exactly `sessions` sessions of a server's model with short prompts (256 positions each); a draft
    server's logs hold `CHAIN_LOG_CAPACITY` tokens."""
    cfg = load_model(directory).config
    return sessions * cfg.state_spec.bytes(torch.float32, MIN_CONTEXT, log_capacity)


def open_session(stub) -> str:
    return stub.CreateSession(pb.CreateSessionRequest(prompt_ids=PROMPT)).session_id


def eventually(call, seconds: float = 10.0):
    """`call()` once it stops being refused RESOURCE_EXHAUSTED: a finished stream's worker lets go of its state
    just after the stream's last message."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return call()
        except grpc.RpcError as e:
            if e.code() != Code.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_full_target_pool_refuses_and_slots_come_back(pair):
    limits = Limits(max_sessions=8, state_memory_bytes=session_budget(pair[0], 2))
    with start(target_service(pair[0], limits)) as server:
        stub = target_stub(server.address)
        first, _ = open_session(stub), open_session(stub)
        err = refused(lambda: open_session(stub), Code.RESOURCE_EXHAUSTED, "state_memory")
        assert "state memory budget" in err.details() and "2 of 2 session slots" in err.details() \
            and "of recurrent state" in err.details(), err.details()
        generate_request = pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=6)
        refused(lambda: list(stub.Generate(generate_request)), Code.RESOURCE_EXHAUSTED, "state_memory")
        stub.CloseSession(pb.CloseSessionRequest(session_id=first))
        third = open_session(stub)  # the closed session's slot, at once
        stub.CloseSession(pb.CloseSessionRequest(session_id=third))
        for _ in range(3):  # each finished stream gives its slot back
            replies = eventually(lambda: list(stub.Generate(generate_request)))
            assert sum(len(r.token_ids) for r in replies) == 6
        def two_replies():
            stream = stub.Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=100_000))
            next(stream), next(stream)
            return stream

        eventually(two_replies).cancel()  # a cancelled stream gives its slot back too
        last = eventually(lambda: open_session(stub))
        refused(lambda: open_session(stub), Code.RESOURCE_EXHAUSTED, "state_memory")
        stub.CloseSession(pb.CloseSessionRequest(session_id=last))


def test_expired_sessions_give_their_slots_back(pair):
    limits = Limits(ttl_s=0.5, state_memory_bytes=session_budget(pair[0], 2))
    with start(target_service(pair[0], limits)) as server:
        stub = target_stub(server.address)
        open_session(stub), open_session(stub)
        refused(lambda: open_session(stub), Code.RESOURCE_EXHAUSTED, "state_memory")
        time.sleep(0.7)
        open_session(stub), open_session(stub)


def test_full_draft_pool_refuses_and_a_closed_session_frees_its_slot(pair):
    budget = session_budget(pair[1], 1, CHAIN_LOG_CAPACITY)
    with start(draft_service(pair[1], Limits(state_memory_bytes=budget))) as server:
        stub = draft_stub(server.address)
        request = dpb.DraftServiceCreateSessionRequest(token_ids=PROMPT)
        sid = stub.CreateSession(request).session_id
        err = refused(lambda: stub.CreateSession(request), Code.RESOURCE_EXHAUSTED, "state_memory")
        assert "1 of 1 session slots" in err.details(), err.details()
        stub.CloseSession(dpb.DraftServiceCloseSessionRequest(session_id=sid))
        assert stub.Propose(dpb.ProposeRequest(session_id=stub.CreateSession(request).session_id, round_id="r1",
                                               k=2)).draft_tokens


def test_kv_growth_refused_over_grpc_leaves_the_session_usable(pair):
    want = generate(load_model(pair[0]), PROMPT, 330, None, 0).token_ids
    spec = load_model(pair[0]).config.state_spec
    limits = Limits(state_memory_bytes=session_budget(pair[0], 2) + 40 * spec.kv_bytes_per_position(torch.float32))
    with start(target_service(pair[0], limits)) as server:
        stub = target_stub(server.address)
        sid, other = open_session(stub), open_session(stub)

        def verify(round_id: str, generated: list[int], version: int) -> pb.VerifyResponse:
            return stub.Verify(pb.VerifyRequest(session_id=sid, round_id=round_id, base_version=version,
                                                draft_tokens=want[len(generated):][:8]))

        generated, version = [], 0
        while True:  # the target's own tokens as drafts: every round keeps all 8
            try:
                reply = verify(f"r{version}", generated, version)
            except grpc.RpcError as e:
                refusal = e
                break
            committed = stub.Commit(pb.CommitRequest(session_id=sid, round_id=f"r{version}", accepted=reply.accepted))
            generated += committed.committed_tokens
            version = committed.head_version
        assert refusal.code() == Code.RESOURCE_EXHAUSTED and "state memory budget" in refusal.details()
        before = stub.GetSession(pb.GetSessionRequest(session_id=sid))
        assert list(before.generated_ids) == generated == want[:len(generated)] and not before.HasField("pending_round")
        assert len(PROMPT) + len(generated) - 1 <= MIN_CONTEXT + 40 < len(PROMPT) + len(generated) + 8
        stub.CloseSession(pb.CloseSessionRequest(session_id=other))
        for _ in range(3):  # the same round, retried, now fits; and the next ones
            reply = verify(f"r{version}", generated, version)
            committed = stub.Commit(pb.CommitRequest(session_id=sid, round_id=f"r{version}", accepted=reply.accepted))
            generated += committed.committed_tokens
            version = committed.head_version
        assert generated == want[:len(generated)] and len(generated) > MIN_CONTEXT


def test_a_generate_stream_that_fails_gives_its_slot_back(pair):
    with start(target_service(pair[0], Limits(state_memory_bytes=session_budget(pair[0], 1)))) as server:
        stub = target_stub(server.address)
        replies, prompt = [], PROMPT * 24  # 120 tokens
        with pytest.raises(grpc.RpcError) as failed:  # K/V for 256 positions, no more: the stream fails there
            for reply in stub.Generate(pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=400)):
                replies.append(reply)
        assert failed.value.code() == Code.RESOURCE_EXHAUSTED and "K/V" in failed.value.details()
        # target-only rounds fill all 256 positions (the pending token is not in the state), the next needs a 257th
        assert sum(len(r.token_ids) for r in replies) == MIN_CONTEXT + 1 - len(prompt)
        eventually(lambda: open_session(stub))
