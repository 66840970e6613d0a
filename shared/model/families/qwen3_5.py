"""Qwen3.5, dense (`qwen3_5_text`) and mixture-of-experts (`qwen3_5_moe_text`): the layout the shared layers use.

The MoE models (35B-A3B, 122B-A10B, 397B-A17B) differ from the dense ones only in their MLPs: every layer's is a
sparse MoE block (router, top-k renormalised always, experts, a shared expert behind a sigmoid gate), and so is
the MTP head's. Published checkpoints wrap the text model in a multimodal one (`qwen3_5`, `qwen3_5_moe`) whose
vision tower the loader skips.
"""
from __future__ import annotations

from typing import Protocol

from torch import Tensor

from deltaspec.shared.model.mixers.attention import Attention
from deltaspec.shared.model.mixers.gdn import GatedDeltaNet
from deltaspec.shared.state.spec import ATTENTION, RECURRENT, RecurrentSpec, StateSpec


class ConfigFields(Protocol):
    """The fields of `deltaspec.shared.model.config.ModelConfig` a family reads (the config imports the families, so
    they name its shape, not the class)."""

    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_key_value_heads: int
    head_dim: int

    @property
    def conv_dim(self) -> int: ...

TEXT_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
WRAPPER_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
ALWAYS_NORM_TOPK = True  # HF's Qwen3_5MoeTopKRouter renormalises the top-k weights; its config has no switch
MIXERS = {"linear_attention": ("linear_attn", GatedDeltaNet), "full_attention": ("self_attn", Attention)}


def state_spec(cfg: ConfigFields) -> StateSpec:
    """Gated DeltaNet layers (`linear_attention`: a conv window over q, k and v, one state per value head) between
    full attention layers (grouped K/V heads)."""
    gdn = RecurrentSpec("gdn", conv_dim=cfg.conv_dim, conv_width=cfg.linear_conv_kernel_dim,
                        heads=cfg.linear_num_value_heads, key_dim=cfg.linear_key_head_dim,
                        value_dim=cfg.linear_value_head_dim)
    layers = tuple(RECURRENT if kind == "linear_attention" else ATTENTION for kind in cfg.layer_types)
    return StateSpec(layers, gdn, cfg.num_key_value_heads, cfg.head_dim)


def convert(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """Nothing to rename: the shared layers carry Qwen3.5's names."""


def publish(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """Nothing to rename for saving either."""
