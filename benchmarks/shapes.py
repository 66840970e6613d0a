"""Real model shapes for the benches, as HF config dicts: the numbers of published checkpoints' text configs, with no
weights (the memory table computes from them, the GPU section fills them with random weights).

Where each shape's numbers come from is said beside it; none was read from a downloaded checkpoint here.
"""
from __future__ import annotations

from deltaspec.shared.model.checkpoint import hf_config, hf_moe_config

QUARTERS = ["linear_attention"] * 3 + ["full_attention"]  # every fourth layer attention, as all of these have

# Qwen/Qwen3.5-0.8B's text config (HF config.json): 24 layers, bf16
QWEN35_08B = hf_config(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                       layer_types=QUARTERS * 6)

# Qwen/Qwen3.5-9B: HF transformers' Qwen3_5TextConfig defaults, documented there as the 9B's, which match the model
# card (32 layers, hidden 4096, FFN 12288; GDN 16 QK / 32 V heads of 128; attention 16 Q / 4 KV heads of 256;
# vocabulary 248320); embeddings untied (that config's default)
QWEN35_9B = hf_config(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_attention_heads=16,
                      num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                      linear_key_head_dim=128, linear_value_head_dim=128, layer_types=QUARTERS * 8,
                      tie_word_embeddings=False)

# Qwen/Qwen3.5-27B: 64 layers, hidden 5120, FFN 17408, attention 24 Q / 4 KV heads of 256, untied, vocabulary 248320
# (its model card; THUDM/slime's scripts/models/qwen3.5-27B.sh); GDN 16 QK / 48 V heads of 128 from the config.json
# of Qwen/Qwen3.6-27B (model_type qwen3_5, every other number the same as the 27B's above): not read from
# Qwen3.5-27B's own config.json
QWEN35_27B = hf_config(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                       num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                       linear_key_head_dim=128, linear_value_head_dim=128, layer_types=QUARTERS * 16,
                       tie_word_embeddings=False)

# Qwen/Qwen3.5-35B-A3B's text config: 40 layers, 256 experts top-8 (HF's defaults for qwen3_5_moe_text are this
# model's)
QWEN35_35B_A3B = hf_moe_config("qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_attention_heads=16,
                               num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                               linear_key_head_dim=128, linear_value_head_dim=128, num_experts=256,
                               num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                               layer_types=QUARTERS * 10)

# Qwen/Qwen3-Next-80B-A3B's config: 48 layers, 512 experts top-10
QWEN3_NEXT_80B_A3B = hf_moe_config("qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
                                   num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                   linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                                   linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10,
                                   moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                   layer_types=QUARTERS * 12)

# the GPU section's draft: Qwen3.5-0.8B's widths and vocabulary, one GDN and one attention layer
DRAFT_08B_2L = hf_config(**{**QWEN35_08B, "layer_types": ["linear_attention", "full_attention"]})


def scaled(shape: dict, width: int = 8, quarters: int = 1) -> dict:
    """`shape` made small for a CPU run while every weight keeps its share of what a decode step reads: widths and
    head counts divided by `width` (head dimensions kept), `quarters` blocks of three GDN layers and one attention
    layer, the vocabulary divided by `width` and the depth's reduction (so the LM head stays its share), expert
    count and top-k as published (so the distinct experts a pass of T tokens reads grow as on the real model). The
    router, as wide as the expert count, is the one weight that grows in share (about 10 % of a layer at 512)."""
    depth = len(shape["layer_types"]) // (4 * quarters)
    out = {**shape, "layer_types": QUARTERS * quarters, "num_hidden_layers": 4 * quarters,
           "vocab_size": shape["vocab_size"] // (width * depth), "eos_token_id": None}
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                "num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"):
        if key in out:
            out[key] = max(1, out[key] // width)
    return out
