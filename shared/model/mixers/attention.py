"""Full attention with grouped K/V, as the families have it: Qwen's (q/k RMSNorm, partial rotary, a per-head sigmoid
output gate) or the plain one (Nemotron-H: no norm, no rotary, no gate), by the config's switches (OLMo's q/k norms
span the whole projection, all heads at once). Granite's softmax scale (`attention_scale`, in place of 1/sqrt(D))
scales q before the state access attends at 1/sqrt(D); its `residual_multiplier` scales the output as it is added
to the residual. Falcon-H1's multipliers scale the input and the keys (`in_multiplier`, `key_multiplier`); Zamba2's
projections take [hidden; embeddings] (`input_size`) and its adapters add a `delta` to them. RecurrentGemma's local
attention sees the last `attention_window` positions only, and biases o_proj alone (`attention_out_bias`).

K/V are written past the committed length and cut by position, so a rejected token costs nothing to roll back. The
fast path runs q (with its gate), k and v as one matmul (their biases as one) and q and k through one rotary call;
where K/V live and how they are read is the state access's business (`StateAccess.attend`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.model.norms import RMSNorm, concat
from deltaspec.shared.model.rotary import apply_partial_rotary, rotary
from deltaspec.shared.state.access import StateAccess, attend
from deltaspec.shared.state.rollback import AttnLayerState
from deltaspec.shared.state.spec import ATTENTION



class AttentionFields(Protocol):
    """What the mixer reads of `ModelConfig` (which imports the families, which import the mixers)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    attention_out_bias: bool | None
    attention_window: int
    attention_output_gate: bool
    attention_qk_norm: bool
    attention_qk_norm_per_head: bool
    rms_norm_eps: float
    norm_offset: float
    attention_scale: float | None
    residual_multiplier: float

    @property
    def rotary_dim(self) -> int: ...


@dataclass
class FusedAttention:
    w_qkv: Tensor  # ((1 or 2) H D + 2 Hkv D, hidden): q_proj (query, and its gate), k_proj, v_proj
    splits: tuple[int, int, int]
    q_norm: Tensor | None  # (D,) folded norm weights; None without q/k norms
    k_norm: Tensor | None
    out_t: Tensor  # o_proj.weight.t(), a view
    b_qkv: Tensor | None = None  # the projections' biases (`attention_bias`), concatenated as w_qkv is
    b_out: Tensor | None = None  # o_proj's, times the output multiplier


