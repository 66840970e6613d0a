"""Multi-head latent attention (DeepSeek's MLA, as Kimi Linear and Bailing hybrid have it).

Each token's keys and values come from one latent: `c = RMSNorm(kv_a(x)[:r])` (r = `kv_lora_rank`) up-projected per
head by `kv_b_proj` to [k_nope; v], and a rotary part `k_rot` shared by every head (Kimi: no rotary at all, NoPE;
Bailing: DeepSeek's interleaved rotary, applied here as rotate-half on de-interleaved channels, for q and k alike,
which leaves every dot product as it is). Queries come from `q_proj` (or `q_a_proj`, its norm and `q_b_proj`).
Softmax scale (Dn + Dr)^-1/2; Bailing gates each head's output by sigmoid(`g_proj` x).

What is cached: the latent [c; k_rot] `(1, r + Dr)` per position, as one K/V head, and not the up-projected per-head
K `(H, Dn + Dr)` and V `(H, Dv)`. The latent is what HF caches too, it has one head dim (the state floor's K and V
share one), and it is H (Dn + Dr + Dv) / (2 (r + Dr)) times smaller even though the state floor keeps it twice, as K
and as V (Kimi-Linear-48B: 8.9 times). Rollback is attention's: cut by position. The reference (`forward`) up-projects
the cached latents of every position and attends per head, as HF does; the fast path attends on the latents
themselves ("absorbed": q_nope through each head's key up-projection into the latent space, so q . k_nope =
(q_nope W_uk) . c, and the attention-weighted latent through each head's value up-projection after), one K/V head
under `StateAccess.attend`, so every pass (eager, static, batched) serves it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.model.norms import RMSNorm, concat
from deltaspec.shared.model.rotary import apply_partial_rotary, rotary
from deltaspec.shared.state.access import StateAccess
from deltaspec.shared.state.rollback import AttnLayerState
from deltaspec.shared.state.spec import ATTENTION

LATENT_NORM_EPS = 1e-6  # HF's q_a_layernorm and kv_a_layernorm: their default eps, whatever the config says


class MLAFields(Protocol):
    """What the mixer reads of `ModelConfig`; `q_lora_rank` 0: one query projection; `rotary_dim` 0: no rotary."""

    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    attention_output_gate: bool

    @property
    def rotary_dim(self) -> int: ...


@dataclass
class FusedMLA:
    w_in: Tensor  # (q rows + r + Dr [+ H], hidden): q_proj (or q_a_proj), kv_a_proj_with_mqa[, g_proj]
    b_in: Tensor | None  # their biases (`attention_bias`; zeros where a projection has none)
    splits: tuple[int, ...]
    q_norm: Tensor | None  # q_a_layernorm's folded weight; None without a query low rank
    q_b: Tensor | None  # q_b_proj.weight
    kv_norm: Tensor  # kv_a_layernorm's folded weight
    w_uk: Tensor  # (H, Dn, r) each head's key up-projection
    w_uv_t: Tensor  # (H, r, Dv) each head's value up-projection, transposed
    q_scale: float  # so that SDPA's (r + Dr)^-1/2 attends at (Dn + Dr)^-1/2
    out_t: Tensor  # o_proj.weight.t(), a view
    b_out: Tensor | None


def deinterleave(x: Tensor) -> Tensor:
    """Channels (0, 2, 4, ..., 1, 3, 5, ...): DeepSeek's interleaved rotary is rotate-half on these."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class LatentAttention(nn.Module):
    state = ATTENTION
    compiles = True

    def __init__(self, cfg: MLAFields) -> None:
        super().__init__()
        self.n_heads, hidden, bias = cfg.num_attention_heads, cfg.hidden_size, cfg.attention_bias
        self.d_nope, self.d_rope, self.d_v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank, self.q_rank = cfg.kv_lora_rank, cfg.q_lora_rank
        self.rotary, self.gated = cfg.rotary_dim > 0, cfg.attention_output_gate
        self.scale = (self.d_nope + self.d_rope) ** -0.5
        q_out = self.n_heads * (self.d_nope + self.d_rope)
        if self.q_rank:
            self.q_a_proj = nn.Linear(hidden, self.q_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_rank, LATENT_NORM_EPS, 0.0)
            self.q_b_proj = nn.Linear(self.q_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.d_rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, 0.0)
        self.kv_b_proj = nn.Linear(self.rank, self.n_heads * (self.d_nope + self.d_v), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.d_v, hidden, bias=bias)
        if self.gated:
            self.g_proj = nn.Linear(hidden, self.n_heads, bias=False)

    def _rope(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        return apply_partial_rotary(deinterleave(x), *rope) if self.rotary else x

    def forward(self, x: Tensor, st: AttnLayerState, start: int, rope: tuple[Tensor, Tensor]) -> Tensor:
        """The reference, as HF computes it: one sequence's T tokens `(T, hidden)` at positions start.., their latents
        cached, every cached latent up-projected per head, attended."""
        T, H, r = x.shape[0], self.n_heads, self.rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_rank else self.q_proj(x)
        q_nope, q_rot = q.view(T, H, -1).split([self.d_nope, self.d_rope], dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([r, self.d_rope], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c), self._rope(k_rot[:, None], rope)[:, 0]], dim=-1)  # (T, r + Dr)
        end = start + T
        st.ensure_capacity(end)
        st.k[0, start:end] = latent
        st.v[0, start:end] = latent
        cached = st.k[0, :end]
        k_nope, v = self.kv_b_proj(cached[:, :r]).view(end, H, -1).split([self.d_nope, self.d_v], dim=-1)
        k = torch.cat([k_nope, cached[:, None, r:].expand(end, H, self.d_rope)], dim=-1)
        query = torch.cat([q_nope, self._rope(q_rot, rope)], dim=-1)
        mask = torch.ones(T, end, dtype=torch.bool, device=x.device).tril(start)
        out = F.scaled_dot_product_attention(query.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask, scale=self.scale).transpose(0, 1)  # (T, H, Dv)
        if self.gated:
            out = out * torch.sigmoid(self.g_proj(x).float()).to(x.dtype)[..., None]
        return self.o_proj(out.reshape(T, -1))

    def fuse(self) -> FusedMLA:
        ins = [self.q_a_proj if self.q_rank else self.q_proj, self.kv_a_proj_with_mqa]
        ins += [self.g_proj] if self.gated else []
        biases = None
        if self.kv_a_proj_with_mqa.bias is not None:
            biases = torch.cat([lin.weight.new_zeros(lin.weight.shape[0]) if lin.bias is None else lin.bias.detach()
                                for lin in ins])
        up = self.kv_b_proj.weight.detach().view(self.n_heads, self.d_nope + self.d_v, self.rank)
        return FusedMLA(w_in=concat(*ins), b_in=biases, splits=tuple(lin.weight.shape[0] for lin in ins),
                        q_norm=self.q_a_layernorm.folded() if self.q_rank else None,
                        q_b=self.q_b_proj.weight.detach() if self.q_rank else None,
                        kv_norm=self.kv_a_layernorm.folded(), w_uk=up[:, :self.d_nope],
                        w_uv_t=up[:, self.d_nope:].transpose(1, 2),
                        q_scale=self.scale * (self.rank + self.d_rope) ** 0.5, out_t=self.o_proj.weight.detach().t(),
                        b_out=None if self.o_proj.bias is None else self.o_proj.bias.detach())

    def fused(self, f: FusedMLA, h: Tensor, residual: Tensor, rope: tuple[Tensor, Tensor], access: StateAccess,
              j: int) -> Tensor:
        """Attention layer j on the normed input h, added to the residual, attending on the latents ("absorbed");
        `rope` is (cos, `rotary_signed` sin)."""
        T, H, r = h.shape[0], self.n_heads, self.rank
        q, latent, *gate = F.linear(h, f.w_in, f.b_in).split(f.splits, dim=-1)
        if f.q_b is not None:
            q = F.linear(F.rms_norm(q, (self.q_rank,), f.q_norm, LATENT_NORM_EPS), f.q_b)
        q_nope, q_rot = q.view(T, H, -1).split([self.d_nope, self.d_rope], dim=-1)
        c, k_rot = latent.split([r, self.d_rope], dim=-1)
        k_rot = k_rot[:, None]
        if self.rotary:
            q_rot, k_rot = rotary(deinterleave(torch.cat([q_rot, k_rot], dim=1)), *rope).split([H, 1], dim=1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), f.w_uk).transpose(0, 1)  # (T, H, r)
        query = torch.cat([q_latent, q_rot], dim=-1) * f.q_scale
        latent = torch.cat([F.rms_norm(c, (r,), f.kv_norm, LATENT_NORM_EPS)[:, None], k_rot], dim=-1)  # (T, 1, r+Dr)
        out = access.attend(j, query, latent, latent)[..., :r]  # (T, H, r)
        out = torch.bmm(out.transpose(0, 1), f.w_uv_t).transpose(0, 1)  # (T, H, Dv)
        if gate:
            out = out * torch.sigmoid(gate[0].float()).to(out.dtype)[..., None]
        out = torch.addmm(residual, out.reshape(T, -1), f.out_t)
        return out if f.b_out is None else out + f.b_out
