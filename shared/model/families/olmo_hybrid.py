"""AllenAI OLMo-Hybrid (`olmo_hybrid`, e.g. Olmo-Hybrid-7B): Gated DeltaNet layers (`linear_attention`) beside
OLMo-3 attention layers (`full_attention`), as HF 5.25's `OlmoHybridForCausalLM` runs them.

- The GDN is Qwen3.5's (`mixers.gdn`: one conv + SiLU over [q; k; v], l2-normed q and k, decay
  `-exp(A_log) softplus(a + dt_bias)`, a per-head gated RMSNorm on its output) with separate q/k/v/g/b/a
  projections, which `convert` concatenates at load into Qwen3.5's `in_proj_qkv` (g is `in_proj_z`); its output
  norm's eps is fixed at 1e-5, and `linear_allow_neg_eigval` (HF's default: on) doubles beta (range [0, 2]).
- The attention has no gate; its q and k RMSNorms span the whole projection (all heads at once); full rotary on
  `rope_parameters.rope_theta` (none where that is null: NoPE); biases on all four projections with `attention_bias`.
- The attention layers are post-norm, as OLMo-2/3's: the attention's output and the MLP's output are each normed
  (`post_attention_layernorm`, `post_feedforward_layernorm`) before their residual add (`post_norm_kinds`). The GDN
  layers are pre-norm. Every norm is the usual RMSNorm (weight from 1), the MLP SwiGLU.
- HF's save writes its load-time renames in reverse (`attention_layer_norm`, `feedforward_layer_norm`, and the conv
  split into `q_conv1d`/`k_conv1d`/`v_conv1d`, in equal thirds); published checkpoints use those names with the
  conv split at q/k/v. `convert` reads both and HF's in-memory names, drops `mtp.*` (HF ignores it) and maps onto
  the shared layers' names; `publish` writes the published layout.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from deltaspec.shared.model.families.qwen3_5 import ConfigFields, state_spec  # noqa: F401 (its GDN state)
from deltaspec.shared.model.fields import json_float, positive_int, refuse_unless, rename
from deltaspec.shared.model.mixers.attention import Attention
from deltaspec.shared.model.mixers.gdn import GatedDeltaNet
from deltaspec.shared.model.mlp import MLP

TEXT_TYPES = ("olmo_hybrid",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = False
LAYER_KINDS = ("linear_attention", "full_attention")
GDN_NORM_EPS = 1e-5  # HF's `OlmoHybridRMSNormGated(head_v_dim, eps=1e-5)`, whatever rms_norm_eps says
# HF's saved names -> its in-memory ones (its `conversion_mapping`); then, per layer, its names -> the shared layers'
SAVED = (("model.layers.*.attention_layer_norm.", "model.layers.*.input_layernorm."),
         ("model.layers.*.feedforward_layer_norm.", "model.layers.*.post_attention_layernorm."))
ATTENTION_NORMS = (("post_attention_layernorm.weight", "input_layernorm.weight"),  # the attention's (after it)
                   ("post_feedforward_layernorm.weight", "post_attention_layernorm.weight"))  # the MLP's (after it)
GDN_NAMES = (("g_proj.weight", "in_proj_z.weight"), ("b_proj.weight", "in_proj_b.weight"),
             ("a_proj.weight", "in_proj_a.weight"), ("o_norm.weight", "norm.weight"),
             ("o_proj.weight", "out_proj.weight"))


def _layer_types(cfg: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    """`layer_types`, or HF's default: attention every 4th layer (3, 7, ...), else the last."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n_layers)]
        if "full_attention" not in kinds:
            kinds[-1] = "full_attention"
    return tuple(kinds)


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of an OLMo-Hybrid config, with HF 5.25's `OlmoHybridConfig` defaults."""
    refuse_unless(cfg, "hidden_act", ("silu",), "olmo_hybrid")
    rope = cfg.get("rope_parameters") or {}
    refuse_unless(rope, "rope_type", ("default",), "olmo_hybrid")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    n_layers, hidden = positive_int(cfg, "num_hidden_layers"), positive_int(cfg, "hidden_size")
    heads = positive_int(cfg, "num_attention_heads")
    k_heads = positive_int(cfg, "linear_num_key_heads") if cfg.get("linear_num_key_heads") is not None else heads
    k_dim = positive_int(cfg, "linear_key_head_dim") if cfg.get("linear_key_head_dim") is not None \
        else int(0.75 * hidden / k_heads)
    return dict(
        num_hidden_layers=n_layers, layer_types=_layer_types(cfg, n_layers), num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate_size=positive_int(cfg, "intermediate_size"),
        rms_norm_eps=json_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps"), norm_offset=0.0,
        rope_theta=10000.0 if theta is None else json_float(theta, "rope_theta"),
        partial_rotary_factor=0.0 if theta is None else 1.0,  # HF's default rope ignores a partial factor
        attention_output_gate=False, attention_qk_norm=True, attention_qk_norm_per_head=False,
        attention_bias=bool(cfg.get("attention_bias", False)), post_norm_kinds=("full_attention",),
        linear_num_key_heads=k_heads, linear_num_value_heads=int(cfg.get("linear_num_value_heads") or heads),
        linear_key_head_dim=k_dim, linear_value_head_dim=int(cfg.get("linear_value_head_dim") or 2 * k_dim),
        linear_conv_kernel_dim=positive_int(cfg, "linear_conv_kernel_dim") if "linear_conv_kernel_dim" in cfg else 4,
        linear_beta_scale=2.0 if cfg.get("linear_allow_neg_eigval", True) else 1.0,
    )


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    """A GDN (`linear_attn`) or an attention (`self_attn`), then the SwiGLU MLP."""
    mixer = ("linear_attn", GatedDeltaNet(cfg, norm_eps=GDN_NORM_EPS)) if kind == "linear_attention" \
        else ("self_attn", Attention(cfg))
    return (*mixer, MLP(cfg.hidden_size, cfg.intermediate_size))


