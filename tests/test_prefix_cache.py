"""The prefix cache (deltaspec.shared.state.prefix_cache) in process: what it caches is exactly a cold prefill's head,
and sessions that resume from it generate exactly what cold sessions (and HF transformers) generate.

- heads taken inside a prefill (`BlockHeads`, the commit algebra per block) and from commits' logs equal the heads
  of cold prefills of each prefix, on random models of every architecture axis, after rounds with rejected drafts;
- greedy output with a hit equals the cold run and HF `generate()`, with every drafter (none, draft model,
  n-gram, MTP), for prefixes ending inside a conv window, exactly on a block boundary and one token after it,
  and for sessions that diverge right after a shared prefix; sampled output equals the cold run seed for seed;
- speculation costs no cache: the same cached tokens with any drafter as without;
- memory: entries are paid from the budget, evicted (leaves, never one a later block hangs on) under load, also
  while sessions that copied them still run, and a state pool has the cache evict before it refuses a session.
"""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

from deltaspec.shared.decoding.drafters import make_drafter
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.drafters.mtp import random_mtp_weights
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.decoding.target import TargetSession
from deltaspec.shared.errors import ResourceExhausted
from deltaspec.shared.model.checkpoint import hf_config, random_model, save_checkpoint
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.state import pool as state_pool
from deltaspec.shared.state import prefix_cache
from deltaspec.shared.state.prefix_cache import ByteBudget, PrefixCache

BLOCK = 8
N = 24


