"""MiniMax-Text-01 (`minimax`: MiniMaxForCausalLM, MiniMaxAI/MiniMax-Text-01-hf): lightning attention layers and
full softmax attention layers, each followed by a sparse MoE block, with scaled residuals.

What HF 5.25's `modeling_minimax.py` and `configuration_minimax.py` make of a config:
- layer kinds from `layer_types` ("linear_attention", "full_attention"), else HF's default: full attention at even
  indices, lightning at odd ones;
- lightning attention (`mixers/lightning.py`, `self_attn`): `num_attention_heads` heads of `head_dim` (else
  hidden_size / heads), a decay per head from the layer's index (HF's `slope_rate` buffer), an RMSNorm over all
  heads of eps 1e-6 (not `rms_norm_eps`), a sigmoid output gate; its state is kind `lightning`, no conv. HF's block
  size (`block_size`) only shapes its prefill and its derived buffers, which `publish` writes;
- full attention is llama's: grouped K/V (`num_key_value_heads`), rotary over the whole head at `rope_theta` (HF's
  MiniMax rotary ignores `partial_rotary_factor`), no q/k norm, gate or biases, scale 1/sqrt(head_dim);
  `sliding_window` is refused;
- every layer's feed-forward is the sparse MoE block: softmax over `num_local_experts`, top `num_experts_per_tok`,
  always renormalised; SwiGLU experts of width `intermediate_size`; no shared expert, no dense MLP;
- the residuals (`DecoderLayer`'s `normed_residual`): each part adds beta times its output to alpha times its
  normed input, not to its input: `linear_attn_alpha_factor`/`beta` for lightning, `full_attn_*` for attention,
  `mlp_*` for the MoE block; norms are plain RMSNorms of eps `rms_norm_eps`.
Tensors: HF 5.25 saves the published layout (`block_sparse_moe.gate`, per expert `block_sparse_moe.experts.j.w1`,
`w3`, `w2`, as Mixtral's: its conversion mapping fuses them in memory) and the lightning layers' buffers
(`slope_rate`, with `query_decay`, `key_decay` and `diagonal_decay` derived from it); `convert` renames the experts
as the loader's per-expert tensors (HF's fused in-memory names load too), drops the derived buffers and fills in
`slope_rate` from the config where a checkpoint lacks it; `publish` writes the published layout, derived buffers
included.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from deltaspec.shared.model.families import lfm2, lfm2_moe
from deltaspec.shared.model.fields import (ConfigError, json_float, positive_int, refuse_unless, rename_experts,
                                           unstack_experts)
from deltaspec.shared.model.mixers.attention import Attention
from deltaspec.shared.model.mixers.lightning import LightningAttention, slope_rates
from deltaspec.shared.model.mlp import SparseMoE
from deltaspec.shared.state.spec import ATTENTION, RECURRENT, RecurrentSpec, StateSpec

TEXT_TYPES = ("minimax",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = True  # HF's router renormalises the top-k probabilities; the config has no switch
LAYER_KINDS = ("linear_attention", "full_attention")
RENAMES = ((".block_sparse_moe.", ".mlp."),)
DERIVED = ("query_decay", "key_decay", "diagonal_decay")  # a lightning layer's buffers HF derives from slope_rate
# (layer kind, its mixer's residual factors' names): the MoE block's are `mlp_*` in every layer
FACTORS = (("linear_attention", "linear_attn"), ("full_attention", "full_attn"))


def _layer_types(cfg: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    kinds = cfg.get("layer_types")
    if kinds is None:
        return tuple("full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n_layers))
    if not isinstance(kinds, list):
        raise ConfigError(f"config.json: field 'layer_types' must be a list of layer kinds, got {kinds!r}")
    return tuple(kinds)


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of a MiniMax config; sizes must be given, other absent fields take HF's defaults."""
    refuse_unless(cfg, "hidden_act", ("silu",), "minimax")  # lightning's q/k/v activation and the experts'
    refuse_unless(cfg, "sliding_window", (None,), "minimax")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    refuse_unless(rope, "rope_type", ("default",), "minimax")
    cfg = {**dict(num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, block_size=256), **cfg}
    n_layers, hidden = positive_int(cfg, "num_hidden_layers"), positive_int(cfg, "hidden_size")
    heads, width = positive_int(cfg, "num_attention_heads"), positive_int(cfg, "intermediate_size")
    positive_int(cfg, "block_size")  # read again by `publish`
    kv_heads = positive_int(cfg, "num_key_value_heads") if cfg["num_key_value_heads"] is not None else heads

    def factors(part: str) -> tuple[float, float]:
        return tuple(json_float(cfg.get(f"{part}_{ab}_factor", 1), f"{part}_{ab}_factor") for ab in ("alpha", "beta"))

    return dict(
        num_hidden_layers=n_layers, layer_types=_layer_types(cfg, n_layers),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=width, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), norm_offset=0.0,
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1e6))), partial_rotary_factor=1.0,
        attention_output_gate=False, attention_qk_norm=False,
        num_experts=positive_int(cfg, "num_local_experts"),
        num_experts_per_tok=positive_int(cfg, "num_experts_per_tok"), moe_intermediate_size=width, norm_topk_prob=True,
        normed_residual=tuple((kind, factors(part), factors("mlp")) for kind, part in FACTORS),
    )


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    """Lightning or full attention (`self_attn`), then the sparse MoE block, each output times its beta."""
    (_, mixer_beta), (_, mlp_beta) = next((m, p) for k, m, p in cfg.normed_residual if k == kind)
    mixer = (LightningAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, mixer_beta)
             if kind == "linear_attention" else Attention(dataclasses.replace(cfg, residual_multiplier=mixer_beta)))
    return "self_attn", mixer, SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                         cfg.moe_intermediate_size, 0, renormalise=True, out_multiplier=mlp_beta)


