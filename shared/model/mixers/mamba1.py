"""The Mamba1 (selective scan) mixer of HF's `mamba` and `falcon_mamba` (`MambaMixer`, `FalconMambaMixer`), with
HF's parameter names.

in_proj splits each token into x and the gate z; a depthwise causal conv (SiLU) runs over x; x_proj reads the
conv's output xc into a low-rank dt, B and C `(N,)` (one B and C for every channel); dt = softplus(dt_proj(dt)).
Each channel c of the d_inner keeps a vector over the state index n:

    h_t[c, n] = exp(dt_t[c] A[c, n]) h_{t-1}[c, n] + dt_t[c] B_t[n] xc_t[c],    y_t[c] = h_t[c] . C_t + D[c] xc_t[c]

and out_proj(y silu(z)) is what the mixer adds. In the state algebra `S_t = D(g_t) S_{t-1} + k_t d_t^T` this is
every channel a head (H = d_inner) with k_t = B_t and q_t = C_t, d_t = dt_t xc_t and a log decay per state entry
g_t = dt_t A `(H, N)`. A channel's state holds no more numbers than one token's (B, dt A) would log, so the state floor
keeps it as the kind `mamba` (a `snapshot` kind): the state after each staged token is logged, the layer's states as
one head of one key and I N values (each token's states contiguous), and a commit copies the one it keeps.
FalconMamba (`rms_eps` set) RMS-normalises dt (before dt_proj), B and C without weights (HF's `*_layernorm` are
buffers of ones its kernels take; they are not in its state dict); Jamba (`rms_weights` too) with weights, its
`dt_layernorm`, `b_layernorm`, `c_layernorm` parameters.

As `mamba2.py`, the pass is split in `inputs`, `recurrence` (the `Step`) and `output`; `Mamba1Mixer.forward` is the
reference (`reference`: one token at a time through the state).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.kernels.conv import causal_conv
from deltaspec.shared.kernels.decay_scan import decay_states
from deltaspec.shared.model.norms import RMSNorm
from deltaspec.shared.state.access import StateAccess
from deltaspec.shared.state.rollback import RecurrentSlot
from deltaspec.shared.state.spec import RECURRENT
from deltaspec.shared.state.steps import Start, Step


class Mamba1Mixer(nn.Module):
    """The mixer's parameters and shape; the pass is the module's functions `inputs`, `recurrence`, `output`."""

    state = RECURRENT
    compiles = False  # the elementwise scan's log-depth loop runs over the token count: no symbolic graph

    def __init__(self, hidden_size: int, intermediate_size: int, state_size: int, dt_rank: int, conv_kernel: int = 4,
                 use_conv_bias: bool = True, use_bias: bool = False, rms_eps: float | None = None,
                 rms_weights: bool = False) -> None:
        super().__init__()
        self.intermediate_size, self.state_size, self.dt_rank, self.rms_eps = (intermediate_size, state_size,
                                                                               dt_rank, rms_eps)
        self.in_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=use_bias)  # [x | z]
        self.conv1d = nn.Conv1d(intermediate_size, intermediate_size, conv_kernel, groups=intermediate_size,
                                bias=use_conv_bias)
        self.x_proj = nn.Linear(intermediate_size, dt_rank + 2 * state_size, bias=False)  # [dt | B | C]
        self.dt_proj = nn.Linear(dt_rank, intermediate_size, bias=True)
        decay_rates = torch.arange(1, state_size + 1, dtype=torch.float32).log()
        self.A_log = nn.Parameter(decay_rates.repeat(intermediate_size, 1))
        self.D = nn.Parameter(torch.ones(intermediate_size))
        self.out_proj = nn.Linear(intermediate_size, hidden_size, bias=use_bias)
        self.rms_weights = rms_eps is not None and rms_weights
        if self.rms_weights:  # Jamba's norms on dt, B and C, registered in HF's order
            self.dt_layernorm = RMSNorm(dt_rank, rms_eps, offset=0.0)
            self.b_layernorm = RMSNorm(state_size, rms_eps, offset=0.0)
            self.c_layernorm = RMSNorm(state_size, rms_eps, offset=0.0)

    @property
    def conv_kernel(self) -> int:
        return self.conv1d.kernel_size[0]

    def forward(self, h: Tensor, st: RecurrentSlot, start: int = 0, rope: object = None) -> Tensor:
        """The reference on one sequence's slot: what it adds to the residual; its tokens staged."""
        y, x, final, (k, d, g) = reference(self, h, st.conv_window().to(h.dtype), st.initial_state())
        st.stage(x, k, d, g, final)
        return y

    def fuse(self) -> Mamba1Mixer:
        """Itself (its input projection is one matmul already), with the decay rates -exp(A_log) `(I, N)` made once
        (`neg_a`)."""
        self.neg_a = -self.A_log.detach().float().exp()
        return self

    def fused(self, f: Mamba1Mixer, h: Tensor, residual: Tensor, rope: object, access: StateAccess,
              i: int) -> Tensor:
        """Recurrent layer i on the normed input h `(N, hidden)`, added to the residual."""
        x, z = inputs(self, h)
        out = access.recurrent(i, x, (), functools.partial(recurrence, self))
        return output(self, out, z, residual)


