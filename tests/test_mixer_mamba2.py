"""The Mamba2 mixer against each HF family's own mixer (transformers' PyTorch path, no cache) as the oracle, and its
split pass against itself: token by token, in two parts, in static form, against `reference`, with padding."""
import math

import pytest
import torch
from transformers.models.bamba.configuration_bamba import BambaConfig
from transformers.models.bamba.modeling_bamba import BambaMixer
from transformers.models.falcon_h1.configuration_falcon_h1 import FalconH1Config
from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector
from transformers.models.granitemoehybrid.configuration_granitemoehybrid import GraniteMoeHybridConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer
from transformers.models.mamba2.configuration_mamba2 import Mamba2Config
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2Mixer
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
from transformers.models.zamba2.configuration_zamba2 import Zamba2Config
from transformers.models.zamba2.modeling_zamba2 import Zamba2MambaMixer

from deltaspec.shared.model.mixers.mamba2 import Mamba2Mixer, inputs, output, recurrence, reference
from deltaspec.shared.state.steps import Start
from support import rel_err

HIDDEN, T = 32, 8
FALCON = dict(hidden_size=HIDDEN, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2,
              mamba_proj_bias=False, projectors_bias=True, ssm_in_multiplier=0.6, ssm_out_multiplier=0.9,
              ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.7], rms_norm_eps=1e-6, num_hidden_layers=1)
OURS_FALCON = dict(hidden_size=HIDDEN, num_heads=4, head_dim=16, state_size=8, n_groups=2, use_bias=False,
                   out_bias=True, in_multiplier=0.6, out_multiplier=0.9, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.7],
                   norm_eps=1e-6)
# family: (HF mixer class, its config, our constructor arguments as the family file would derive them)
FAMILIES = {
    "mamba2-g2-bias": (HFMamba2Mixer, Mamba2Config(
        hidden_size=HIDDEN, num_heads=4, head_dim=16, expand=2, state_size=8, n_groups=2, use_bias=True,
        layer_norm_epsilon=1e-5, num_hidden_layers=1),
        dict(hidden_size=HIDDEN, num_heads=4, head_dim=16, state_size=8, n_groups=2, use_bias=True, norm_eps=1e-5)),
    "nemotron_h-g1-limit": (NemotronHMamba2Mixer, NemotronHConfig(
        hidden_size=HIDDEN, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=1,
        layer_norm_epsilon=1e-6, time_step_limit=(0.0, 0.9), layers_block_type=["mamba"]),
        dict(hidden_size=HIDDEN, num_heads=8, head_dim=8, state_size=16, n_groups=1, norm_eps=1e-6,
             dt_limit=(0.0, 0.9))),
    "bamba-g2-clamp": (BambaMixer, BambaConfig(
        hidden_size=HIDDEN, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_proj_bias=True,
        rms_norm_eps=1e-6, time_step_limit=(0.3, 1.2), num_hidden_layers=1, attn_layer_indices=[]),
        dict(hidden_size=HIDDEN, num_heads=4, head_dim=16, state_size=8, n_groups=2, use_bias=True, norm_eps=1e-6,
             dt_limit=(0.3, 1.2))),
    "granite-g1-noconvbias": (GraniteMoeHybridMambaLayer, GraniteMoeHybridConfig(
        hidden_size=HIDDEN, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_n_groups=1,
        mamba_conv_bias=False, rms_norm_eps=1e-6, residual_multiplier=0.4, num_hidden_layers=1, layer_types=["mamba"]),
        dict(hidden_size=HIDDEN, num_heads=8, head_dim=8, state_size=16, n_groups=1, use_conv_bias=False,
             norm_eps=1e-6, out_multiplier=0.4)),
    "falcon_h1-gate_only": (FalconH1Mixer, FalconH1Config(**FALCON, mamba_rms_norm=False),
                            dict(OURS_FALCON, rms_norm=False)),
    "falcon_h1-norm_then_gate": (FalconH1Mixer, FalconH1Config(**FALCON, mamba_rms_norm=True,
                                                               mamba_norm_before_gate=True),
                                 dict(OURS_FALCON, norm_before_gate=True)),
    "falcon_h1-gate_then_norm": (FalconH1Mixer, FalconH1Config(**FALCON, mamba_rms_norm=True,
                                                               mamba_norm_before_gate=False),
                                 dict(OURS_FALCON, norm_before_gate=False)),
    "zamba2-g2-min_dt": (Zamba2MambaMixer, Zamba2Config(
        hidden_size=HIDDEN, n_mamba_heads=4, mamba_headdim=16, mamba_d_state=8, mamba_ngroups=2, add_bias_linear=True,
        time_step_min=0.4, layers_block_type=["mamba"], num_hidden_layers=1),
        dict(hidden_size=HIDDEN, num_heads=4, head_dim=16, state_size=8, n_groups=2, use_bias=True, norm_eps=1e-5,
             dt_limit=(0.4, math.inf))),
}


