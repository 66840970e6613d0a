"""LFM2's short conv (`mixers.short_conv`) against HF's `Lfm2ShortConv` as the oracle, and its state (kind `conv`: a
window and zero heads) through every operation of the state floor the family tests do not reach: mark, truncate and
commit_marked, a state pool's slots, a prefix cache's heads inside a prefill, and a padded batch's windows."""
from __future__ import annotations

import pytest
import torch
from transformers.models.lfm2.configuration_lfm2 import Lfm2Config
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

from deltaspec.shared.decoding.target import TargetSession
from deltaspec.shared.model.batched import forward_batch
from deltaspec.shared.model.checkpoint import random_model, save_checkpoint
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.mixers.short_conv import ShortConv, inputs, recurrence
from deltaspec.shared.state import pool as state_pool
from deltaspec.shared.state import prefix_cache
from deltaspec.shared.state.rollback import ModelState, RecurrentSlot
from deltaspec.shared.state.spec import RecurrentSpec, StateSpec
from deltaspec.shared.state.steps import Start

HIDDEN, T = 24, 9
LFM2 = {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 61, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "conv_L_cache": 4, "conv_bias": True, "layer_types": ["conv", "full_attention", "conv", "conv"]}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@torch.no_grad()
@pytest.mark.parametrize("kernel,bias", [(2, False), (3, True), (5, True)])
def test_reference_and_fast_path_match_hf(kernel, bias):
    hf = Lfm2ShortConv(Lfm2Config(hidden_size=HIDDEN, conv_L_cache=kernel, conv_bias=bias, num_hidden_layers=1,
                                  layer_types=["conv"]), 0).eval()
    gen = torch.Generator().manual_seed(kernel)
    for p in hf.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    ours = ShortConv(HIDDEN, kernel, bias)
    ours.load_state_dict(hf.state_dict())
    h = torch.randn(T, HIDDEN, generator=gen)
    want = hf(h[None])[0]
    spec = RecurrentSpec("conv", conv_dim=HIDDEN, conv_width=kernel, heads=0, key_dim=0, value_dim=0)
    state = ModelState(StateSpec(("recurrent",), spec, 1, 1))
    assert rel(ours(h, RecurrentSlot(state.recurrent, 0, 0)), want) < 1e-6  # the reference, staging its window
    Bx, C = inputs(ours, h)
    assert torch.equal(state.recurrent.window[0], Bx[-(kernel - 1):])
    full = torch.cat([torch.zeros(kernel - 1, HIDDEN), Bx])
    for split in (T, 1, 4):  # the fast path, in pieces, carrying the window as the state access does
        ys = []
        for start in range(0, T, split):
            piece = full[start:start + kernel - 1 + min(split, T - start)]
            step = recurrence(ours, piece[None], (), Start(torch.zeros(1, 0, 0, 0)))
            assert step.k.shape == (1, piece.shape[0] - kernel + 1, 0, 0) and step.g.shape[-1] == 0
            ys.append(step.out[0])
        assert rel(ours.out_proj(C * torch.cat(ys)), want) < 1e-6


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return save_checkpoint(random_model(LFM2, seed=5), tmp_path_factory.mktemp("lfm2"))


def cold(model, tokens: list[int]) -> ModelState:
    state = model.new_state()
    model(torch.tensor(tokens), state)
    state.commit(len(tokens))
    return state


@torch.no_grad()
def test_mark_truncate_and_commit_marked_keep_the_right_window(lfm2):
    model = load_model(lfm2)
    tokens = torch.randint(0, 61, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    state = cold(model, tokens[:4])
    model(torch.tensor(tokens[4:12]), state)  # 8 staged
    state.mark(2)  # from the logs
    state.truncate(6)
    state.commit_marked()  # head after 6 tokens, 4 staged
    state.commit(3)  # head after 9
    for head in (9, 10):
        want = cold(model, tokens[:head + 1])
        got = model(torch.tensor(tokens[head:head + 1]), state)[0]
        state.commit(1)
        assert rel(state.recurrent.conv, want.recurrent.conv) < 1e-6  # B x of 8 rows and of 11 may round apart
        assert rel(got[0], model(torch.tensor(tokens[:head + 1]), model.new_state())[0][-1]) < 1e-5


@torch.no_grad()
def test_padded_batch_keeps_each_window_from_its_own_tokens(lfm2):
    """Sequences of 4, 1 and 2 tokens in one batch: the short ones are padded with copies of their last row, and
    neither those nor a neighbour's rows reach a window (the next token of each equals the one alone)."""
    model = load_model(lfm2)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 61, (n,), generator=gen).tolist() for n in (3, 6, 5)]
    states = [cold(model, p) for p in prompts]
    news = [torch.randint(0, 61, (n,), generator=gen) for n in (4, 1, 2)]
    forward_batch(model, list(zip(news, states)))
    for prompt, new, state in zip(prompts, news, states):
        state.commit(len(new))
        want = cold(model, prompt + new.tolist())
        assert rel(state.recurrent.conv, want.recurrent.conv) < 1e-6


@torch.no_grad()
def test_pool_slots_and_prefix_cache_heads(lfm2):
    """Zero-head buffers in a state pool's slots, and the heads a prefix cache takes inside a 43-token prefill (the
    commit algebra per block, on empty states): each equals a cold prefill's."""
    model = load_model(lfm2)
    state_pool.attach(model, state_pool.StatePool(model.config.state_spec, 2**24))
    prefix_cache.attach(model, 5)
    prompt = torch.randint(0, 61, (44,), generator=torch.Generator().manual_seed(8)).tolist()
    TargetSession(model, prompt)
    cache = model.prefix_cache
    assert len(cache.entries) == 43 // 5
    plain = load_model(lfm2)
    for entry in cache.entries.values():
        assert rel(entry.window, cold(plain, prompt[:entry.end]).recurrent.conv) < 1e-6
