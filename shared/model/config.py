"""Model configuration: the Qwen3.5 text architecture, read from a HF `config.json`.

Accepted: `model_type` `qwen3_5_text`, or `qwen3_5` with a `text_config`. Anything else, or a
field of the wrong kind, raises `ConfigError` naming the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYER_KINDS = ("linear_attention", "full_attention")


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
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = [t for t in self.layer_types if t not in LAYER_KINDS]
        if bad:
            raise ConfigError(f"layer_types: unknown layer kind {bad[0]!r} (expected one of {LAYER_KINDS})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a whole multiple of linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a whole multiple of num_key_value_heads")

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
        if model_type == "qwen3_5":
            if not isinstance(cfg.get("text_config"), dict):
                raise ConfigError("config.json: model_type 'qwen3_5' needs a 'text_config' object")
            text = dict(cfg["text_config"])
            text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
            text["model_type"] = "qwen3_5_text"
            return cls.from_dict(text)
        if model_type != "qwen3_5_text":
            raise ConfigError(
                f"config.json: unknown model_type {model_type!r} (expected 'qwen3_5_text' or 'qwen3_5')"
            )
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
            intermediate_size=_int(cfg, "intermediate_size"),
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


def _int(cfg: dict[str, Any], name: str) -> int:
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config.json: field {name!r} must be a positive integer, got {value!r}")
    return value