class Attention(nn.Module):
    state = ATTENTION
    compiles = True  # its fast path traces into a graph whose token count is symbolic

    def __init__(self, cfg: AttentionFields, in_multiplier: float = 1.0, key_multiplier: float = 1.0,
                 out_multiplier: float | None = None, input_size: int | None = None) -> None:
        """Falcon-H1's multipliers: `in_multiplier` scales the input before the projections, `key_multiplier` the
        keys as projected, `out_multiplier` the output (default: the config's `residual_multiplier`). `input_size`:
        the projections' input width where it is not the hidden size (Zamba2's [hidden; embeddings])."""
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.gated, self.rotary = cfg.attention_output_gate, cfg.rotary_dim > 0
        # q times this, attended at 1/sqrt(D), is attended at `attention_scale`
        self.q_scale = 1.0 if cfg.attention_scale is None else cfg.attention_scale * math.sqrt(self.head_dim)
        self.in_multiplier, self.key_multiplier = in_multiplier, key_multiplier
        self.out_multiplier = cfg.residual_multiplier if out_multiplier is None else out_multiplier
        self.window = cfg.attention_window or None  # a sliding window's width, None: every position
        bias, width = cfg.attention_bias, input_size or cfg.hidden_size
        out_bias = bias if cfg.attention_out_bias is None else cfg.attention_out_bias
        self.q_proj = nn.Linear(width, (1 + self.gated) * self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=out_bias)
        self.norm_per_head = cfg.attention_qk_norm_per_head
        if cfg.attention_qk_norm:
            q_heads, k_heads = (1, 1) if self.norm_per_head else (self.n_heads, self.n_kv)
            self.q_norm = RMSNorm(q_heads * self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(k_heads * self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: Tensor, st: AttnLayerState, start: int, rope: tuple[Tensor, Tensor],
                delta: Tensor | None = None) -> Tensor:
        """The reference: one sequence's T tokens `(T, hidden)` at positions start.., `rope` their (cos, sin);
        `delta` is added to [q; k; v] as projected (Zamba2's adapters)."""
        T = x.shape[0]
        if self.in_multiplier != 1.0:
            x = x * self.in_multiplier
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if delta is not None:
            q, k, v = (p + d for p, d in zip((q, k, v), delta.split([q.shape[-1], k.shape[-1], v.shape[-1]], -1)))
        q = q.view(T, self.n_heads, (1 + self.gated) * self.head_dim)
        q, gate = q.chunk(2, dim=-1) if self.gated else (q, None)
        k = k.view(T, self.n_kv, self.head_dim)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        if self.q_norm is not None:
            q, k = self._normed(self.q_norm, q), self._normed(self.k_norm, k)
        if self.rotary:
            q, k = apply_partial_rotary(q, *rope), apply_partial_rotary(k, *rope)  # (T, H, D)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        v = v.view(T, self.n_kv, self.head_dim)
        out = attend(st, q, k, v, start, self.window).reshape(T, -1)  # (T, H D)
        out = self.o_proj(out if gate is None else out * torch.sigmoid(gate.reshape(T, -1)))
        return out if self.out_multiplier == 1.0 else out * self.out_multiplier

    def _normed(self, norm: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """`norm` over each head of x `(T, H, D)`, or over all its heads at once (OLMo's)."""
        return norm(x) if self.norm_per_head else norm(x.flatten(-2)).view_as(x)

    def fuse(self) -> FusedAttention:
        splits = (self.q_proj.weight.shape[0], self.k_proj.weight.shape[0], self.v_proj.weight.shape[0])
        norms = (None, None) if self.q_norm is None else (self.q_norm.folded(), self.k_norm.folded())
        biases = [lin.bias for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj)]
        return FusedAttention(w_qkv=concat(self.q_proj, self.k_proj, self.v_proj), splits=splits, q_norm=norms[0],
                              k_norm=norms[1], out_t=self.o_proj.weight.detach().t(),
                              b_qkv=None if biases[0] is None else torch.cat(biases[:3]).detach(),
                              b_out=None if biases[3] is None else biases[3].detach() * self.out_multiplier)

    def fused(self, f: FusedAttention, h: Tensor, residual: Tensor, rope: tuple[Tensor, Tensor],
              access: StateAccess, j: int, delta: Tensor | None = None) -> Tensor:
        """Attention layer j (among the attention layers) on the normed input h, added to the residual; `rope` is
        (cos, `rotary_signed` sin) at the tokens' positions; `delta` as the reference's."""
        T, H, Hkv, D = h.shape[0], self.n_heads, self.n_kv, self.head_dim
        if self.in_multiplier != 1.0:
            h = h * self.in_multiplier
        qkv = F.linear(h, f.w_qkv, f.b_qkv)
        q_gate, k, v = (qkv if delta is None else qkv + delta).split(f.splits, dim=-1)
        q_gate = q_gate.view(T, H, (1 + self.gated) * D)
        q, k = q_gate[..., :D], k.view(T, Hkv, D)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        if f.q_norm is not None:
            q = self._normed(lambda x: F.rms_norm(x, f.q_norm.shape, f.q_norm, self.q_norm.eps), q)
            k = self._normed(lambda x: F.rms_norm(x, f.k_norm.shape, f.k_norm, self.k_norm.eps), k)
        if self.rotary:
            q, k = rotary(torch.cat([q, k], dim=1), *rope).split([H, Hkv], dim=1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = access.attend(j, q, k, v.view(T, Hkv, D), self.window)
        if self.gated:
            out = out * torch.sigmoid(q_gate[..., D:])
        out = torch.addmm(residual, out.reshape(T, -1), f.out_t, alpha=self.out_multiplier)
        return out if f.b_out is None else out + f.b_out
