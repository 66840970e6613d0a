"""Zamba2 (`zamba2`: Zyphra Zamba2 1.2B, 2.7B, 7B): Mamba2 layers, and hybrid layers where a transformer block
shared by several layers runs on [stream; embeddings] before the layer's Mamba2 mixer; no MLP outside the blocks.

What differs (HF 5.25's `modeling_zamba2.py`, `configuration_zamba2.py`):
- layer kinds from `layers_block_type` ("mamba" is HF's legacy name for "linear_attention"): a Mamba2 layer is a
  norm and the mixer, added to the residual; a "hybrid" layer holds two states (state kind `HYBRID`: its own K/V,
  and the Mamba2 state) and is a `SharedBlockMixer` (`shared/model/mixers/shared_block.py`);
- `num_mem_blocks` shared blocks, hybrid layer c using block c mod `num_mem_blocks` (`share`, after the layers are
  built): one module per block, registered in the first layer using it, where HF's checkpoint holds its tensors.
  HF 5.25 ties them only with `tie_word_embeddings` (its ties of every `_tied_weights_keys` entry follow that flag);
  without it each hybrid layer has, saves and loads its own copy, and so does deltaspec;
- per hybrid layer LoRA adapters of rank `adapter_rank` on the block's MLP [gate; up] always, and on its q, k, v
  with `use_shared_attention_adapter` (which needs as many K/V heads as query heads: HF adds a 2 x hidden adapter to
  each);
- attention on 2 x hidden inputs, head_dim 2 x hidden / heads, softmax scale 1/sqrt(head_dim / 2), rotary over the
  whole head only with `use_mem_rope`, no biases, output to hidden;
- the block's MLP is `hidden_act`'s GLU (GELU by default), biases with `add_bias_linear`;
- the Mamba2 mixer: `n_mamba_heads`, head size `mamba_expand` x hidden / heads, `mamba_d_state`, `mamba_ngroups`,
  `mamba_d_conv`, a conv bias always (HF ignores `use_conv_bias`), projection biases with `add_bias_linear`, gated
  norm eps 1e-5, dt clamped below at `time_step_min`;
- norms plain (w as it is), `final_layernorm`; `lm_head` tied unless `tie_word_embeddings` is false.
`convert` puts `shared_transformer`, `linear` and `mamba_decoder` under the layer's `hybrid` mixer, splits the
block's `gate_up_proj` into gate and up, drops any copy of a shared block's tensors past its first layer (HF ties
them); `publish` writes HF's layout back.
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.model.families.mamba2 import mixer, ssd_spec
from deltaspec.shared.model.fields import (ConfigError, json_float, positive_int, refuse_unless, rename,
                                           supported_kinds)
from deltaspec.shared.model.mixers.shared_block import SharedBlock, SharedBlockMixer
from deltaspec.shared.state.spec import HYBRID, RECURRENT, StateSpec

TEXT_TYPES = ("zamba2",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = False
LAYER_KINDS = ("linear_attention", "hybrid")
ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}  # the block MLP's, as HF's ACT2FN has them
NAMES = (("model.layers.*.shared_transformer.", "model.layers.*.hybrid.shared_transformer."),
         ("model.layers.*.linear.", "model.layers.*.hybrid.linear."),
         ("model.layers.*.mamba_decoder.", "model.layers.*.hybrid.mamba_decoder."),
         ("model.final_layernorm.", "model.norm."))  # (HF's, the shared layers')
_GATE_UP = re.compile(r"^(model\.layers\.\d+\.shared_transformer\.feed_forward\.)gate_up_proj\.(weight|bias)$")
_SHARED = re.compile(r"^model\.layers\.(\d+)\.shared_transformer\.")


def _layer_types(cfg: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not isinstance(kinds, list) or len(kinds) != n_layers:
        raise ConfigError(f"config.json: field 'layers_block_type' must list {n_layers} layer kinds, got {kinds!r}")
    kinds = ["linear_attention" if k == "mamba" else k for k in kinds]
    return supported_kinds(kinds, LAYER_KINDS, "zamba2", named=("mamba", *LAYER_KINDS))


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of a Zamba2 config; sizes must be given, other absent fields take HF's defaults."""
    refuse_unless(cfg, "hidden_act", tuple(ACTIVATIONS), "zamba2")
    refuse_unless(cfg, "use_long_context", (False,), "zamba2")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    refuse_unless(rope, "rope_type", ("default",), "zamba2")
    n_layers, hidden = positive_int(cfg, "num_hidden_layers"), positive_int(cfg, "hidden_size")
    heads = positive_int(cfg, "num_attention_heads")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if cfg.get("use_shared_attention_adapter") and kv_heads != heads:
        raise ConfigError(f"config.json: zamba2's attention adapters need num_key_value_heads equal to "
                          f"num_attention_heads ({heads}), got {kv_heads}")
    if (2 * hidden) % heads:
        raise ConfigError(f"config.json: zamba2 needs num_attention_heads ({heads}) to divide 2 x hidden_size")
    mamba_heads, width = int(cfg.get("n_mamba_heads", 8)), int(cfg.get("mamba_expand", 2)) * hidden
    if mamba_heads <= 0 or width % mamba_heads:
        raise ConfigError(f"config.json: zamba2 needs n_mamba_heads ({cfg.get('n_mamba_heads')!r}) to divide "
                          f"mamba_expand x hidden_size ({width})")
    head_dim = 2 * hidden // heads
    return dict(
        num_hidden_layers=n_layers, layer_types=_layer_types(cfg, n_layers), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), norm_offset=0.0,
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        partial_rotary_factor=1.0 if cfg.get("use_mem_rope") else 0.0, attention_output_gate=False,
        attention_qk_norm=False, attention_scale=1 / math.sqrt(head_dim / 2),
        mlp_bias=bool(cfg.get("add_bias_linear", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        mamba_num_heads=mamba_heads, mamba_head_dim=width // mamba_heads,
        ssm_state_size=int(cfg.get("mamba_d_state", 64)), mamba_n_groups=int(cfg.get("mamba_ngroups", 1)),
        mamba_conv_kernel=int(cfg.get("mamba_d_conv", 4)), mamba_conv_bias=True,
        mamba_proj_bias=bool(cfg.get("add_bias_linear", False)), mamba_norm_eps=1e-5,
        mamba_dt_limit=(json_float(cfg.get("time_step_min", 0.001), "time_step_min"), math.inf),
    )


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    """A Mamba2 layer (`mamba`), or a hybrid layer (`hybrid`) whose shared block `share` hands it; no MLP."""
    if kind == "linear_attention":
        return "mamba", mixer(cfg), None
    return "hybrid", SharedBlockMixer(cfg.hidden_size, cfg.rms_norm_eps, mixer(cfg)), None


def share(cfg: Any, layers: nn.ModuleList) -> None:
    """Hand hybrid layer c the block c mod `num_mem_blocks`: one module per block, made at its first layer; untied
    (`tie_word_embeddings` false, under which HF 5.25 ties none of its `_tied_weights_keys`), a copy per layer."""
    hybrids = [layer.mixer for layer in layers if layer.kind == "hybrid"]
    n_blocks = int(cfg.raw.get("num_mem_blocks", 1))
    adapters = bool(cfg.raw.get("use_shared_attention_adapter", False))
    rank, act = int(cfg.raw.get("adapter_rank", 128)), ACTIVATIONS[cfg.raw.get("hidden_act", "gelu")]
    blocks: dict[int, SharedBlock] = {}
    for c, hybrid in enumerate(hybrids):
        key = c % n_blocks if cfg.tie_word_embeddings else c
        owner = key not in blocks
        if owner:
            blocks[key] = SharedBlock(cfg, c % n_blocks, n_blocks, len(hybrids), adapters, rank, act)
        hybrid.attach(blocks[key], c, owner)


def state_spec(cfg: Any) -> StateSpec:
    layers = tuple(RECURRENT if kind == "linear_attention" else HYBRID for kind in cfg.layer_types)
    return StateSpec(layers, ssd_spec(cfg), cfg.num_key_value_heads, cfg.head_dim)


def convert(tensors: dict[str, Tensor], cfg: Any) -> None:
    """HF's names -> the shared layers', in place: a tied block's tensors from the first layer using it only."""
    hybrid = [i for i, kind in enumerate(cfg.layer_types) if kind == "hybrid"]
    owners = set(hybrid[:int(cfg.raw.get("num_mem_blocks", 1))] if cfg.tie_word_embeddings else hybrid)
    for name in [n for n in tensors if _SHARED.match(n) and int(_SHARED.match(n).group(1)) not in owners]:
        del tensors[name]  # a tied copy (HF saves the first only)
    for name in [n for n in tensors if _GATE_UP.match(n)]:
        prefix, kind = _GATE_UP.match(name).groups()  # type: ignore[union-attr]
        tensors[f"{prefix}gate_proj.{kind}"], tensors[f"{prefix}up_proj.{kind}"] = tensors.pop(name).chunk(2)
    rename(tensors, NAMES)


def publish(tensors: dict[str, Tensor], cfg: Any) -> None:
    """`convert`'s inverse, in place: HF 5.25's names and its fused `gate_up_proj`."""
    rename(tensors, ((ours, hf) for hf, ours in NAMES))
    gate = re.compile(r"^(model\.layers\.\d+\.shared_transformer\.feed_forward\.)gate_proj\.(weight|bias)$")
    for name in [n for n in tensors if gate.match(n)]:
        prefix, kind = gate.match(name).groups()  # type: ignore[union-attr]
        up = tensors.pop(f"{prefix}up_proj.{kind}")
        tensors[f"{prefix}gate_up_proj.{kind}"] = torch.cat([tensors.pop(name), up])
