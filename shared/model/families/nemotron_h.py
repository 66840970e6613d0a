"""Nemotron-H (`nemotron_h`: NVIDIA Nemotron-H, Nemotron Nano 2): blocks of one part each, behind one RMSNorm.

A block is a Mamba2 mixer (`linear_attention`, the `M` of a `hybrid_override_pattern`), a plain attention
(`full_attention`, `*`: grouped K/V, no rotary, no norm, no gate), a ReLU-squared MLP (`mlp`, `-`), or a MoE block
(`moe`, `E`: `deltaspec.shared.model.mlp.GroupMoE`, sigmoid group-limited routing, non-gated ReLU-squared experts,
optionally in a latent space, and a shared expert). Norms are the
usual RMSNorm (w applied as it is). The Mamba2 state is kind `ssd`: per head h a `(state, head_dim)` matrix decaying
by exp(dt A_h), written with B_t (dt x_t)^T, so a round logs B, dt x and dt A per token and commits in closed form.

Tensors: HF 5.25 saves `model.embeddings`, `model.layers.i.norm`, `model.layers.i.mixer.*`, `model.norm_f`; NVIDIA's
published checkpoints name the trunk `backbone.` instead of `model.`. `convert` maps both onto the shared layers'
names (`embed_tokens`, `input_layernorm` or `post_attention_layernorm`, `mamba`, `self_attn` or `mlp`, `norm`);
the published per-expert `mixer.experts.j.up_proj.weight` are stacked by the loader into HF's `experts.up_proj`.
`publish` writes HF's.

MTP head (`num_nextn_predict_layers: 1`; HF 5.25 reads the config but its model drops `mtp.*`, so vLLM's
`nemotron_h_mtp.py` is the reference): one step of the family's own blocks, kinds `mtp_layers_block_type` (or the
pattern `mtp_hybrid_override_pattern`; HF's default attention then MoE), published as `mtp.layers.i.norm|mixer.*`
like the trunk's, with the fusion on the first (`enorm`, `hnorm`, `eh_proj`) and the end norm on the last
(`final_layernorm`). `convert` maps them onto the MTP drafter's names (`pre_fc_norm_embedding`, `pre_fc_norm_hidden`,
`fc`, `norm`: the computation is the same as Qwen's, embedding first). Refused: more than one step (each with its
own fusion, which vLLM does not run either) and Mamba2 blocks in the head (its cache rolls back by position only).
"""
from __future__ import annotations

import re
from typing import Any, Protocol

from torch import Tensor, nn

from deltaspec.shared.model.families.mamba2 import mixer, ssd_spec, time_step_limit
from deltaspec.shared.model.fields import (MTP_FUSION, ConfigError, json_float, positive_int, refuse_unless,
                                           supported_kinds)
from deltaspec.shared.model.mixers.attention import Attention
from deltaspec.shared.model.mlp import GroupMoE, GroupMoEFields, ReluSquaredMLP
from deltaspec.shared.state.spec import ATTENTION, RECURRENT, STATELESS, StateSpec


class NemotronFields(GroupMoEFields, Protocol):
    """What this module reads of a `ModelConfig`."""

    layer_types: tuple[str, ...]
    hidden_size: int
    intermediate_size: int
    mlp_bias: bool
    num_key_value_heads: int
    head_dim: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    mamba_n_groups: int
    mamba_conv_kernel: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    mamba_norm_eps: float
    mamba_dt_limit: tuple[float, float]
    mtp_layer_types: tuple[str, ...]


TEXT_TYPES = ("nemotron_h",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = False
LAYER_KINDS = ("linear_attention", "full_attention", "mlp", "moe")
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
PARTS = {"linear_attention": "mamba", "full_attention": "self_attn", "mlp": "mlp", "moe": "mlp"}  # the shared names
CHANNEL_MIXERS = ("mlp", "moe")  # blocks behind the shared layers' post_attention_layernorm
MTP_DEFAULT = ["full_attention", "moe"]  # HF's `mtp_layers_block_type` when the config gives none
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}  # HF's remap of older kind names (MTP's)


def _layer_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types")
    if kinds is None and isinstance(cfg.get("hybrid_override_pattern"), str):
        kinds = [PATTERN.get(c, c) for c in cfg["hybrid_override_pattern"]]
    if not isinstance(kinds, list) or not kinds:
        raise ConfigError("config.json: nemotron_h needs 'layers_block_type' (or 'hybrid_override_pattern')")
    return supported_kinds(kinds, LAYER_KINDS, "nemotron_h")



