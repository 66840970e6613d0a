"""Versioned state: after every round the committed head equals a sequential run over the committed tokens.

The reference run feeds the committed tokens one at a time through the naive float32 kernel.
Plans of (k, a) rounds come from hypothesis and include zero-draft rounds, accept counts at and
beyond the conv window (K-1 = 3), full acceptance with the bonus token, and reverted rounds.

Two tolerances, for two different claims:
- rollback itself (one GDN layer, identical inputs): max abs diff <= 1e-5;
- the whole model: a multi-token verify pass and a one-token-at-a-time run differ by float32
  rounding of batched matmuls (~1e-6 per layer, grown by depth), so the head is compared with
  a relative tolerance of 1e-4 of each tensor's scale. A rollback error is O(1), far above both.
"""
import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.decoding.target import TargetSession
from deltaspec.shared.errors import FailedPrecondition, InvalidArgument, NotFound
from deltaspec.shared.model.checkpoint import hf_config, random_model
from deltaspec.shared.state.rollback import RecurrentSlot, ModelState
from deltaspec.shared.state.spec import CHAIN_LOG_CAPACITY

TOL = 1e-5  # rollback of one layer on identical inputs
MODEL_RTOL = 1e-4  # whole model: verify pass vs one-token run
PROMPT = [5, 17, 200, 3, 99, 42, 7]
MODEL = random_model(hf_config(), seed=11)
REFERENCE = copy.deepcopy(MODEL)
REFERENCE.set_gdn_kernel("naive")
CONTINUATION = generate(MODEL, PROMPT, 120).token_ids


def sequential_state(model, tokens, state: ModelState | None = None) -> ModelState:
    """Feed `tokens` one at a time (after what `state` already holds) and commit each."""
    state = state or model.new_state()
    for t in tokens:
        model(torch.tensor([t]), state)
        state.commit(1)
    return state


def assert_same_head(state: ModelState, ref: ModelState) -> None:
    assert state.length == ref.length and state.staged == 0
    assert state.recurrent.state.dtype == torch.float32
    n = state.length
    pairs = [("recurrent", state.recurrent.state, ref.recurrent.state), ("conv window", state.recurrent.conv, ref.recurrent.conv)]
    for i, (a, b) in enumerate(zip(state.attn, ref.attn)):
        pairs += [(f"attention {i} keys", a.k[:, :n], b.k[:, :n]), (f"attention {i} values", a.v[:, :n], b.v[:, :n])]
    for name, x, y in pairs:
        for layer, (xl, yl) in enumerate(zip(x, y)):
            assert (xl - yl).abs().max() <= MODEL_RTOL * yl.abs().max().clamp_min(1e-3), f"{name}, layer {layer}"


@settings(max_examples=30, deadline=None)
@given(plan=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=8),
       seed=st.integers(0, 2**16))
def test_gdn_layer_rollback_is_exact(plan, seed):
    """One GDN layer on identical inputs: staged + committed state equals the naive sequential state."""
    layer, ref_layer = MODEL.model.layers[0].linear_attn, REFERENCE.model.layers[0].linear_attn
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(sum(k for k, _ in plan) + len(plan), MODEL.config.hidden_size, generator=gen)
    state, ref = MODEL.new_state(), REFERENCE.new_state()
    pos = 0
    for k, a in plan:
        a = min(a, k)
        with torch.inference_mode():
            layer(xs[pos : pos + k + 1], RecurrentSlot(state.recurrent, 0, 0))  # verify pass: k+1 tokens staged at once
            state.staged = k + 1
            state.commit(a + 1)
            for t in range(pos, pos + a + 1):  # reference: the kept tokens one by one, naive kernel
                ref_layer(xs[t : t + 1], RecurrentSlot(ref.recurrent, 0, 0))
                ref.staged = 1
                ref.commit(1)
        pos += k + 1
        assert (state.recurrent.state[0] - ref.recurrent.state[0]).abs().max() <= TOL
        assert (state.recurrent.conv[0] - ref.recurrent.conv[0]).abs().max() <= TOL


