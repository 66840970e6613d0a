"""Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-Hybrid): a causal depthwise conv + SiLU over q, k and v, then the
gated delta rule.

Per head the state evolves as `S_t = exp(g_t) S_{t-1} + k_t delta_t^T` with the delta-rule correction
`delta_t = beta_t (v_t - S'^T k_t)`, which depends on the state and is therefore logged (`Step.d`); g is a log decay
per head. The fast path runs its four input projections as one matmul, its q/k l2norms as one `rms_norm`, and the
kernel `deltaspec.shared.kernels.gated_delta_rule` picks by device, dtype and token count. OLMo-Hybrid's beta
reaches 2 (`linear_beta_scale`, its `allow_neg_eigval`): beta only scales the correction, which is logged as computed,
so the state algebra and the commit are unchanged.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.kernels import gated_delta_rule
from deltaspec.shared.kernels.conv import causal_conv
from deltaspec.shared.model.norms import GatedRMSNorm, concat, l2norm
from deltaspec.shared.state.access import StateAccess
from deltaspec.shared.state.rollback import RecurrentSlot
from deltaspec.shared.state.spec import RECURRENT
from deltaspec.shared.state.steps import Start, Step


class GDNFields(Protocol):
    """What the mixer reads of `ModelConfig` (which imports the families, which import the mixers)."""

    hidden_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    linear_beta_scale: float
    rms_norm_eps: float

    @property
    def conv_dim(self) -> int: ...

    @property
    def value_dim(self) -> int: ...


L2NORM_EPS = 1e-6  # the l2norm of q and k (HF's default, not the config's rms_norm_eps)


@dataclass
class FusedGDN:
    w_in: Tensor  # (conv_dim + value_dim + 2 Hv, hidden): in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    splits: tuple[int, int, int, int]
    conv_taps: Tensor  # (conv_dim, K): the depthwise conv weight
    qk_scale: Tensor  # (2 n_k, 1): rms_norm(x, eps/d) * scale = l2norm(x) * (d^-1/2 for q, 1 for k)
    neg_a: Tensor  # (Hv,) -exp(A_log)
    dt_bias: Tensor  # (Hv,) float32
    out_t: Tensor  # out_proj.weight.t(), a view (addmm takes the residual)


class GatedDeltaNet(nn.Module):
    state = RECURRENT
    compiles = True  # its fast path traces into a graph whose token count is symbolic

    def __init__(self, cfg: GDNFields, norm_eps: float | None = None) -> None:
        """`norm_eps`: the gated output norm's eps where a family fixes it (OLMo-Hybrid's 1e-5), else
        `rms_norm_eps`."""
        super().__init__()
        self.n_k, self.n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.d_k, self.d_v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.beta_scale = cfg.linear_beta_scale
        self.kernel_name = "auto"
        conv_dim, width = cfg.conv_dim, cfg.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, cfg.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.n_v, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, width, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.n_v).uniform_(0.01, 16)))
        self.norm = GatedRMSNorm(self.d_v, cfg.rms_norm_eps if norm_eps is None else norm_eps)
        self.out_proj = nn.Linear(cfg.value_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, st: RecurrentSlot, start: int = 0, rope: object = None) -> Tensor:
        """The reference: one sequence's T tokens `(T, hidden)`, staged into its slot."""
        T = x.shape[0]
        mixed = self.in_proj_qkv(x)  # (T, conv_dim)
        window = torch.cat([st.conv_window().to(mixed.dtype), mixed], dim=0)  # (K-1+T, conv_dim)
        conv = F.silu(F.conv1d(window.t()[None], self.conv1d.weight, groups=window.shape[1]))[0].t()  # (T, conv_dim)
        key_dim = self.n_k * self.d_k
        q, k, v = conv.split([key_dim, key_dim, self.n_v * self.d_v], dim=-1)
        rep = self.n_v // self.n_k
        q = l2norm(q.float().view(T, self.n_k, self.d_k)).repeat_interleave(rep, dim=1) * self.d_k**-0.5
        k = l2norm(k.float().view(T, self.n_k, self.d_k)).repeat_interleave(rep, dim=1)  # (T, Hv, Dk)
        v = v.float().view(T, self.n_v, self.d_v)
        beta = self.in_proj_b(x).float().sigmoid()  # (T, Hv)
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        out, delta, final, logged = gated_delta_rule(self.kernel_name, q, k, v, g, beta, st.initial_state(),
                                                     logs=lambda: st.verify_logs(T))
        st.stage(mixed, k, delta, g, final, kernel_logged=logged)
        z = self.in_proj_z(x).view(T, self.n_v, self.d_v)
        out = self.norm(out.to(x.dtype), z)  # (T, Hv, Dv)
        return self.out_proj(out.reshape(T, -1))

    def fuse(self) -> FusedGDN:
        splits = (self.in_proj_qkv.weight.shape[0], self.in_proj_z.weight.shape[0], self.n_v, self.n_v)
        return FusedGDN(w_in=concat(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a), splits=splits,
                        conv_taps=self.conv1d.weight.detach()[:, 0],
                        qk_scale=qk_scale(self.n_k, self.d_k, self.A_log.device),
                        neg_a=-self.A_log.detach().float().exp(), dt_bias=self.dt_bias.detach().float(),
                        out_t=self.out_proj.weight.detach().t())

    def fused(self, f: FusedGDN, h: Tensor, residual: Tensor, rope: object, access: StateAccess, i: int) -> Tensor:
        """Recurrent layer i on the normed input h `(N, hidden)`, added to the residual: one matmul in, the state
        access runs the conv window, the recurrence and the staging, the gated norm and one addmm out."""
        mixed, z, b, a = F.linear(h, f.w_in).split(f.splits, dim=-1)
        out = access.recurrent(i, mixed, (b, a), functools.partial(recurrence, self, f))
        return output(self.norm, out, z, residual, f.out_t)


