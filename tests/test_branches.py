"""Branches: the draft stages the next round for the open round's likeliest misses, exactly.

A branch's head comes from the open round's logs (`ModelState.load_from`) by the commit's own arithmetic, so a
drafter that swaps a branch in proposes, round after round, bit for bit what the same drafter proposes without it
(greedy and sampled, fresh random models, outcomes drawn at random and outcomes a branch foresaw), and a draft
with a prefix cache publishes the same blocks with the same states. The draft
session stages them in idle time, sized by its acceptance, and answers the plain proposal after a foreseen miss
without a forward pass; over loopback gRPC both loops stay exactly target-only with branches on.
"""
import random
import time

import pytest
import torch

from deltaspec.shared.decoding.draft_session import DraftSession, Outcome
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.checkpoint import hf_config, random_model
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server
from deltaspec.shared.state import prefix_cache
from deltaspec.shared.state.rollback import ModelState
from deltaspec.shared.state.spec import CHAIN_LOG_CAPACITY
from deltaspec.shared.telemetry import Telemetry
from test_rpc_support import PROMPT, draft_service, one_torch_thread, pair, start, target_service  # noqa: F401

CFG = hf_config(layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
DRAFT = random_model(CFG, seed=21)


def heads_equal(a: ModelState, b: ModelState) -> bool:
    return (a.length == b.length and torch.equal(a.recurrent.conv, b.recurrent.conv) and torch.equal(a.recurrent.state,
                                                                                          b.recurrent.state)
            and all(torch.equal(x.k[:, :a.length], y.k[:, :a.length]) and torch.equal(x.v[:, :a.length],
                                                                                      y.v[:, :a.length])
                    for x, y in zip(a.attn, b.attn)))


@pytest.mark.parametrize("mark", [None, 3, 7])
def test_load_from_is_the_commit_head(mark):
    """For every n, a state loaded from another's staging after n tokens holds the head `commit(n)` makes there (after
    `drop_marked` when a chained round sits on a mark), bit for bit, and continues identically."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, CFG["vocab_size"], (9 + 7,), generator=gen)
    for n in range(1, 8):
        states = [DRAFT.new_state(log_capacity=CHAIN_LOG_CAPACITY) for _ in range(2)]
        for st in states:
            DRAFT(ids[:9], st)
            st.commit(9)
            DRAFT(ids[9:], st)  # 7 staged, one pass each way
            if mark is not None:
                st.mark(mark)
        source, committed = states
        fork = DRAFT.new_state(log_capacity=CHAIN_LOG_CAPACITY)
        if mark is not None and n > mark:
            continue  # a commit keeps at most the marked tokens once the chained round is dropped
        fork.load_from(source, n)
        if mark is not None:
            committed.drop_marked()
        committed.commit(n)
        assert heads_equal(fork, committed), n
        more = torch.randint(0, CFG["vocab_size"], (3,), generator=gen)
        assert torch.equal(DRAFT(more, fork)[0], DRAFT(more, committed)[0])


def run_rounds(sampling: SamplingParams, foreseen: float, seed: int, models: tuple = (DRAFT, DRAFT)) -> tuple[int, int]:
    """Pipelined drafting rounds on two drafters (of `models`), the second staging branches; their proposals must
    agree bit for bit. Outcomes: a branch's with probability `foreseen` when there is one, else drawn at random.
    Returns (rounds that used a branch, rounds)."""
    rng = random.Random(seed)
    plain, branching = ModelDrafter(models[0], sampling), ModelDrafter(models[1], sampling)
    branching.branching = True
    history = [rng.randrange(CFG["vocab_size"]) for _ in range(6)]
    for d in (plain, branching):
        d.start(history)
    used = rounds = 0
    for rounds in range(1, 13):
        k = rng.choice([2, 3, 4])
        a, b = plain.propose(k), branching.propose(k)
        assert a.tokens == b.tokens
        assert (a.probs is None and b.probs is None) or torch.equal(a.probs, b.probs)
        if rng.random() < 0.8:  # the pipelined loop's speculation, then the branches in idle time
            (g1, s1), (g2, s2) = plain.speculate(k), branching.speculate(k)
            assert g1 == g2 and s1.tokens == s2.tokens
            branching.stage_branches(rng.choice([1, 2, 3]), k, lambda accepted, token: False)
        if branching.branches and rng.random() < foreseen:
            branch = rng.choice(branching.branches)
            outcome = (branch.accepted, branch.token)
        else:
            outcome = (rng.randint(0, len(a.tokens)), rng.randrange(CFG["vocab_size"]))
        used += any((br.accepted, br.token) == outcome for br in branching.branches)
        plain.advance(*outcome)
        branching.advance(*outcome)
    return used, rounds


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=50, seed=3)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_drafter_with_branches_proposes_what_it_would_without(sampling, seed):
    used, rounds = run_rounds(sampling, foreseen=0.7, seed=seed)
    assert 0 < used < rounds


def test_branches_with_a_prefix_cache_publish_what_the_drafter_without_them_does():
    """A draft model with a prefix cache: the cache follows a branch swapped in (its cursor moves to the branch's
    state), so the blocks published, and the states they hold, equal those of the drafter without branches."""
    models = (random_model(CFG, seed=21), random_model(CFG, seed=21))
    caches = [prefix_cache.attach(m, 4) for m in models]
    used, rounds = run_rounds(SamplingParams(), foreseen=0.8, seed=2, models=models)
    assert used > 0
    entries = [sorted(c.entries.values(), key=lambda e: e.end) for c in caches]
    assert len(entries[0]) == len(entries[1]) > 5
    for a, b in zip(*entries):
        assert (a.end, a.tokens) == (b.end, b.tokens)
        assert torch.equal(a.window, b.window) and torch.equal(a.state, b.state) and torch.equal(a.kv, b.kv)


def test_likely_misses_ranks_by_the_drafts_own_odds():
    drafter = ModelDrafter(DRAFT)
    drafter.branching = True
    drafter.start([5, 6, 7, 8])
    drafter.proposed = [1, 2, 3]
    drafter.odds = [(0.9, 11, 0.05), (0.5, 12, 0.4), (0.8, 13, 0.15)]
    # scores: 0.05; 0.9 x 0.4 = 0.36; 0.9 x 0.5 x 0.15 = 0.0675
    assert drafter.likely_misses(2) == [(1, 12), (2, 13)]
    assert drafter.likely_misses(5) == [(1, 12), (2, 13), (0, 11)]


def wait_for(condition, what: str) -> None:
    for _ in range(500):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(what)


def test_draft_session_answers_a_foreseen_miss_without_drafting():
    """The session stages branches after its speculation made ahead; the plain proposal after a miss one of them
    foresaw is that branch's drafts, equal to a session's without branches; how each ended is told."""
    told: list[str] = []
    history = [1, 2, 3, 4, 5]
    piped = DraftSession(DRAFT, history, branches=3, branch_ended=lambda outcome, seconds: told.append(outcome))
    plain = DraftSession(DRAFT, history)
    piped.acceptance = 0.0  # as unsure as it gets: as many branches as allowed
    for session in (piped, plain):
        session.propose("a", 4)
        session.propose("b", 4, None, speculative=True)
    wait_for(lambda: len(piped.drafter.branches) == 3, "no branches staged")
    branch = piped.drafter.branches[1]
    miss = Outcome("a", branch.accepted, branch.token)
    c = piped.propose("c", 4, miss)
    assert c.proposal is branch.proposal  # the branch's own drafts: no forward pass made them now
    assert c.proposal.tokens == plain.propose("c", 4, miss).proposal.tokens
    assert told.count("used") == 1 and told.count("unused") == 2


def test_draft_session_without_misses_stages_no_branches():
    session = DraftSession(DRAFT, [1, 2, 3, 4, 5], branches=2)
    session.acceptance = 1.0
    session.propose("a", 4)
    session.propose("b", 4, None, speculative=True)
    wait_for(lambda: session.ahead is not None, "no speculation made ahead")
    time.sleep(0.05)
    assert session.drafter.branches == []


def test_both_loops_with_branches_equal_target_only(pair):
    """A draft service staging branches behind both loops, pipelined: the same tokens as target-only decoding, and
    its metrics say what the branches did and cost."""
    target_dir, draft_dir = pair
    telemetry = Telemetry()
    expected = generate(load_model(target_dir), PROMPT, 64, None, 0).token_ids
    with start(draft_service(draft_dir, branches=2, telemetry=telemetry)) as d, \
            start(target_service(target_dir, draft_address=d.address, draft_timeout_s=10.0)) as t:
        for k in (2, 4):
            client, _ = generate_client_driven(t.address, d.address, PROMPT, "", 64, k, draft_timeout_s=10.0)
            server, _ = generate_on_server(t.address, PROMPT, "", 64, k)
            assert client.token_ids == server.token_ids == expected, k
    registry = telemetry.metrics.registry
    ended = {o: registry.get_sample_value("deltaspec_draft_branches_total", {"outcome": o}) or 0.0
             for o in ("used", "unused", "cut")}
    assert sum(ended.values()) > 0, ended
    assert (registry.get_sample_value("deltaspec_draft_branch_seconds_total", {"outcome": "unused"}) or 0.0) >= 0


@pytest.mark.parametrize("slots, staged", [(2, 0), (3, 1), (5, 3)])
def test_branches_never_take_the_last_free_state_slot(slots, staged):
    """On a server the draft's states come from its pool: a branch takes a slot while it lives, never the last free
    one (a new session's)."""
    from deltaspec.shared.state.pool import StatePool, attach

    model = random_model(CFG, seed=21)
    per_session = model.config.state_spec.bytes(model.dtype, 512, CHAIN_LOG_CAPACITY)
    attach(model, StatePool(model.config.state_spec, 8 * per_session, slots, log_capacity=CHAIN_LOG_CAPACITY))
    drafter = ModelDrafter(model)
    drafter.branching = True
    drafter.start([3, 1, 4, 1, 5, 9])
    drafter.propose(4)
    drafter.speculate(4)
    assert drafter.stage_branches(5, 4, lambda accepted, token: False) == staged
    assert model.state_pool.slots - model.state_pool.in_use == slots - 1 - staged
