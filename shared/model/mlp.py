"""The channel mixers after a layer's token mixer, with HF's parameter names, each with the faces the one pass uses
(`deltaspec.shared.model.mixers`): `forward` (the reference), `fuse()` and `fused(f, h, residual)` (the fast path,
its input projections as one matmul and the residual add riding on `addmm`). `out_multiplier` (Granite's
`residual_multiplier`) scales what a block adds to the residual: `addmm`'s and `add`'s alpha, no extra call."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.kernels.experts import apply_experts, relu_squared, swiglu
from deltaspec.shared.model.moe import Experts, GroupRouter, UngatedExperts, route, route_groups
from deltaspec.shared.model.norms import concat


@dataclass
class FusedMLP:
    w_in: Tensor  # (2 intermediate, hidden) [gate; up], or (intermediate, hidden) up alone
    down_t: Tensor  # down_proj.weight.t(), a view
    b_in: Tensor | None = None  # [gate; up] biases, with `bias` (Bamba's `mlp_bias`)
    b_out: Tensor | None = None  # down_proj.bias, times the MLP's out_multiplier


class MLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x) (Qwen, Llama, Bamba, Granite), with biases where the config asks for them,
    times `out_multiplier`; Falcon-H1's `gate_multiplier` scales the gate's projection before its activation;
    Zamba2's `act` (GELU) replaces SiLU, and its adapters add a `delta` to [gate; up] as projected; `limit` clips as
    `swiglu` does (Bailing's shared experts)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, out_multiplier: float = 1.0,
                 gate_multiplier: float = 1.0, act: Callable[[Tensor], Tensor] = F.silu,
                 limit: float | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.out_multiplier, self.gate_multiplier, self.act, self.limit = out_multiplier, gate_multiplier, act, limit

    def forward(self, x: Tensor, delta: Tensor | None = None) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if delta is not None:
            d_gate, d_up = delta.chunk(2, dim=-1)
            gate, up = gate + d_gate, up + d_up
        out = self.down_proj(self._gated(gate, up))
        return out if self.out_multiplier == 1.0 else out * self.out_multiplier

    def _gated(self, gate: Tensor, up: Tensor) -> Tensor:
        """act(gate times its multiplier) * up, both clipped where there is a `limit`."""
        gate = self.act(gate if self.gate_multiplier == 1.0 else gate * self.gate_multiplier)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return gate * up

    def fuse(self) -> FusedMLP:
        biased = self.down_proj.bias is not None
        b_in = torch.cat([self.gate_proj.bias.detach(), self.up_proj.bias.detach()]) if biased else None
        return FusedMLP(concat(self.gate_proj, self.up_proj), self.down_proj.weight.detach().t(), b_in,
                        self.down_proj.bias.detach() * self.out_multiplier if biased else None)

    def fused(self, f: FusedMLP, h: Tensor, residual: Tensor, delta: Tensor | None = None) -> Tensor:
        gate_up = F.linear(h, f.w_in, f.b_in)
        gate, up = (gate_up if delta is None else gate_up + delta).chunk(2, dim=-1)
        out = torch.addmm(residual, self._gated(gate, up), f.down_t, alpha=self.out_multiplier)
        return out if f.b_out is None else out + f.b_out


class ReluSquaredMLP(nn.Module):
    """down(relu(up x)^2), no gate (Nemotron-H)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(relu_squared(self.up_proj(x)))

    def fuse(self) -> ReluSquaredMLP:
        return self  # already one matmul in and one out

    def fused(self, f: ReluSquaredMLP, h: Tensor, residual: Tensor) -> Tensor:
        return residual + self.down_proj(relu_squared(self.up_proj(h)))


@dataclass
class FusedMoE:
    w_in: Tensor  # (E [+ 2 shared intermediate [+ 1]], hidden): router[, shared expert gate and up[, its gate]]
    splits: tuple[int, ...]
    shared_down_t: Tensor | None  # shared_expert.down_proj.weight.t(), a view; None without a shared expert