def state_spec(cfg: Any) -> StateSpec:
    """Lightning layers (kind `lightning`: a `head_dim` x `head_dim` state per head, no conv) and attention K/V."""
    layers = tuple(RECURRENT if kind == "linear_attention" else ATTENTION for kind in cfg.layer_types)
    spec = RecurrentSpec("lightning", conv_dim=0, conv_width=1, heads=cfg.num_attention_heads, key_dim=cfg.head_dim,
                         value_dim=cfg.head_dim)
    return StateSpec(layers, spec, cfg.num_key_value_heads, cfg.head_dim)


def _lightning(cfg: Any) -> list[int]:
    return [i for i, kind in enumerate(cfg.layer_types) if kind == "linear_attention"]


def convert(tensors: dict[str, Tensor], cfg: Any) -> None:
    """HF's names (published per expert, or fused as HF keeps them in memory) -> the shared layers', in place; the
    derived lightning buffers dropped, `slope_rate` computed as HF does where the checkpoint lacks it."""
    lfm2.rename_fragments(tensors, RENAMES)
    rename_experts(tensors, lfm2_moe.PROJS)
    for i in _lightning(cfg):
        prefix = f"model.layers.{i}.self_attn."
        for name in DERIVED:
            tensors.pop(prefix + name, None)
        tensors.setdefault(prefix + "slope_rate", slope_rates(cfg.num_attention_heads, i, cfg.num_hidden_layers))


def block_decays(slope_rate: Tensor, block_size: int) -> dict[str, Tensor]:
    """HF's `decay_factors`: the buffers its block-wise prefill reads, from a layer's `slope_rate` `(H, 1, 1)`."""
    slope = slope_rate.float()
    steps = torch.arange(block_size) + 1
    diagonal = slope * (steps[:, None] - steps[None, :])[None, None]
    diagonal = torch.exp(torch.where(diagonal >= 0, -diagonal, float("-inf")))
    decays = dict(query_decay=torch.exp(-slope * steps[:, None]),
                  key_decay=torch.exp(-slope * (block_size - steps[:, None])), diagonal_decay=diagonal)
    return {name: t.to(slope_rate.dtype) for name, t in decays.items()}


def publish(tensors: dict[str, Tensor], cfg: Any) -> None:
    """`convert`'s inverse, in place: the published layout and buffers, as HF 5.25's `save_pretrained` writes them."""
    for i in _lightning(cfg):
        prefix = f"model.layers.{i}.self_attn."
        block = block_decays(tensors[prefix + "slope_rate"], cfg.raw.get("block_size", 256))
        tensors.update({prefix + name: t for name, t in block.items()})
    unstack_experts(tensors)
    rename_experts(tensors, ((ours, published) for published, ours in lfm2_moe.PROJS))
    lfm2.rename_fragments(tensors, tuple((ours, hf) for hf, ours in RENAMES))
