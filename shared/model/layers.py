"""The layers of the Qwen hybrid stacks, in plain PyTorch, with HF's parameter names (Qwen3.5's GDN layout).

Every layer works on one sequence `(T, hidden)` and stages its tokens into its slice of a
`ModelState` (see `deltaspec.shared.state.rollback`); none of them changes the committed head.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.kernels import gated_delta_rule
from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.kernels.experts import apply_experts
from deltaspec.shared.model.moe import Experts, route
from deltaspec.shared.state.access import attend
from deltaspec.shared.state.rollback import AttnLayerState, RecurrentSlot


class RMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: the weight is stored as w and applied as (1 + w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the GDN output per value head (plain weight), then gated by silu(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Router (`gate`), routed experts, and a shared expert behind a sigmoid gate; HF's parameter names."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, intermediate: int, shared_intermediate: int,
                 renormalise: bool) -> None:
        super().__init__()
        self.top_k, self.renormalise = top_k, renormalise
        self.gate = nn.Linear(hidden, n_experts, bias=False)
        self.experts = Experts(n_experts, hidden, intermediate)
        self.shared_expert = MLP(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.touched: Tensor | int = 0  # distinct experts the last eager pass read

    def forward(self, x: Tensor) -> Tensor:
        weights, chosen = route(self.gate(x), self.top_k, self.renormalise)
        routed, self.touched = apply_experts(self.experts.gate_up_proj, self.experts.down_proj, x, weights, chosen)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Linear-attention layer: causal depthwise conv + SiLU, then the gated delta rule."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_k, self.n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.d_k, self.d_v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel_name = "auto"
        conv_dim, width = cfg.conv_dim, cfg.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, cfg.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.n_v, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, width, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.n_v).uniform_(0.01, 16)))
        self.norm = GatedRMSNorm(self.d_v, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(cfg.value_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, st: RecurrentSlot) -> Tensor:
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
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        out, delta, final, logged = gated_delta_rule(self.kernel_name, q, k, v, g, beta, st.initial_state(),
                                                     logs=lambda: st.verify_logs(T))
        st.stage(mixed, k, delta, g, final, kernel_logged=logged)
        z = self.in_proj_z(x).view(T, self.n_v, self.d_v)
        out = self.norm(out.to(x.dtype), z)  # (T, Hv, Dv)
        return self.out_proj(out.reshape(T, -1))


@functools.lru_cache(maxsize=16)
def _inv_freq(dim: int, theta: float, device: torch.device) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def rotary_cos_sin(cfg: ModelConfig, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    freqs = positions.float()[:, None] * _inv_freq(cfg.rotary_dim, cfg.rope_theta, positions.device)  # (T, dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x `(T, H, D)`; rotate the first `cos.shape[-1]` dims (rotate-half convention), pass the rest."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos[:, None] + rotated * sin[:, None], rest], dim=-1)


class Attention(nn.Module):
    """Full attention with a per-head sigmoid output gate, q/k RMSNorm, partial rotary, grouped KV."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, st: AttnLayerState, start: int, rope: tuple[Tensor, Tensor]) -> Tensor:
        T = x.shape[0]
        q, gate = self.q_proj(x).view(T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_partial_rotary(self.q_norm(q), *rope)  # (T, H, D)
        k = apply_partial_rotary(self.k_norm(self.k_proj(x).view(T, self.n_kv, self.head_dim)), *rope)
        v = self.v_proj(x).view(T, self.n_kv, self.head_dim)
        out = attend(st, q, k, v, start)  # (T, H, D)
        out = out.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, sparse: bool = False) -> None:
        """`sparse`: a sparse MoE block (`deltaspec.shared.model.moe`) in place of the dense MLP."""
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp: MLP | SparseMoE = (
            SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                      cfg.shared_expert_intermediate_size, cfg.norm_topk_prob)
            if sparse else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, st: RecurrentSlot | AttnLayerState, start: int, rope: tuple[Tensor, Tensor]) -> Tensor:
        h = self.input_layernorm(x)
        if isinstance(st, RecurrentSlot):
            h = self.linear_attn(h, st)
        else:
            h = self.self_attn(h, st, start, rope)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridStack(nn.Module):
    """The embeddings, the decoder layers and the final norm (HF's `model.*` tensors)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kind, cfg.sparse(i)) for i, kind in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