class SparseMoE(nn.Module):
    """Router (`gate`), routed gated experts, and a shared expert, behind a sigmoid gate (Qwen3-Next, Qwen3.5-MoE),
    added as it is (`shared_gate` False: Granite's `shared_mlp`) or absent (`shared_intermediate` 0: LFM2-MoE's);
    the sum times `out_multiplier`. Routing is `route` (softmax, then top-k), which `SigmoidMoE` replaces."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, intermediate: int, shared_intermediate: int,
                 renormalise: bool, shared_gate: bool = True, out_multiplier: float = 1.0) -> None:
        super().__init__()
        self.top_k, self.renormalise, self.out_multiplier = top_k, renormalise, out_multiplier
        self.gate = nn.Linear(hidden, n_experts, bias=False)
        self.experts = Experts(n_experts, hidden, intermediate)
        self.shared_expert = MLP(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_gate and shared_intermediate else None
        self.touched: Tensor | int = 0  # what says how many distinct experts the last eager pass read (`experts_read`)
        # expert parallelism (`parallel.shard`): `experts` holds experts first_expert.. only (the router all of them)
        self.first_expert: int | None = None

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Routing weights (N, k) and expert indices (N, k) from the router logits (N, E)."""
        return route(logits, self.top_k, self.renormalise)

    def forward(self, x: Tensor) -> Tensor:
        weights, chosen = self.route(self.gate(x))
        out, self.touched = apply_experts(self.experts.gate_up_proj, self.experts.down_proj, x, weights, chosen,
                                          first=self.first_expert)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out if self.out_multiplier == 1.0 else out * self.out_multiplier

    def fuse(self) -> FusedMoE:
        shared = self.shared_expert
        if shared is None:
            return FusedMoE(w_in=concat(self.gate), splits=(self.gate.weight.shape[0],), shared_down_t=None)
        gates = () if self.shared_expert_gate is None else (self.shared_expert_gate,)
        return FusedMoE(w_in=concat(self.gate, shared.gate_proj, shared.up_proj, *gates),
                        splits=(self.gate.weight.shape[0], 2 * shared.gate_proj.weight.shape[0], *(1,) * len(gates)),
                        shared_down_t=shared.down_proj.weight.detach().t())

    def fused(self, f: FusedMoE, h: Tensor, residual: Tensor) -> Tensor:
        """`forward` with the router and the shared expert's input projections in one matmul, over all of h's
        tokens at once."""
        logits, *shared_in = F.linear(h, f.w_in).split(f.splits, dim=-1)
        weights, chosen = self.route(logits)
        routed, touched = apply_experts(self.experts.gate_up_proj, self.experts.down_proj, h, weights, chosen,
                                        first=self.first_expert)
        if not torch.compiler.is_compiling():  # a graph's count would be one of its own buffers
            self.touched = touched
        if f.shared_down_t is not None:
            gate, up = shared_in[0].chunk(2, dim=-1)
            shared = torch.mm(F.silu(gate) * up, f.shared_down_t)
            if len(shared_in) > 1:
                shared = torch.sigmoid(shared_in[1]) * shared
            routed = routed + shared
        return torch.add(residual, routed, alpha=self.out_multiplier)


class SigmoidMoEFields(Protocol):
    """What `SigmoidMoE` reads of a `ModelConfig`."""

    hidden_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    use_expert_bias: bool


class SigmoidMoE(SparseMoE):
    """LFM2-MoE's block (HF's `Lfm2MoeSparseMoeBlock`): `SparseMoE`'s router and gated experts, no shared expert,
    routed by `route_groups` with one group: sigmoid scores of the logits in the model's dtype, the choice by
    scores + `expert_bias` (a float32 buffer, with `use_expert_bias`), weights renormalised (sum + 1e-6) per
    `norm_topk_prob`, times `routed_scaling_factor`."""

    keep_float32 = ("expert_bias",)  # as HF keeps it, whatever the model's dtype

    def __init__(self, cfg: SigmoidMoEFields) -> None:
        super().__init__(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, 0,
                         cfg.norm_topk_prob)
        self.scale = cfg.routed_scaling_factor
        self.expert_bias: Tensor | None
        self.register_buffer("expert_bias",
                             torch.zeros(cfg.num_experts, dtype=torch.float32) if cfg.use_expert_bias else None)

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        return route_groups(logits, self.expert_bias, self.top_k, 1, 1, self.renormalise, self.scale, eps=1e-6)


class GroupMoEFields(Protocol):
    """What `GroupMoE` reads of a `ModelConfig`."""

    hidden_size: int
    mlp_bias: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    moe_latent_size: int


@dataclass
class FusedGroupMoE:
    w_in: Tensor  # (latent + shared intermediate, hidden): [fc1_latent_proj; shared_experts.up_proj], or the latter
    b_in: Tensor | None  # their biases, with `mlp_bias`
    splits: tuple[int, ...]  # (latent, shared intermediate), or (shared intermediate,)