def _mtp_layer_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    """The MTP head's block kinds, read as HF 5.25 reads them; () without a head."""
    steps = cfg.get("num_nextn_predict_layers") or 0
    if not steps:
        return ()
    if steps != 1:
        raise ConfigError(f"config.json: nemotron_h's num_nextn_predict_layers {steps!r} is not supported (one MTP "
                          "step, as vLLM runs it)")
    kinds = cfg.get("mtp_layers_block_type")
    kinds = MTP_DEFAULT if kinds is None else [LEGACY.get(k, k) for k in kinds] if isinstance(kinds, list) else kinds
    if kinds == MTP_DEFAULT and isinstance(cfg.get("mtp_hybrid_override_pattern"), str):
        kinds = [PATTERN.get(c, c) for c in cfg["mtp_hybrid_override_pattern"]]
    if not isinstance(kinds, list) or not kinds:
        raise ConfigError("config.json: nemotron_h's mtp_layers_block_type must be a non-empty list of layer kinds")
    return supported_kinds(kinds, ("full_attention", "mlp", "moe"), "nemotron_h",
                           "MTP layer kind (mtp_layers_block_type)")


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of a Nemotron-H config, HF 5.25's names or the published ones (`mamba_n_groups`...)."""
    for name, supported in (("mlp_hidden_act", ("relu2",)), ("mamba_hidden_act", ("silu",))):
        refuse_unless(cfg, name, supported, "nemotron_h")
    layer_types, mtp_layer_types = _layer_types(cfg), _mtp_layer_types(cfg)
    kinds = layer_types + mtp_layer_types

    def get(name: str, old: str, default: Any) -> Any:
        return cfg.get(name, cfg.get(old, default))

    return dict(
        num_hidden_layers=len(layer_types), layer_types=layer_types,
        num_attention_heads=positive_int(cfg, "num_attention_heads"),
        num_key_value_heads=positive_int(cfg, "num_key_value_heads"),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // positive_int(cfg, "num_attention_heads")),
        intermediate_size=positive_int(cfg, "intermediate_size") if "mlp" in kinds else 0,
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), norm_offset=0.0,
        partial_rotary_factor=0.0, attention_output_gate=False, attention_qk_norm=False,
        attention_bias=False,  # HF's NemotronHAttention has no biases, whatever the config says
        tie_word_embeddings=False,  # nor does HF's model tie lm_head to the embeddings (it declares no tied weights)
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        mamba_num_heads=positive_int(cfg, "mamba_num_heads"), mamba_head_dim=positive_int(cfg, "mamba_head_dim"),
        ssm_state_size=positive_int(cfg, "ssm_state_size"), mamba_n_groups=int(get("n_groups", "mamba_n_groups", 8)),
        mamba_conv_kernel=int(get("conv_kernel", "mamba_d_conv", 4)),
        mamba_conv_bias=bool(get("use_conv_bias", "mamba_conv_bias", True)),
        mamba_proj_bias=bool(cfg.get("use_bias", False)),  # HF's mixer reads use_bias, not mamba_proj_bias
        mamba_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        mamba_dt_limit=time_step_limit(get("time_step_limit", "mamba_dt_limit", (0.0, float("inf")))),
        mtp_layer_types=mtp_layer_types,
        **(_experts(cfg) if "moe" in kinds else {}),
    )


