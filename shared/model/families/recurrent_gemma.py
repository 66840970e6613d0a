"""RecurrentGemma (`recurrent_gemma`: RecurrentGemmaForCausalLM, google/recurrentgemma-2b and -9b; Griffin):
RG-LRU recurrent blocks and local attention, in the cycle `block_types` (default recurrent, recurrent, attention).

Every layer is a temporal block behind `temporal_pre_norm` and an MLP behind `channel_pre_norm`; the norms are Gemma's
(w applied as 1 + w, eps `rms_norm_eps`), the final one `final_norm`. What sets it apart from the shared layers:
- the embeddings are scaled by sqrt(hidden_size) rounded to bfloat16, as HF's `normalizer` buffer is (whatever
  `embeddings_scale_by_sqrt_dim` says: HF 5.25 ignores it);
- the recurrent block is `mixers.rglru`, its state kind `rglru` (a snapshot kind, as Mamba1's: the state is
  `lru_width` numbers, logged whole after each staged token); its conv window holds `conv1d_width - 1` rows of x;
- the attention block attends to the last `attention_window_size` positions (a sliding window, the query's own
  included), with rotary on the first `partial_rotary_factor` (0.5) of each head, q/k/v biased with
  `attention_bias`, o_proj always biased; head_dim is hidden_size / num_attention_heads, as HF derives it;
- the MLP is gelu_tanh(gate x) * up x, width `intermediate_size / 2`, every projection biased;
- the logits are soft-capped: cap * tanh(logits / cap), cap `logits_soft_cap`.
Tensors are named as HF 5.25 saves them (the published checkpoints' names): `temporal_block` is the mixer of either
kind; `convert` renames the norms and the MLP onto the shared layers' names and `publish` back.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.model.families.lfm2 import rename_fragments
from deltaspec.shared.model.families.qwen3_5 import ConfigFields
from deltaspec.shared.model.fields import ConfigError, json_float, positive_int, refuse_unless, supported_kinds
from deltaspec.shared.model.mixers.attention import Attention
from deltaspec.shared.model.mixers.rglru import RGLRUMixer
from deltaspec.shared.model.mlp import MLP
from deltaspec.shared.state.spec import ATTENTION, RECURRENT, RecurrentSpec, StateSpec

TEXT_TYPES = ("recurrent_gemma",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = False
LAYER_KINDS = ("recurrent", "attention")
BLOCK_TYPES = ("recurrent", "recurrent", "attention")  # HF's default cycle
RENAMES = (("model.final_norm.", "model.norm."), (".temporal_pre_norm.", ".input_layernorm."),
           (".channel_pre_norm.", ".post_attention_layernorm."), (".mlp_block.", ".mlp."))


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of a RecurrentGemma config, as HF 5.25's `RecurrentGemmaConfig` reads it."""
    refuse_unless(cfg, "hidden_activation", ("gelu_pytorch_tanh",), "recurrent_gemma")
    rope = cfg.get("rope_parameters") or {}
    refuse_unless(rope, "rope_type", ("default",), "recurrent_gemma")
    n_layers, hidden = positive_int(cfg, "num_hidden_layers"), positive_int(cfg, "hidden_size")
    heads = positive_int(cfg, "num_attention_heads")
    blocks = supported_kinds(list(cfg.get("block_types", BLOCK_TYPES)), LAYER_KINDS, "recurrent_gemma", "block type")
    if not blocks:
        raise ConfigError("config.json: recurrent_gemma block_types is empty (it names the cycle of recurrent and "
                          "attention blocks)")
    width = positive_int(cfg, "lru_width") if cfg.get("lru_width") is not None else hidden
    if width % heads:
        raise ConfigError(f"config.json: recurrent_gemma lru_width ({width}) must be a whole multiple of "
                          f"num_attention_heads ({heads})")
    kv = cfg.get("num_key_value_heads")
    rotary = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    return dict(
        num_hidden_layers=n_layers, layer_types=(blocks * n_layers)[:n_layers], num_attention_heads=heads,
        num_key_value_heads=heads if kv is None else positive_int(cfg, "num_key_value_heads"),
        head_dim=hidden // heads, intermediate_size=positive_int(cfg, "intermediate_size") // 2,
        rms_norm_eps=json_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps"), norm_offset=1.0,
        rope_theta=json_float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_theta"),
        partial_rotary_factor=json_float(rotary, "partial_rotary_factor"), attention_output_gate=False,
        attention_qk_norm=False, attention_bias=bool(cfg.get("attention_bias", False)), attention_out_bias=True,
        attention_window=positive_int(cfg, "attention_window_size") if "attention_window_size" in cfg else 2048,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        embedding_multiplier=float(torch.tensor(hidden ** 0.5, dtype=torch.bfloat16)),
        logits_soft_cap=json_float(cfg.get("logits_soft_cap", 30.0), "logits_soft_cap"),
        lru_width=width, lru_conv_width=positive_int(cfg, "conv1d_width") if "conv1d_width" in cfg else 4,
    )


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    """The temporal block (RG-LRU or local attention), then the biased gelu_tanh MLP."""
    mixer = (RGLRUMixer(cfg.hidden_size, cfg.lru_width, cfg.num_attention_heads, cfg.lru_conv_width)
             if kind == "recurrent" else Attention(cfg))
    return "temporal_block", mixer, MLP(cfg.hidden_size, cfg.intermediate_size, bias=True,
                                        act=functools.partial(F.gelu, approximate="tanh"))


def state_spec(cfg: Any) -> StateSpec:
    """Recurrent blocks hold a conv window over x and `lru_width` state numbers (one head of 1 x W, kind `rglru`);
    attention blocks their K/V."""
    rec = RecurrentSpec("rglru", conv_dim=cfg.lru_width, conv_width=cfg.lru_conv_width, heads=1, key_dim=1,
                        value_dim=cfg.lru_width)
    layers = tuple(RECURRENT if kind == "recurrent" else ATTENTION for kind in cfg.layer_types)
    return StateSpec(layers, rec, cfg.num_key_value_heads, cfg.head_dim)


def convert(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """HF's names -> the shared layers', in place."""
    rename_fragments(tensors, RENAMES)


def publish(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """`convert`'s inverse, in place: HF 5.25's names."""
    rename_fragments(tensors, tuple((ours, hf) for hf, ours in RENAMES))
