"""The model families deltaspec loads, chosen by `config.json`'s `model_type` from one registry (`FAMILIES`).

A family is one module here, holding only what sets it apart, as HF's modular files do: the `model_type`s it
covers, the state it declares (`state_spec`: which layers are recurrent, their kind and shapes, the attention K/V),
and how its published tensors map onto the shared layers (`deltaspec.shared.model.layers`; Qwen3.5, dense and MoE,
is the layout the layers use; Qwen3-Next packs its GDN input projections per key head and is unpacked at load). A
family module defines `TEXT_TYPES`, `WRAPPER_TYPES`, `ALWAYS_NORM_TOPK`, `LAYER_KINDS`, `fields` (its config.json
read into `ModelConfig`'s fields), `layer` (the mixer, from `deltaspec.shared.model.mixers`, and the MLP each layer
kind runs), `state_spec`, `convert` and its inverse `publish`; adding one is that module and a line here (and a
mixer module where its mixer is new), with no decoding, state or service code touched.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import Tensor, nn

from deltaspec.shared.model.families import (bailing_hybrid, bamba, falcon_h1, falcon_mamba, granitemoehybrid,
                                             jamba, kimi_linear, lfm2, lfm2_moe, mamba, mamba2, minimax, nemotron_h,
                                             olmo_hybrid, qwen3_5, qwen3_next, recurrent_gemma, zamba2)
from deltaspec.shared.model.families.qwen3_5 import ConfigFields
from deltaspec.shared.state.spec import StateSpec


@dataclass(frozen=True)
class Family:
    name: str
    text_types: tuple[str, ...]  # model_type of a text config
    wrapper_types: dict[str, str]  # multimodal wrapper model_type -> its text_config's model_type
    always_norm_topk: bool  # top-k routing weights renormalised whatever the config says (no `norm_topk_prob`)
    layer_kinds: tuple[str, ...]  # the kinds its `layer_types` name
    fields: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> its `ModelConfig` fields
    layer: Callable[[Any, str, bool], tuple[str, nn.Module | None, nn.Module | None]]  # a layer's parts (by kind)
    state_spec: Callable[[ConfigFields], StateSpec]  # the state a model of this family holds
    convert: Callable[[dict[str, Tensor], ConfigFields], None]  # published tensor names -> the layers', in place
    publish: Callable[[dict[str, Tensor], ConfigFields], None]  # and back, for saving
    # optional: hands parts shared across layers to the built layers, in order (Zamba2's shared transformer blocks)
    share: Callable[[Any, nn.ModuleList], None] | None = None

    @classmethod
    def of(cls, module: ModuleType) -> Family:
        return cls(module.__name__.rsplit(".", 1)[-1], module.TEXT_TYPES, module.WRAPPER_TYPES,
                   module.ALWAYS_NORM_TOPK, module.LAYER_KINDS, module.fields, module.layer, module.state_spec,
                   module.convert, module.publish, getattr(module, "share", None))


FAMILIES = tuple(Family.of(module) for module in (
    qwen3_5, qwen3_next, nemotron_h, bamba, granitemoehybrid, mamba2, lfm2, lfm2_moe, mamba, falcon_mamba, olmo_hybrid,
    jamba, kimi_linear, bailing_hybrid, minimax, falcon_h1, zamba2, recurrent_gemma))


def family_of(model_type: object) -> Family | None:
    return next((f for f in FAMILIES if model_type in f.text_types or model_type in f.wrapper_types), None)


def family_named(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)
