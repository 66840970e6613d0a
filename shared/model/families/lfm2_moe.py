"""Liquid LFM2-MoE (`lfm2_moe`: LFM2-8B-A1B): LFM2's layers (`lfm2`), the feed-forwards after the first
`num_dense_layers` layers sparse MoE blocks.

What differs from LFM2 (HF 5.25's `modeling_lfm2_moe.py`, `configuration_lfm2_moe.py`):
- the dense feed-forward (layers below `num_dense_layers`) is SwiGLU of width `intermediate_size` as it is (no
  `block_auto_adjust_ff_dim` derivation);
- the sparse ones (`Lfm2MoeSparseMoeBlock`, every other layer: `mlp_only_layers` = the dense ones) are
  `deltaspec.shared.model.mlp.SigmoidMoE`: a router `gate` in the model's dtype, sigmoid scores, the choice by
  scores + the float32 buffer `expert_bias` where `use_expert_bias`, the chosen scores renormalised (sum + 1e-6)
  per `norm_topk_prob` and times `routed_scaling_factor` (Nemotron-H's `route_groups` with one group), gated SwiGLU
  experts of width `moe_intermediate_size` (`gate_up_proj` = [w1; w3], `down_proj` = w2), no shared expert;
- `layer_types` is required: HF's model reads it layer by layer and has no `full_attn_idxs` fallback.
Tensors: HF 5.25 saves the published layout, per expert (`feed_forward.experts.j.w1.weight`, `w3`, `w2`: its
conversion mapping fuses them in memory); `convert` names them as the loader's per-expert tensors, which it stacks
(HF's fused in-memory names load too), and maps the rest as LFM2's; `publish` writes the published layout.
"""
from __future__ import annotations

import re
from typing import Any

from torch import Tensor, nn

from deltaspec.shared.model.families import lfm2
from deltaspec.shared.model.fields import ConfigError, json_float, positive_int, unstack_experts
from deltaspec.shared.model.mlp import MLP, SigmoidMoE

TEXT_TYPES = ("lfm2_moe",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = False
LAYER_KINDS = lfm2.LAYER_KINDS
RENAMES = (*lfm2.RENAMES, (".feed_forward.", ".mlp."))  # then the MoE block's `gate`, `expert_bias`, `experts`
PROJS = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))  # an expert's published names, the loader's
_PUBLISHED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.\d+)\.(w1|w3|w2)\.weight$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

state_spec = lfm2.state_spec  # conv windows and attention K/V, as LFM2's


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of an LFM2-MoE config, HF's defaults where it leaves one out (32 experts, top-4)."""
    if not isinstance(cfg.get("layer_types"), list):
        raise ConfigError("config.json: lfm2_moe needs 'layer_types' (HF's model has no full_attn_idxs fallback)")
    cfg = {**dict(intermediate_size=7168, moe_intermediate_size=1792, num_experts=32, num_experts_per_tok=4), **cfg}
    dense = cfg.get("num_dense_layers", 2)
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise ConfigError(f"config.json: field 'num_dense_layers' must be 0 or more, got {dense!r}")
    return {**lfm2.fields(cfg), **dict(
        intermediate_size=positive_int(cfg, "intermediate_size"), num_experts=positive_int(cfg, "num_experts"),
        num_experts_per_tok=positive_int(cfg, "num_experts_per_tok"),
        moe_intermediate_size=positive_int(cfg, "moe_intermediate_size"), mlp_only_layers=tuple(range(dense)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), use_expert_bias=bool(cfg.get("use_expert_bias", True)),
        routed_scaling_factor=json_float(cfg.get("routed_scaling_factor", 1.0), "routed_scaling_factor"))}


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    """LFM2's mixer, then the dense SwiGLU MLP or the sparse MoE block."""
    return (*lfm2.mixer(cfg, kind), SigmoidMoE(cfg) if sparse else MLP(cfg.hidden_size, cfg.intermediate_size))


def name_experts(tensors: dict[str, Tensor]) -> None:
    """Published per-expert names (`mlp.experts.j.w1`, `w3`, `w2`) -> the loader's, which it stacks, in place."""
    ours = dict(PROJS)
    for name in [n for n in tensors if _PUBLISHED.match(n)]:
        expert, proj = _PUBLISHED.match(name).groups()  # type: ignore[union-attr]
        tensors[f"{expert}.{ours[proj]}.weight"] = tensors.pop(name)


def publish_experts(tensors: dict[str, Tensor]) -> None:
    """`name_experts`' inverse from the fused experts, in place: unstacked, each expert's w1, w3 and w2."""
    unstack_experts(tensors)
    theirs = {ours: published for published, ours in PROJS}
    for name in [n for n in tensors if _PER_EXPERT.match(n)]:
        expert, proj = _PER_EXPERT.match(name).groups()  # type: ignore[union-attr]
        tensors[f"{expert}.{theirs[proj]}.weight"] = tensors.pop(name)


def convert(tensors: dict[str, Tensor], cfg: Any) -> None:
    """HF's names (published per expert, or fused as HF keeps them in memory) -> the shared layers', in place."""
    lfm2.rename_fragments(tensors, RENAMES)
    name_experts(tensors)


def publish(tensors: dict[str, Tensor], cfg: Any) -> None:
    """`convert`'s inverse, in place: the published layout, as HF 5.25's `save_pretrained` writes it."""
    publish_experts(tensors)
    lfm2.rename_fragments(tensors, tuple((ours, hf) for hf, ours in RENAMES))
