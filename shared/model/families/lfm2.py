"""Liquid LFM2 (`lfm2`): gated short convolutions (`conv`) between attention layers (`full_attention`).

Every layer is a token mixer behind `operator_norm` and a SwiGLU `feed_forward` (w1 the gate, w3 up, w2 down) behind
`ffn_norm`. The conv layer is `Lfm2ShortConv` (`mixers.short_conv`): its state is the conv window alone, kind `conv`.
The attention is plain grouped attention with per-head RMSNorms on q and k (`q_layernorm`, `k_layernorm`) and full
rotary, no gate and no biases. Every norm is the usual RMSNorm with eps `norm_eps`; the one HF names
`embedding_norm` is the final norm, after the last layer. The MLP's width is derived from `intermediate_size` when
`block_auto_adjust_ff_dim` (2/3 of it, times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`).
Published configs may say `block_ff_dim` and `tie_embedding` (which HF reads over `intermediate_size` and
`tie_word_embeddings`); published checkpoints name tensors as HF 5.25 saves them. `convert` maps HF's names onto the
shared layers' (`input_layernorm`, `post_attention_layernorm`, `mlp.gate_proj`..., `o_proj`, `q_norm`, `norm`);
`publish` writes HF's.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from deltaspec.shared.model.families.qwen3_5 import ConfigFields
from deltaspec.shared.model.fields import json_float, positive_int, refuse_unless, supported_kinds
from deltaspec.shared.model.mixers.attention import Attention
from deltaspec.shared.model.mixers.short_conv import ShortConv
from deltaspec.shared.model.mlp import MLP
from deltaspec.shared.state.spec import ATTENTION, RECURRENT, RecurrentSpec, StateSpec

TEXT_TYPES = ("lfm2",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = False
LAYER_KINDS = ("conv", "full_attention")
# HF's names -> the shared layers', name fragments that occur nowhere else
RENAMES = (("model.embedding_norm.", "model.norm."), (".operator_norm.", ".input_layernorm."),
           (".ffn_norm.", ".post_attention_layernorm."), (".feed_forward.w1.", ".mlp.gate_proj."),
           (".feed_forward.w3.", ".mlp.up_proj."), (".feed_forward.w2.", ".mlp.down_proj."),
           (".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn.q_layernorm.", ".self_attn.q_norm."),
           (".self_attn.k_layernorm.", ".self_attn.k_norm."))


def _layer_types(cfg: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    """`layer_types`, or HF's fallback: attention at `full_attn_idxs` (every layer without it), conv elsewhere."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        attention = cfg.get("full_attn_idxs")
        attention = range(n_layers) if attention is None else attention
        kinds = ["full_attention" if i in attention else "conv" for i in range(n_layers)]
    return supported_kinds(kinds, LAYER_KINDS, "lfm2")


def _ff_dim(cfg: dict[str, Any]) -> int:
    """The MLP's width as `Lfm2MLP` derives it (`block_ff_dim`, the published name, wins as in HF's config)."""
    width = cfg.get("block_ff_dim", cfg.get("intermediate_size", 12288))
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = positive_int(cfg, "block_multiple_of") if "block_multiple_of" in cfg else 256
        width = int(json_float(multiplier, "block_ffn_dim_multiplier") * width)
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of an LFM2 config, as HF 5.25's `Lfm2Config` reads it."""
    rope = cfg.get("rope_parameters") or {}
    refuse_unless(rope, "rope_type", ("default",), "lfm2")
    n_layers = positive_int(cfg, "num_hidden_layers")
    heads = positive_int(cfg, "num_attention_heads")
    return dict(
        num_hidden_layers=n_layers, layer_types=_layer_types(cfg, n_layers), num_attention_heads=heads,
        num_key_value_heads=positive_int(cfg, "num_key_value_heads"),
        head_dim=int(cfg.get("head_dim") or positive_int(cfg, "hidden_size") // heads),
        intermediate_size=_ff_dim(cfg), rms_norm_eps=json_float(cfg.get("norm_eps", 1e-5), "norm_eps"),
        norm_offset=0.0, rope_theta=json_float(rope.get("rope_theta", cfg.get("rope_theta", 1e6)), "rope_theta"),
        partial_rotary_factor=1.0, attention_output_gate=False, attention_qk_norm=True, attention_bias=False,
        tie_word_embeddings=bool(cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True))),
        short_conv_kernel=int(cfg.get("conv_L_cache", 3)), short_conv_bias=bool(cfg.get("conv_bias", False)),
    )


def mixer(cfg: Any, kind: str) -> tuple[str, nn.Module]:
    """A short conv (`conv`) or an attention (`self_attn`)."""
    if kind == "conv":
        return "conv", ShortConv(cfg.hidden_size, cfg.short_conv_kernel, cfg.short_conv_bias)
    return "self_attn", Attention(cfg)


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    """The layer's mixer, then the SwiGLU MLP."""
    return (*mixer(cfg, kind), MLP(cfg.hidden_size, cfg.intermediate_size))


def state_spec(cfg: Any) -> StateSpec:
    """Conv layers hold a window of K-1 rows of B x (hidden wide) and no recurrent state; attention its K/V."""
    conv = RecurrentSpec("conv", conv_dim=cfg.hidden_size, conv_width=cfg.short_conv_kernel, heads=0, key_dim=0,
                         value_dim=0)
    layers = tuple(RECURRENT if kind == "conv" else ATTENTION for kind in cfg.layer_types)
    return StateSpec(layers, conv, cfg.num_key_value_heads, cfg.head_dim)


def rename_fragments(tensors: dict[str, Tensor], pairs: tuple[tuple[str, str], ...]) -> None:
    """Each (old, new) pair in turn replaces its first occurrence in every name, in place."""
    for name in list(tensors):
        new = name
        for old, replacement in pairs:
            new = new.replace(old, replacement, 1)
        if new != name:
            tensors[new] = tensors.pop(name)


def convert(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """HF's names -> the shared layers', in place."""
    rename_fragments(tensors, RENAMES)


def publish(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """`convert`'s inverse, in place: HF 5.25's names."""
    rename_fragments(tensors, tuple((ours, hf) for hf, ours in RENAMES))