def drafts_for(session: TargetSession, k: int, a: int) -> list[int]:
    """k drafts whose first a are the target's own greedy tokens and the rest wrong."""
    pos = len(session.generated)
    right = CONTINUATION[pos : pos + a]
    return right + [(CONTINUATION[pos + i] + 1) % 257 for i in range(len(right), k)]


rounds = st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8), st.booleans()), min_size=1, max_size=10)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=rounds)
def test_head_equals_sequential_run_after_every_round(plan):
    session = TargetSession(MODEL, PROMPT)
    ref = sequential_state(REFERENCE, PROMPT[:-1])
    assert_same_head(session.state, ref)  # first round after prefill
    for i, (k, a, revert_first) in enumerate(plan):
        a = min(a, k)
        drafts = drafts_for(session, k, a)
        if revert_first:  # a verified-then-reverted round leaves no trace
            session.verify(f"x{i}", drafts, session.version)
            session.revert(f"x{i}")
        rnd = session.verify(f"r{i}", drafts, session.version)
        assert rnd.verdict.accepted == a
        session.commit(f"r{i}", a)
        sequential_state(REFERENCE, session.tokens[ref.length : -1], ref)
        assert_same_head(session.state, ref)
    assert session.generated == CONTINUATION[: len(session.generated)]


@pytest.mark.parametrize("accepted", [0, 1, 3, 4, 7, 8], ids=lambda a: f"a{a}")
def test_partial_commit_after_full_verify(accepted):
    """The caller may keep fewer tokens than the verdict allowed (e.g. at max_new_tokens)."""
    session = TargetSession(MODEL, PROMPT)
    rnd = session.verify("r", drafts_for(session, 8, 8), 0)
    assert rnd.verdict.accepted == 8
    session.commit("r", accepted)
    assert session.generated == CONTINUATION[: accepted + 1]
    assert_same_head(session.state, sequential_state(REFERENCE, session.tokens[:-1]))


def snapshot(session: TargetSession):
    gdn = session.state.recurrent
    return session.version, list(session.tokens), session.state.length, gdn.conv.clone(), gdn.state.clone()


def assert_unchanged(session, snap):
    version, tokens, length, conv, recurrent = snap
    assert (session.version, session.tokens, session.state.length) == (version, tokens, length)
    assert torch.equal(session.state.recurrent.conv, conv) and torch.equal(session.state.recurrent.state, recurrent)


def test_retries_never_advance_twice_and_refusals_change_nothing():
    session = TargetSession(MODEL, PROMPT)
    drafts = drafts_for(session, 5, 2)
    first = session.verify("r1", drafts, 0)
    assert session.verify("r1", drafts, 0) is first  # same input: same answer
    with pytest.raises(FailedPrecondition):
        session.verify("r1", drafts[:-1], 0)  # same id, other input
    with pytest.raises(FailedPrecondition):
        session.verify("r2", drafts, 0)  # one pending round at a time
    with pytest.raises(InvalidArgument):
        session.commit("r1", 3)  # above what was verified
    with pytest.raises(NotFound):
        session.commit("nope", 0)
    v1 = session.commit("r1", 2)
    snap = snapshot(session)
    assert session.commit("r1", 2) == v1  # retry: same version, no second advance
    with pytest.raises(FailedPrecondition):
        session.commit("r1", 1)
    with pytest.raises(FailedPrecondition):
        session.verify("r2", drafts_for(session, 3, 1), base_version=0)  # stale base
    with pytest.raises(InvalidArgument):
        session.verify("r2", [1, 2, 999], v1)  # out of vocabulary
    with pytest.raises(InvalidArgument):
        session.verify("r2", [1] * 17, v1)  # over the draft limit
    assert_unchanged(session, snap)
    assert_same_head(session.state, sequential_state(REFERENCE, session.tokens[:-1]))