def conv_qkv(m: Any, f: Any, full: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Conv + SiLU, then l2-normed q (times Dk^-1/2) and k, and v, from `full = [window; x]` `(..., K-1+T, conv_dim)`
    (any leading axes: a batch of sequences), `f.conv_taps` and `f.qk_scale` as `fuse` makes them; key heads repeated
    to the value heads. q, k `(..., T, Hv, Dk)`, v `(..., T, Hv, Dv)`, float32. KDA's (`kda.py`) too."""
    conv = F.silu(causal_conv(full, f.conv_taps))
    if conv.dtype != torch.float32:  # the delta rule runs in float32 (no cast, no dispatch, for float32 models)
        conv = conv.float()
    lead, key_dim = conv.shape[:-1], m.n_k * m.d_k
    qk, v = conv.split([2 * key_dim, m.n_v * m.d_v], dim=-1)
    qk = F.rms_norm(qk.view(*lead, 2 * m.n_k, m.d_k), (m.d_k,), eps=L2NORM_EPS / m.d_k) * f.qk_scale
    if m.n_v != m.n_k:
        qk = qk.repeat_interleave(m.n_v // m.n_k, dim=-2)
    q, k = qk.split(m.n_v, dim=-2)
    return q, k, v.view(*lead, m.n_v, m.d_v)


def qk_scale(n_k: int, d_k: int, device: torch.device) -> Tensor:
    """`(2 n_k, 1)`: rms_norm(x, eps/d) * scale = l2norm(x) * (d^-1/2 for q, 1 for k)."""
    return torch.tensor([d_k**-1.0] * n_k + [d_k**-0.5] * n_k, device=device)[:, None]


def gates(m: GatedDeltaNet, f: FusedGDN, full: Tensor, b: Tensor,
          a: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k, v (`conv_qkv`), beta and the log decay g per head from b, a `(..., T, Hv)`."""
    q, k, v = conv_qkv(m, f, full)
    if b.dtype != torch.float32:
        b, a = b.float(), a.float()
    beta = b.sigmoid() if m.beta_scale == 1.0 else b.sigmoid() * m.beta_scale  # no op where beta stays in [0, 1]
    return q, k, v, beta, f.neg_a * F.softplus(a + f.dt_bias)


Gates = Callable[..., tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]  # (m, f, full, *inputs) -> q, k, v, beta, g


def recurrence(m: Any, f: Any, full: Tensor, inputs: tuple[Tensor, ...], start: Start, gates: Gates = gates) -> Step:
    """The layer's `Recurrence`: its `gates` (GDN's, or KDA's, whose log decay g has a key-channel axis), then the
    delta rule from `start`; a batch's padding gets beta = g = 0."""
    q, k, v, beta, g = gates(m, f, full, *inputs)
    if start.valid is not None:  # padding neither decays nor writes the state
        beta, g = beta * start.valid, g * (start.valid if g.dim() == beta.dim() else start.valid[..., None])
    out, delta, final, logged = gated_delta_rule(m.kernel_name, q, k, v, g, beta, start.initial, start.out_state,
                                                 start.logs, start.static)
    return Step(out, k, delta, g, final, logged)


def output(norm: GatedRMSNorm, out: Tensor, z: Tensor, residual: Tensor, out_t: Tensor) -> Tensor:
    """Gated norm of the delta rule's output `(T, Hv, Dv)` by its gate z `(T, Hv Dv)`, and the output projection
    `out_t` (its weight transposed), added to the residual."""
    T, H, D = out.shape
    if out.dtype != residual.dtype:
        out = out.to(residual.dtype)
    out = F.rms_norm(out, (D,), norm.weight, norm.eps) * norm.act(z.view(T, H, D))
    return torch.addmm(residual, out.view(T, -1), out_t)