def _move(tensors: dict[str, Tensor], prefix: str, pairs: tuple[tuple[str, str], ...]) -> None:
    """Rename prefix + each pair's first to prefix + its second, all at once (a name may be another's new name)."""
    moved = {prefix + new: tensors.pop(prefix + old) for old, new in pairs}
    tensors.update(moved)


def _qkv_sizes(cfg: ConfigFields) -> list[int]:
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    return [key_dim, key_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim]


def convert(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """HF's saved (or published, or in-memory) names -> the shared layers', in place."""
    for name in [n for n in tensors if n.startswith("mtp.")]:
        del tensors[name]
    rename(tensors, SAVED)
    for i, kind in enumerate(cfg.layer_types):
        prefix = f"model.layers.{i}."
        if kind == "full_attention":
            _move(tensors, prefix, ATTENTION_NORMS)
            continue
        prefix += "linear_attn."
        tensors[prefix + "in_proj_qkv.weight"] = torch.cat([tensors.pop(prefix + f"{x}_proj.weight") for x in "qkv"])
        if prefix + "conv1d.weight" not in tensors:
            tensors[prefix + "conv1d.weight"] = torch.cat([tensors.pop(prefix + f"{x}_conv1d.weight") for x in "qkv"])
        _move(tensors, prefix, GDN_NAMES)


def publish(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """`convert`'s inverse, in place: the published layout (the conv split at q/k/v), which HF loads."""
    for i, kind in enumerate(cfg.layer_types):
        prefix = f"model.layers.{i}."
        if kind == "full_attention":
            _move(tensors, prefix, tuple((ours, hf) for hf, ours in ATTENTION_NORMS))
            continue
        prefix += "linear_attn."
        for ours, suffix in (("in_proj_qkv.weight", "_proj.weight"), ("conv1d.weight", "_conv1d.weight")):
            for x, rows in zip("qkv", tensors.pop(prefix + ours).split(_qkv_sizes(cfg))):
                tensors[prefix + x + suffix] = rows
        _move(tensors, prefix, tuple((ours, hf) for hf, ours in GDN_NAMES))
    rename(tensors, tuple((ours, hf) for hf, ours in SAVED))
