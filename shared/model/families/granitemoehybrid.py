"""Granite-4.0-H (`granitemoehybrid`: IBM Granite-4.0-H micro, tiny, small): Bamba's layers with muP-style
multipliers, a shared SwiGLU MLP in every layer and, where `num_local_experts` > 0, a sparse MoE beside it.

What differs from Bamba (HF 5.25's `modeling_granitemoehybrid.py`, `configuration_granitemoehybrid.py`):
- layer kinds from `layer_types` (or `layers_block_type`, HF's alias), "linear_attention" and "full_attention" as
  HF 5.25 writes them, "mamba" and "attention" as the published configs do (HF remaps them); all Mamba2 if absent;
- the multipliers, each applied in one place every pass uses (`ModelConfig`'s fields): `embedding_multiplier` scales
  the embeddings, `residual_multiplier` the mixer's and the MLP block's outputs before each residual add,
  `attention_multiplier` is the softmax scale itself (not 1/sqrt(d)), and the logits are divided by
  `logits_scaling`;
- attention is llama's without q/k norm or gate, full rotary when `position_embedding_type` is "rope" and none
  otherwise ("nope", or absent: HF's default);
- the MLP block is `shared_mlp` (`input_linear` = [gate; up], `output_linear`, width `shared_intermediate_size`),
  and with experts `block_sparse_moe` (a router whose top-k logits are softmaxed, which is softmax then top-k
  renormalised; experts of width `intermediate_size`) added to it ungated: the shared `SparseMoE` without its
  shared expert gate.
Tensors: HF 5.25 saves the published layout (`block_sparse_moe.input_linear`, `output_linear`, `router.layer`, which
its conversion mapping renames in memory to `experts.gate_up_proj`, `experts.down_proj`, `router`); `convert` takes
both onto the shared layers' names, splitting `shared_mlp.input_linear` into gate and up; `publish` writes the
published layout.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor, nn

from deltaspec.shared.model.families import bamba
from deltaspec.shared.model.families.mamba2 import mixer
from deltaspec.shared.model.fields import (ConfigError, json_float, positive_int, refuse_unless, rename,
                                           supported_kinds)
from deltaspec.shared.model.mixers.attention import Attention
from deltaspec.shared.model.mlp import MLP, SparseMoE

TEXT_TYPES = ("granitemoehybrid",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = True  # HF's router softmaxes the top-k logits: the top-k probabilities renormalised
LAYER_KINDS = ("linear_attention", "full_attention")
LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}  # published configs' names
# block_sparse_moe's tensors: (the published name, the shared layers'), then HF's own in memory (its conversion
# mapping's targets), which a checkpoint saved without reverting that mapping carries
PUBLISHED = (("router.layer.", "gate."), ("input_linear.weight", "experts.gate_up_proj"),
             ("output_linear.weight", "experts.down_proj"))
IN_MEMORY = (("router.", "gate."), ("experts.", "experts."))
_SHARED_IN = re.compile(r"^model\.layers\.(\d+)\.shared_mlp\.input_linear\.weight$")


def _layer_types(cfg: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    kinds = cfg.get("layer_types") or cfg.get("layers_block_type") or ["linear_attention"] * n_layers
    if not isinstance(kinds, list):
        raise ConfigError(f"config.json: field 'layer_types' must be a list of layer kinds, got {kinds!r}")
    kinds = [LEGACY_KINDS.get(k, k) for k in kinds]
    return supported_kinds(kinds, LAYER_KINDS, "granitemoehybrid", named=(*LAYER_KINDS, *LEGACY_KINDS))


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of a Granite-4.0-H config; sizes must be given, other absent fields take HF's defaults
    (8 experts, top-2, as HF's config has them)."""
    refuse_unless(cfg, "hidden_act", ("silu",), "granitemoehybrid")  # the MLPs' and the conv's activation
    refuse_unless(cfg, "position_embedding_type", (None, "rope", "nope"), "granitemoehybrid")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    refuse_unless(rope, "rope_type", ("default",), "granitemoehybrid")
    n_layers, hidden = positive_int(cfg, "num_hidden_layers"), positive_int(cfg, "hidden_size")
    heads, eps = positive_int(cfg, "num_attention_heads"), float(cfg.get("rms_norm_eps", 1e-6))
    shared = positive_int(cfg, "shared_intermediate_size")
    experts = cfg.get("num_local_experts", 8)
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
        raise ConfigError(f"config.json: field 'num_local_experts' must be 0 or more, got {experts!r}")
    moe = dict(num_experts=experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
               moe_intermediate_size=positive_int(cfg, "intermediate_size"), shared_expert_intermediate_size=shared,
               norm_topk_prob=True) if experts else {}

    def multiplier(name: str) -> float:
        return json_float(cfg.get(name, 1.0), name)

    return dict(
        num_hidden_layers=n_layers, layer_types=_layer_types(cfg, n_layers),
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=shared, rms_norm_eps=eps, norm_offset=0.0,
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        partial_rotary_factor=1.0 if cfg.get("position_embedding_type") == "rope" else 0.0,
        attention_output_gate=False, attention_qk_norm=False, attention_bias=bool(cfg.get("attention_bias", False)),
        embedding_multiplier=multiplier("embedding_multiplier"), residual_multiplier=multiplier("residual_multiplier"),
        attention_scale=multiplier("attention_multiplier"), logits_scaling=multiplier("logits_scaling"),
        **bamba.mamba_fields(cfg, "granitemoehybrid", eps), **moe,
    )


