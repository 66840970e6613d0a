"""MiniMax's lightning attention (MiniMax-Text-01, HF 5.25's `MiniMaxLightningAttention`): linear attention whose
state decays by a constant per head, with HF's parameter names.

Per head h, with q, k, v = silu(qkv_proj x) split per head (each head's 3 D columns are [q | k | v]):

    S_t = exp(-s_h) S_{t-1} + k_t v_t^T,    o_t = S_t^T q_t    (no 1/sqrt(D) scale)

then one RMSNorm over all heads' outputs together (`norm`, eps 1e-6: HF's fixed one, not the config's), a sigmoid
gate `output_gate(x)` and `out_proj`, times `out_multiplier` (MiniMax's beta of the layer's residual). HF runs a
prefill block-wise (`block_size` tokens: masked products within a block, the state between blocks) and decode one
token at a time; both are this recurrence, which the fast path runs as `decay_scan` (one step, or chunks).

In the state algebra k_t = key, d_t = value and g_t = -s_h: nothing depends on the state, and there is no conv (the
state's window is empty, `conv_width` 1, and its pre-conv inputs are empty rows). The slope s_h is HF's buffer
`slope_rate` `(H, 1, 1)`, a function of the layer's index that `slope_rates` computes as HF does; a checkpoint
carries it (`save_pretrained` writes it), else the family fills it in from the config.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.kernels.decay_scan import decay_scan
from deltaspec.shared.model.norms import RMSNorm, concat
from deltaspec.shared.state.access import StateAccess
from deltaspec.shared.state.rollback import RecurrentSlot
from deltaspec.shared.state.spec import RECURRENT
from deltaspec.shared.state.steps import Start, Step

NORM_EPS = 1e-6  # the output norm's (HF builds it without the config's rms_norm_eps)


def slope_rates(heads: int, layer: int, n_layers: int) -> Tensor:
    """HF's `slope_rate` of layer `layer` of `n_layers`, `(H, 1, 1)` float32: 2^(-8 (h+1) / H), scaled down linearly
    with depth (to 1e-5 at the last layer); computed with HF's operations, so bit for bit its buffer."""
    base = 1 / (2 ** (8 / heads))
    factor = 1 - layer / (n_layers - 1 + 1e-5) + 1e-5
    return ((base ** (torch.arange(heads, device="cpu") + 1)) * factor)[:, None, None]


@dataclass
class FusedLightning:
    w_in: Tensor  # (4 H D, hidden): qkv_proj, output_gate
    neg_slope: Tensor  # (H,) float32: each token's log decay, -s_h
    norm: Tensor  # (H D,) the output norm's weight, folded
    out_t: Tensor  # out_proj.weight.t(), a view


class LightningAttention(nn.Module):
    state = RECURRENT
    compiles = True  # its fast path is Mamba2's ops (decay_scan), which trace with a symbolic token count

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, out_multiplier: float = 1.0) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.out_multiplier = num_heads, head_dim, out_multiplier
        width = num_heads * head_dim
        self.norm = RMSNorm(width, NORM_EPS, offset=0.0)
        self.qkv_proj = nn.Linear(hidden_size, 3 * width, bias=False)
        self.out_proj = nn.Linear(width, hidden_size, bias=False)
        self.output_gate = nn.Linear(hidden_size, width, bias=False)
        self.register_buffer("slope_rate", slope_rates(num_heads, 0, 1))  # the first layer's until loaded

    def forward(self, x: Tensor, st: RecurrentSlot, start: int = 0, rope: object = None) -> Tensor:
        """The reference: one sequence's T tokens `(T, hidden)` one at a time through the state, staged into its
        slot; what the layer adds to its residual."""
        T, H, D = x.shape[0], self.n_heads, self.head_dim
        q, k, v = F.silu(self.qkv_proj(x)).float().view(T, H, 3 * D).split(D, dim=-1)  # (T, H, D)
        g = -self.slope_rate.float().view(H)
        state, outs = st.initial_state(), []
        for t in range(T):
            state = g.exp()[:, None, None] * state + k[t, :, :, None] * v[t, :, None, :]  # (H, D, D)
            outs.append(torch.einsum("hk,hkv->hv", q[t], state))
        st.stage(x[:, :0], k, v, g.expand(T, H), state)
        y = self.norm(torch.stack(outs).flatten(1).to(x.dtype)) * torch.sigmoid(self.output_gate(x))
        y = self.out_proj(y)
        return y if self.out_multiplier == 1.0 else y * self.out_multiplier

    def fuse(self) -> FusedLightning:
        return FusedLightning(w_in=concat(self.qkv_proj, self.output_gate),
                              neg_slope=-self.slope_rate.detach().float().view(self.n_heads),
                              norm=self.norm.folded(), out_t=self.out_proj.weight.detach().t())

    def fused(self, f: FusedLightning, h: Tensor, residual: Tensor, rope: object, access: StateAccess,
              i: int) -> Tensor:
        """Recurrent layer i on the normed input h `(N, hidden)`, added to the residual: one matmul in (q, k, v and
        the gate), the recurrence through the state access (its pre-conv inputs empty rows), one addmm out."""
        qkv, gate = F.linear(h, f.w_in).split([3 * self.n_heads * self.head_dim, self.n_heads * self.head_dim], -1)
        out = access.recurrent(i, qkv[:, :0], (F.silu(qkv),), functools.partial(recurrence, self, f))
        return output(self, f, out, gate, residual)


def recurrence(m: LightningAttention, f: FusedLightning, full: Tensor, inputs: tuple[Tensor, ...],
               start: Start) -> Step:
    """The layer's `Recurrence`: `inputs` = (silu(qkv) `(..., T, 3 H D)`,); `full` is empty (no conv). A padding
    token (start.valid 0) gets g = 0 and k = 0: no decay and no write, so the state passes it unchanged."""
    (qkv,) = inputs
    q, k, v = qkv.float().unflatten(-1, (m.n_heads, 3 * m.head_dim)).split(m.head_dim, dim=-1)  # (..., T, H, D)
    g = f.neg_slope.expand(q.shape[:-1])  # (..., T, H)
    if start.valid is not None:
        g, k = g * start.valid, k * start.valid[..., None]
    out, final = decay_scan(q, k, v, g, start.initial, static=start.static)
    return Step(out, k, v, g, final)


def output(m: LightningAttention, f: FusedLightning, out: Tensor, gate: Tensor, residual: Tensor) -> Tensor:
    """The recurrence's output `(N, H, D)`: normed over all heads, gated by sigmoid(gate), projected and added to
    the residual times `out_multiplier`."""
    y = out.flatten(-2).to(residual.dtype)
    y = F.rms_norm(y, y.shape[-1:], f.norm, m.norm.eps) * torch.sigmoid(gate)
    return torch.addmm(residual, y, f.out_t, alpha=m.out_multiplier)
