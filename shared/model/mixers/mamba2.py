"""The Mamba2 (SSD) mixer of every HF hybrid family that has one, with HF's parameter names.

A pass is split in three so that the state's addressing stays with the engine's state access: `inputs` (the input
projection), `recurrence` (conv window and recurrent state in, a `Step` out) and `output` (gated norm, output
projection, residual); `Mamba2Mixer.fused` runs them over a `StateAccess`, `Mamba2Mixer.forward` is the reference
(`reference`: one token at a time through the state). In the state algebra `S_t = exp(g_t) S_{t-1} + k_t d_t^T`,
per head h, state `(N, P)`:
k_t = B_t and q_t = C_t (of the head's group), d_t = dt_t x_t, g_t = dt_t A_h, and the output is S_t^T C_t + D_h x_t.
The state is `(H, N, P)`: HF's cache holds its transpose `(H, P, N)`.

What each family's mixer (transformers 5.25, the PyTorch path) takes from its config:

- Mamba2 (`Mamba2Mixer`): num_heads, head_dim, state_size, n_groups, conv_kernel, use_conv_bias, use_bias (in and
  out projections), norm_eps = layer_norm_epsilon, dt_limit = time_step_limit. The norm gates first (the default).
- Nemotron-H (`NemotronHMamba2Mixer`): num_heads = mamba_num_heads, head_dim = mamba_head_dim, state_size =
  ssm_state_size, n_groups, conv_kernel, use_conv_bias, use_bias = use_bias (not mamba_proj_bias), norm_eps =
  layer_norm_epsilon, dt_limit = time_step_limit. Its width is heads x head_dim, not expand x hidden.
- Bamba, Granite-MoE-hybrid (`BambaMixer`, `GraniteMoeHybridMambaLayer`): mamba_n_heads, mamba_d_head, mamba_d_state,
  mamba_n_groups, mamba_d_conv, use_conv_bias = mamba_conv_bias, use_bias = mamba_proj_bias, norm_eps = rms_norm_eps,
  dt_limit = time_step_limit; Granite also out_multiplier = residual_multiplier (its decoder scales the mixer's
  output by it before the residual add).
- Falcon-H1 (`FalconH1Mixer`): as Bamba, width mamba_d_ssm, and out_bias = projectors_bias; rms_norm =
  mamba_rms_norm (without it the output is only gated: y silu(z)); norm_before_gate = mamba_norm_before_gate;
  in_multiplier = ssm_in_multiplier (scales h before in_proj); ssm_multipliers (the five muP factors of z, x, B, C,
  dt, which HF keeps as the model-level buffer `mup_vector`); out_multiplier = the decoder's ssm_out_multiplier.
- Zamba2 (`Zamba2MambaMixer`): n_mamba_heads, mamba_headdim, mamba_d_state, mamba_ngroups, mamba_d_conv, conv bias
  always (use_conv_bias=True), use_bias = add_bias_linear, norm_eps = 1e-5 (fixed), dt_limit = (time_step_min, inf).

Every family normalises groups of width / n_groups channels (`norm_group_size` overrides it) and convolves with
SiLU. HF clamps dt to time_step_limit in its chunked scan but not in its one-token step; here every path clamps, so
prefill, verify and decode agree.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.kernels.decay_scan import decay_scan
from deltaspec.shared.state.access import StateAccess
from deltaspec.shared.state.rollback import RecurrentSlot
from deltaspec.shared.state.spec import RECURRENT
from deltaspec.shared.state.steps import Start, Step

NO_LIMIT = (0.0, math.inf)


class GroupGatedRMSNorm(nn.Module):
    """RMSNorm over groups of channels, gated by silu(z) before the norm (most families) or after it (Falcon-H1's
    option): the group is the channels of one B/C group, so tensor-parallel shards normalise alone."""

    def __init__(self, size: int, group_size: int, eps: float, before_gate: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size, self.eps, self.before_gate = group_size, eps, before_gate

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        gate = F.silu(z.float())
        y = y.float() if self.before_gate else y.float() * gate
        groups = y.unflatten(-1, (-1, self.group_size))  # (..., n, group_size)
        y = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2) * self.weight
        return y * gate if self.before_gate else y


class Mamba2Mixer(nn.Module):
    """The mixer's parameters and shape; the pass is the module's functions `inputs`, `recurrence`, `output`."""

    state = RECURRENT
    compiles = True  # its fast path traces into a graph whose token count is symbolic

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, state_size: int, n_groups: int = 1,
                 conv_kernel: int = 4, use_conv_bias: bool = True, use_bias: bool = False, out_bias: bool | None = None,
                 norm_eps: float = 1e-5, dt_limit: tuple[float, float] = NO_LIMIT, rms_norm: bool = True,
                 norm_before_gate: bool = False, norm_group_size: int | None = None, in_multiplier: float = 1.0,
                 ssm_multipliers: Sequence[float] | None = None, out_multiplier: float = 1.0) -> None:
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"{num_heads} heads do not split into {n_groups} groups")
        self.num_heads, self.head_dim, self.state_size, self.n_groups = num_heads, head_dim, state_size, n_groups
        self.intermediate_size = width = num_heads * head_dim
        self.conv_dim = width + 2 * n_groups * state_size
        self.dt_limit = tuple(dt_limit)
        self.in_multiplier, self.out_multiplier = in_multiplier, out_multiplier
        self.in_proj = nn.Linear(hidden_size, width + self.conv_dim + num_heads, bias=use_bias)  # [z | x B C | dt]
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=use_conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(num_heads))
        self.A_log = nn.Parameter(torch.arange(1, num_heads + 1, dtype=torch.float32).log())
        self.D = nn.Parameter(torch.ones(num_heads))
        group_size = norm_group_size or width // n_groups
        self.norm = GroupGatedRMSNorm(width, group_size, norm_eps, norm_before_gate) if rms_norm else None
        self.out_proj = nn.Linear(width, hidden_size, bias=use_bias if out_bias is None else out_bias)
        mup = None
        if ssm_multipliers is not None:  # one factor per slice of the projection: z, x, B, C, dt
            widths = (width, width, n_groups * state_size, n_groups * state_size, num_heads)
            # made on the CPU even where the model is built on the meta device (a load): no checkpoint holds it
            mup = torch.cat([torch.full((w,), float(f), device="cpu")
                             for w, f in zip(widths, ssm_multipliers, strict=True)])
        self.register_buffer("mup_vector", mup, persistent=False)

    @property
    def conv_kernel(self) -> int:
        return self.conv1d.kernel_size[0]

    def forward(self, h: Tensor, st: RecurrentSlot, start: int = 0, rope: object = None) -> Tensor:
        """The reference on one sequence's slot: what it adds to the residual; its tokens staged."""
        y, xBC, final, (k, d, g) = reference(self, h, st.conv_window().to(h.dtype), st.initial_state())
        st.stage(xBC, k, d, g, final)
        return y

    def fuse(self) -> Mamba2Mixer:
        """Itself (its input projection is one matmul already), with what a pass would recompute made once: the
        decay rates -exp(A_log) (`neg_a`), the muP vector in the weights' dtype (as HF builds it in the model's)."""
        if self.mup_vector is not None:
            self.mup_vector = self.mup_vector.to(self.in_proj.weight)
        self.neg_a = -self.A_log.detach().float().exp()
        return self

    def fused(self, f: Mamba2Mixer, h: Tensor, residual: Tensor, rope: object, access: StateAccess,
              i: int) -> Tensor:
        """Recurrent layer i on the normed input h `(N, hidden)`, added to the residual."""
        xBC, (z, dt_raw) = inputs(self, h)
        out = access.recurrent(i, xBC, (dt_raw,), functools.partial(recurrence, self))
        return output(self, out, z, residual)


