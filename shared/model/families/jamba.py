"""AI21 Jamba (`jamba`: JambaForCausalLM, ai21labs/Jamba-v0.1, AI21-Jamba-*-1.5/1.6/1.7, Jamba-reasoning):
Mamba1 layers and attention layers, each followed by a SwiGLU MLP or, every few layers, a sparse MoE block.

What HF 5.25's `modeling_jamba.py` and `configuration_jamba.py` make of a config:
- layer i is attention where i % `attn_layer_period` == `attn_layer_offset`, else Mamba1; its feed-forward is sparse
  where i % `expert_layer_period` == `expert_layer_offset` and `num_experts` > 1 (the other layers are
  `mlp_only_layers`); an offset not below its period is refused, as HF refuses it;
- the Mamba1 mixer (`mixers/mamba1.py`) is `mamba_expand` x hidden_size wide, state `mamba_d_state`, conv
  `mamba_d_conv`, dt rank `mamba_dt_rank` ("auto": ceil(hidden_size / 16)), biases `mamba_conv_bias` and
  `mamba_proj_bias`, and RMS-normalises dt (before dt_proj), B and C with weights (`dt_layernorm`, `b_layernorm`,
  `c_layernorm`, eps `rms_norm_eps`); its state is kind `mamba`, as Mamba's;
- attention is llama's without rotary, q/k norm, gate or biases, scale 1/sqrt(head_dim);
- the MoE router (`feed_forward.router`) softmaxes the logits and keeps the top-k weights as they are (not
  renormalised); the experts are SwiGLU of width `intermediate_size`, as the dense MLP; no shared expert;
- every norm is a plain RMSNorm (w applied as it is), eps `rms_norm_eps`: `input_layernorm`, `pre_ff_layernorm`,
  `final_layernorm`; `lm_head` is tied only where `tie_word_embeddings` (HF's default: not).
Tensors: HF 5.25 saves the published layout, per expert (`feed_forward.experts.j.gate_proj.weight`, `up_proj`,
`down_proj`: its conversion mapping fuses them in memory); `convert` renames them onto the loader's per-expert names,
which it stacks (HF's fused in-memory names load too); `publish` writes the published layout.
"""
from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn

from deltaspec.shared.model.families import lfm2, mamba
from deltaspec.shared.model.fields import ConfigError, positive_int, refuse_unless, unstack_experts
from deltaspec.shared.model.mixers.attention import Attention
from deltaspec.shared.model.mlp import MLP, SparseMoE
from deltaspec.shared.state.spec import ATTENTION, RECURRENT, StateSpec

TEXT_TYPES = ("jamba",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = False
LAYER_KINDS = ("linear_attention", "full_attention")
# (HF's name fragment, the shared layers'), replaced in turn: the router before the rest of the feed-forward
RENAMES = (("model.final_layernorm.", "model.norm."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
           (".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."))


def _every(cfg: dict[str, Any], period: str, offset: str, defaults: tuple[int, int]) -> tuple[int, int]:
    """(period, offset) of a layer pattern, HF's defaults where absent; the offset must sit below the period."""
    p, o = (cfg.get(period, defaults[0]), cfg.get(offset, defaults[1]))
    p = positive_int({period: p}, period)
    if isinstance(o, bool) or not isinstance(o, int) or not 0 <= o < p:
        raise ConfigError(f"config.json: field {offset!r} must be between 0 and {period} ({p}) - 1, got {o!r}")
    return p, o


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of a Jamba config; sizes must be given, other absent fields take HF's defaults."""
    refuse_unless(cfg, "hidden_act", ("silu",), "jamba")  # the MLPs' and the conv's activation
    n_layers, hidden = positive_int(cfg, "num_hidden_layers"), positive_int(cfg, "hidden_size")
    heads, eps = positive_int(cfg, "num_attention_heads"), float(cfg.get("rms_norm_eps", 1e-6))
    width = positive_int(cfg, "intermediate_size")
    attn_period, attn_offset = _every(cfg, "attn_layer_period", "attn_layer_offset", (8, 4))
    moe_period, moe_offset = _every(cfg, "expert_layer_period", "expert_layer_offset", (2, 1))
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 16))
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
        raise ConfigError(f"config.json: field 'num_experts' must be 0 or more, got {experts!r}")
    moe = dict(num_experts=experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
               moe_intermediate_size=width, norm_topk_prob=False,
               mlp_only_layers=tuple(i for i in range(n_layers) if i % moe_period != moe_offset),
               ) if experts > 1 else {}  # HF's sparse blocks need more than one expert
    rank = cfg.get("mamba_dt_rank", "auto")
    rank = math.ceil(hidden / 16) if rank == "auto" else positive_int(cfg, "mamba_dt_rank")
    kv_heads = cfg.get("num_key_value_heads", 8)
    d = {k: cfg.get(k, v) for k, v in (("mamba_d_state", 16), ("mamba_d_conv", 4), ("mamba_expand", 2))}
    return dict(
        num_hidden_layers=n_layers,
        layer_types=tuple("full_attention" if i % attn_period == attn_offset else "linear_attention"
                          for i in range(n_layers)),
        num_attention_heads=heads, num_key_value_heads=heads if kv_heads is None else int(kv_heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate_size=width, rms_norm_eps=eps,
        norm_offset=0.0, partial_rotary_factor=0.0, attention_output_gate=False, attention_qk_norm=False,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mamba_num_heads=positive_int(d, "mamba_expand") * hidden, mamba_head_dim=1,
        ssm_state_size=positive_int(d, "mamba_d_state"), mamba_dt_rank=rank,
        mamba_conv_kernel=positive_int(d, "mamba_d_conv"), mamba_conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(cfg.get("mamba_proj_bias", False)), mamba_norm_eps=eps, **moe,
    )


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    """A Mamba1 mixer with weighted dt/B/C norms (`mamba`) or an attention (`self_attn`), then the dense MLP or the
    sparse MoE block (softmax top-k, not renormalised; no shared expert)."""
    token_mixer = (("mamba", mamba.mixer(cfg, rms_eps=cfg.mamba_norm_eps, rms_weights=True))
                   if kind == "linear_attention" else ("self_attn", Attention(cfg)))
    mlp = (SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, 0,
                     renormalise=cfg.norm_topk_prob) if sparse else MLP(cfg.hidden_size, cfg.intermediate_size))
    return (*token_mixer, mlp)


def state_spec(cfg: Any) -> StateSpec:
    """Mamba1 layers (kind `mamba`) and attention layers' K/V."""
    layers = tuple(RECURRENT if kind == "linear_attention" else ATTENTION for kind in cfg.layer_types)
    return StateSpec(layers, mamba.mamba1_spec(cfg), cfg.num_key_value_heads, cfg.head_dim)


def convert(tensors: dict[str, Tensor], cfg: Any) -> None:
    """HF's names (published per expert, or fused as HF keeps them in memory) -> the shared layers', in place."""
    lfm2.rename_fragments(tensors, RENAMES)


def publish(tensors: dict[str, Tensor], cfg: Any) -> None:
    """`convert`'s inverse, in place: the published layout, as HF 5.25's `save_pretrained` writes it."""
    unstack_experts(tensors)
    lfm2.rename_fragments(tensors, tuple((ours, hf) for hf, ours in RENAMES))
