"""Moonshot Kimi Linear (`kimi_linear`: Kimi-Linear-48B-A3B): KDA layers and multi-head latent attention layers,
each followed by a SwiGLU MLP (the first `first_k_dense_replace`) or DeepSeek-V3's MoE block.

What HF 5.25's `modeling_kimi_linear.py` and `configuration_kimi_linear.py` make of a config:
- `layer_types` as given, else from `linear_attn_config`'s 1-based `full_attn_layers` and `kda_layers`, else full
  attention at every fourth layer after the first; `mlp_layer_types` ("dense"/"sparse") likewise, else dense below
  `first_k_dense_replace` (1); the KDA sizes from `linear_attn_config` (`num_heads`, `head_dim`,
  `short_conv_kernel_size`) or `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`;
- KDA (`mixers/kda.py`): low-rank forget and output gates, the softplus decay, sigmoid-gated output norm (eps
  `rms_norm_eps`); state kind "kda" (a log decay per head and key channel);
- MLA (`mixers/mla.py`) without rotary (NoPE: `qk_rope_head_dim` channels shared by the heads, never rotated), no
  output gate, scale (qk_nope + qk_rope)^-1/2; its latent is what the attention state caches, as one K/V head of
  `kv_lora_rank + qk_rope_head_dim`. `num_key_value_heads` plays no part (every head has its keys), but one below
  `num_attention_heads` is refused: HF's attention then repeats the already per-head keys and fails;
- the MoE block (`mlp.SharedExpertsMoE`): HF's config names `num_experts`, `num_experts_per_token`,
  `num_expert_group`, `moe_renormalize`, `num_shared_experts` (or their DeepSeek aliases); shared experts
  `num_shared_experts x moe_intermediate_size` wide;
- plain RMSNorms (w as it is); `lm_head` never tied (HF's model declares no tied weights).
Tensors: HF 5.25 saves the published layout: `block_sparse_moe.` for every MLP, experts per expert (`w1`, `w3`,
`w2`), the conv split into `q_conv1d`, `k_conv1d`, `v_conv1d`, the forget gate's `f_a_proj`, `f_b_proj`, `dt_bias`,
`A_log` on the layer (HF's in-memory `forget_gate.` names load too). `convert` maps them onto the shared layers'
names (the loader stacks the experts), `publish` writes them back.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from deltaspec.shared.model.families.lfm2 import rename_fragments
from deltaspec.shared.model.fields import ConfigError, json_float, positive_int, refuse_unless, rename_experts, \
    supported_kinds, unstack_experts
from deltaspec.shared.model.mixers.kda import KDAForm, KimiDeltaAttention
from deltaspec.shared.model.mixers.mla import LatentAttention
from deltaspec.shared.model.mlp import MLP, SharedExpertsMoE
from deltaspec.shared.state.spec import ATTENTION, RECURRENT, RecurrentSpec, StateSpec

TEXT_TYPES = ("kimi_linear",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = False
LAYER_KINDS = ("linear_attention", "full_attention")
RENAMES = ((".block_sparse_moe.", ".mlp."), (".self_attn.forget_gate.", ".self_attn."))  # published/HF -> ours
PROJS = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))  # an expert's published names, the loader's
CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")  # the published conv, split at q, k, v
KDA = KDAForm(low_rank=True, a_log_4d=True, rounded_decay=False, keep_float32=("dt_bias",))


def get(cfg: dict[str, Any], names: tuple[str, ...], default: Any) -> Any:
    """The first of `names` (HF's name, then its aliases) the config has, else `default`."""
    return next((cfg[n] for n in names if cfg.get(n) is not None), default)


def layer_types(cfg: dict[str, Any], linear: dict[str, Any], n_layers: int, model_type: str,
                default: list[str]) -> tuple[str, ...]:
    """`layer_types`, else `linear_attn_config`'s 1-based layer lists, else `default`; every kind one of ours."""
    kinds = cfg.get("layer_types")
    if kinds is None and "full_attn_layers" in linear and "kda_layers" in linear:
        kinds = [None] * n_layers
        for name, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for i in linear[name]:
                if not 1 <= i <= n_layers:
                    raise ConfigError(f"config.json: {model_type}'s linear_attn_config.{name} names layer {i}")
                kinds[i - 1] = kind
    kinds = default if kinds is None else kinds
    return supported_kinds(kinds, LAYER_KINDS, model_type, "layer kind in layer_types")


def dense_layers(cfg: dict[str, Any], n_layers: int, first_dense: int, model_type: str) -> tuple[int, ...]:
    """The layers whose MLP is dense: `mlp_layer_types`' "dense" ones, else those below `first_dense`."""
    kinds = cfg.get("mlp_layer_types") or ["dense" if i < first_dense else "sparse" for i in range(n_layers)]
    if len(kinds) != n_layers or any(k not in ("dense", "sparse") for k in kinds):
        raise ConfigError(f"config.json: {model_type}'s mlp_layer_types must be 'dense' or 'sparse' for each of the "
                          f"{n_layers} layers, got {kinds!r}")
    return tuple(i for i, kind in enumerate(kinds) if kind == "dense")


def moe_fields(cfg: dict[str, Any], model_type: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's MoE fields under HF's names or their aliases, `defaults` (HF's) where absent."""
    def read(names: tuple[str, ...]) -> Any:
        return positive_int({names[0]: get(cfg, names, defaults[names[0]])}, names[0])

    n, top_k = read(("num_experts", "num_local_experts")), read(("num_experts_per_token", "num_experts_per_tok"))
    groups, top_groups = read(("num_expert_group", "n_group")), read(("topk_group",))
    if n % groups or n // groups < 2 or top_groups > groups or top_k > top_groups * (n // groups):
        raise ConfigError(f"config.json: {model_type}'s num_experts ({n}) must split into num_expert_group ({groups}) "
                          f"groups of at least 2 experts, of which topk_group ({top_groups}) hold at least "
                          f"num_experts_per_token ({top_k})")
    shared = read(("num_shared_experts", "n_shared_experts"))
    width = read(("moe_intermediate_size",))
    return dict(num_experts=n, num_experts_per_tok=top_k, n_group=groups, topk_group=top_groups,
                moe_intermediate_size=width, shared_expert_intermediate_size=shared * width,
                norm_topk_prob=bool(get(cfg, ("moe_renormalize", "norm_topk_prob"), True)),
                routed_scaling_factor=json_float(get(cfg, ("routed_scaling_factor",), defaults[
                    "routed_scaling_factor"]), "routed_scaling_factor"))


def mla_fields(cfg: dict[str, Any], model_type: str, defaults: dict[str, int]) -> dict[str, Any]:
    """The latent attention's sizes (HF's defaults where absent)."""
    heads = positive_int(cfg, "num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and heads // positive_int(cfg, "num_key_value_heads") > 1:
        raise ConfigError(f"config.json: {model_type} with num_key_value_heads={kv_heads!r} below "
                          f"num_attention_heads ({heads}) is not supported (HF's latent attention fails)")
    sizes = {name: positive_int({name: cfg.get(name, default)}, name) for name, default in defaults.items()}
    q_rank = cfg.get("q_lora_rank")
    return dict(num_attention_heads=heads, num_key_value_heads=heads, **sizes,
                q_lora_rank=0 if q_rank is None else positive_int(cfg, "q_lora_rank"),
                attention_bias=bool(cfg.get("attention_bias", False)), attention_qk_norm=False)


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of a Kimi Linear config; HF's defaults where a field is absent."""
    refuse_unless(cfg, "hidden_act", ("silu",), "kimi_linear")  # the MLPs' and the short convs' activation
    n_layers = positive_int(cfg, "num_hidden_layers")
    linear = cfg.get("linear_attn_config") or {}
    heads = positive_int({"num_heads": linear.get("num_heads", cfg.get("linear_num_heads", 32))}, "num_heads")
    head_dim = positive_int({"head_dim": linear.get("head_dim", cfg.get("linear_head_dim", 128))}, "head_dim")
    width = positive_int({"short_conv_kernel_size": linear.get("short_conv_kernel_size",
                                                               cfg.get("linear_conv_kernel_dim", 4))},
                         "short_conv_kernel_size")
    kinds = layer_types(cfg, linear, n_layers, "kimi_linear",
                        ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)])
    return dict(
        num_hidden_layers=n_layers, layer_types=kinds,
        **mla_fields(cfg, "kimi_linear", dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                              v_head_dim=128)),
        partial_rotary_factor=0.0, attention_output_gate=False,
        intermediate_size=positive_int({"intermediate_size": cfg.get("intermediate_size", 9216)}, "intermediate_size"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), norm_offset=0.0, tie_word_embeddings=False,
        linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim, linear_conv_kernel_dim=width,
        mlp_only_layers=dense_layers(cfg, n_layers, cfg.get("first_k_dense_replace", 1), "kimi_linear"),
        **moe_fields(cfg, "kimi_linear", dict(num_experts=256, num_experts_per_token=8, num_expert_group=1,
                                              topk_group=1, num_shared_experts=1, moe_intermediate_size=1024,
                                              routed_scaling_factor=2.446)))


def mlp(cfg: Any, sparse: bool) -> nn.Module:
    return SharedExpertsMoE(cfg) if sparse else MLP(cfg.hidden_size, cfg.intermediate_size)


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    if kind == "full_attention":
        return "self_attn", LatentAttention(cfg), mlp(cfg, sparse)
    return "self_attn", KimiDeltaAttention(cfg, KDA), mlp(cfg, sparse)


def state_spec(cfg: Any) -> StateSpec:
    """KDA states per head `(D, D)` with a log decay per key channel; the latent as one K/V head (`mixers/mla.py`)."""
    H, D = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    kinds = {"linear_attention": RECURRENT, "full_attention": ATTENTION}
    return StateSpec(tuple(kinds[k] for k in cfg.layer_types),
                     RecurrentSpec("kda", 3 * H * D, cfg.linear_conv_kernel_dim, H, D, D),
                     1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def join_convs(tensors: dict[str, Tensor]) -> None:
    """The published per-projection convs `q_conv1d`, `k_conv1d`, `v_conv1d` -> one `conv1d` over [q; k; v]."""
    for name in [n for n in tensors if n.endswith(f".{CONVS[0]}.weight")]:
        prefix = name[: -len(f"{CONVS[0]}.weight")]
        tensors[prefix + "conv1d.weight"] = torch.cat([tensors.pop(f"{prefix}{c}.weight") for c in CONVS])


def split_convs(tensors: dict[str, Tensor]) -> None:
    """`join_convs`' inverse."""
    for name in [n for n in tensors if n.endswith(".self_attn.conv1d.weight")]:
        prefix = name[: -len("conv1d.weight")]
        for c, part in zip(CONVS, tensors.pop(name).chunk(3)):
            tensors[f"{prefix}{c}.weight"] = part.clone()


def convert(tensors: dict[str, Tensor], cfg: Any) -> None:
    """The published names (or HF's in-memory ones) -> the shared layers', in place."""
    rename_fragments(tensors, RENAMES)
    rename_experts(tensors, PROJS)
    join_convs(tensors)


def publish(tensors: dict[str, Tensor], cfg: Any) -> None:
    """`convert`'s inverse, in place: the published layout, as HF 5.25's `save_pretrained` writes it."""
    unstack_experts(tensors)
    rename_experts(tensors, ((ours, published) for published, ours in PROJS))
    split_convs(tensors)
    rename_fragments(tensors, ((".mlp.", ".block_sparse_moe."),))
