"""inclusionAI Ling hybrid (`bailing_hybrid`: Ling-3.0-Flash): Kimi Linear's stack (`kimi_linear.py`: KDA, latent
attention, DeepSeek-V3's MoE) with its own gates, rotary and clipping.

What differs from Kimi Linear (HF 5.25's `modeling_bailing_hybrid.py`, `configuration_bailing_hybrid.py`):
- KDA: full-rank forget and output gates (`f_proj`, `g_proj`); with `kda_safe_gate` (default) the log decay is
  `kda_lower_bound * sigmoid(exp(A_log) (f + dt_bias))` (in [bound, 0]), else Kimi's softplus form, either rounded to
  the model's dtype; `A_log` `(H,)`; conv, `A_log`, `dt_bias` kept in float32. H = `linear_num_heads` (else
  `num_attention_heads`), D = `linear_head_dim` (else `head_dim`: HF moves the config's `head_dim` there and sets
  `head_dim` to `qk_rope_head_dim`), conv `short_conv_kernel_size`;
- latent attention: DeepSeek's interleaved rotary on the `qk_rope_head_dim` channels (`rope_parameters`'
  `rope_theta`, default 6e6; only the "default" rope type), and a per-head sigmoid output gate `g_proj`;
- layer kinds: `layer_types`, else attention at the last layer of every `layer_group_size` (6); MLPs dense below
  `first_k_dense_replace` (2); MoE defaults 512 experts, top-8 of 8 groups (best 4), scale 2.5;
- SwiGLU clipping of the routed and shared experts by layer (`expert_swiglu_limit_list`,
  `share_expert_swiglu_limit_list`; 0: none): deltaspec's layers take one limit for every sparse layer, so lists
  whose limits differ between sparse layers are refused; dense MLPs are never clipped (HF's take none);
- the MTP head (`num_mtp_layers`, alias `num_nextn_predict_layers`, HF's default 1), which HF ignores: vLLM's
  `bailing_moe_v3_mtp.py` runs it, a DeepSeek-V3-style step stored as layer `num_hidden_layers`: `enorm`, `hnorm`,
  `eh_proj`, a latent-attention layer with a sparse MoE whose SwiGLUs are unclipped (the limit lists hold the
  trunk's layers only), `final_layernorm`; the target's embeddings and LM head. `convert` maps the first step onto
  the MTP drafter's names (`--draft mtp`); further steps' layers are dropped (the drafter reuses the first, where
  vLLM would run step j's), and so is a step's `shared_head.head` (vLLM shares the target's LM head).
Tensors: HF 5.25 saves the published layout: `model.word_embeddings`, `attention.` for `self_attn.`, `attention.dense`
for `o_proj`, the forget gate's tensors on the layer, the conv split into `q_conv1d`, `k_conv1d`, `v_conv1d`,
experts per expert, the router's bias as `gate.expert_bias`. `convert` reads those and HF's in-memory names,
`publish` writes the published layout.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from deltaspec.shared.model.families import kimi_linear
from deltaspec.shared.model.families.lfm2 import rename_fragments
from deltaspec.shared.model.fields import (MTP_FUSION, ConfigError, json_float, positive_int, refuse_unless,
                                           unstack_experts)
from deltaspec.shared.model.mixers.kda import KDAForm, KimiDeltaAttention
from deltaspec.shared.model.mixers.mla import LatentAttention
from deltaspec.shared.model.mlp import MLP, SharedExpertsMoE

TEXT_TYPES = ("bailing_hybrid",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = False
LAYER_KINDS = kimi_linear.LAYER_KINDS
# published/HF -> ours, in turn on each name
RENAMES = (("model.word_embeddings.", "model.embed_tokens."), (".attention.", ".self_attn."),
           (".self_attn.forget_gate.", ".self_attn."), (".self_attn.dense.", ".self_attn.o_proj."),
           (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"))
KDA = KDAForm(low_rank=False, a_log_4d=False, rounded_decay=True, keep_float32=("dt_bias", "A_log", "conv1d.weight"))

state_spec = kimi_linear.state_spec  # KDA states and the latent as one K/V head, as Kimi Linear's


def _rope(cfg: dict[str, Any]) -> float:
    """The rotary's theta; a rope type other than "default" is refused (its scaling is not implemented)."""
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"config.json: field 'rope_parameters' must be an object, got {rope!r}")
    refuse_unless(rope, "rope_type", ("default",), "bailing_hybrid")
    return json_float(rope.get("rope_theta", cfg.get("rope_theta", 6e6)), "rope_theta")


