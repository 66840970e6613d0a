"""Mamba (`mamba`: MambaForCausalLM, e.g. state-spaces/mamba-*-hf): Mamba1 blocks alone, no attention and no MLP.

A block is one RMSNorm (w applied as it is, eps `layer_norm_epsilon`) and a Mamba1 mixer (`mixers/mamba1.py`),
added to the residual; the final norm is `norm_f`; `lm_head` is tied to the embeddings unless `tie_word_embeddings`
is false (HF's default: tied). The mixer's width is `intermediate_size` where config.json gives it (HF sets it from
the file after deriving expand x hidden_size), else expand x hidden_size; dt's rank `time_step_rank` ("auto":
ceil(hidden_size / 16)); `hidden_act`
is the conv's activation: SiLU only. Its state is kind `mamba`: every channel of d_inner a head whose state is a
`(state_size, 1)` column decaying per entry by exp(dt A[c, n]); the conv window holds x alone.

`residual_in_fp32` (HF's default) keeps HF's residual in float32 whatever the weights; deltaspec keeps it in the
weights' dtype: the same in float32. `use_mambapy` and `use_associative_scan` pick among HF's scans of the same sum.

Tensors: HF 5.25 saves `backbone.embeddings`, `backbone.layers.i.norm`, `backbone.layers.i.mixer.*`,
`backbone.norm_f`, as Mamba2 does; `mamba_ssm`'s `backbone.embedding.` is renamed as HF's load hook renames it.
The helpers here (`read`, `mixer`, `mamba1_spec`) serve every family whose mixer is Mamba1's.
"""
from __future__ import annotations

import math
from typing import Any

from torch import nn

from deltaspec.shared.model.families.mamba2 import convert, publish  # noqa: F401 - Mamba2's tensor names
from deltaspec.shared.model.fields import positive_int, refuse_unless
from deltaspec.shared.model.mixers.mamba1 import Mamba1Mixer
from deltaspec.shared.state.spec import RECURRENT, RecurrentSpec, StateSpec

TEXT_TYPES = ("mamba",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = False
LAYER_KINDS = ("linear_attention",)


def _size(cfg: dict[str, Any], name: str, default: int) -> int:
    return positive_int(cfg, name) if name in cfg else default


def read(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """`ModelConfig` fields of a Mamba or FalconMamba config; sizes must be given, other fields take HF's defaults."""
    refuse_unless(cfg, "hidden_act", ("silu",), model_type)  # the conv's activation
    n_layers, hidden = positive_int(cfg, "num_hidden_layers"), positive_int(cfg, "hidden_size")
    width = _size(cfg, "intermediate_size", _size(cfg, "expand", 2) * hidden)
    rank = cfg.get("time_step_rank", "auto")
    rank = math.ceil(hidden / 16) if rank == "auto" else positive_int(cfg, "time_step_rank")
    eps = float(cfg.get("layer_norm_epsilon", 1e-5))
    return dict(
        num_hidden_layers=n_layers, layer_types=LAYER_KINDS * n_layers, rms_norm_eps=eps, norm_offset=0.0,
        partial_rotary_factor=0.0, attention_output_gate=False, attention_qk_norm=False,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        mamba_num_heads=width, mamba_head_dim=1, ssm_state_size=positive_int(cfg, "state_size"),
        mamba_dt_rank=rank, mamba_conv_kernel=_size(cfg, "conv_kernel", 4),
        mamba_conv_bias=bool(cfg.get("use_conv_bias", True)), mamba_proj_bias=bool(cfg.get("use_bias", False)),
    )


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return read(cfg, "mamba")


def mixer(cfg: Any, rms_eps: float | None = None, rms_weights: bool = False) -> Mamba1Mixer:
    """The Mamba1 mixer of a config's `mamba_*` fields; `rms_eps`: FalconMamba's norms on dt, B and C (with
    `rms_weights`, Jamba's)."""
    return Mamba1Mixer(cfg.hidden_size, cfg.mamba_num_heads, cfg.ssm_state_size, cfg.mamba_dt_rank,
                       cfg.mamba_conv_kernel, cfg.mamba_conv_bias, cfg.mamba_proj_bias, rms_eps, rms_weights)


def mamba1_spec(cfg: Any) -> RecurrentSpec:
    """The state of one such mixer: a conv window over x; `state_size` numbers per channel, held as one head of
    `1 x channels state_size` (the logs then hold each token's states contiguous: `mixers/mamba1.py`)."""
    return RecurrentSpec("mamba", conv_dim=cfg.mamba_num_heads, conv_width=cfg.mamba_conv_kernel, heads=1,
                         key_dim=1, value_dim=cfg.mamba_num_heads * cfg.ssm_state_size)


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    return "mamba", mixer(cfg), None


def state_spec(cfg: Any) -> StateSpec:
    return StateSpec((RECURRENT,) * len(cfg.layer_types), mamba1_spec(cfg), kv_heads=0, head_dim=0)
