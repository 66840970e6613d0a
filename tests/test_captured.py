"""Captured passes (`deltaspec.shared.model.captured`) against the fused path, on the CPU.

There are no CUDA graphs on the CPU: a captured model fills the same static inputs (tokens, first position, first log
slot) and runs the same static pass over the state's buffers that a graph records on a GPU, so what is checked here
is everything around the graph: which passes it covers, the key a recorded pass is kept under (token count and the
buffers it reads and writes, which a commit swaps), the static inputs, and that every pass, staging and head equals
the eager fused path's. `tests/test_cuda.py` runs the graphs themselves on a GPU.
"""
import copy

import pytest
import torch

from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.checkpoint import hf_config, hf_moe_config, random_model
from test_compiled import TARGET, run_plan


@pytest.fixture(scope="module")
def models():
    eager = random_model(TARGET, seed=31).fuse()
    return eager, copy.deepcopy(eager).capture(max_tokens=9)


def test_every_pass_and_commit_matches_the_fused_path(models):
    eager, captured = models
    gen = torch.Generator().manual_seed(7)
    ref, state = eager.new_state(capacity=64), captured.new_state(capacity=64)
    # (tokens, then a pass on top or None, what to keep): 20 tokens are more than the graphs take (eager); 57 tokens
    # in, 9 more need the K/V to grow first (eager), and the next pass is on new buffers
    plan = [(20, None, 20), (1, None, 1), (1, 1, 2), (5, None, 2), (1, None, 0), (9, None, 9), (3, 2, 4),
            (2, 3, None), (1, 1, 1), (6, None, 6), (4, 1, 3), (9, None, 9), (9, None, 9), (2, None, 2)]
    covered = []
    run_plan(plan, (eager, ref), (captured, state), gen, lambda n: covered.append(captured.captured.fits(state, n)))
    assert covered[0] is False and covered[-2] is False and covered.count(False) == 2
    # one recorded pass per token count and buffer set: the commits alternate two sets, a pass on top of a staging
    # reads another, the grown K/V is new
    assert len(captured.captured.passes) == captured.captured.recorded < sum(covered)


def test_the_key_follows_the_buffers_a_pass_touches(models):
    _, captured = models
    cap = captured.captured
    state = captured.new_state(capacity=32)
    from_head = cap.key(state, 3)
    assert cap.key(state, 1)[1:] == from_head[1:]  # the token count is part of the key
    captured(torch.arange(3), state)
    on_top = cap.key(state, 3)
    assert on_top != from_head  # on top of a staging the pass reads the staged window and state
    state.commit(3)  # the committed and staged buffers swap
    swapped = cap.key(state, 3)
    assert swapped not in (from_head, on_top)
    captured(torch.arange(2), state), state.commit(2)  # swapped back
    assert cap.key(state, 3) == from_head
    assert cap.key(captured.new_state(capacity=32), 3) != from_head  # another sequence's buffers


def test_speculative_decoding_with_captured_models_equals_target_only(models):
    eager, captured = models
    draft = random_model(hf_config(vocab_size=eager.config.vocab_size,
                                   layer_types=["linear_attention", "full_attention"]), seed=32).fuse().capture()
    prompt = torch.randint(0, eager.config.vocab_size, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    want = generate(eager, prompt, 30).token_ids
    assert generate(captured, prompt, 30).token_ids == want
    assert generate(captured, prompt, 30, ModelDrafter(draft), 4).token_ids == want


def test_a_moe_target_matches_the_fused_path():
    """A sparse MoE target's static pass (on a GPU recorded with its experts as grouped matmuls; here their loop) over
    the same plan of decodes, verifies and commits, and speculative output equal to target-only."""
    eager = random_model(hf_moe_config("qwen3_next", num_experts=6, num_experts_per_tok=2), seed=33).fuse()
    captured = copy.deepcopy(eager).capture(max_tokens=9)
    gen = torch.Generator().manual_seed(8)
    run_plan([(20, None, 20), (1, None, 1), (5, None, 2), (3, 2, None), (9, None, 9), (4, 1, 3)],
             (eager, eager.new_state(capacity=64)), (captured, captured.new_state(capacity=64)), gen)
    assert captured.captured.recorded > 0
    draft = random_model(hf_config(vocab_size=eager.config.vocab_size,
                                   layer_types=["linear_attention", "full_attention"]), seed=34).fuse()
    prompt = torch.randint(0, eager.config.vocab_size, (12,), generator=gen).tolist()
    assert generate(captured, prompt, 24, ModelDrafter(draft), 3).token_ids == generate(eager, prompt, 24).token_ids


def test_what_capture_refuses():
    with pytest.raises(ValueError, match="fused path"):
        random_model(hf_config(), seed=1).fuse(False).capture()
    with pytest.raises(ValueError, match="max_tokens"):
        random_model(hf_config(), seed=1).fuse().capture(max_tokens=0)
    assert random_model(hf_config(), seed=1).fuse().capture().fuse(False).captured is None


def test_pooled_sessions_one_after_another(models):
    """Sessions in a state pool's slots, one after another as a server runs them (the pool's forward hook reserving
    each pass's positions first): every generation equals the eager one, and a later session's passes reuse what an
    earlier one's recorded wherever its buffers sit where that one's did (the pool's GDN slots never move)."""
    from deltaspec.shared.state.pool import StatePool, attach

    eager, _ = models
    pooled = copy.deepcopy(eager).capture()
    attach(pooled, StatePool(pooled.config.state_spec, 64 * 2**20, max_slots=2))
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        prompt = torch.randint(0, eager.config.vocab_size, (7,), generator=gen).tolist()
        assert generate(pooled, prompt, 12).token_ids == generate(eager, prompt, 12).token_ids
    assert 0 < pooled.captured.recorded < 3 * 12
