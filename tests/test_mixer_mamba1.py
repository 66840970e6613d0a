"""The Mamba1 mixer against HF's own `MambaMixer` and `FalconMambaMixer` (transformers' PyTorch path, no cache) as the
oracle, and its split pass against itself: token by token, in parts, in static form, against `reference`, with
padding; and the state floor's commit of kind `mamba` (a copy of the logged state) against every prefix."""
import pytest
import torch
from transformers.models.falcon_mamba.configuration_falcon_mamba import FalconMambaConfig
from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaMixer
from transformers.models.mamba.configuration_mamba import MambaConfig
from transformers.models.mamba.modeling_mamba import MambaMixer

from deltaspec.shared.model.mixers.mamba1 import Mamba1Mixer, inputs, output, recurrence, reference
from deltaspec.shared.state.rollback import RecurrentSlot, RecurrentStates
from deltaspec.shared.state.spec import RecurrentSpec
from deltaspec.shared.state.steps import Start
from support import rel_err

HIDDEN, T = 24, 9
# family: (HF mixer class, its config, our constructor arguments as the family file derives them)
FAMILIES = {
    "mamba-rank_auto": (MambaMixer, MambaConfig(hidden_size=HIDDEN, state_size=6, expand=2, conv_kernel=4,
                                                num_hidden_layers=1),
                        dict(hidden_size=HIDDEN, intermediate_size=48, state_size=6, dt_rank=2)),
    "mamba-bias_k3": (MambaMixer, MambaConfig(hidden_size=HIDDEN, state_size=5, expand=3, conv_kernel=3,
                                              time_step_rank=5, use_bias=True, use_conv_bias=False,
                                              num_hidden_layers=1),
                      dict(hidden_size=HIDDEN, intermediate_size=72, state_size=5, dt_rank=5, conv_kernel=3,
                           use_conv_bias=False, use_bias=True)),
    "falcon_mamba-norms": (FalconMambaMixer, FalconMambaConfig(hidden_size=HIDDEN, state_size=8, expand=2,
                                                               time_step_rank=4, mixer_rms_eps=1e-3,
                                                               num_hidden_layers=1),
                           dict(hidden_size=HIDDEN, intermediate_size=48, state_size=8, dt_rank=4, rms_eps=1e-3)),
}


def randomize(module: torch.nn.Module, seed: int) -> None:
    """randn weights at a scale that keeps activations O(1), and log decays dt A of about -0.1 to -5 a token."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(0.1, 5, generator=gen).log())
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.5))


def pair(family: str) -> tuple[torch.nn.Module, Mamba1Mixer]:
    """HF's mixer with random weights, ours loaded from its state dict (strictly: the names must match)."""
    cls, config, ours_args = FAMILIES[family]
    hf = cls(config, 0, initialize_mixer_weights=False).eval()  # as HF's blocks build it (randomized below)
    randomize(hf, seed=len(family))
    ours = Mamba1Mixer(**ours_args)
    ours.load_state_dict(hf.state_dict())
    ours.fuse()
    return hf, ours


def empty(m: Mamba1Mixer, *batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(*batch, m.conv_kernel - 1, m.intermediate_size),
            torch.zeros(*batch, 1, 1, m.intermediate_size * m.state_size))


