"""Kimi Delta Attention (Kimi Linear, Bailing hybrid): Gated DeltaNet's relative whose decay is a vector over key
channels.

Per head the state evolves as `S_t = D(g_t) S_{t-1} + k_t delta_t^T`, D(g) = diag(exp(g)) over the Dk rows, with
GDN's delta-rule correction `delta_t = beta_t (v_t - S'^T k_t)`; what a token logs is GDN's (k, delta) plus a log
decay per key channel, `(H, Dk)` (state kind "kda", `DECAYS["kda"] == "key"`), and the commit is the one closed form
scaling rows. Everything else is GDN's, reused from `gdn.py`: the conv over [q; k; v] with SiLU, the l2norms
(q times Dk^-1/2), the kernels (`gated_delta_rule`, whose loops, step and chunks take a per-channel g; the Triton
kernel decays per head and is not used) and the gated output norm, here gated by sigmoid (HF's `o_norm`).

The two families differ in their gates only: Kimi's forget gate `f_b_proj(f_a_proj(x))` and output gate
`g_b_proj(g_a_proj(x))` are low rank (rank Dk), its log decay `-exp(A_log) softplus(f + dt_bias)`; Bailing's are
full rank (`f_proj`, `g_proj`), its "safe" decay `lower_bound * sigmoid(exp(A_log) (f + dt_bias))` (or Kimi's),
rounded to the model's dtype as HF rounds it. q, k and v have one head count and one head dim (no grouping).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.kernels import gated_delta_rule
from deltaspec.shared.model.mixers import gdn
from deltaspec.shared.model.norms import GatedRMSNorm, concat, l2norm
from deltaspec.shared.state.access import StateAccess
from deltaspec.shared.state.rollback import RecurrentSlot
from deltaspec.shared.state.spec import RECURRENT


class KDAFields(Protocol):
    """What the mixer reads of `ModelConfig`: H heads of D for q, k and v alike (`linear_num_value_heads`,
    `linear_value_head_dim`); `kda_lower_bound` None for the softplus decay."""

    hidden_size: int
    linear_num_value_heads: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    kda_lower_bound: float | None
    rms_norm_eps: float


@dataclass(frozen=True)
class KDAForm:
    """What sets a family's KDA apart: `low_rank`, Kimi's forget and output gates through rank-D projections
    (`f_a_proj`/`f_b_proj`, `g_a_proj`/`g_b_proj`), else Bailing's full-rank `f_proj`, `g_proj`; `a_log_4d`, A_log
    held `(1, 1, H, 1)` (Kimi's) rather than `(H,)`; `rounded_decay`, the log decay rounded to the model's dtype
    (Bailing's); `keep_float32`, the tensors HF keeps in float32 whatever the model's dtype."""

    low_rank: bool
    a_log_4d: bool
    rounded_decay: bool
    keep_float32: tuple[str, ...]


@dataclass
class FusedKDA:
    w_in: Tensor  # (3 H D + H + 2 R, hidden): q_proj, k_proj, v_proj, b_proj, f_a_proj|f_proj, g_a_proj|g_proj
    splits: tuple[int, int, int, int]
    conv_taps: Tensor  # (3 H D, K)
    qk_scale: Tensor  # (2 H, 1), as GDN's
    neg_a: Tensor  # (H, 1) -exp(A_log) (or +exp(A_log) for the safe gate's sigmoid), float32
    dt_bias: Tensor  # (H, D) float32
    f_b: Tensor | None  # (H D, D) the low-rank gates' second halves; None where full rank
    g_b: Tensor | None
    out_t: Tensor  # o_proj.weight.t(), a view


class KimiDeltaAttention(nn.Module):
    state = RECURRENT
    compiles = True

    def __init__(self, cfg: KDAFields, form: KDAForm) -> None:
        super().__init__()
        H, D, hidden = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.hidden_size
        self.n_k = self.n_v = H
        self.d_k = self.d_v = D
        self.lower_bound, self.rounded_decay, self.keep_float32 = cfg.kda_lower_bound, form.rounded_decay, \
            form.keep_float32
        self.kernel_name = "auto"
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, H * D, bias=False) for _ in range(3))
        self.conv1d = nn.Conv1d(3 * H * D, 3 * H * D, cfg.linear_conv_kernel_dim, groups=3 * H * D, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty((1, 1, H, 1) if form.a_log_4d else (H,)).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(torch.zeros(H * D))
        self.b_proj = nn.Linear(hidden, H, bias=False)
        if form.low_rank:
            self.f_a_proj, self.f_b_proj = nn.Linear(hidden, D, bias=False), nn.Linear(D, H * D, bias=False)
            self.g_a_proj, self.g_b_proj = nn.Linear(hidden, D, bias=False), nn.Linear(D, H * D, bias=False)
        else:
            self.f_proj, self.g_proj = nn.Linear(hidden, H * D, bias=False), nn.Linear(hidden, H * D, bias=False)
        self.o_norm = GatedRMSNorm(D, cfg.rms_norm_eps, torch.sigmoid)
        self.o_proj = nn.Linear(H * D, hidden, bias=False)

    @property
    def low_rank(self) -> bool:
        return hasattr(self, "f_a_proj")

    def forward(self, x: Tensor, st: RecurrentSlot, start: int = 0, rope: object = None) -> Tensor:
        """The reference: one sequence's T tokens `(T, hidden)`, staged into its slot, as HF's layer computes them."""
        T, H, D = x.shape[0], self.n_v, self.d_v
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # (T, 3 H D)
        window = torch.cat([st.conv_window().to(mixed.dtype), mixed], dim=0)  # (K-1+T, 3 H D)
        taps = self.conv1d.weight  # float32 where HF keeps it so (`keep_float32`), as HF then convolves
        conv = F.silu(F.conv1d(window.t()[None].to(taps.dtype), taps, groups=window.shape[1]))[0].t()
        q, k, v = (t.float().view(T, H, D) for t in conv.split(H * D, dim=-1))
        q, k = l2norm(q) * D**-0.5, l2norm(k)
        beta = self.b_proj(x).float().sigmoid()  # (T, H)
        f = self.f_b_proj(self.f_a_proj(x)) if self.low_rank else self.f_proj(x)
        f = f.float().view(T, H, D) + self.dt_bias.float().view(H, D)
        rate = self.A_log.float().exp().view(H, 1)
        g = -rate * F.softplus(f) if self.lower_bound is None else self.lower_bound * torch.sigmoid(rate * f)
        if self.rounded_decay:
            g = g.to(x.dtype).float()
        out, delta, final, logged = gated_delta_rule(self.kernel_name, q, k, v, g, beta, st.initial_state(),
                                                     logs=lambda: st.verify_logs(T))
        st.stage(mixed, k, delta, g, final, kernel_logged=logged)
        gate = self.g_b_proj(self.g_a_proj(x)) if self.low_rank else self.g_proj(x)
        out = self.o_norm(out.to(x.dtype), gate.view(T, H, D))
        return self.o_proj(out.reshape(T, -1))

    def fuse(self) -> FusedKDA:
        H, D = self.n_v, self.d_v
        gates = (self.f_a_proj, self.g_a_proj) if self.low_rank else (self.f_proj, self.g_proj)
        rate = self.A_log.detach().float().exp().view(H, 1)
        return FusedKDA(
            w_in=concat(self.q_proj, self.k_proj, self.v_proj, self.b_proj, *gates),
            splits=(3 * H * D, H, gates[0].weight.shape[0], gates[1].weight.shape[0]),
            conv_taps=self.conv1d.weight.detach()[:, 0], qk_scale=gdn.qk_scale(H, D, self.A_log.device),
            neg_a=-rate if self.lower_bound is None else rate, dt_bias=self.dt_bias.detach().float().view(H, D),
            f_b=self.f_b_proj.weight.detach() if self.low_rank else None,
            g_b=self.g_b_proj.weight.detach() if self.low_rank else None, out_t=self.o_proj.weight.detach().t())

    def fused(self, f: FusedKDA, h: Tensor, residual: Tensor, rope: object, access: StateAccess, i: int) -> Tensor:
        """Recurrent layer i on the normed input h `(N, hidden)`, added to the residual: one matmul in (the gates'
        low-rank second halves after it), the state access runs the conv window, the recurrence and the staging,
        then GDN's gated norm and one addmm out."""
        mixed, b, forget, z = F.linear(h, f.w_in).split(f.splits, dim=-1)
        if f.f_b is not None:
            forget, z = F.linear(forget, f.f_b), F.linear(z, f.g_b)
        a = forget.view(h.shape[0], self.n_v, self.d_v)
        out = access.recurrent(i, mixed, (b, a), functools.partial(gdn.recurrence, self, f, gates=gates))
        return gdn.output(self.o_norm, out, z, residual, f.out_t)


def gates(m: KimiDeltaAttention, f: FusedKDA, full: Tensor, b: Tensor,
          a: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k, v (GDN's `conv_qkv`), beta from b `(..., T, H)`, and the log decay per key channel `(..., T, H, D)` from
    the forget gate's a `(..., T, H, D)`."""
    q, k, v = gdn.conv_qkv(m, f, full)
    dtype = b.dtype
    if dtype != torch.float32:
        b, a = b.float(), a.float()
    if m.lower_bound is None:
        g = f.neg_a * F.softplus(a + f.dt_bias)
    else:
        g = m.lower_bound * torch.sigmoid(f.neg_a * (a + f.dt_bias))
    if m.rounded_decay and dtype != torch.float32:
        g = g.to(dtype).float()
    return q, k, v, b.sigmoid(), g