def ids(n: int, seed: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A random target with an MTP head, saved and loaded as HF's layout, and a random draft of its vocabulary."""
    root = tmp_path_factory.mktemp("prefix")
    target = random_model(hf_config(mtp_num_hidden_layers=1), seed=21)
    target.mtp = random_mtp_weights(target.config, 1, seed=4)
    draft = random_model(hf_config(layer_types=["linear_attention", "full_attention"]), seed=22)
    return save_checkpoint(target, root / "target"), save_checkpoint(draft, root / "draft")


def fresh(directory, block: int | None = BLOCK, keep_hidden: bool = False, max_bytes: int = 2**30,
          state_every: int = 1):
    model = load_model(directory).fuse()
    if block:
        prefix_cache.attach(model, block, keep_hidden, max_bytes, state_every)
    return model


def drafter(kind: str, target, draft_dir, sampling: SamplingParams = SamplingParams()):
    if kind == "draft":
        return ModelDrafter(fresh(draft_dir), sampling)
    return None if kind == "none" else make_drafter(kind, target, sampling)


def assert_head(state, cold) -> None:
    """Two heads after the same tokens: GDN windows and states, and the attention K/V of every position (to float32
    rounding: a resumed sequence computes from the closed-form head, a cold one from the kernel's)."""
    assert state.length == cold.length
    torch.testing.assert_close(state.recurrent.conv, cold.recurrent.conv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state.recurrent.state, cold.recurrent.state, rtol=1e-4, atol=1e-4)
    for a, b in zip(state.attn, cold.attn):
        torch.testing.assert_close(a.k[:, :state.length], b.k[:, :cold.length], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.v[:, :state.length], b.v[:, :cold.length], rtol=1e-4, atol=1e-4)


def cold_head(model, tokens: list[int]):
    state = model.new_state(capacity=512)
    model(torch.tensor(tokens), state)
    state.commit(state.staged)
    return state


def assert_entries_are_cold_heads(cache: PrefixCache, model) -> None:
    """Every cached entry holds what a cold prefill of its whole prefix leaves: nothing rejected, nothing stale (an
    entry without a recurrent state: its K/V)."""
    assert cache.entries
    for entry in cache.entries.values():
        chain = [entry]
        while chain[-1].parent is not None:
            chain.append(chain[-1].parent)
        tokens = [t for e in reversed(chain) for t in e.tokens]
        kv, cold = torch.cat([e.kv for e in reversed(chain)], dim=3), cold_head(model, tokens)
        if entry.state is None:
            for (k, v), a in zip(kv, cold.attn):
                torch.testing.assert_close(k, a.k[:, :entry.end], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(v, a.v[:, :entry.end], rtol=1e-4, atol=1e-4)
            continue
        resumed = model.new_state(capacity=512)
        resumed.load_head(entry.end, entry.window, entry.state, kv)
        assert_head(resumed, cold)


def test_heads_taken_inside_a_prefill_equal_cold_prefills(config_dict, tmp_path):
    """Blocks of 5 over a 43-token prefill (windows of K-1 = 3 rows): every boundary's head, by `BlockHeads`."""
    model = fresh(save_checkpoint(random_model(config_dict, seed=3), tmp_path), block=5)
    prompt = ids(44, seed=1, vocab=model.config.vocab_size)
    TargetSession(model, prompt)
    assert len(model.prefix_cache.entries) == 43 // 5
    assert_entries_are_cold_heads(model.prefix_cache, model)


def test_heads_cached_from_rounds_hold_no_rejected_token(pair):
    """A random draft gets most rounds rejected: the blocks its rounds complete are cached from the kept tokens'
    logs only, so each equals a cold prefill of the committed tokens."""
    target_dir, draft_dir = pair
    target = fresh(target_dir, block=5)
    result = generate(target, ids(9, seed=2), 40, ModelDrafter(fresh(draft_dir)), 4)
    assert result.stats.accepted < result.stats.drafted  # rejections happened
    assert len(target.prefix_cache.entries) == (9 - 1 + 40) // 5
    assert_entries_are_cold_heads(target.prefix_cache, target)


@pytest.fixture(scope="module")
def hf_greedy(pair):
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()

    def run(prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
    return run


# Where a later prompt's shared prefix ends, counted in positions the head holds (all but the pending token):
# inside the conv window after a block boundary, exactly on one, one token after one.
SHARED = {"inside_window": 2 * BLOCK + 2, "on_boundary": 2 * BLOCK, "one_after": 2 * BLOCK + 1}


@pytest.mark.parametrize("kind", ["none", "draft", "ngram", "mtp"])
def test_greedy_with_hits_equals_cold_runs_and_hf(pair, hf_greedy, kind):
    target_dir, draft_dir = pair
    cached, cold = fresh(target_dir, keep_hidden=kind == "mtp"), fresh(target_dir, block=None)
    base = ids(40, seed=5)
    assert generate(cached, base, N, drafter(kind, cached, draft_dir), 4).token_ids \
        == generate(cold, base, N).token_ids == hf_greedy(base, N)
    for name, shared in SHARED.items():
        prompt = base[:shared] + ids(6, seed=len(name))  # diverges right after the shared prefix
        hit = generate(cached, prompt, N, drafter(kind, cached, draft_dir), 4)
        assert hit.stats.cached_prompt_tokens == shared // BLOCK * BLOCK, name
        assert hit.token_ids == generate(cold, prompt, N).token_ids == hf_greedy(prompt, N), name
    again = generate(cached, base, N, drafter(kind, cached, draft_dir), 4)  # the whole prompt and its reply
    assert again.stats.cached_prompt_tokens == (len(base) - 1) // BLOCK * BLOCK
    assert again.token_ids == hf_greedy(base, N)


def test_a_finished_generation_caches_its_whole_history(pair):
    """A conversation's next turn resends prompt + reply + its own tokens: when the history ends on a block
    boundary, its last block is cached too (the pending token is committed once the generation is over)."""
    target_dir, _ = pair
    cached, cold = fresh(target_dir), fresh(target_dir, block=None)
    prompt = ids(40, seed=6)
    history = prompt + generate(cached, prompt, N).token_ids
    assert len(history) % BLOCK == 0
    turn = history + ids(5, seed=7)
    hit = generate(cached, turn, N)
    assert hit.stats.cached_prompt_tokens == len(history)
    assert hit.token_ids == generate(cold, turn, N).token_ids


def test_sampled_with_hits_equals_cold_runs_seed_for_seed(pair):
    target_dir, draft_dir = pair
    cached, cold = fresh(target_dir), fresh(target_dir, block=None)
    prompt = ids(37, seed=8)
    for seed in (1, 2):
        sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
        want = generate(cold, prompt, N, ModelDrafter(fresh(draft_dir, block=None), sampling), 4, sampling).token_ids
        for _ in range(2):  # a miss that fills the cache, then a hit
            got = generate(cached, prompt, N, ModelDrafter(fresh(draft_dir), sampling), 4, sampling)
            assert got.token_ids == want
        assert got.stats.cached_prompt_tokens == 32


def test_speculation_costs_no_cached_tokens(pair):
    """The same requests hit exactly as many cached tokens with each drafter as with speculation off."""
    target_dir, draft_dir = pair
    prompts = [ids(30, seed=9), ids(30, seed=9)[:20] + ids(15, seed=10), ids(30, seed=9) + ids(9, seed=11)]
    counts = {}
    for kind in ("none", "draft", "ngram"):
        target = fresh(target_dir)
        counts[kind] = [generate(target, p, N, drafter(kind, target, draft_dir), 4).stats.cached_prompt_tokens
                        for p in prompts]
    assert counts["none"] == counts["draft"] == counts["ngram"] == [0, 16, 24]


def test_a_full_budget_evicts_leaves_and_outputs_stay_exact(pair):
    """A budget of a few entries: every publish evicts; sessions copying entries while others evict them still
    generate the cold tokens, and no entry is left whose parent went."""
    target_dir, _ = pair
    probe = fresh(target_dir)
    TargetSession(probe, ids(BLOCK + 1, seed=0))
    entry_bytes = probe.prefix_cache.bytes
    cached, cold = fresh(target_dir, max_bytes=6 * entry_bytes), fresh(target_dir, block=None)
    system = ids(4 * BLOCK, seed=12)
    prompts = [system + ids(12 + i, seed=100 + i) for i in range(8)]
    want = [generate(cold, p, N).token_ids for p in prompts]
    with ThreadPoolExecutor(4) as workers:
        got = list(workers.map(lambda p: generate(cached, p, N).token_ids, prompts + prompts))
    assert got == want + want
    cache = cached.prefix_cache
    assert cache.stats.evictions > 0 and cache.bytes <= 6 * entry_bytes
    assert all(e.parent is None or e.parent.alive for e in cache.entries.values())
    assert_entries_are_cold_heads(cache, cached)


def test_an_entry_evicted_while_its_copy_runs_changes_nothing(pair):
    target_dir, _ = pair
    cached, cold = fresh(target_dir), fresh(target_dir, block=None)
    prompt = ids(30, seed=13)
    TargetSession(cached, prompt)
    session = TargetSession(cached, prompt)
    assert session.cached_tokens == 24
    cached.prefix_cache.clear()
    for i in range(N // 4):
        session.verify(f"r{i}", [])
        session.commit(f"r{i}", 0)
    assert session.generated == generate(cold, prompt, N // 4).token_ids


def test_a_state_pool_pays_entries_and_evicts_them_before_refusing_a_session(pair):
    """Entries take the K/V budget sessions leave; a session that needs it gets it back, and a session is
    refused only when the sessions alone fill the budget."""
    target_dir, _ = pair
    model = load_model(target_dir).fuse()
    per_session = model.config.state_spec.bytes(model.dtype, 256)
    pool = state_pool.StatePool(model.config.state_spec, 3 * per_session, max_slots=2)
    state_pool.attach(model, pool)
    cache = prefix_cache.attach(model, BLOCK)
    assert pool.reclaim == cache.reclaim
    kept = [TargetSession(model, ids(200, seed=s)) for s in (14, 15)]  # fill the cache from K/V the budget has
    assert cache.bytes > 0 and pool.kv_used > sum(s.state.attn[0].k.shape[1] for s in kept) * pool.kv_per_position
    del kept
    filled = cache.bytes
    sessions = [TargetSession(model, ids(200, seed=16)), TargetSession(model, ids(200, seed=17))]
    assert cache.stats.evictions > 0 and cache.bytes < filled + 1
    with pytest.raises(ResourceExhausted):
        TargetSession(model, ids(20, seed=18))  # both slots taken: no eviction makes a third
    assert len(sessions) == 2


def test_extend_resumes_from_the_head_and_equals_one_prompt(pair):
    """A session continued with a user's next turn prefills only the new tokens and then generates what a
    session opened on the whole history generates."""
    target_dir, _ = pair
    cached, cold = fresh(target_dir), fresh(target_dir, block=None)
    session = TargetSession(cached, ids(20, seed=19))
    for i in range(5):
        session.verify(f"r{i}", [])
        session.commit(f"r{i}", 0)
    turn = ids(11, seed=20)
    prefilled = cached.prefix_cache.stats.prefilled_tokens
    assert session.extend(turn) == 6
    assert cached.prefix_cache.stats.prefilled_tokens == prefilled  # no lookup: the head stays
    for i in range(N):
        rnd = session.verify(f"s{i}", [])
        session.commit(f"s{i}", 0)
        assert rnd.verdict.accepted == 0
    history = session.tokens[:20 + 5 + len(turn)]
    assert session.tokens[len(history):] == generate(cold, history, N).token_ids
    resumed = TargetSession(cached, history)  # the session lost: its history hits what it cached
    assert resumed.cached_tokens == (len(history) - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("kind", ["none", "draft", "mtp"])
def test_sparse_states_resume_at_the_deepest_state_and_branch_points_get_one(pair, hf_greedy, kind):
    """Blocks of 8, a recurrent state every 4 blocks (32 positions), at leaves and at branch points. A second prompt
    diverging off the grid (after 40 positions) resumes at 32 and leaves a state where it branched; a third
    diverging there resumes at 40; a resent history resumes at its leaf. Every output equals the cold run and
    HF's; every entry equals a cold prefill; only grid blocks, leaves and branch points hold a state."""
    target_dir, draft_dir = pair
    cached, cold = fresh(target_dir, keep_hidden=kind == "mtp", state_every=4), fresh(target_dir, block=None)
    cache = cached.prefix_cache
    base = ids(60, seed=23)
    first = generate(cached, base, N, drafter(kind, cached, draft_dir), 4)
    assert first.token_ids == generate(cold, base, N).token_ids == hf_greedy(base, N)
    for seed, resumed_at in ((24, 32), (25, 40)):
        prompt = base[:40] + ids(10, seed=seed)
        hit = generate(cached, prompt, N, drafter(kind, cached, draft_dir), 4)
        assert hit.stats.cached_prompt_tokens == resumed_at
        assert hit.token_ids == generate(cold, prompt, N).token_ids == hf_greedy(prompt, N)
    history = base + first.token_ids
    again = generate(cached, history + ids(3, seed=26), N, drafter(kind, cached, draft_dir), 4)
    assert again.stats.cached_prompt_tokens == len(history) // BLOCK * BLOCK
    assert again.token_ids == generate(cold, history + ids(3, seed=26), N).token_ids
    for entry in cache.entries.values():
        wanted = entry.end % 32 == 0 or entry.children != 1
        assert (entry.state is not None) == wanted, (entry.end, entry.children)
    assert cache.states() < len(cache.entries)
    assert cache.bytes == sum(e.nbytes for e in cache.entries.values()) == cache.budget.used
    assert_entries_are_cold_heads(cache, cached)


def test_sparse_states_under_eviction_leave_no_leaf_without_a_state(pair):
    """A tight budget with sparse states: evicting a leaf takes the stateless blocks above it with it (nothing can
    resume from them), outputs stay exact, and the bytes add up."""
    target_dir, _ = pair
    probe = fresh(target_dir)
    TargetSession(probe, ids(BLOCK + 1, seed=0))
    entry_bytes = probe.prefix_cache.bytes
    cached, cold = fresh(target_dir, max_bytes=8 * entry_bytes, state_every=3), fresh(target_dir, block=None)
    system = ids(5 * BLOCK + 3, seed=27)
    prompts = [system[:BLOCK * (1 + i % 5)] + ids(20 + i, seed=200 + i) for i in range(10)]
    want = [generate(cold, p, N).token_ids for p in prompts]
    with ThreadPoolExecutor(3) as workers:
        got = list(workers.map(lambda p: generate(cached, p, N).token_ids, prompts + prompts[::-1]))
    assert got == want + want[::-1]
    cache = cached.prefix_cache
    assert cache.stats.evictions > 0 and cache.bytes <= 8 * entry_bytes
    assert cache.bytes == sum(e.nbytes for e in cache.entries.values()) == cache.budget.used
    assert all(e.state is not None for e in cache.entries.values() if not e.children)
    assert all(e.parent is None or e.parent.alive for e in cache.entries.values())
    assert_entries_are_cold_heads(cache, cached)


def test_bad_block_sizes_and_budgets_are_refused():
    with pytest.raises(ValueError, match="block size"):
        PrefixCache(0, ByteBudget(1))
    with pytest.raises(ValueError, match="recurrent state every 1 or more blocks"):
        PrefixCache(4, ByteBudget(1), state_every=0)
    model = random_model(hf_config(), seed=1)
    prefix_cache.attach(model, 4)
    with pytest.raises(ValueError, match="already"):
        prefix_cache.attach(model, 4)