def inputs(m: Mamba2Mixer, h: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """h `(..., T, hidden)` -> (xBC `(..., T, conv_dim)`, the pre-conv inputs the window keeps; (z `(..., T, I)`, the
    gate; dt_raw `(..., T, H)`, before dt_bias and softplus))."""
    proj = m.in_proj(h if m.in_multiplier == 1.0 else h * m.in_multiplier)
    if m.mup_vector is not None:
        proj = proj * m.mup_vector
    z, xBC, dt_raw = proj.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
    return xBC, (z, dt_raw)


def _per_head(m: Mamba2Mixer, y: Tensor) -> Tensor:
    """B or C `(..., T, G N)` -> `(..., T, H, N)`: each head reads its group's."""
    return y.unflatten(-1, (m.n_groups, m.state_size)).repeat_interleave(m.num_heads // m.n_groups, dim=-2)


def recurrence(m: Mamba2Mixer, full: Tensor, extras: tuple[Tensor], start: Start) -> Step:
    """full = [conv window; xBC] `(..., K-1+T, conv_dim)`, extras = (dt_raw `(..., T, H)`,) -> the pass's `Step`.

    A padding token (start.valid 0) gets dt = 0: no write and no decay, so the state passes it unchanged."""
    (dt_raw,) = extras
    flat = full.reshape(-1, *full.shape[-2:]).transpose(1, 2)  # (B, conv_dim, K-1+T)
    conv = F.silu(F.conv1d(flat, m.conv1d.weight, m.conv1d.bias, groups=m.conv_dim)).transpose(1, 2)  # (B, T, C)
    conv = conv.reshape(*full.shape[:-2], -1, m.conv_dim).float()
    x, B, C = conv.split([m.intermediate_size, m.n_groups * m.state_size, m.n_groups * m.state_size], dim=-1)
    x = x.unflatten(-1, (m.num_heads, m.head_dim))  # (..., T, H, P)
    B, C = _per_head(m, B), _per_head(m, C)  # (..., T, H, N)
    dt = F.softplus(dt_raw.float() + m.dt_bias)  # (..., T, H)
    if m.dt_limit != NO_LIMIT:
        dt = dt.clamp(*m.dt_limit)
    if start.valid is not None:
        dt = dt * start.valid
    g = dt * m.neg_a
    d = dt[..., None] * x
    out, final = decay_scan(C, B, d, g, start.initial, static=start.static)
    return Step(out + m.D[:, None] * x, B, d, g, final)


def output(m: Mamba2Mixer, out: Tensor, z: Tensor, residual: Tensor) -> Tensor:
    """out `(..., T, H, P)` (a `Step`'s), z `(..., T, I)` -> residual + out_multiplier * out_proj(gated norm)."""
    y = out.flatten(-2)  # (..., T, I)
    y = y * F.silu(z.float()) if m.norm is None else m.norm(y, z)
    return torch.add(residual, m.out_proj(y.to(m.out_proj.weight.dtype)), alpha=m.out_multiplier)


def reference(m: Mamba2Mixer, h: Tensor, window: Tensor,
              state: Tensor) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """The pass in its plainest form, one token at a time through the state: the fast path's twin in tests, and the
    engine's layer path. h `(T, hidden)`, window `(K-1, conv_dim)` (the last pre-conv inputs), state `(H, N, P)`;
    returns what `output` adds to the residual `(T, hidden)`, the pre-conv inputs xBC `(T, conv_dim)`, the state
    after the tokens, and what the state floor logs of them: k `(T, H, N)`, d `(T, H, P)`, g `(T, H)`."""
    xBC, (z, dt_raw) = inputs(m, h)
    full = torch.cat([window, xBC])  # (K-1+T, conv_dim)
    conv = F.silu(F.conv1d(full.t()[None], m.conv1d.weight, m.conv1d.bias, groups=m.conv_dim))[0].t()  # (T, conv_dim)
    x, B, C = conv.float().split([m.intermediate_size, m.n_groups * m.state_size, m.n_groups * m.state_size], dim=-1)
    dt = F.softplus(dt_raw.float() + m.dt_bias).clamp(*m.dt_limit)  # (T, H)
    A = -m.A_log.float().exp()
    group = torch.arange(m.num_heads, device=h.device) // (m.num_heads // m.n_groups)  # each head's B/C group
    ys, ks, ds = [], [], []
    for t in range(h.shape[0]):
        xt = x[t].view(m.num_heads, m.head_dim)  # (H, P)
        Bt, Ct = (y[t].view(m.n_groups, m.state_size)[group] for y in (B, C))  # (H, N)
        dx = dt[t, :, None] * xt
        state = (dt[t] * A).exp()[:, None, None] * state + Bt[:, :, None] * dx[:, None, :]
        ys.append(torch.einsum("hnp,hn->hp", state, Ct) + m.D[:, None] * xt)
        ks.append(Bt)
        ds.append(dx)
    y = output(m, torch.stack(ys), z, torch.zeros_like(h))
    return y, xBC, state, (torch.stack(ks), torch.stack(ds), dt * A)
