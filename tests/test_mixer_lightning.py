"""MiniMax's lightning attention (`mixers.lightning`) against HF's `MiniMaxLightningAttention` as the oracle (its
block-wise prefill from an empty state, its one-token steps from a cached one), and its fast path against its
reference on fresh random inputs and states: whole, in pieces, in static form, as a padded batch, and through the
state floor's logs (every prefix's state from the closed-form commit)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.minimax.configuration_minimax import MiniMaxConfig
from transformers.models.minimax.modeling_minimax import MiniMaxCache, MiniMaxLightningAttention

from deltaspec.shared.model.mixers.lightning import LightningAttention, recurrence, slope_rates
from deltaspec.shared.state.access import SequenceAccess
from deltaspec.shared.state.rollback import ModelState, RecurrentSlot
from deltaspec.shared.state.spec import RecurrentSpec, StateSpec
from deltaspec.shared.state.steps import Start
from support import rel_err

HIDDEN = 32
# (heads, head_dim, layer index, layers, HF's block size)
SHAPES = {"h4-d8-first": (4, 8, 0, 3, 8), "h2-d16-middle": (2, 16, 2, 5, 16), "h8-d4-last": (8, 4, 3, 4, 4)}


@pytest.fixture(params=list(SHAPES), ids=list(SHAPES))
def pair(request) -> tuple[MiniMaxLightningAttention, LightningAttention]:
    """HF's layer with random weights, ours loaded from its state dict (strictly, less the buffers HF derives from
    `slope_rate`)."""
    heads, dim, index, layers, block = SHAPES[request.param]
    config = MiniMaxConfig(hidden_size=HIDDEN, num_attention_heads=heads, head_dim=dim, num_hidden_layers=layers,
                           block_size=block)
    hf = MiniMaxLightningAttention(config, index).eval()
    gen = torch.Generator().manual_seed(index)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.ndim > 1 else 0.2) + (p.ndim == 1))
    ours = LightningAttention(HIDDEN, heads, dim).eval()
    ours.load_state_dict({k: v for k, v in hf.state_dict().items() if not k.endswith("_decay")})
    return hf, ours


def new_state(m: LightningAttention, initial: torch.Tensor | None = None) -> ModelState:
    spec = RecurrentSpec("lightning", conv_dim=0, conv_width=1, heads=m.n_heads, key_dim=m.head_dim,
                         value_dim=m.head_dim)
    state = ModelState(StateSpec(("recurrent",), spec, 1, 1))
    if initial is not None:
        state.recurrent.state[0].copy_(initial)
    return state


def reference(m: LightningAttention, x: torch.Tensor, state: ModelState) -> torch.Tensor:
    """The reference pass, staged into `state`; its output."""
    out = m(x, RecurrentSlot(state.recurrent, 0, state.staged))
    state.staged += x.shape[0]
    return out


def fast(m: LightningAttention, x: torch.Tensor, state: ModelState) -> torch.Tensor:
    """The fast path through the eager state access, staged into `state`; its output."""
    out = m.fused(m.fuse(), x, torch.zeros_like(x), None, SequenceAccess(state), 0)
    state.staged += x.shape[0]
    return out


def hidden(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, HIDDEN, generator=torch.Generator().manual_seed(seed))


def random_state(m: LightningAttention, seed: int, *batch: int) -> torch.Tensor:
    return torch.randn(*batch, m.n_heads, m.head_dim, m.head_dim, generator=torch.Generator().manual_seed(seed))


def test_slope_rates_are_hfs_bit_for_bit():
    for heads, index, layers in ((4, 0, 3), (2, 2, 5), (8, 3, 4), (64, 40, 80)):
        config = MiniMaxConfig(hidden_size=8 * heads, num_attention_heads=heads, num_hidden_layers=layers)
        assert torch.equal(slope_rates(heads, index, layers), MiniMaxLightningAttention(config, index).slope_rate)


@torch.no_grad()
def test_prefill_and_cached_steps_match_hf(pair):
    """HF's block-wise prefill (several blocks and a partial one) from an empty state, then its one-token steps from
    the state it cached: ours, reference and fast path, give its outputs and its state."""
    hf, ours = pair
    x = hidden(1, 3 * hf.block_size + 3)
    want, want_state = hf(x[None], None, None)
    for run in (reference, fast):
        state = new_state(ours)
        assert rel_err(run(ours, x, state), want[0]) < 1e-5
        assert rel_err(state.recurrent.spare[0], want_state[0]) < 1e-5
    cache, initial = MiniMaxCache(), random_state(ours, 2)
    cache.set_linear_cache(hf.layer_idx, initial[None].clone())
    x = hidden(3, 5)
    want, want_state = hf(x[None], None, None, cache=cache)
    for run in (reference, fast):
        state = new_state(ours, initial)
        assert rel_err(run(ours, x, state), want[0]) < 1e-5
        assert rel_err(state.recurrent.spare[0], want_state[0]) < 1e-5


@torch.no_grad()
def test_fast_path_matches_reference_whole_and_in_pieces(pair):
    """From a random state: one pass of 70 tokens (two chunks), and the same tokens in pieces of 1, 5 and 64
    carrying the staged state, as the engine's verify and decode passes do."""
    _, m = pair
    x, initial = hidden(4, 70), random_state(m, 4)
    want_state = new_state(m, initial)
    want = reference(m, x, want_state)
    for parts in ([70], [1] * 6 + [64], [5, 1, 64]):
        state, ys = new_state(m, initial), []
        for piece in x.split(parts):
            ys.append(fast(m, piece, state))
        assert rel_err(torch.cat(ys), want) < 1e-5
        assert rel_err(state.recurrent.spare[0], want_state.recurrent.spare[0]) < 1e-5