def fast(m: Mamba1Mixer, h: torch.Tensor, window: torch.Tensor, state: torch.Tensor, static: bool = False,
         valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """inputs -> recurrence -> output, the window and state carried as the engine's state access does."""
    x, z = inputs(m, h)
    full = torch.cat([window, x], dim=-2)
    step = recurrence(m, full, (), Start(state, valid=valid, static=static))
    assert step.d.shape[:-1] == step.g.shape and step.k.shape == (*step.g.shape, 1)
    assert torch.equal(step.d[..., -1, :, :], step.final[..., 0, :])  # the logs are the states after each token
    return output(m, step.out, z, torch.zeros_like(h)), full[..., h.shape[-2]:, :], step.final


def hidden(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=list(FAMILIES), ids=list(FAMILIES))
def family(request):
    return request.param


@torch.no_grad()
def test_full_pass_matches_hf(family):
    hf, ours = pair(family)
    h = hidden(1, T)
    want = hf(h[None])[0]
    for static in (False, True):
        assert rel_err(fast(ours, h, *empty(ours), static=static)[0], want) < 1e-5
    assert rel_err(reference(ours, h, *empty(ours))[0], want) < 1e-5


@torch.no_grad()
def test_token_by_token_and_split_match_full(family):
    _, m = pair(family)
    h = hidden(2, T)
    want, want_window, want_state = fast(m, h, *empty(m))
    for static in (False, True):
        for parts in ([1] * T, [5, 4], [2, 7]):
            window, state, ys = *empty(m), []
            for piece in h.split(parts):
                y, window, state = fast(m, piece, window, state, static=static)
                ys.append(y)
            assert rel_err(torch.cat(ys), want) < 1e-5 and rel_err(state, want_state) < 1e-5
            assert rel_err(window, want_window) < 1e-6


@torch.no_grad()
def test_reference_matches_fast_path(family):
    _, m = pair(family)
    gen = torch.Generator().manual_seed(3)
    h, window = hidden(3, T), torch.randn(m.conv_kernel - 1, m.intermediate_size, generator=gen)
    state = torch.randn(1, 1, m.intermediate_size * m.state_size, generator=gen)
    y, x, final, logs = reference(m, h, window, state)
    want_y, want_window, want_final = fast(m, h, window, state)
    assert rel_err(y, want_y) < 1e-5 and rel_err(final, want_final) < 1e-5
    assert torch.equal(torch.cat([window, x])[T:], want_window)
    step = recurrence(m, torch.cat([window, x]), (), Start(state))
    assert rel_err(logs[1], step.d) < 1e-5  # what the state floor logs (the states), as the fast path gives it
    assert torch.equal(logs[0], step.k) and torch.equal(logs[2], step.g)  # zeros, as the kind wants


@torch.no_grad()
def test_the_state_floor_commits_every_prefix(family):
    """Staged through a `RecurrentSlot` of kind `mamba` (a `snapshot` kind: the logs hold the state after each
    token), the first a tokens give the state and window a sequential run reaches, for every a."""
    _, m = pair(family)
    spec = RecurrentSpec("mamba", conv_dim=m.intermediate_size, conv_width=m.conv_kernel,
                         heads=1, key_dim=1, value_dim=m.intermediate_size * m.state_size)
    states = RecurrentStates(spec, 1, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(6)
    states.conv[0] = torch.randn(m.conv_kernel - 1, m.intermediate_size, generator=gen)
    states.state[0] = torch.randn(1, 1, m.intermediate_size * m.state_size, generator=gen)
    window, state = states.conv[0].clone(), states.state[0].clone()
    h = hidden(6, T)
    m(h, RecurrentSlot(states, 0, 0))  # the reference stages the pass
    out_window, out_state = torch.empty_like(states.conv), torch.empty_like(states.state)
    for a in range(1, T + 1):
        states.state_after(a, T, out_window, out_state)
        _, want_window, want_state = fast(m, h[:a], window, state)
        assert rel_err(out_state[0], want_state) < 1e-5 and rel_err(out_window[0], want_window) < 1e-6


@torch.no_grad()
def test_padding_leaves_the_state_unchanged():
    """A batch whose second sequence ends in 3 padding tokens: its state and real outputs are those of its real
    tokens alone, and a pass of padding only gives back the state it started from, bit for bit."""
    _, m = pair("falcon_mamba-norms")
    gen = torch.Generator().manual_seed(4)
    h = hidden(4, 2, T)
    window = torch.randn(2, m.conv_kernel - 1, m.intermediate_size, generator=gen)
    state = torch.randn(2, 1, 1, m.intermediate_size * m.state_size, generator=gen)
    valid = torch.ones(2, T, 1)
    valid[1, T - 3:] = 0
    y, _, final = fast(m, h, window, state, valid=valid)
    for b, n in ((0, T), (1, T - 3)):
        y_alone, _, final_alone = fast(m, h[b, :n], window[b], state[b])
        assert rel_err(y[b, :n], y_alone) < 1e-5 and rel_err(final[b], final_alone) < 1e-5
    for n in (1, 3):
        for static in (False, True):
            _, _, final = fast(m, h[:, :n], window, state, static=static, valid=torch.zeros(2, n, 1))
            assert torch.equal(final, state)