def test_draft_model_rolls_back_exactly():
    """The draft is a hybrid model too: its head must equal a sequential run over what it consumed."""
    draft = random_model(hf_config(hidden_size=32, intermediate_size=64, layer_types=[
        "linear_attention", "full_attention"]), seed=4)
    draft_ref = copy.deepcopy(draft)
    draft_ref.set_gdn_kernel("naive")
    drafter = ModelDrafter(draft)
    drafter.start(PROMPT)
    history = list(PROMPT)
    for i, (k, a) in enumerate([(4, 0), (0, 0), (6, 6), (3, 1), (8, 5), (2, 2), (5, 4)]):
        proposal = drafter.propose(k)
        a = min(a, len(proposal.tokens))
        nxt = (proposal.tokens[a] + 1) % 257 if a < len(proposal.tokens) else 13 + i
        history += proposal.tokens[:a] + [nxt]
        drafter.advance(a, nxt)
        consumed = history[: len(history) - len(drafter.pending)]
        assert drafter.pending == history[len(consumed):]
        assert_same_head(drafter.state, sequential_state(draft_ref, consumed))


def staged_state(tokens: list[int], n: int | None = None) -> ModelState:
    """The committed prompt, then `tokens` staged in passes of 3 (a mark after the first n when given)."""
    state = sequential_state(MODEL, PROMPT, MODEL.new_state(log_capacity=CHAIN_LOG_CAPACITY))
    for i in range(0, len(tokens), 3):
        if n is not None and i == n:
            state.mark()
        MODEL(torch.tensor(tokens[i:i + 3]), state)
    return state


def assert_same_staging(state: ModelState, want: ModelState) -> None:
    """Same staged window and state after everything staged (what the next pass starts from)."""
    assert state.staged == want.staged
    for got, ref in ((state.recurrent.window, want.recurrent.window), (state.recurrent.spare, want.recurrent.spare)):
        assert (got - ref).abs().max() <= MODEL_RTOL * ref.abs().max(), (got - ref).abs().max()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 9, 15], ids=lambda n: f"n{n}")
def test_mark_and_truncate_anywhere_from_the_logs(n):
    """Three rounds' worth of staged tokens (more than a target logs): `mark(n)` computed from the logs equals a
    snapshot taken after n tokens, `truncate(n)` equals staging only n, and the tokens after a mark stay staged
    through `commit_marked`: the head and the staging then equal a run that committed n tokens."""
    tokens = CONTINUATION[:45]
    assert len(tokens) > 36
    late, early = staged_state(tokens), staged_state(tokens[:n])
    late.mark(n)
    assert late.marked == n and late.staged == len(tokens)
    for got, ref in ((late.recurrent.marked_window, early.recurrent.window), (late.recurrent.marked_state, early.recurrent.spare)):
        assert (got - ref).abs().max() <= MODEL_RTOL * ref.abs().max()
    late.commit_marked()  # the first n tokens become the head, the rest stays staged
    want = sequential_state(REFERENCE, PROMPT + tokens[:n])
    assert late.length == want.length
    for got, ref in ((late.recurrent.conv, want.recurrent.conv), (late.recurrent.state, want.recurrent.state)):
        assert (got - ref).abs().max() <= MODEL_RTOL * ref.abs().max()
    rest = staged_state(tokens)
    rest.commit(n)
    MODEL(torch.tensor(tokens[n:]), rest)
    assert_same_staging(late, rest)
    cut = staged_state(tokens, n=3)
    cut.truncate(n + 3)  # keeps the mark at 3 (within what stays)
    assert cut.marked == 3
    assert_same_staging(cut, staged_state(tokens[:n + 3]))
    cut.truncate(3)  # back to the mark: a pointer swap
    assert cut.marked == 0
    assert_same_staging(cut, staged_state(tokens[:3]))
    with pytest.raises(ValueError):
        cut.mark(4)


def test_bf16_weights_keep_float32_state_and_exact_speculation():
    model = random_model(hf_config(), seed=11).to(torch.bfloat16)
    session = TargetSession(model, PROMPT)
    assert session.state.recurrent.state.dtype == torch.float32 and session.state.recurrent.conv.dtype == torch.bfloat16
    want = generate(model, PROMPT, 16).token_ids
    assert generate(model, PROMPT, 16, ModelDrafter(model), 5).token_ids == want