@torch.no_grad()
def test_static_form_and_padding(pair):
    """The static form (one chunk, or one step) equals the eager one; a batch whose second sequence ends in padding
    gives that sequence's real outputs and state, and padding alone leaves a state as it was, bit for bit."""
    _, m = pair
    f, T = m.fuse(), 9
    qkv = F.silu(F.linear(hidden(5, 2, T), f.w_in)[..., :3 * m.n_heads * m.head_dim])
    initial = random_state(m, 5, 2)
    empty = qkv[..., :0]
    for n in (1, T):
        eager = recurrence(m, f, empty[:, :n], (qkv[:, :n],), Start(initial))
        static = recurrence(m, f, empty[:, :n], (qkv[:, :n],), Start(initial, static=True))
        assert rel_err(static.out, eager.out) < 1e-5 and rel_err(static.final, eager.final) < 1e-5
    valid = torch.ones(2, T, 1)
    valid[1, T - 3:] = 0
    padded = recurrence(m, f, empty, (qkv,), Start(initial, valid=valid))
    for b, n in ((0, T), (1, T - 3)):
        alone = recurrence(m, f, empty[b, :n], (qkv[b, :n],), Start(initial[b]))
        assert rel_err(padded.out[b, :n], alone.out) < 1e-5 and rel_err(padded.final[b], alone.final) < 1e-5
    for static in (False, True):
        nothing = recurrence(m, f, empty[:, :3], (qkv[:, :3],), Start(initial, valid=torch.zeros(2, 3, 1),
                                                                        static=static))
        assert torch.equal(nothing.final, initial)


@torch.no_grad()
def test_logs_rebuild_every_prefix_state(pair):
    """What the pass logs (k = key, d = value, g = -slope) is all a commit needs: the state after keeping a of the
    staged tokens, from the closed form, is the reference's after those a tokens, for every a."""
    _, m = pair
    x, initial = hidden(6, 8), random_state(m, 6)
    state = new_state(m, initial)
    fast(m, x, state)
    window, after = torch.empty_like(state.recurrent.conv), torch.empty_like(state.recurrent.state)
    for a in range(1, 9):
        state.recurrent.state_after(a, 8, window, after)
        want = new_state(m, initial)
        reference(m, x[:a], want)
        assert rel_err(after[0], want.recurrent.spare[0]) < 1e-5 and window.numel() == 0
