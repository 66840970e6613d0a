"""The layers of a hybrid stack, with HF's parameter names: a decoder layer is a token mixer (the family's, by layer
kind: `deltaspec.shared.model.mixers`) and an MLP (dense, or a sparse MoE block), each behind its pre-norm.

Every layer works on one sequence `(T, hidden)` and stages its tokens into its slice of a `ModelState` (see
`deltaspec.shared.state.rollback`); none of them changes the committed head. This is the reference path; the fused
path (`deltaspec.shared.model.fused`) runs the same weights in fewer calls.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.kernels.experts import apply_experts
from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.moe import Experts, route
from deltaspec.shared.model.norms import RMSNorm
from deltaspec.shared.state.rollback import AttnLayerState, RecurrentSlot


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


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, sparse: bool = False) -> None:
        """A layer of kind `kind` (one of the family's `layer_types`): its mixer is registered under the family's
        name for it (`linear_attn`, `self_attn`...). `sparse`: a sparse MoE block in place of the dense MLP."""
        super().__init__()
        self.kind = kind
        self.mixer_name, mixer = cfg.mixers[kind]
        self.add_module(self.mixer_name, mixer(cfg))
        self.mlp: MLP | SparseMoE = (
            SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                      cfg.shared_expert_intermediate_size, cfg.norm_topk_prob)
            if sparse else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, x: Tensor, st: RecurrentSlot | AttnLayerState, start: int,
                rope: tuple[Tensor, Tensor]) -> Tensor:
        x = x + self.mixer(self.input_layernorm(x), st, start, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridStack(nn.Module):
    """The embeddings, the decoder layers and the final norm (HF's `model.*` tensors)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kind, cfg.sparse(i)) for i, kind in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