def inputs(m: Mamba1Mixer, h: Tensor) -> tuple[Tensor, Tensor]:
    """h `(..., T, hidden)` -> (x `(..., T, I)`, what the conv reads and its window keeps; z `(..., T, I)`, the
    gate)."""
    x, z = m.in_proj(h).chunk(2, dim=-1)
    return x, z


def selective(m: Mamba1Mixer, xc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The conv's output xc `(..., T, I)` -> dt `(..., T, I)` (after dt_proj and softplus), B and C `(..., T, N)`."""
    dt, B, C = m.x_proj(xc).split([m.dt_rank, m.state_size, m.state_size], dim=-1)
    if m.rms_eps is not None:  # in float32, one fused op each (a decode step is dispatch-bound)
        norms = (m.dt_layernorm, m.b_layernorm, m.c_layernorm) if m.rms_weights else (None,) * 3
        dt, B, C = (F.rms_norm(y.float(), y.shape[-1:], None if n is None else n.weight.float(), m.rms_eps).to(xc.dtype)
                    for y, n in zip((dt, B, C), norms))
    dt = F.softplus((dt @ m.dt_proj.weight.t()).float() + m.dt_proj.bias.float())
    return dt, B.float(), C.float()


def recurrence(m: Mamba1Mixer, full: Tensor, extras: tuple[Tensor, ...], start: Start) -> Step:
    """full = [conv window; x] `(..., K-1+T, I)` -> the pass's `Step`: out `(..., T, I, 1)` (with D's skip), and what
    the `snapshot` kind logs: the state after each token as d `(..., T, 1, I N)` (k and g zeros, `(..., T, 1, 1)` and
    `(..., T, 1)`): the state floor holds the layer's states as one head of value_dim I N (`initial`
    `(..., 1, 1, I N)`), so a token's states are contiguous in the logs and a commit copies one block. The states
    come from `decay_states` with k = B (broadcast over the channels, a view), d = dt xc, g = dt A; each token's
    output is its state read by C.

    A padding token (start.valid 0) gets dt = 0: no write and no decay, so the state passes it unchanged."""
    xc = F.silu(causal_conv(full, m.conv1d.weight[:, 0], m.conv1d.bias))  # (..., T, I) (mkldnn's conv costs more)
    dt, B, C = selective(m, xc)
    if start.valid is not None:
        dt = dt * start.valid
    xc = xc.float()
    g = dt[..., None] * m.neg_a  # (..., T, I, N)
    d = (dt * xc)[..., None]  # (..., T, I, 1)
    lead = start.initial.shape[:-3]
    initial = start.initial.reshape(*lead, *m.A_log.shape, 1)  # (..., I, N, 1): each channel a head of the scan
    states = decay_states(B[..., None, :].expand(g.shape), d, g, initial)[..., 0]  # (..., T, I, N)
    out = (states @ C[..., None]) + (m.D * xc)[..., None]  # (..., T, I, 1)
    logged = states.flatten(-2)[..., None, :]  # (..., T, 1, I N)
    zeros = logged.new_zeros(*logged.shape[:-1])
    return Step(out, zeros[..., None], logged, zeros, logged[..., -1, :, None, :])


def output(m: Mamba1Mixer, out: Tensor, z: Tensor, residual: Tensor) -> Tensor:
    """out `(..., T, I, 1)` (a `Step`'s), z `(..., T, I)` -> residual + out_proj(out silu(z))."""
    y = out.squeeze(-1) * F.silu(z.float())
    return residual + m.out_proj(y.to(m.out_proj.weight.dtype))


def reference(m: Mamba1Mixer, h: Tensor, window: Tensor,
              state: Tensor) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """The pass in its plainest form, one token at a time through the state: the fast path's twin in tests, and the
    engine's layer path. h `(T, hidden)`, window `(K-1, I)` (the last pre-conv inputs), state `(1, 1, I N)` (as the
    state floor holds it); returns what `output` adds to the residual `(T, hidden)`, the pre-conv inputs x `(T, I)`,
    the state after the tokens, and what the state floor logs of them: zeros k `(T, 1, 1)`, the state after each
    token d `(T, 1, I N)`, zeros g `(T, 1)`."""
    x, z = inputs(m, h)
    full = torch.cat([window, x])  # (K-1+T, I)
    xc = F.silu(F.conv1d(full.t()[None], m.conv1d.weight, m.conv1d.bias, groups=m.intermediate_size))[0].t()
    dt, B, C = selective(m, xc)
    xc = xc.float()
    A = -m.A_log.float().exp()  # (I, N)
    state = state.reshape(A.shape)
    ys, states = [], []
    for t in range(h.shape[0]):
        g, d = dt[t, :, None] * A, dt[t] * xc[t]  # (I, N), (I,)
        state = g.exp() * state + d[:, None] * B[t]  # (I, N)
        ys.append(state @ C[t] + m.D * xc[t])
        states.append(state.flatten()[None])
    y = output(m, torch.stack(ys)[..., None], z, torch.zeros_like(h))
    T = dt.shape[0]
    return y, x, state.reshape(1, 1, -1), (xc.new_zeros(T, 1, 1), torch.stack(states), xc.new_zeros(T, 1))
