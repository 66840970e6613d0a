"""FalconMamba (`falcon_mamba`: FalconMambaForCausalLM, tiiuae/falcon-mamba-7b and Falcon3-Mamba): Mamba, with what
HF's `modular_falcon_mamba.py` adds to it.

- The mixer RMS-normalises dt (before dt_proj), B and C, without weights, eps `mixer_rms_eps` (default 1e-6):
  `mixer(cfg, rms_eps)`. HF's `dt_layernorm`, `b_layernorm`, `c_layernorm` weights are non-persistent buffers of
  ones, absent from what `save_pretrained` writes; a checkpoint that carries them anyway has them dropped at load,
  as HF ignores them.
- HF registers no load hook for the embeddings (Mamba's `backbone.embedding.` rename): only `backbone.embeddings.`
  loads.
Everything else (config fields and defaults, tensor names, the tie, the state) is Mamba's (`families/mamba.py`).
"""
from __future__ import annotations

import re
from typing import Any

from torch import Tensor, nn

from deltaspec.shared.model.families import mamba
from deltaspec.shared.model.families.mamba import ALWAYS_NORM_TOPK, LAYER_KINDS, publish, state_spec
from deltaspec.shared.model.families.mamba2 import NAMES
from deltaspec.shared.model.families.qwen3_5 import ConfigFields
from deltaspec.shared.model.fields import rename

__all__ = ["ALWAYS_NORM_TOPK", "LAYER_KINDS", "publish", "state_spec"]

TEXT_TYPES = ("falcon_mamba",)
WRAPPER_TYPES: dict[str, str] = {}
UNUSED = re.compile(r"backbone\.layers\.\d+\.mixer\.(dt|b|c)_layernorm\.weight")  # HF's buffers of ones


def fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {**mamba.read(cfg, "falcon_mamba"), "mamba_norm_eps": float(cfg.get("mixer_rms_eps", 1e-6))}


def layer(cfg: Any, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
    return "mamba", mamba.mixer(cfg, rms_eps=cfg.mamba_norm_eps), None


def convert(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """HF's names -> the shared layers', in place; the weightless norms' buffers, if saved, dropped."""
    for name in [name for name in tensors if UNUSED.fullmatch(name)]:
        del tensors[name]
    rename(tensors, NAMES)
