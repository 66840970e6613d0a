"""RecurrentGemma's recurrent block against HF's own `RecurrentGemmaRecurrentBlock` as the oracle (prefill from
position 0, then one token at a time from its cache), and its split pass against itself: in parts, in static form,
against `reference`, with padding and with a first token anywhere in a batch; and the state floor's commit of kind
`rglru` (a copy of the logged state) against every prefix."""
import pytest
import torch
from transformers.models.recurrent_gemma.configuration_recurrent_gemma import RecurrentGemmaConfig
from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRecurrentBlock

from deltaspec.shared.model.mixers.rglru import RGLRUMixer, output, recurrence, reference
from deltaspec.shared.state.access import first_token
from deltaspec.shared.state.rollback import RecurrentSlot, RecurrentStates
from deltaspec.shared.state.spec import RecurrentSpec
from deltaspec.shared.state.steps import Start
from support import rel_err

HIDDEN, T = 24, 9
# name: (width, heads, conv width)
SHAPES = {"w24-h4-k4": (24, 4, 4), "w36-h2-k3": (36, 2, 3)}


def pair(name: str) -> tuple[RecurrentGemmaRecurrentBlock, RGLRUMixer]:
    """HF's block with random weights (decays of about 0.01 to 1 a token), ours loaded from its state dict (strictly:
    the names must match)."""
    width, heads, conv = SHAPES[name]
    config = RecurrentGemmaConfig(hidden_size=HIDDEN, lru_width=width, num_attention_heads=heads, conv1d_width=conv,
                                  num_hidden_layers=1, vocab_size=8, intermediate_size=8)
    hf = RecurrentGemmaRecurrentBlock(config, 0).eval()
    gen = torch.Generator().manual_seed(len(name))
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.5))
    ours = RGLRUMixer(HIDDEN, width, heads, conv)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def empty(m: RGLRUMixer, *batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(*batch, m.conv_kernel - 1, m.width), torch.zeros(*batch, 1, 1, m.width)


def fast(m: RGLRUMixer, h: torch.Tensor, window: torch.Tensor, state: torch.Tensor, first: torch.Tensor | None = None,
         static: bool = False, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused pass's pieces, the window and state carried as the engine's state access does."""
    f = m.fuse()
    x, y = torch.nn.functional.linear(h, f.w_in, f.b_in).chunk(2, dim=-1)
    full = torch.cat([window, x], dim=-2)
    step = recurrence(m, f, full, (), Start(state, valid=valid, static=static, first=first))
    assert torch.equal(step.d[..., -1, :, :], step.final[..., 0, :])  # the logs are the states after each token
    gate = torch.nn.functional.gelu(y, approximate="tanh")
    return output(m, step.out, gate, torch.zeros_like(h)), full[..., h.shape[-2]:, :], step.final


def hidden(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=list(SHAPES), ids=list(SHAPES))
def name(request):
    return request.param


@torch.no_grad()
def test_prefill_then_decode_match_hf(name):
    """From position 0 (HF's reset: no sqrt(1 - a^2) at the first token), then three decode steps."""
    hf, ours = pair(name)
    h = hidden(1, T + 3)
    want = [hf(h[None, :T], position_ids=torch.arange(T)[None], attention_mask=None)[0][0]]
    want += [hf(h[None, t:t + 1], position_ids=torch.tensor([[t]]), attention_mask=None)[0][0] for t in range(T, T + 3)]
    want = torch.cat(want)
    got, window, state = fast(ours, h[:T], *empty(ours), first=first_token(T, h.device))
    rows = [got]
    for t in range(T, T + 3):
        y, window, state = fast(ours, h[t:t + 1], window, state)
        rows.append(y)
    assert rel_err(torch.cat(rows), want) < 1e-5
    assert rel_err(reference(ours, h[:T], *empty(ours), at_start=True)[0], want[:T]) < 1e-5


@torch.no_grad()
def test_split_and_static_passes_match_the_whole(name):
    _, m = pair(name)
    h = hidden(2, T)
    want, want_window, want_state = fast(m, h, *empty(m), first=first_token(T, h.device))
    for static in (False, True):
        for parts in ([1] * T, [5, 4], [2, 7]):
            window, state, ys, at = *empty(m), [], 0
            for piece in h.split(parts):
                first = first_token(len(piece), h.device) if at == 0 else None
                y, window, state = fast(m, piece, window, state, first=first, static=static)
                ys.append(y)
                at += len(piece)
            assert rel_err(torch.cat(ys), want) < 1e-5 and rel_err(state, want_state) < 1e-5
            assert rel_err(window, want_window) < 1e-6


@torch.no_grad()
def test_reference_matches_fast_path(name):
    _, m = pair(name)
    gen = torch.Generator().manual_seed(3)
    h, window = hidden(3, T), torch.randn(m.conv_kernel - 1, m.width, generator=gen)
    state = torch.randn(1, 1, m.width, generator=gen)
    y, x, final, logs = reference(m, h, window, state, at_start=False)
    want_y, want_window, want_final = fast(m, h, window, state)
    assert rel_err(y, want_y) < 1e-5 and rel_err(final, want_final) < 1e-5
    assert torch.equal(torch.cat([window, x])[T:], want_window)
    f = m.fuse()
    step = recurrence(m, f, torch.cat([window, x]), (), Start(state))
    assert rel_err(logs[1], step.d) < 1e-5  # what the state floor logs (the states), as the fast path gives it
    assert torch.equal(logs[0], step.k) and torch.equal(logs[2], step.g)  # zeros, as the kind wants


@torch.no_grad()
def test_the_state_floor_commits_every_prefix(name):
    """Staged through a `RecurrentSlot` of kind `rglru` (the logs hold the state after each token), the first a
    tokens give the state and window a sequential run reaches, for every a."""
    _, m = pair(name)
    spec = RecurrentSpec("rglru", conv_dim=m.width, conv_width=m.conv_kernel, heads=1, key_dim=1, value_dim=m.width)
    states = RecurrentStates(spec, 1, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(6)
    states.conv[0] = torch.randn(m.conv_kernel - 1, m.width, generator=gen)
    states.state[0] = torch.randn(1, 1, m.width, generator=gen)
    window, state = states.conv[0].clone(), states.state[0].clone()
    h = hidden(6, T)
    m(h, RecurrentSlot(states, 0, 0), start=5)  # the reference stages the pass
    out_window, out_state = torch.empty_like(states.conv), torch.empty_like(states.state)
    for a in range(1, T + 1):
        states.state_after(a, T, out_window, out_state)
        _, want_window, want_state = fast(m, h[:a], window, state)
        assert rel_err(out_state[0], want_state) < 1e-5 and rel_err(out_window[0], want_window) < 1e-6


@torch.no_grad()
def test_padding_and_a_first_token_in_a_batch():
    """A batch whose first sequence starts at position 0 and whose second continues a state and ends in 3 padding
    tokens: each is what it gives alone; a pass of padding only gives back the state it started from, bit for bit."""
    _, m = pair("w24-h4-k4")
    gen = torch.Generator().manual_seed(4)
    h = hidden(4, 2, T)
    window = torch.randn(2, m.conv_kernel - 1, m.width, generator=gen)
    state = torch.randn(2, 1, 1, m.width, generator=gen)
    window[0], state[0] = 0, 0  # a new sequence
    valid, first = torch.ones(2, T, 1), torch.zeros(2, T, 1)
    valid[1, T - 3:], first[0, 0] = 0, 1
    y, _, final = fast(m, h, window, state, first=first, valid=valid)
    for b, n, alone in ((0, T, first_token(T, h.device)), (1, T - 3, None)):
        y_alone, _, final_alone = fast(m, h[b, :n], window[b], state[b], first=alone)
        assert rel_err(y[b, :n], y_alone) < 1e-5 and rel_err(final[b], final_alone) < 1e-5
    for n in (1, 3):
        _, _, final = fast(m, h[:, :n], window, state, valid=torch.zeros(2, n, 1))
        assert torch.equal(final, state)
