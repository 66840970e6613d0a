"""Qwen3.5, dense (`qwen3_5_text`) and mixture-of-experts (`qwen3_5_moe_text`): the layout the shared layers use.

The MoE models (35B-A3B, 122B-A10B, 397B-A17B) differ from the dense ones only in their MLPs: every layer's is a
sparse MoE block (router, top-k renormalised always, experts, a shared expert behind a sigmoid gate), and so is
the MTP head's. Published checkpoints wrap the text model in a multimodal one (`qwen3_5`, `qwen3_5_moe`) whose
vision tower the loader skips.
"""
from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor, nn

from deltaspec.shared.model.fields import ConfigError, positive_int
from deltaspec.shared.model.mixers.attention import Attention
from deltaspec.shared.model.mixers.gdn import GatedDeltaNet
from deltaspec.shared.model.mlp import MLP, SparseMoE
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
LAYER_KINDS = ("linear_attention", "full_attention")


def fields(cfg: dict[str, Any], always_norm_topk: bool = ALWAYS_NORM_TOPK) -> dict[str, Any]:
    """The `ModelConfig` fields of a Qwen hybrid's text config (layer kinds every `full_attention_interval`-th layer
    unless `layer_types` lists them)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    n_layers = positive_int(cfg, "num_hidden_layers")
    interval = cfg.get("full_attention_interval", 4)
    layer_types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    experts = _experts(cfg, always_norm_topk)
    only, step = experts.get("mlp_only_layers", ()), experts.get("decoder_sparse_step", 1)
    dense = not experts or step != 1 or any(0 <= i < n_layers for i in only)  # some layer has a dense MLP
    if dense and "intermediate_size" not in cfg:
        raise ConfigError("config.json: field 'intermediate_size' is needed by the dense MLP layers")
    return dict(
        num_attention_heads=positive_int(cfg, "num_attention_heads"),
        num_key_value_heads=positive_int(cfg, "num_key_value_heads"),
        attention_bias=bool(cfg.get("attention_bias", False)),
        intermediate_size=positive_int(cfg, "intermediate_size") if dense or "intermediate_size" in cfg else 0,
        num_hidden_layers=n_layers,
        head_dim=int(cfg.get("head_dim")
                     or positive_int(cfg, "hidden_size") // positive_int(cfg, "num_attention_heads")),
        linear_num_key_heads=positive_int(cfg, "linear_num_key_heads"),
        linear_num_value_heads=positive_int(cfg, "linear_num_value_heads"),
        linear_key_head_dim=positive_int(cfg, "linear_key_head_dim"),
        linear_value_head_dim=positive_int(cfg, "linear_value_head_dim"),
        layer_types=tuple(layer_types),
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        partial_rotary_factor=float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))),
        mtp_num_hidden_layers=int(cfg.get("mtp_num_hidden_layers", 0)),
        **experts,
    )


def _experts(cfg: dict[str, Any], always_norm_topk: bool) -> dict[str, Any]:
    """The sparse MoE fields, when the config has experts (`num_experts` > 0)."""
    if not cfg.get("num_experts"):
        return {}
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConfigError(f"config.json: field 'mlp_only_layers' must be a list of layer indices, got {only!r}")
    return {
        "num_experts": positive_int(cfg, "num_experts"),
        "num_experts_per_tok": positive_int(cfg, "num_experts_per_tok"),
        "moe_intermediate_size": positive_int(cfg, "moe_intermediate_size"),
        "shared_expert_intermediate_size": positive_int(cfg, "shared_expert_intermediate_size"),
        "norm_topk_prob": True if always_norm_topk else bool(cfg.get("norm_topk_prob", True)),
        "decoder_sparse_step": int(cfg.get("decoder_sparse_step") or 1), "mlp_only_layers": tuple(only),
    }


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    """Every layer: a GDN (`linear_attn`) or a gated attention (`self_attn`), then a dense MLP or a sparse MoE."""
    mixer = ("linear_attn", GatedDeltaNet(cfg)) if kind == "linear_attention" else ("self_attn", Attention(cfg))
    mlp = (SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                     cfg.shared_expert_intermediate_size, cfg.norm_topk_prob)
           if sparse else MLP(cfg.hidden_size, cfg.intermediate_size))
    return (*mixer, mlp)


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