def randomize(module: torch.nn.Module, seed: int) -> None:
    """randn weights at a scale that keeps activations O(1), log decays around -1 a token, and norm weights near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = {"A_log": 0.5, "dt_bias": 0.5, "D": 1.0, "norm.weight": 0.2}.get(
                name, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (name == "norm.weight"))


def pair(family: str) -> tuple[torch.nn.Module, Mamba2Mixer, float]:
    """HF's mixer with random weights, ours loaded from its state dict (strictly: the names must match), and the
    factor HF's decoder applies to the mixer's output (Falcon-H1's ssm_out_multiplier, Granite's
    residual_multiplier)."""
    cls, config, ours_args = FAMILIES[family]
    hf = cls(config, 0).eval()
    if cls is FalconH1Mixer:  # HF's model, not the mixer, registers the muP vector
        hf.register_buffer("mup_vector", compute_mup_vector(config), persistent=False)
    randomize(hf, seed=len(family))
    ours = Mamba2Mixer(**ours_args)
    ours.load_state_dict(hf.state_dict())
    ours.fuse()
    return hf, ours, getattr(config, "ssm_out_multiplier", getattr(config, "residual_multiplier", 1.0))


def empty(m: Mamba2Mixer, *batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(*batch, m.conv_kernel - 1, m.conv_dim),
            torch.zeros(*batch, m.num_heads, m.state_size, m.head_dim))


def fast(m: Mamba2Mixer, h: torch.Tensor, window: torch.Tensor, state: torch.Tensor, static: bool = False,
         valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """inputs -> recurrence -> output, the window and state carried as the engine's state access does."""
    xBC, (z, dt_raw) = inputs(m, h)
    full = torch.cat([window, xBC], dim=-2)
    step = recurrence(m, full, (dt_raw,), Start(state, valid=valid, static=static))
    assert step.k.shape[-2:] == (m.num_heads, m.state_size) and step.d.shape == step.out.shape and not step.logged
    return output(m, step.out, z, torch.zeros_like(h)), full[..., h.shape[-2]:, :], step.final


def hidden(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=list(FAMILIES), ids=list(FAMILIES))
def family(request):
    return request.param


@torch.no_grad()
def test_full_pass_matches_hf(family):
    hf, ours, out_multiplier = pair(family)
    h = hidden(1, T)
    want = hf(h[None])[0] * out_multiplier
    for static in (False, True):
        assert rel_err(fast(ours, h, *empty(ours), static=static)[0], want) < 1e-4


@torch.no_grad()
def test_token_by_token_and_split_match_full(family):
    _, m, _ = pair(family)
    h = hidden(2, T)
    want, want_window, want_state = fast(m, h, *empty(m))
    for static in (False, True):
        for parts in ([1] * T, [5, 3]):
            window, state, ys = *empty(m), []
            for piece in h.split(parts):
                y, window, state = fast(m, piece, window, state, static=static)
                ys.append(y)
            assert rel_err(torch.cat(ys), want) < 1e-5 and rel_err(state, want_state) < 1e-5
            assert rel_err(window, want_window) < 1e-6  # in_proj of one row and of eight may round apart


@torch.no_grad()
def test_logs_rebuild_every_prefix_state(family):
    """The Step's (k, d, g) are all a commit needs: S_a = exp(G_a) S_0 + sum_t exp(G_a - G_t) k_t d_t^T equals the state
    after the first a + 1 tokens, for every a."""
    _, m, _ = pair(family)
    h = hidden(5, T)
    state = torch.randn(m.num_heads, m.state_size, m.head_dim, generator=torch.Generator().manual_seed(5))
    xBC, (_, dt_raw) = inputs(m, h)
    full = torch.cat([empty(m)[0], xBC])
    step = recurrence(m, full, (dt_raw,), Start(state))
    G = step.g.cumsum(0)  # (T, H)
    for a in range(T):
        weights = (G[a] - G[:a + 1]).exp()  # (a+1, H)
        closed = G[a].exp()[:, None, None] * state + torch.einsum("th,thn,thp->hnp", weights, step.k[:a + 1],
                                                                  step.d[:a + 1])
        after = recurrence(m, full[:m.conv_kernel + a], (dt_raw[:a + 1],), Start(state)).final
        assert rel_err(closed, after) < 1e-5


@torch.no_grad()
def test_reference_matches_fast_path(family):
    _, m, _ = pair(family)
    gen = torch.Generator().manual_seed(3)
    h, window = hidden(3, T), torch.randn(m.conv_kernel - 1, m.conv_dim, generator=gen)
    state = torch.randn(m.num_heads, m.state_size, m.head_dim, generator=gen)
    y, xBC, final, logs = reference(m, h, window, state)
    want_y, want_window, want_final = fast(m, h, window, state)
    assert rel_err(y, want_y) < 1e-5 and rel_err(final, want_final) < 1e-5
    assert torch.equal(torch.cat([window, xBC])[T:], want_window)
    step = recurrence(m, torch.cat([window, xBC]), (inputs(m, h)[1][1],), Start(state))
    for got, want in zip(logs, (step.k, step.d, step.g)):  # what the state floor logs, as the fast path gives it
        assert rel_err(got, want) < 1e-5


@torch.no_grad()
def test_padding_leaves_the_state_unchanged():
    """A batch whose second sequence ends in 3 padding tokens: its state and real outputs are those of its real
    tokens alone, and a pass of padding only gives back the state it started from, bit for bit."""
    _, m, _ = pair("bamba-g2-clamp")  # its dt clamp has a floor: padding must still get dt = 0
    gen = torch.Generator().manual_seed(4)
    h = hidden(4, 2, T)
    window, state = torch.randn(2, m.conv_kernel - 1, m.conv_dim, generator=gen), torch.randn(
        2, m.num_heads, m.state_size, m.head_dim, generator=gen)
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