class GroupMoE(nn.Module):
    """Nemotron-H's MoE block: a `GroupRouter` (sigmoid scores, group-limited top-k: `route_groups`), non-gated
    relu^2 experts that work in a latent space when `moe_latent_size` is set (`fc1_latent_proj` in,
    `fc2_latent_proj` out), and a relu^2 shared expert (`shared_experts`) on the block's input, added after."""

    def __init__(self, cfg: GroupMoEFields) -> None:
        super().__init__()
        self.cfg = cfg
        latent, bias = cfg.moe_latent_size, cfg.mlp_bias
        self.experts = UngatedExperts(cfg.num_experts, latent or cfg.hidden_size, cfg.moe_intermediate_size)
        self.gate = GroupRouter(cfg.num_experts, cfg.hidden_size)
        self.shared_experts = ReluSquaredMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, bias)
        self.fc1_latent_proj = nn.Linear(cfg.hidden_size, latent, bias=bias) if latent else None
        self.fc2_latent_proj = nn.Linear(latent, cfg.hidden_size, bias=bias) if latent else None
        self.touched: Tensor | int = 0  # what says how many distinct experts the last eager pass read (`experts_read`)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.cfg
        return route_groups(self.gate(x), self.gate.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group,
                            cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)

    def experts_on(self, z: Tensor, x: Tensor) -> Tensor:
        """The routed experts' sum for the block input x, z being x in the experts' space (fc1's output)."""
        routed, touched = apply_experts(self.experts.up_proj, self.experts.down_proj, z, *self.route(x),
                                        act=relu_squared)
        if not torch.compiler.is_compiling():  # a graph's count would be one of its own buffers
            self.touched = touched
        return routed if self.fc2_latent_proj is None else self.fc2_latent_proj(routed)

    def forward(self, x: Tensor) -> Tensor:
        z = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        return self.experts_on(z, x) + self.shared_experts(x)

    def fuse(self) -> FusedGroupMoE:
        up = self.shared_experts.up_proj
        ins = (up,) if self.fc1_latent_proj is None else (self.fc1_latent_proj, up)
        b_in = None if up.bias is None else torch.cat([i.bias.detach() for i in ins])
        return FusedGroupMoE(concat(*ins), b_in, splits=tuple(i.weight.shape[0] for i in ins))

    def fused(self, f: FusedGroupMoE, h: Tensor, residual: Tensor) -> Tensor:
        """`forward` with fc1_latent_proj and the shared expert's up_proj in one matmul."""
        *z, up = F.linear(h, f.w_in, f.b_in).split(f.splits, dim=-1)
        shared = self.shared_experts.down_proj(relu_squared(up))
        return residual + (self.experts_on(z[0] if z else h, h) + shared)


class SharedExpertsMoEFields(Protocol):
    """What `SharedExpertsMoE` reads of a `ModelConfig`."""

    hidden_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    expert_swiglu_limit: float
    shared_swiglu_limit: float


class SharedExpertsMoE(nn.Module):
    """DeepSeek-V3's MoE block, as Kimi Linear and Bailing hybrid have it: a `GroupRouter` `gate` (float32 logits,
    `route_groups`: sigmoid scores, the choice biased by `e_score_correction_bias` among the best `topk_group` of
    `n_group` groups, weights renormalised (sum + 1e-20) per `norm_topk_prob`, times `routed_scaling_factor`), gated
    SwiGLU `experts`, and `shared_experts` (a SwiGLU MLP) on the block's input, added unweighted. Bailing clips both
    SwiGLUs (`swiglu`'s limit; 0: none)."""

    def __init__(self, cfg: SharedExpertsMoEFields) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = GroupRouter(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                  limit=cfg.shared_swiglu_limit or None)
        self.act = functools.partial(swiglu, limit=cfg.expert_swiglu_limit or None)
        self.touched: Tensor | int = 0  # what says how many distinct experts the last eager pass read (`experts_read`)

    def routed(self, x: Tensor) -> Tensor:
        cfg = self.cfg
        weights, chosen = route_groups(self.gate(x), self.gate.e_score_correction_bias, cfg.num_experts_per_tok,
                                       cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        out, touched = apply_experts(self.experts.gate_up_proj, self.experts.down_proj, x, weights, chosen,
                                     act=self.act)
        if not torch.compiler.is_compiling():  # a graph's count would be one of its own buffers
            self.touched = touched
        return out

    def forward(self, x: Tensor) -> Tensor:
        return self.routed(x) + self.shared_experts(x)

    def fuse(self) -> FusedMLP:
        return self.shared_experts.fuse()

    def fused(self, f: FusedMLP, h: Tensor, residual: Tensor) -> Tensor:
        """The routed experts added to the residual, then the shared expert's fused path on top."""
        return self.shared_experts.fused(f, h, residual + self.routed(h))
