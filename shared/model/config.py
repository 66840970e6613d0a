"""Model configuration: a hybrid recurrent/attention text architecture, read from a HF `config.json`.

The family comes from `model_type` through one registry (`deltaspec.shared.model.families`), and its module reads
its own fields (`fields`). Anything else, or a field of the wrong kind, raises `ConfigError` naming the field.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from deltaspec.shared.model.families import FAMILIES, family_named, family_of
from deltaspec.shared.model.fields import ConfigError, positive_int
from deltaspec.shared.state.spec import StateSpec

__all__ = ["ConfigError", "ModelConfig", "known_model_types"]


@dataclass(frozen=True)
class ModelConfig:
    """What the engine reads of a checkpoint's config, whatever its family: the family's parser (`fields`) maps its
    own names onto these; a field a family does not have keeps its default."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # the family's layer kinds, layer by layer
    num_attention_heads: int = 0  # 0: no attention layers (a pure state-space model)
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    norm_offset: float = 1.0  # RMSNorm applies (offset + w): 1 for Qwen's zero-centred norms, 0 for the usual
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25  # 0: no rotary embedding
    attention_output_gate: bool = True  # Qwen's sigmoid gate on the attention output (q_proj doubled)
    attention_qk_norm: bool = True
    attention_qk_norm_per_head: bool = True  # False: q/k RMSNorms over the whole projection (OLMo's)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool | None = None  # o_proj's bias; None: as `attention_bias` (RecurrentGemma's: always)
    attention_window: int = 0  # a query sees the last this many positions, its own included (0: all of them)
    mlp_bias: bool = False
    eos_token_id: tuple[int, ...] = ()
    mtp_num_hidden_layers: int = 0
    # the MTP head's layer kinds, where the family's layout names them (Nemotron-H's); () : as many full-attention
    # layers as the checkpoint's `mtp.layers.*` (Qwen's)
    mtp_layer_types: tuple[str, ...] = ()
    # fields the MTP head's layers take in place of the trunk's (the Ling hybrid's: its head's SwiGLUs unclipped)
    mtp_overrides: tuple[tuple[str, Any], ...] = ()
    family: str = "qwen3_5"
    post_norm_kinds: tuple[str, ...] = ()  # layer kinds whose norms follow their mixer and MLP (OLMo's attention)
    # MiniMax's residual, (layer kind, (mixer's alpha, beta), (MLP's alpha, beta)): in a layer of such a kind each part
    # adds beta times its output to alpha times its normed input, not to its input (the parts apply beta themselves,
    # as their out_multiplier)
    normed_residual: tuple[tuple[str, tuple[float, float], tuple[float, float]], ...] = ()
    # Gated DeltaNet layers
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    linear_beta_scale: float = 1.0  # beta = scale * sigmoid(b): 2 lets it reach 2 (OLMo-Hybrid's allow_neg_eigval)
    # Mamba2 layers
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    mamba_n_groups: int = 1
    mamba_conv_kernel: int = 4
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_norm_eps: float = 1e-5
    mamba_dt_limit: tuple[float, float] = (0.0, float("inf"))
    mamba_dt_rank: int = 0  # Mamba1 layers (mamba_num_heads: d_inner, every channel a head): dt's low rank
    # RecurrentGemma's RG-LRU blocks: the recurrence's width and its conv's
    lru_width: int = 0
    lru_conv_width: int = 4
    # short conv layers (LFM2)
    short_conv_kernel: int = 3
    short_conv_bias: bool = False
    # sparse MoE blocks (0 experts: every MLP dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Nemotron-H's group-limited routing (`route_groups`) and latent experts; the defaults change nothing
    n_group: int = 1  # the experts in this many contiguous groups, the choice within the `topk_group` best
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # scales the routing weights
    moe_latent_size: int = 0  # 0: the experts work on the hidden state itself
    use_expert_bias: bool = False  # LFM2-MoE's `expert_bias` buffer, added to the sigmoid scores for the choice
    # muP-style multipliers (Granite-4.0-H), each applied in one place every pass uses; 1 (None) is a no-op
    embedding_multiplier: float = 1.0  # scales the embeddings (`HybridStack.embed`)
    residual_multiplier: float = 1.0  # scales each mixer's and MLP's output before its residual add (their `alpha`)
    attention_scale: float | None = None  # the attention's softmax scale; None: 1/sqrt(head_dim)
    logits_scaling: float = 1.0  # divides the logits (`HybridLM.logits`)
    logits_multiplier: float = 1.0  # multiplies them (Falcon-H1's `lm_head_multiplier`)
    logits_soft_cap: float = 0.0  # cap * tanh(logits / cap) (RecurrentGemma's); 0: none
    # multi-head latent attention (Kimi Linear, Bailing hybrid: `mixers/mla.py`); KDA's decay (`mixers/kda.py`)
    q_lora_rank: int = 0  # 0: one query projection
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    kda_lower_bound: float | None = None  # None: Kimi's softplus decay; else Bailing's safe gate's bound
    expert_swiglu_limit: float = 0.0  # Bailing's clipping of the routed and shared experts' SwiGLU (0: none)
    shared_swiglu_limit: float = 0.0
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        kinds = family_named(self.family).layer_kinds
        bad = [t for t in self.layer_types + self.mtp_layer_types if t not in kinds]
        if bad:
            raise ConfigError(f"layer_types: unknown layer kind {bad[0]!r} (expected one of {kinds})")
        if self.linear_num_key_heads and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a whole multiple of linear_num_key_heads")
        if self.num_key_value_heads and self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a whole multiple of num_key_value_heads")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok must be between 1 and num_experts ({self.num_experts}), "
                              f"got {self.num_experts_per_tok}")

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a sparse MoE block (HF's rule: not in `mlp_only_layers`, and every
        `decoder_sparse_step`-th layer); the MTP head's layers are sparse whenever the model has experts."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def layer_parts(self, kind: str, sparse: bool) -> tuple[str, nn.Module | None, nn.Module | None]:
        """A layer of kind `kind` as the family builds it: (its mixer's module name, the mixer, the MLP)."""
        return family_named(self.family).layer(self, kind, sparse)

    def share_parts(self, layers: nn.ModuleList) -> None:
        """Hand the built layers the parts they share, where the family has any (Zamba2's transformer blocks)."""
        share = family_named(self.family).share
        if share is not None:
            share(self, layers)

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
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        common = dict(
            vocab_size=positive_int(cfg, "vocab_size"),
            hidden_size=positive_int(cfg, "hidden_size"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_id=eos_ids,
        )
        return cls(**{**common, **family.fields(cfg)}, family=family.name, raw=cfg)  # the family's own reading wins

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