def _experts(cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE blocks' fields, HF's defaults where the config leaves one out (HF's model ignores `n_shared_experts`
    and `moe_shared_expert_overlap`: one shared expert, always added)."""
    cfg = {**dict(n_routed_experts=cfg.get("num_local_experts", 8), num_experts_per_tok=2, moe_intermediate_size=7688,
                  moe_shared_expert_intermediate_size=7688, n_group=1, topk_group=1), **cfg}
    n, groups, top_groups = (positive_int(cfg, k) for k in ("n_routed_experts", "n_group", "topk_group"))
    if n % groups or n // groups < 2 or top_groups > groups:
        raise ConfigError(f"config.json: nemotron_h's n_routed_experts ({n}) must split into n_group ({groups}) groups "
                          f"of at least 2 experts, of which topk_group ({top_groups}) are kept")
    top_k = positive_int(cfg, "num_experts_per_tok")
    if top_k > top_groups * (n // groups):
        raise ConfigError(f"config.json: nemotron_h's num_experts_per_tok ({top_k}) is more than the experts of "
                          f"topk_group ({top_groups}) groups")
    latent = cfg.get("moe_latent_size")
    return dict(num_experts=n, num_experts_per_tok=top_k, n_group=groups, topk_group=top_groups,
                moe_intermediate_size=positive_int(cfg, "moe_intermediate_size"),
                shared_expert_intermediate_size=positive_int(cfg, "moe_shared_expert_intermediate_size"),
                moe_latent_size=0 if latent is None else positive_int(cfg, "moe_latent_size"),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                routed_scaling_factor=json_float(cfg.get("routed_scaling_factor", 1.0), "routed_scaling_factor"))


def layer(cfg: NemotronFields, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    if kind == "mlp":
        return "", None, ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
    if kind == "moe":
        return "", None, GroupMoE(cfg)
    if kind == "full_attention":
        return "self_attn", Attention(cfg), None
    return "mamba", mixer(cfg), None


def state_spec(cfg: NemotronFields) -> StateSpec:
    kinds = {"linear_attention": RECURRENT, "full_attention": ATTENTION, "mlp": STATELESS, "moe": STATELESS}
    return StateSpec(tuple(kinds[k] for k in cfg.layer_types), ssd_spec(cfg), cfg.num_key_value_heads, cfg.head_dim)


_BLOCK = re.compile(r"^(model|backbone|mtp)\.layers\.(\d+)\.(norm|mixer)\.(.*)$")
_MTP_END = re.compile(r"^mtp\.layers\.(\d+)\.(enorm|hnorm|eh_proj|final_layernorm)\.(.*)$")


def _end_layer(part: str, cfg: NemotronFields) -> int:
    """The MTP layer a published fusion part sits on: the end norm on the last, the rest on the first."""
    return len(cfg.mtp_layer_types) - 1 if part == "final_layernorm" else 0


def convert(tensors: dict[str, Tensor], cfg: NemotronFields) -> None:
    """HF's (or the published `backbone.`) names -> the shared layers', in place; the MTP head's -> the drafter's."""
    for name in list(tensors):
        end = _MTP_END.match(name)
        if end and cfg.mtp_layer_types and int(end.group(1)) == _end_layer(end.group(2), cfg):
            tensors[f"mtp.{MTP_FUSION[end.group(2)]}.{end.group(3)}"] = tensors.pop(name)
            continue
        m = _BLOCK.match(name)
        if m:
            where, i, part, rest = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            kinds = cfg.mtp_layer_types if where == "mtp" else cfg.layer_types
            if i >= len(kinds):
                continue  # left as it is: the loader (or, for mtp.*, the MTP drafter) names it as unexpected
            kind = kinds[i]
            new = ("post_attention_layernorm" if kind in CHANNEL_MIXERS else "input_layernorm") if part == "norm" \
                else PARTS[kind]
            tensors[f"{'mtp' if where == 'mtp' else 'model'}.layers.{i}.{new}.{rest}"] = tensors.pop(name)
            continue
        for old, new in (("backbone.", "model."), ("model.embeddings.", "model.embed_tokens."),
                         ("model.norm_f.", "model.norm.")):
            if name.startswith(old):
                tensors[new + name[len(old):]] = tensors.pop(name)
                name = new + name[len(old):]


def publish(tensors: dict[str, Tensor], cfg: NemotronFields) -> None:
    """`convert`'s inverse, in place: HF 5.25's names, and the MTP head's as NVIDIA publishes them."""
    mtp_parts = {v: k for k, v in MTP_FUSION.items()}
    for name in list(tensors):
        m = re.match(r"^(model|mtp)\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm|mamba|self_attn|mlp)\."
                     r"(.*)$", name)
        mtp = re.match(rf"^mtp\.({'|'.join(mtp_parts)})\.(.*)$", name)
        if m:
            part = "norm" if m.group(3).endswith("layernorm") else "mixer"
            tensors[f"{m.group(1)}.layers.{m.group(2)}.{part}.{m.group(4)}"] = tensors.pop(name)
        elif mtp:
            part = mtp_parts[mtp.group(1)]
            tensors[f"mtp.layers.{_end_layer(part, cfg)}.{part}.{mtp.group(2)}"] = tensors.pop(name)
        elif name.startswith(("model.embed_tokens.", "model.norm.")):
            new = name.replace("model.embed_tokens.", "model.embeddings.", 1).replace("model.norm.", "model.norm_f.", 1)
            tensors[new] = tensors.pop(name)
