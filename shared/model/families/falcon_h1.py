"""Falcon-H1 (`falcon_h1`: TII's Falcon-H1 0.5B to 34B): every layer runs a Mamba2 mixer and an attention side by
side on the same normed input and adds both to the residual, then a SwiGLU MLP; muP-style multipliers throughout.

What differs from Bamba (HF 5.25's `modeling_falcon_h1.py`, `configuration_falcon_h1.py`):
- one layer kind, "hybrid" (HF's `layers_block_type`): the layer holds a recurrent state and K/V at once (state
  kind `HYBRID`), its mixers a `ParallelMixer` of `mamba` and `self_attn`;
- the Mamba2 mixer's width is `mamba_d_ssm` (else `mamba_expand` x hidden), its gated norm optional
  (`mamba_rms_norm`; without it the output is y silu(z)) and gating before or after the norm
  (`mamba_norm_before_gate`), its out_proj's bias `projectors_bias`;
- the multipliers, each where HF applies it: `embedding_multiplier` (the embeddings), `ssm_in_multiplier` (the
  mixer's input), `ssm_multipliers` (z, x, B, C, dt of its projection: HF's `mup_vector`), `ssm_out_multiplier` (its
  output), `attention_in_multiplier` (the attention's input), `key_multiplier` (its keys), `attention_out_multiplier`
  (its output), `mlp_multipliers` (the MLP's gate before its activation, and its output), `lm_head_multiplier` (the
  logits);
- attention is llama's (no q/k norm, no gate, biases with `attention_bias`), rotary on the whole `head_dim` (HF's
  rotary takes no partial factor), default rope only.
`convert` puts `mamba` and `self_attn` under the layer's `parallel` mixer and renames `feed_forward`,
`pre_ff_layernorm` and `final_layernorm` onto the shared layers' names; `publish` writes HF's back.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from deltaspec.shared.model.families.mamba2 import ssd_spec, time_step_limit
from deltaspec.shared.model.fields import ConfigError, json_float, positive_int, refuse_unless, rename
from deltaspec.shared.model.mixers.attention import Attention
from deltaspec.shared.model.mixers.mamba2 import Mamba2Mixer
from deltaspec.shared.model.mixers.parallel import ParallelMixer
from deltaspec.shared.model.mlp import MLP
from deltaspec.shared.state.spec import HYBRID, StateSpec

TEXT_TYPES = ("falcon_h1",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = False
LAYER_KINDS = ("hybrid",)
NAMES = (("model.layers.*.mamba.", "model.layers.*.parallel.mamba."),
         ("model.layers.*.self_attn.", "model.layers.*.parallel.self_attn."),
         ("model.layers.*.feed_forward.", "model.layers.*.mlp."),
         ("model.layers.*.pre_ff_layernorm.", "model.layers.*.post_attention_layernorm."),
         ("model.final_layernorm.", "model.norm."))  # (HF's, the shared layers')
SCALARS = ("ssm_in_multiplier", "ssm_out_multiplier", "attention_in_multiplier", "attention_out_multiplier",
           "key_multiplier")  # the layer's multipliers of one number each


def multipliers(cfg: dict[str, Any]) -> dict[str, Any]:
    """The layer's multipliers as HF reads them (1 where absent): `SCALARS`, `mlp_multipliers` (gate, down) and
    `ssm_multipliers` (z, x, B, C, dt)."""
    out: dict[str, Any] = {name: json_float(cfg.get(name, 1.0), name) for name in SCALARS}
    for name, n in (("mlp_multipliers", 2), ("ssm_multipliers", 5)):
        value = cfg.get(name) or [1.0] * n
        if not isinstance(value, list) or len(value) != n:
            raise ConfigError(f"config.json: field {name!r} must be a list of {n} numbers, got {value!r}")
        out[name] = tuple(json_float(v, name) for v in value)
    return out


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of a Falcon-H1 config; sizes must be given, other absent fields take HF's defaults. The
    layer's multipliers are read (and checked) here, and again where the layer is built (`layer`)."""
    refuse_unless(cfg, "hidden_act", ("silu",), "falcon_h1")  # the MLP's and the conv's activation
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    refuse_unless(rope, "rope_type", ("default",), "falcon_h1")
    multipliers(cfg)
    n_layers, hidden = positive_int(cfg, "num_hidden_layers"), positive_int(cfg, "hidden_size")
    heads, eps = positive_int(cfg, "num_attention_heads"), float(cfg.get("rms_norm_eps", 1e-5))
    mamba_heads = positive_int(cfg, "mamba_n_heads")
    width = cfg.get("mamba_d_ssm", 1024)  # HF's default; None: mamba_expand x hidden_size
    width = int(cfg.get("mamba_expand", 2)) * hidden if width is None else positive_int({"mamba_d_ssm": width},
                                                                                        "mamba_d_ssm")
    d_head = cfg.get("mamba_d_head", "auto")
    d_head = width // mamba_heads if d_head == "auto" else positive_int(cfg, "mamba_d_head")
    if d_head * mamba_heads != width:
        raise ConfigError(f"config.json: falcon_h1 needs mamba_n_heads x mamba_d_head ({mamba_heads} x {d_head}) to "
                          f"equal its width mamba_d_ssm (or mamba_expand x hidden_size): {width}")
    limit = cfg.get("time_step_limit")
    return dict(
        num_hidden_layers=n_layers, layer_types=LAYER_KINDS * n_layers,
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads", 8) or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=positive_int(cfg, "intermediate_size"), rms_norm_eps=eps, norm_offset=0.0,
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))), partial_rotary_factor=1.0,
        attention_output_gate=False, attention_qk_norm=False,
        attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
        mamba_num_heads=mamba_heads, mamba_head_dim=d_head, ssm_state_size=positive_int(cfg, "mamba_d_state"),
        mamba_n_groups=int(cfg.get("mamba_n_groups", 1)), mamba_conv_kernel=int(cfg.get("mamba_d_conv", 4)),
        mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)), mamba_proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        mamba_norm_eps=eps, mamba_dt_limit=time_step_limit((0.0, float("inf")) if limit is None else limit),
        embedding_multiplier=json_float(cfg.get("embedding_multiplier", 1.0), "embedding_multiplier"),
        logits_multiplier=json_float(cfg.get("lm_head_multiplier", 1.0), "lm_head_multiplier"),
    )


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    """Every layer: the Mamba2 mixer beside the attention (`parallel`), then the SwiGLU MLP, each with its
    multipliers."""
    m, raw = multipliers(cfg.raw), cfg.raw
    mamba = Mamba2Mixer(cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size,
                        cfg.mamba_n_groups, cfg.mamba_conv_kernel, cfg.mamba_conv_bias, cfg.mamba_proj_bias,
                        out_bias=bool(raw.get("projectors_bias", False)), norm_eps=cfg.mamba_norm_eps,
                        dt_limit=cfg.mamba_dt_limit, rms_norm=bool(raw.get("mamba_rms_norm", False)),
                        norm_before_gate=bool(raw.get("mamba_norm_before_gate", True)),
                        in_multiplier=m["ssm_in_multiplier"], ssm_multipliers=m["ssm_multipliers"],
                        out_multiplier=m["ssm_out_multiplier"])
    attention = Attention(cfg, in_multiplier=m["attention_in_multiplier"], key_multiplier=m["key_multiplier"],
                          out_multiplier=m["attention_out_multiplier"])
    gate, down = m["mlp_multipliers"]
    mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, out_multiplier=down, gate_multiplier=gate)
    return "parallel", ParallelMixer(mamba, attention), mlp


def state_spec(cfg: Any) -> StateSpec:
    return StateSpec((HYBRID,) * len(cfg.layer_types), ssd_spec(cfg), cfg.num_key_value_heads, cfg.head_dim)


def convert(tensors: dict[str, Tensor], cfg: Any) -> None:
    """HF's names -> the shared layers', in place."""
    rename(tensors, NAMES)


def publish(tensors: dict[str, Tensor], cfg: Any) -> None:
    """`convert`'s inverse, in place: HF 5.25's names."""
    rename(tensors, ((ours, hf) for hf, ours in NAMES))
