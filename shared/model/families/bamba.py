"""Bamba (`bamba`: IBM Bamba-9B): llama-style decoder layers whose token mixer is Mamba2 or attention, each with a
SwiGLU MLP.

What differs from the Qwen layout (HF 5.25's `modeling_bamba.py`, `configuration_bamba.py`):
- layer kinds from `attn_layer_indices` (attention there, Mamba2 elsewhere: HF's `layers_block_type`);
- every layer has both parts: the mixer behind `input_layernorm`, the MLP behind `pre_ff_layernorm`; norms are the
  usual RMSNorm (w applied as it is, not Qwen's 1 + w); the final norm is `final_layernorm`;
- the MLP is `feed_forward` (gate, up, down; biases with `mlp_bias`), the Mamba2 mixer `mamba` (Mamba2's, its gated
  norm over `mamba_n_groups` groups with `rms_norm_eps`), the attention llama's: no q/k norm, no output gate,
  biases with `attention_bias`, rotary on the first half of each head (HF's config sets `partial_rotary_factor` 0.5
  unless `rope_parameters` names another), default rope only;
- `hidden_act` drives both the MLP and the mixer's conv: SiLU only (anything else is refused, naming it).
`convert` renames `feed_forward`, `pre_ff_layernorm` and `final_layernorm` onto the shared layers' names (the
published checkpoints use HF's); `publish` writes them back.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from deltaspec.shared.model.families.mamba2 import mixer, ssd_spec, time_step_limit
from deltaspec.shared.model.families.qwen3_5 import ConfigFields
from deltaspec.shared.model.fields import ConfigError, positive_int, refuse_unless, rename
from deltaspec.shared.model.mixers.attention import Attention
from deltaspec.shared.model.mlp import MLP
from deltaspec.shared.state.spec import ATTENTION, RECURRENT, StateSpec

TEXT_TYPES = ("bamba",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = False
LAYER_KINDS = ("linear_attention", "full_attention")
NAMES = (("model.layers.*.feed_forward.", "model.layers.*.mlp."),
         ("model.layers.*.pre_ff_layernorm.", "model.layers.*.post_attention_layernorm."),
         ("model.final_layernorm.", "model.norm."))  # (HF's, the shared layers')


def _layer_types(cfg: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    """HF's `layers_block_type`: attention at `attn_layer_indices` (indices past the last layer ignored, as HF does)."""
    indices = cfg.get("attn_layer_indices") or []
    if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise ConfigError(f"config.json: field 'attn_layer_indices' must be a list of layer indices, got {indices!r}")
    return tuple("full_attention" if i in indices else "linear_attention" for i in range(n_layers))


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of a Bamba config; sizes must be given, other absent fields take HF's defaults."""
    refuse_unless(cfg, "hidden_act", ("silu",), "bamba")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    refuse_unless(rope, "rope_type", ("default",), "bamba")
    n_layers, hidden = positive_int(cfg, "num_hidden_layers"), positive_int(cfg, "hidden_size")
    heads, eps = positive_int(cfg, "num_attention_heads"), float(cfg.get("rms_norm_eps", 1e-5))
    return dict(
        num_hidden_layers=n_layers, layer_types=_layer_types(cfg, n_layers),
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads", 8) or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=positive_int(cfg, "intermediate_size"), rms_norm_eps=eps, norm_offset=0.0,
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.5)),
        attention_output_gate=False, attention_qk_norm=False,
        attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
        **mamba_fields(cfg, "bamba", eps),
    )


def mamba_fields(cfg: dict[str, Any], model_type: str, norm_eps: float) -> dict[str, Any]:
    """The Mamba2 mixer's `ModelConfig` fields as Bamba's config names them (`mamba_n_heads`, `mamba_d_head`...;
    Granite-4.0-H's names them so too), HF's defaults where absent; its gated norm's eps is the model's."""
    mamba_heads = positive_int(cfg, "mamba_n_heads")
    width = int(cfg.get("mamba_expand", 2)) * positive_int(cfg, "hidden_size")
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = width // mamba_heads if d_head == "auto" else positive_int(cfg, "mamba_d_head")
    if d_head * mamba_heads != width:
        raise ConfigError(f"config.json: {model_type} needs mamba_n_heads x mamba_d_head ({mamba_heads} x {d_head}) "
                          f"to equal mamba_expand x hidden_size ({width})")
    return dict(
        mamba_num_heads=mamba_heads, mamba_head_dim=d_head, ssm_state_size=positive_int(cfg, "mamba_d_state"),
        mamba_n_groups=int(cfg.get("mamba_n_groups", 1)), mamba_conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)), mamba_proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        mamba_norm_eps=norm_eps, mamba_dt_limit=time_step_limit(cfg.get("time_step_limit", (0.0, float("inf")))),
    )


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    """Every layer: a Mamba2 mixer (`mamba`) or an attention (`self_attn`), then the SwiGLU MLP."""
    token_mixer = ("mamba", mixer(cfg)) if kind == "linear_attention" else ("self_attn", Attention(cfg))
    return (*token_mixer, MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias))


def state_spec(cfg: Any) -> StateSpec:
    layers = tuple(RECURRENT if kind == "linear_attention" else ATTENTION for kind in cfg.layer_types)
    return StateSpec(layers, ssd_spec(cfg), cfg.num_key_value_heads, cfg.head_dim)


def convert(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """HF's names -> the shared layers', in place."""
    rename(tensors, NAMES)


def publish(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """`convert`'s inverse, in place: HF 5.25's names."""
    rename(tensors, ((ours, hf) for hf, ours in NAMES))
