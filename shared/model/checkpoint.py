"""Writing checkpoints in HF layout, and random models for tests and benchmarks."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.norms import RMSNorm
from deltaspec.shared.model.families import family_of
from deltaspec.shared.model.hybrid import HybridLM

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def save_checkpoint(model: HybridLM, directory: str | Path) -> Path:
    """`config.json` + `model.safetensors` in the family's published layout, which HF's `Qwen3_5ForCausalLM`,
    `Qwen3_5MoeForCausalLM` or `Qwen3NextForCausalLM` loads as it is (experts fused, as HF keeps them)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(model.config.raw)
    config["dtype"] = DTYPE_NAMES[model.dtype]
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.clone() for k, v in model.state_dict().items()}  # a fused model's projections share storage
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    tensors.update(model.mtp)
    family_of(config["model_type"]).publish(tensors, model.config)  # type: ignore[union-attr]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def hf_config(**overrides: Any) -> dict[str, Any]:
    """A small Qwen3.5 text config dict; every field can be overridden."""
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": 257, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "eos_token_id": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 4096,
    }
    cfg.update(overrides)
    cfg["num_hidden_layers"] = len(cfg["layer_types"])
    return cfg


MOE_ARCHITECTURES = {"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}


def hf_moe_config(model_type: str = "qwen3_5_moe_text", **overrides: Any) -> dict[str, Any]:
    """A small sparse MoE config of either family (8 experts, top-2, a shared expert); every field can be overridden.
    Qwen3.5-MoE has no dense MLP (no `intermediate_size`); Qwen3-Next keeps one for its `mlp_only_layers`."""
    moe: dict[str, Any] = {"architectures": [MOE_ARCHITECTURES[model_type]], "model_type": model_type,
                           "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                           "shared_expert_intermediate_size": 48}
    if model_type == "qwen3_next":
        moe.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    cfg = hf_config(**{**moe, **overrides})
    if model_type != "qwen3_next" and "intermediate_size" not in overrides:
        del cfg["intermediate_size"]
    return cfg


def random_model(config: dict[str, Any], seed: int = 0, scale: float = 0.3) -> HybridLM:
    """Every parameter drawn at random (norm weights and decays included, so no path is trivially exact)."""
    gen = torch.Generator().manual_seed(seed)
    model = HybridLM(ModelConfig.from_dict(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                fan_in = p.shape[-1] if p.ndim > 1 else 1
                p.copy_(torch.randn(p.shape, generator=gen) * (scale if p.ndim == 1 else fan_in**-0.5))
        for norm in model.modules():  # a norm applied as w itself (not 1 + w) is drawn around 1, as trained ones sit
            if isinstance(norm, RMSNorm) and not norm.offset:
                norm.weight += 1
    return model.eval()
