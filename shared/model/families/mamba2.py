"""Mamba2 (`mamba2`: Mamba2ForCausalLM, e.g. Mamba-Codestral): Mamba2 blocks alone, no attention and no MLP.

A block is one RMSNorm (w applied as it is) and a Mamba2 mixer, added to the residual; the model ties `lm_head` to the
embeddings when `tie_word_embeddings` says so (HF declares the tie and honours the flag). Its state is kind `ssd`, as
every Mamba2 family's: per head h a `(state, head_dim)` matrix decaying by exp(dt A_h), written with B_t (dt x_t)^T.
With no attention layer the state holds no K/V (`StateSpec` with no ATTENTION entry, `kv_heads` and `head_dim` 0).

`residual_in_fp32` (HF's default): HF keeps the residual stream in float32 whatever the weights; deltaspec keeps it
in the weights' dtype, which is the same in float32 and differs by the residual's rounding in bfloat16 or float16.

Tensors: HF 5.25 saves `backbone.embeddings`, `backbone.layers.i.norm`, `backbone.layers.i.mixer.*`,
`backbone.norm_f`; checkpoints converted from `mamba_ssm` name the embeddings `backbone.embedding` (HF's load hook
renames them), which `convert` takes as well. The helpers here (`mixer`, `ssd_spec`, `time_step_limit`) build the
mixer and its state for every family whose mixer is Mamba2's, from `ModelConfig`'s `mamba_*` fields.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from deltaspec.shared.model.families.qwen3_5 import ConfigFields
from deltaspec.shared.model.fields import ConfigError, json_float, positive_int, refuse_unless, rename
from deltaspec.shared.model.mixers.mamba2 import Mamba2Mixer
from deltaspec.shared.state.spec import RECURRENT, RecurrentSpec, StateSpec

TEXT_TYPES = ("mamba2",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = False
LAYER_KINDS = ("linear_attention",)
NAMES = (("backbone.embeddings.", "model.embed_tokens."), ("backbone.norm_f.", "model.norm."),
         ("backbone.layers.*.norm.", "model.layers.*.input_layernorm."),
         ("backbone.layers.*.mixer.", "model.layers.*.mamba."))  # (HF's, the shared layers')


def time_step_limit(value: Any) -> tuple[float, float]:
    """`time_step_limit` (dt's clamp) as HF writes it: [low, high], high possibly `{"__float__": "Infinity"}`."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"config.json: field 'time_step_limit' must be [low, high], got {value!r}")
    return json_float(value[0], "time_step_limit"), json_float(value[1], "time_step_limit")


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of a Mamba2 config; sizes must be given, other absent fields take HF's defaults."""
    refuse_unless(cfg, "hidden_act", ("silu",), "mamba2")  # the conv's activation
    n_layers, hidden = positive_int(cfg, "num_hidden_layers"), positive_int(cfg, "hidden_size")
    heads, head_dim = positive_int(cfg, "num_heads"), positive_int(cfg, "head_dim")
    if heads * head_dim != cfg.get("expand", 2) * hidden:
        raise ConfigError(f"config.json: mamba2 needs num_heads x head_dim ({heads} x {head_dim}) to equal expand x "
                          f"hidden_size ({cfg.get('expand', 2)} x {hidden})")
    eps = float(cfg.get("layer_norm_epsilon", 1e-5))
    return dict(
        num_hidden_layers=n_layers, layer_types=LAYER_KINDS * n_layers, rms_norm_eps=eps, norm_offset=0.0,
        partial_rotary_factor=0.0, attention_output_gate=False, attention_qk_norm=False,
        mamba_num_heads=heads, mamba_head_dim=head_dim, ssm_state_size=positive_int(cfg, "state_size"),
        mamba_n_groups=int(cfg.get("n_groups", 8)), mamba_conv_kernel=int(cfg.get("conv_kernel", 4)),
        mamba_conv_bias=bool(cfg.get("use_conv_bias", True)), mamba_proj_bias=bool(cfg.get("use_bias", False)),
        mamba_norm_eps=eps, mamba_dt_limit=time_step_limit(cfg.get("time_step_limit", (0.0, float("inf")))),
    )


def mixer(cfg: Any) -> Mamba2Mixer:
    """The Mamba2 mixer of a config's `mamba_*` fields (every family whose mixer is Mamba2's, gated norm first), its
    output scaled by the config's `residual_multiplier` (Granite's; 1 elsewhere)."""
    return Mamba2Mixer(cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size,
                       cfg.mamba_n_groups, cfg.mamba_conv_kernel, cfg.mamba_conv_bias, cfg.mamba_proj_bias,
                       norm_eps=cfg.mamba_norm_eps, dt_limit=cfg.mamba_dt_limit,
                       out_multiplier=cfg.residual_multiplier)


def ssd_spec(cfg: Any) -> RecurrentSpec:
    """The state of one such mixer: a conv window over x, B and C; per head a `(state_size, head_dim)` matrix."""
    width = cfg.mamba_num_heads * cfg.mamba_head_dim
    return RecurrentSpec("ssd", conv_dim=width + 2 * cfg.mamba_n_groups * cfg.ssm_state_size,
                         conv_width=cfg.mamba_conv_kernel, heads=cfg.mamba_num_heads, key_dim=cfg.ssm_state_size,
                         value_dim=cfg.mamba_head_dim)


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    return "mamba", mixer(cfg), None


def state_spec(cfg: Any) -> StateSpec:
    return StateSpec((RECURRENT,) * len(cfg.layer_types), ssd_spec(cfg), kv_heads=0, head_dim=0)


def convert(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """HF's names (and `mamba_ssm`'s `backbone.embedding.`) -> the shared layers', in place."""
    rename(tensors, (("backbone.embedding.", "model.embed_tokens."), *NAMES))


def publish(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """`convert`'s inverse, in place: HF 5.25's names."""
    rename(tensors, ((ours, hf) for hf, ours in NAMES))
