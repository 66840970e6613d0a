"""Model configuration: the hybrid GDN/attention text architecture, read from a HF `config.json`.

The family comes from `model_type` through one registry (`deltaspec.shared.model.families`): Qwen3.5 dense and MoE
(`qwen3_5_text`, `qwen3_5_moe_text`, or their multimodal wrappers `qwen3_5`, `qwen3_5_moe` with a `text_config`)
and Qwen3-Next (`qwen3_next`). Anything else, or a field of the wrong kind, raises `ConfigError` naming the field.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltaspec.shared.model.families import FAMILIES, family_named, family_of
from deltaspec.shared.state.spec import StateSpec

class ConfigError(ValueError):
    """A checkpoint's config.json cannot describe a model this engine runs."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_id: tuple[int, ...] = ()
    mtp_num_hidden_layers: int = 0
    family: str = "qwen3_5"
    # sparse MoE blocks (0 experts: every MLP dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        kinds = tuple(self.mixers)
        bad = [t for t in self.layer_types if t not in kinds]
        if bad:
            raise ConfigError(f"layer_types: unknown layer kind {bad[0]!r} (expected one of {kinds})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a whole multiple of linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a whole multiple of num_key_value_heads")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok must be between 1 and num_experts ({self.num_experts}), "
                              f"got {self.num_experts_per_tok}")

        if not self.intermediate_size and not all(self.sparse(i) for i in range(self.num_hidden_layers)):
            raise ConfigError("config.json: field 'intermediate_size' is needed by the dense MLP layers")

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a sparse MoE block (HF's rule: not in `mlp_only_layers`, and every
        `decoder_sparse_step`-th layer); the MTP head's layers are sparse whenever the model has experts."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def mixers(self) -> dict[str, tuple[str, type]]:
        """Layer kind -> (the mixer's module name in a layer, its class), as the family builds its layers."""
        return family_named(self.family).mixers

    @functools.cached_property
    def state_spec(self) -> StateSpec:
        """The state a model of this config holds, as its family declares it."""
        return family_named(self.family).state_spec(self)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type")
        family = family_of(model_type)
        if family is None:
            raise ConfigError(f"config.json: unknown model_type {model_type!r} (expected one of {known_model_types()})")
        if model_type in family.wrapper_types:
            if not isinstance(cfg.get("text_config"), dict):
                raise ConfigError(f"config.json: model_type {model_type!r} needs a 'text_config' object")
            text = dict(cfg["text_config"])
            text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
            text["model_type"] = family.wrapper_types[model_type]
            return cls.from_dict(text)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        n_layers = _int(cfg, "num_hidden_layers")
        interval = cfg.get("full_attention_interval", 4)
        layer_types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
        ]
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        hidden = _int(cfg, "hidden_size")
        heads = _int(cfg, "num_attention_heads")
        return cls(
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size") if "intermediate_size" in cfg or not cfg.get("num_experts")
            else 0,  # a model whose every MLP is sparse need not have one
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=_int(cfg, "num_key_value_heads"),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            linear_num_key_heads=_int(cfg, "linear_num_key_heads"),
            linear_num_value_heads=_int(cfg, "linear_num_value_heads"),
            linear_key_head_dim=_int(cfg, "linear_key_head_dim"),
            linear_value_head_dim=_int(cfg, "linear_value_head_dim"),
            layer_types=tuple(layer_types),
            linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(
                cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
            ),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            eos_token_id=eos_ids,
            mtp_num_hidden_layers=int(cfg.get("mtp_num_hidden_layers", 0)),
            family=family.name,
            **_experts(cfg, family.always_norm_topk),
            raw=cfg,
        )

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            cfg = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json in the checkpoint directory") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: bad JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(cfg)


def known_model_types() -> list[str]:
    return sorted(t for f in FAMILIES for t in (*f.text_types, *f.wrapper_types))


def _experts(cfg: dict[str, Any], always_norm_topk: bool) -> dict[str, Any]:
    """The sparse MoE fields, when the config has experts (`num_experts` > 0)."""
    if not cfg.get("num_experts"):
        return {}
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConfigError(f"config.json: field 'mlp_only_layers' must be a list of layer indices, got {only!r}")
    return {
        "num_experts": _int(cfg, "num_experts"), "num_experts_per_tok": _int(cfg, "num_experts_per_tok"),
        "moe_intermediate_size": _int(cfg, "moe_intermediate_size"),
        "shared_expert_intermediate_size": _int(cfg, "shared_expert_intermediate_size"),
        "norm_topk_prob": True if always_norm_topk else bool(cfg.get("norm_topk_prob", True)),
        "decoder_sparse_step": int(cfg.get("decoder_sparse_step") or 1), "mlp_only_layers": tuple(only),
    }


def _int(cfg: dict[str, Any], name: str) -> int:
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config.json: field {name!r} must be a positive integer, got {value!r}")
    return value
