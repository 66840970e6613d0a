"""The fused path (`deltaspec.shared.model.fused`) against the layer path, the truth it replaces.

Random weights and random token ids (never zeros), awkward sizes on purpose: value heads != key
heads, d_k != d_v, a rotary share of one half, attention first, untied embeddings. Every forward
of a session (prefill, one-token decode, multi-token verify, partial and zero commits, reverts)
must give the same logits and hidden states, and every commit the same head, within float32
rounding of differently grouped matmuls (relative 5e-5 of each tensor's scale: the grouping's error depends on
the BLAS kernels of the host, at most 1.7e-5 on this AMD EPYC host with MKL, under 1e-5 on the hosts CI ran on before).
"""
import copy

import pytest
import torch

from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.checkpoint import hf_config, random_model

RTOL = 5e-5
AWKWARD = hf_config(
    vocab_size=301, hidden_size=72, intermediate_size=100, num_attention_heads=6, num_key_value_heads=2, head_dim=20,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=12, linear_value_head_dim=20,
    layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
CONFIGS = {"awkward-ratio3-attn_first-untied": AWKWARD, "default-ratio2-gdn_first-tied": hf_config()}


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= RTOL * want.abs().max().clamp_min(1e-3))


def assert_same_head(state, ref) -> None:
    assert (state.length, state.staged) == (ref.length, ref.staged)
    n = state.length
    pairs = [(state.recurrent.state, ref.recurrent.state), (state.recurrent.conv, ref.recurrent.conv)]
    pairs += [(a.k[:, :n], b.k[:, :n]) for a, b in zip(state.attn, ref.attn)]
    pairs += [(a.v[:, :n], b.v[:, :n]) for a, b in zip(state.attn, ref.attn)]
    for got, want in pairs:
        assert close(got, want)


@pytest.fixture(params=list(CONFIGS), ids=list(CONFIGS))
def pair(request):
    layers = random_model(CONFIGS[request.param], seed=len(request.param))
    return layers, copy.deepcopy(layers).fuse()


def test_fuse_keeps_the_checkpoint(pair):
    layers, fused = pair
    want, got = layers.state_dict(), fused.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    layer = fused.model.layers[0]
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == fused.fused.layers[0].mlp.w_in.untyped_storage().data_ptr()


def test_every_forward_and_commit_matches_the_layer_path(pair):
    """Prefill (one and two chunks), decode (T = 1), verify (T = 2..9): partial, full and zero commits, reverts."""
    layers, fused = pair
    gen = torch.Generator().manual_seed(7)
    vocab = layers.config.vocab_size
    ref, state = layers.new_state(capacity=8), fused.new_state(capacity=8)  # small: the KV buffers grow
    plan = [(70, 70), (1, 1), (1, 1), (5, 2), (1, 0), (9, 9), (1, 1), (3, 1), (4, None), (2, 1), (1, 1), (6, 4),
            (37, 37), (5, 3)]  # 70: two chunks; 37: one
    for T, keep in plan:
        ids = torch.randint(0, vocab, (T,), generator=gen)
        want_logits, want_hidden = layers(ids, ref)
        got_logits, got_hidden = fused(ids, state)
        assert close(got_logits, want_logits) and close(got_hidden, want_hidden), f"forward of {T} tokens"
        if keep is None:
            ref.revert(), state.revert()
        else:
            ref.commit(keep), state.commit(keep)
        assert_same_head(state, ref)


def test_staged_logs_match(pair):
    """What a verify pass logs for rollback (pre-conv inputs, keys, corrections, decays) is the same."""
    layers, fused = pair
    ids = torch.randint(0, layers.config.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    ref, state = layers.new_state(), fused.new_state()
    layers(ids, ref), fused(ids, state)
    for name in ("x", "k", "delta", "g", "window", "spare"):
        assert close(getattr(state.recurrent, name), getattr(ref.recurrent, name)), name


def test_speculative_generation_matches_the_layer_path():
    target = random_model(AWKWARD, seed=5)
    draft = random_model(hf_config(vocab_size=301, layer_types=["linear_attention", "full_attention"]), seed=6)
    prompt = torch.randint(0, 301, (11,), generator=torch.Generator().manual_seed(9)).tolist()
    want = generate(target, prompt, 40, ModelDrafter(draft), 4).token_ids
    target.fuse(), draft.fuse()
    assert generate(target, prompt, 40, ModelDrafter(draft), 4).token_ids == want
    assert generate(target, prompt, 40).token_ids == want


def test_bfloat16_weights_take_the_same_path():
    """bf16 weights: the delta rule still runs in float32 on both paths; logits agree to bf16 rounding."""
    layers = random_model(AWKWARD, seed=8).to(torch.bfloat16)
    fused = copy.deepcopy(layers).fuse()
    ids = torch.randint(0, 301, (9,), generator=torch.Generator().manual_seed(4))
    ref, state = layers.new_state(), fused.new_state()
    for chunk in (ids[:6], ids[6:7], ids[7:]):
        want, _ = layers(chunk, ref)
        got, _ = fused(chunk, state)
        assert (got - want).norm() / want.norm() < 3e-2
        ref.commit(len(chunk)), state.commit(len(chunk))
    assert state.recurrent.state.dtype == torch.float32


def test_rope_table_slices_equal_computing_each_pass():
    """`HybridLM.rope` (a table by position, regrown and remade per dtype) gives bit for bit what computing the
    pass's positions gives, for both paths' forms (sin, and sin signed for the fused rotary)."""
    from deltaspec.shared.model.rotary import rotary_cos_sin, rotary_signed

    model = random_model(AWKWARD, seed=3)
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        like = torch.randn(1, 4).to(dtype)
        for start, end in ((0, 1), (5, 14), (1023, 1024), (1020, 1100), (3000, 3001), (17, 18)):
            cos, sin, signed = model.rope(start, end, like)
            want_cos, want_sin = rotary_cos_sin(model.config.rotary_dim, model.config.rope_theta, torch.arange(start, end),
                                                dtype)
            assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
            assert torch.equal(signed, rotary_signed(want_cos, want_sin)[1])