state_spec = bamba.state_spec  # Mamba2 layers (kind `ssd`) and attention layers, as Bamba's


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    """Every layer: a Mamba2 mixer (`mamba`) or an attention (`self_attn`), then the shared MLP, with the experts
    beside it in a sparse layer; both parts' outputs times `residual_multiplier`."""
    token_mixer = ("mamba", mixer(cfg)) if kind == "linear_attention" else ("self_attn", Attention(cfg))
    mlp = (SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                     cfg.shared_expert_intermediate_size, renormalise=True, shared_gate=False,
                     out_multiplier=cfg.residual_multiplier)
           if sparse else MLP(cfg.hidden_size, cfg.intermediate_size, out_multiplier=cfg.residual_multiplier))
    return (*token_mixer, mlp)


def _shared(cfg: Any) -> str:
    """Where `shared_mlp` sits among the shared layers: the MoE's shared expert, or the dense MLP itself."""
    return "mlp.shared_expert." if cfg.num_experts else "mlp."


def _names(cfg: Any, moe: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    """(HF's prefix, the shared layers') for everything but `shared_mlp.input_linear`, which is split in two."""
    return [("model.layers.*.shared_mlp.output_linear.", f"model.layers.*.{_shared(cfg)}down_proj."),
            *((f"model.layers.*.block_sparse_moe.{hf}", f"model.layers.*.mlp.{ours}") for hf, ours in moe)]


def convert(tensors: dict[str, Tensor], cfg: Any) -> None:
    """HF's names (published, or as HF keeps them in memory) -> the shared layers', in place."""
    for name in [n for n in tensors if _SHARED_IN.match(n)]:
        prefix = f"model.layers.{_SHARED_IN.match(name).group(1)}.{_shared(cfg)}"  # type: ignore[union-attr]
        tensors[f"{prefix}gate_proj.weight"], tensors[f"{prefix}up_proj.weight"] = tensors.pop(name).chunk(2)
    rename(tensors, _names(cfg, PUBLISHED + IN_MEMORY))


def publish(tensors: dict[str, Tensor], cfg: Any) -> None:
    """`convert`'s inverse, in place: the published names, as HF 5.25's `save_pretrained` writes them."""
    gate = re.compile(rf"^model\.layers\.(\d+)\.{re.escape(_shared(cfg))}gate_proj\.weight$")
    for name in [n for n in tensors if gate.match(n)]:
        i = gate.match(name).group(1)  # type: ignore[union-attr]
        up = tensors.pop(f"model.layers.{i}.{_shared(cfg)}up_proj.weight")
        tensors[f"model.layers.{i}.shared_mlp.input_linear.weight"] = torch.cat([tensors.pop(name), up])
    rename(tensors, ((ours, hf) for hf, ours in _names(cfg, PUBLISHED)))