def _limit(cfg: dict[str, Any], names: tuple[str, str], n_layers: int, dense: tuple[int, ...]) -> float:
    """The one SwiGLU limit of every sparse layer (0: none) from a per-layer list (`names`: HF's, its alias)."""
    limits = kimi_linear.get(cfg, names, [0] * n_layers)
    if not isinstance(limits, list) or len(limits) != n_layers:
        raise ConfigError(f"config.json: bailing_hybrid's {names[0]} must hold one limit per layer ({n_layers}), "
                          f"got {limits!r}")
    sparse = {json_float(v, names[0]) for i, v in enumerate(limits) if i not in dense}
    if len(sparse) > 1:
        raise ConfigError(f"config.json: bailing_hybrid with {names[0]}={limits!r} is not supported (one limit for "
                          f"every sparse layer only)")
    return sparse.pop() if sparse else 0.0


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of a Bailing hybrid config; HF's defaults where a field is absent."""
    refuse_unless(cfg, "hidden_act", ("silu",), "bailing_hybrid")  # the MLPs' and the short convs' activation
    n_layers = positive_int(cfg, "num_hidden_layers")
    positive_int(cfg, "num_attention_heads")  # required: refused here, naming it, when absent or not a count
    group = positive_int({"layer_group_size": cfg.get("layer_group_size", 6)}, "layer_group_size")
    kinds = kimi_linear.layer_types(cfg, {}, n_layers, "bailing_hybrid",
                                    ["full_attention" if (i + 1) % group == 0 else "linear_attention"
                                     for i in range(n_layers)])
    dense = kimi_linear.dense_layers(cfg, n_layers, cfg.get("first_k_dense_replace", 2), "bailing_hybrid")
    rope_dim = positive_int({"qk_rope_head_dim": cfg.get("qk_rope_head_dim", 64)}, "qk_rope_head_dim")
    sizes = {name: positive_int({name: kimi_linear.get(cfg, names, default)}, name)
             for name, names, default in (("linear_num_heads", ("linear_num_heads", "num_attention_heads"), 32),
                                          ("linear_head_dim", ("linear_head_dim", "head_dim"), 128),
                                          ("linear_conv_kernel_dim",
                                           ("linear_conv_kernel_dim", "short_conv_kernel_size"), 4))}
    safe = bool(cfg.get("kda_safe_gate", True))
    mtp_steps = kimi_linear.get(cfg, ("num_mtp_layers", "num_nextn_predict_layers"), 1)  # HF's default: one
    return dict(
        num_hidden_layers=n_layers, layer_types=kinds, mlp_only_layers=dense,
        mtp_layer_types=("full_attention",) if mtp_steps else (),
        mtp_overrides=(("expert_swiglu_limit", 0.0), ("shared_swiglu_limit", 0.0)),
        **kimi_linear.mla_fields(cfg, "bailing_hybrid", dict(kv_lora_rank=512, qk_nope_head_dim=128,
                                                             qk_rope_head_dim=64, v_head_dim=128)),
        head_dim=rope_dim, partial_rotary_factor=1.0, rope_theta=_rope(cfg), attention_output_gate=True,
        intermediate_size=positive_int({"intermediate_size": cfg.get("intermediate_size", 6144)}, "intermediate_size"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), norm_offset=0.0, tie_word_embeddings=False,
        linear_num_key_heads=sizes["linear_num_heads"], linear_num_value_heads=sizes["linear_num_heads"],
        linear_key_head_dim=sizes["linear_head_dim"], linear_value_head_dim=sizes["linear_head_dim"],
        linear_conv_kernel_dim=sizes["linear_conv_kernel_dim"],
        kda_lower_bound=json_float(cfg.get("kda_lower_bound", -5.0), "kda_lower_bound") if safe else None,
        expert_swiglu_limit=_limit(cfg, ("expert_swiglu_limit_list", "swiglu_limits"), n_layers, dense),
        shared_swiglu_limit=_limit(cfg, ("share_expert_swiglu_limit_list", "swiglu_limits_shared"), n_layers, dense),
        **kimi_linear.moe_fields(cfg, "bailing_hybrid", dict(num_experts=512, num_experts_per_token=8,
                                                             num_expert_group=8, topk_group=4, num_shared_experts=1,
                                                             moe_intermediate_size=768, routed_scaling_factor=2.5)))


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    mlp = SharedExpertsMoE(cfg) if sparse else MLP(cfg.hidden_size, cfg.intermediate_size)
    return "self_attn", LatentAttention(cfg) if kind == "full_attention" else KimiDeltaAttention(cfg, KDA), mlp


def convert(tensors: dict[str, Tensor], cfg: Any) -> None:
    """The published names (or HF's in-memory ones) -> the shared layers', in place; the first MTP step's -> the MTP
    drafter's (`mtp.*`), further steps dropped."""
    for name in [n for n in tensors if n.startswith("model.layers.")]:
        _, _, i, rest = name.split(".", 3)
        if int(i) < cfg.num_hidden_layers:
            continue
        tensor = tensors.pop(name)
        if int(i) == cfg.num_hidden_layers and cfg.mtp_layer_types and not rest.startswith("shared_head.head."):
            part, _, tail = rest.partition(".")
            tensors[f"mtp.{MTP_FUSION[part]}.{tail}" if part in MTP_FUSION else f"mtp.layers.0.{rest}"] = tensor
    rename_fragments(tensors, RENAMES)
    kimi_linear.join_convs(tensors)


def publish(tensors: dict[str, Tensor], cfg: Any) -> None:
    """`convert`'s inverse, in place: the published layout, as HF 5.25's `save_pretrained` writes it (and the MTP
    step as vLLM reads it)."""
    fusion, step = {v: k for k, v in MTP_FUSION.items()}, f"model.layers.{cfg.num_hidden_layers}."
    for name in [n for n in tensors if n.startswith("mtp.")]:
        part, _, tail = name[len("mtp."):].partition(".")
        tensors[step + (f"{fusion[part]}.{tail}" if part in fusion else name[len("mtp.layers.0."):])] = \
            tensors.pop(name)
    unstack_experts(tensors)
    kimi_linear.split_convs(tensors)
    rename_fragments(tensors, tuple((ours, theirs) for theirs, ours in reversed(RENAMES)
                                    if theirs != ".self_attn.forget_gate."))
