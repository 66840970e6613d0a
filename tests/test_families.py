"""Families beyond the Qwen ones, against HF transformers' own classes as the oracle: each loads as
`save_pretrained` writes it, and every path (layer, fused, static, batched; decode, verify, commits of every length,
rounds of zero drafts after accepted ones; prefix cache hits in a state pool's slots) gives HF's logits and HF's
greedy tokens. A pure Mamba2 runs all of it with no attention layer at all."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaspec.shared.decoding.draft_length import CostModelLength
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.drafters.ngram import NgramDrafter
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.batched import forward_batch
from deltaspec.shared.model.checkpoint import save_checkpoint
from deltaspec.shared.model.config import ConfigError, ModelConfig
from deltaspec.shared.model.loader import CheckpointError, load_model
from deltaspec.shared.rpc.generation import generate_on_server
from deltaspec.shared.state import pool as state_pool
from deltaspec.shared.state import prefix_cache
from support import Served, both_loops
from test_batching import run_threads
from test_draft_length import CHEAP, DEAR  # drafting pays (as far as it may), or never does (k = 0 and a probe)

transformers = pytest.importorskip("transformers")

# two configs per model_type: head counts, state sizes, conv widths, groups and layer orders differ
CONFIGS = {
    "nemotron_h-a": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=97, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        intermediate_size=64, mamba_num_heads=6, mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4,
        layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"])),
    "nemotron_h-b": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=89, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=48, mamba_num_heads=4, mamba_head_dim=12, ssm_state_size=16, n_groups=1, conv_kernel=3,
        use_conv_bias=False, tie_word_embeddings=True, time_step_limit=[0.05, 2.0],
        layers_block_type=["full_attention", "linear_attention", "linear_attention", "mlp"])),
    "nemotron_h-moe": ("NemotronHConfig", "NemotronHForCausalLM", dict(  # group-limited routing, latent experts
        vocab_size=83, hidden_size=40, num_attention_heads=2, num_key_value_heads=1, head_dim=20,
        intermediate_size=56, mamba_num_heads=4, mamba_head_dim=10, ssm_state_size=8, n_groups=2, conv_kernel=4,
        mlp_bias=True, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=36, moe_latent_size=16, routed_scaling_factor=2.5,
        hybrid_override_pattern="ME*-E")),
    "lfm2-a": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        vocab_size=97, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        block_multiple_of=16, block_ffn_dim_multiplier=1.5, conv_L_cache=3, conv_bias=True, norm_eps=1e-6,
        tie_word_embeddings=False, num_hidden_layers=5,
        layer_types=["conv", "conv", "full_attention", "conv", "full_attention"])),
    "lfm2-b": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        vocab_size=89, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=40,
        block_auto_adjust_ff_dim=False, conv_L_cache=5, rope_parameters={"rope_type": "default", "rope_theta": 5e4},
        full_attn_idxs=[0], num_hidden_layers=4)),
    "lfm2_moe-a": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(  # biased choice, renormalised, scaled
        vocab_size=97, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, num_dense_layers=1, routed_scaling_factor=2.5,
        conv_L_cache=3, conv_bias=True, norm_eps=1e-6, tie_word_embeddings=False, num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "conv"])),
    "lfm2_moe-b": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(  # no bias, raw sigmoid weights, two dense layers
        vocab_size=79, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=40,
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, num_dense_layers=2, use_expert_bias=False,
        norm_topk_prob=False, conv_L_cache=4, rope_parameters={"rope_type": "default", "rope_theta": 5e4},
        num_hidden_layers=4, layer_types=["full_attention", "conv", "conv", "full_attention"])),
    "bamba-a": ("BambaConfig", "BambaForCausalLM", dict(
        vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=6, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=2, mamba_d_conv=4, time_step_limit=[0.05, 2.0])),
    "bamba-b": ("BambaConfig", "BambaForCausalLM", dict(
        vocab_size=89, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, attn_layer_indices=[0, 2], mamba_n_heads=4, mamba_d_head=8, mamba_d_state=16,
        mamba_n_groups=1, mamba_d_conv=3, mamba_expand=1, mamba_conv_bias=False, mamba_proj_bias=True,
        mlp_bias=True, tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=500.0))),
    "granitemoehybrid-a": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=97, hidden_size=48, intermediate_size=24, shared_intermediate_size=40, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=6, mamba_d_state=8, mamba_n_groups=2,
        mamba_d_conv=4, time_step_limit=[0.05, 2.0], position_embedding_type="rope", embedding_multiplier=12.0,
        residual_multiplier=0.25, attention_multiplier=0.5, logits_scaling=4.0)),
    "granitemoehybrid-b": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=89, hidden_size=32, shared_intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=0,
        layer_types=["full_attention", "linear_attention", "linear_attention"], mamba_n_heads=4, mamba_d_head=8,
        mamba_d_state=16, mamba_expand=1, mamba_d_conv=3, mamba_conv_bias=False, mamba_proj_bias=True,
        tie_word_embeddings=True, position_embedding_type="nope", embedding_multiplier=6.0, residual_multiplier=0.5,
        attention_multiplier=0.125, logits_scaling=2.5)),
    "mamba2-a": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=97, hidden_size=48, num_hidden_layers=3, num_heads=12, head_dim=8, state_size=8, n_groups=3,
        conv_kernel=4, tie_word_embeddings=True)),
    "mamba2-b": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=89, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=16, n_groups=1,
        conv_kernel=3, use_bias=True, use_conv_bias=False, time_step_limit=[0.05, 2.0])),
    "mamba-a": ("MambaConfig", "MambaForCausalLM", dict(
        vocab_size=97, hidden_size=32, num_hidden_layers=3, state_size=8, expand=2, conv_kernel=4)),
    "mamba-b": ("MambaConfig", "MambaForCausalLM", dict(
        vocab_size=89, hidden_size=24, num_hidden_layers=2, state_size=5, expand=3, conv_kernel=3, time_step_rank=7,
        use_bias=True, use_conv_bias=False, tie_word_embeddings=False, layer_norm_epsilon=1e-6)),
    "falcon_mamba-a": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, state_size=6, expand=2, conv_kernel=4,
        mixer_rms_eps=1e-3)),
    "falcon_mamba-b": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(
        vocab_size=89, hidden_size=16, num_hidden_layers=3, state_size=12, expand=3, conv_kernel=2, time_step_rank=3,
        use_bias=True, use_conv_bias=False, tie_word_embeddings=False)),
    "jamba-a": ("JambaConfig", "JambaForCausalLM", dict(  # attention at 1 and 4, experts at 1 and 3
        vocab_size=97, hidden_size=48, intermediate_size=40, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=6, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)),
    "jamba-b": ("JambaConfig", "JambaForCausalLM", dict(  # attention first, experts at 2, tied, biased projections
        vocab_size=89, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, attn_layer_period=4, attn_layer_offset=0, expert_layer_period=3, expert_layer_offset=2,
        num_experts=4, num_experts_per_tok=2, mamba_d_state=5, mamba_d_conv=3, mamba_expand=3, mamba_dt_rank=7,
        mamba_conv_bias=False, mamba_proj_bias=True, tie_word_embeddings=True, rms_norm_eps=1e-5)),
    "olmo_hybrid-a": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
        vocab_size=97, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4, attention_bias=True, pad_token_id=None,
        eos_token_id=None, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])),
    "olmo_hybrid-b": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
        vocab_size=89, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=40,
        num_hidden_layers=3, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=12,
        linear_value_head_dim=8, linear_conv_kernel_dim=3, linear_allow_neg_eigval=False, tie_word_embeddings=True,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5e4}, pad_token_id=None,
        eos_token_id=None, layer_types=["full_attention", "linear_attention", "full_attention"])),
    "kimi_linear-a": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(  # NoPE latent attention at 1, dense first
        vocab_size=97, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, intermediate_size=40,
        linear_attn_config=dict(head_dim=8, num_heads=3, short_conv_kernel_size=4), num_local_experts=6,
        num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=16, pad_token_id=None,
        bos_token_id=None, eos_token_id=None,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])),
    "kimi_linear-b": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(  # query low rank, biases, 2 shared experts
        vocab_size=89, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, kv_lora_rank=12,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=16, q_lora_rank=10, attention_bias=True,
        intermediate_size=24, linear_attn_config=dict(head_dim=12, num_heads=2, short_conv_kernel_size=3,
                                                      full_attn_layers=[1, 3], kda_layers=[2]),
        num_local_experts=8, num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=12,
        norm_topk_prob=False, routed_scaling_factor=1.5, rms_norm_eps=1e-6,
        mlp_layer_types=["sparse", "dense", "sparse"], pad_token_id=None, bos_token_id=None, eos_token_id=None)),
    "bailing_hybrid-a": ("BailingHybridConfig", "BailingHybridForCausalLM", dict(  # safe gate, attention every 2nd
        vocab_size=97, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, head_dim=8, short_conv_kernel_size=4,
        num_local_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=16,
        intermediate_size=40, first_k_dense_replace=1, layer_group_size=2, pad_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    "bailing_hybrid-b": ("BailingHybridConfig", "BailingHybridForCausalLM", dict(  # softplus decay, clipped SwiGLUs
        vocab_size=89, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=10, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=16, head_dim=12,
        short_conv_kernel_size=3, kda_safe_gate=False, num_local_experts=6, num_experts_per_tok=3, n_group=1,
        topk_group=1, n_shared_experts=2, moe_intermediate_size=12, intermediate_size=24, first_k_dense_replace=1,
        expert_swiglu_limit_list=[0, 0.4, 0.4], share_expert_swiglu_limit_list=[0, 0.3, 0.3], attention_bias=True,
        norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-5, pad_token_id=None, eos_token_id=None,
        layer_types=["full_attention", "linear_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "minimax-a": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(  # HF's prefill crosses blocks; every residual scaled
        vocab_size=97, hidden_size=48, intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, num_local_experts=6, num_experts_per_tok=2, block_size=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
        full_attn_alpha_factor=1.5, full_attn_beta_factor=0.7, linear_attn_alpha_factor=0.8,
        linear_attn_beta_factor=1.3, mlp_alpha_factor=1.2, mlp_beta_factor=0.9)),
    "minimax-b": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(  # HF's default layer order (attention first), top-3
        vocab_size=89, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=24, num_local_experts=5, num_experts_per_tok=3, tie_word_embeddings=True,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5e4})),
    "falcon_h1-a": ("FalconH1Config", "FalconH1ForCausalLM", dict(  # every multiplier, head_dim apart, gated norm
        vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_d_ssm=48, mamba_n_heads=6, mamba_d_state=8, mamba_n_groups=2,
        mamba_d_conv=4, mamba_rms_norm=True, mamba_norm_before_gate=True, projectors_bias=True,
        embedding_multiplier=3.0, lm_head_multiplier=0.5, mlp_multipliers=[0.7, 1.3], key_multiplier=0.8,
        attention_in_multiplier=1.2, attention_out_multiplier=0.9, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9],
        ssm_in_multiplier=1.1, ssm_out_multiplier=0.6)),
    "falcon_h1-b": ("FalconH1Config", "FalconH1ForCausalLM", dict(  # width from expand, no norm, biases, tied
        vocab_size=89, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, mamba_d_ssm=None, mamba_expand=1, mamba_n_heads=4, mamba_d_state=16,
        mamba_n_groups=1, mamba_d_conv=3, mamba_conv_bias=False, mamba_proj_bias=True, attention_bias=True,
        mlp_bias=True, tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=500.0),
        mamba_rms_norm=False, ssm_multipliers=[1.0, 0.5, 1.0, 2.0, 1.0])),
    "zamba2-a": ("Zamba2Config", "Zamba2ForCausalLM", dict(  # two shared blocks over three hybrid layers, adapters
        vocab_size=97, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, intermediate_size=48,
        n_mamba_heads=4, mamba_d_state=8, mamba_ngroups=2, mamba_d_conv=4, num_mem_blocks=2,
        use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True,
        layers_block_type=["mamba", "hybrid", "hybrid", "mamba", "hybrid"])),
    "zamba2-b": ("Zamba2Config", "Zamba2ForCausalLM", dict(  # one block, grouped K/V, no rotary, SiLU, biases
        vocab_size=89, hidden_size=24, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=40, n_mamba_heads=6, mamba_d_state=16, mamba_ngroups=1, mamba_d_conv=3, mamba_expand=1,
        add_bias_linear=True, hidden_act="silu", adapter_rank=3, tie_word_embeddings=False, time_step_min=0.01,
        layers_block_type=["hybrid", "mamba", "mamba", "hybrid"])),
    "recurrent_gemma-a": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", dict(  # HF's cycle, MQA, window 8
        vocab_size=97, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=64, lru_width=48, attention_window_size=8, conv1d_width=4)),
    "recurrent_gemma-b": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", dict(  # attention first, a wider LRU,
        # a tight soft cap, biases, full rotary, untied
        vocab_size=89, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=40, lru_width=48, attention_window_size=5, conv1d_width=3, logits_soft_cap=5.0,
        attention_bias=True, block_types=["attention", "recurrent"], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0})),
}
# per model_type: config changes a load refuses, and what its message names
REFUSED = {
    "nemotron_h": (({"layers_block_type": ["linear_attention", "moe"], "n_routed_experts": 6, "n_group": 4}, "n_group"),
                   ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
                   ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
                   ({"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["linear_attention"]},
                    "mtp_layers_block_type")),
    "bamba": (({"hidden_act": "gelu"}, "hidden_act"), ({"rope_parameters": {"rope_type": "llama3"}}, "rope_type"),
              ({"mamba_d_head": 5}, "mamba_d_head")),
    "mamba2": (({"hidden_act": "gelu"}, "hidden_act"), ({"head_dim": 5}, "head_dim")),
    "granitemoehybrid": (({"hidden_act": "gelu"}, "hidden_act"), ({"mamba_d_head": 5}, "mamba_d_head"),
                         ({"position_embedding_type": "alibi"}, "position_embedding_type"),
                         ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type"),
                         ({"layer_types": ["mamba", "sliding_attention"]}, "'sliding_attention'")),
    "mamba": (({"hidden_act": "gelu"}, "hidden_act"), ({"time_step_rank": 0}, "time_step_rank"),
              ({"state_size": None}, "state_size")),
    "falcon_mamba": (({"hidden_act": "relu"}, "hidden_act"), ({"expand": 1.5}, "expand")),
    "lfm2": (({"layer_types": ["conv", "sliding_attention"], "num_hidden_layers": 2}, "'sliding_attention'"),
             ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}}, "rope_type")),
    "olmo_hybrid": (({"hidden_act": "gelu"}, "hidden_act"),
                    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
                    ({"layer_types": ["linear_attention", "sliding_attention"], "num_hidden_layers": 2},
                     "'sliding_attention'")),
    "jamba": (({"hidden_act": "gelu"}, "hidden_act"), ({"attn_layer_offset": 4}, "attn_layer_offset"),
              ({"expert_layer_period": 0}, "expert_layer_period"), ({"mamba_dt_rank": 0}, "mamba_dt_rank"),
              ({"num_experts_per_tok": 7}, "num_experts_per_tok")),
    "falcon_h1": (({"hidden_act": "gelu"}, "hidden_act"), ({"rope_parameters": {"rope_type": "llama3"}}, "rope_type"),
                  ({"mamba_d_head": 5}, "mamba_d_head"), ({"ssm_multipliers": [1.0, 2.0]}, "ssm_multipliers"),
                  ({"mlp_multipliers": [1.0]}, "mlp_multipliers")),
    "zamba2": (({"hidden_act": "relu"}, "hidden_act"), ({"use_long_context": True}, "use_long_context"),
               ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type"),
               ({"use_shared_attention_adapter": True, "num_key_value_heads": 1}, "num_key_value_heads"),
               ({"n_mamba_heads": 7}, "n_mamba_heads"), ({"layers_block_type": ["mamba"]}, "layers_block_type")),
    "lfm2_moe": (({"layer_types": None}, "layer_types"), ({"num_dense_layers": -1}, "num_dense_layers"),
                 ({"num_experts_per_tok": 9}, "num_experts_per_tok")),
    "kimi_linear": (({"hidden_act": "gelu"}, "hidden_act"), ({"num_key_value_heads": 1}, "num_key_value_heads"),
                    ({"layer_types": ["linear_attention", "sliding_attention"], "num_hidden_layers": 2},
                     "'sliding_attention'"), ({"num_expert_group": 4}, "num_expert_group"),
                    ({"mlp_layer_types": ["dense"]}, "mlp_layer_types")),
    "bailing_hybrid": (({"hidden_act": "gelu"}, "hidden_act"), ({"num_key_value_heads": 1}, "num_key_value_heads"),
                       ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
                       ({"expert_swiglu_limit_list": [0.5, 1.0]}, "expert_swiglu_limit_list"),
                       ({"num_expert_group": 5}, "num_expert_group")),
    "minimax": (({"hidden_act": "gelu"}, "hidden_act"), ({"sliding_window": 8}, "sliding_window"),
                ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}}, "rope_type"),
                ({"layer_types": ["linear_attention", "sliding_attention"], "num_hidden_layers": 2},
                 "'sliding_attention'"), ({"num_local_experts": 0}, "num_local_experts"),
                ({"block_size": 0}, "block_size"), ({"mlp_beta_factor": "x"}, "mlp_beta_factor")),
    "recurrent_gemma": (({"hidden_activation": "gelu"}, "hidden_activation"), ({"lru_width": 49}, "lru_width"),
                        ({"block_types": ["recurrent", "mlp"]}, "'mlp'"), ({"block_types": []}, "block_types"),
                        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type")),
}


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn at random, decays and norms included, so no path is trivially exact; and Nemotron-H's
    and LFM2-MoE's router biases, buffers, so that they move the choice of experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 8, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g) - 1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim == 1 else p.shape[-1] ** -0.5))


def saved(name: str, directory: Path) -> torch.nn.Module:
    """HF's model of config `name` with random weights, written by its own `save_pretrained` into `directory`."""
    config_class, model_class, fields = CONFIGS[name]
    hf = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields)).eval()
    randomise(hf, len(name))
    hf.save_pretrained(directory)
    return hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp(request.param)
    return directory, saved(request.param, directory)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_logits_match_hf_on_every_path(checkpoint):
    directory, hf = checkpoint
    ours = load_model(directory)
    ids = torch.randint(0, ours.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    assert rel(ours(ids, ours.new_state())[0], want) < 1e-4  # fused, prefill in one pass
    state, rows = ours.new_state(capacity=4), []  # decode, K/V grown as it goes
    for t in ids[:10]:
        rows.append(ours(t[None], state)[0][0])
        state.commit(1)
    for T, keep in ((7, 3), (5, 5), (4, 0), (9, 9)):  # verify passes, partial, full and zero commits
        start = state.length
        logits, _ = ours(ids[start:start + T], state)
        state.commit(keep)
        rows += list(logits[:keep])
    assert rel(torch.stack(rows), want[:len(rows)]) < 1e-4
    ours.capture()  # the static pass a compiled or CUDA graph records (run directly on a CPU)
    state = ours.new_state()
    ours(ids[:20], state)
    state.commit(20)
    static = [ours(ids[20:21], state)[0], ours(ids[21:26], state)[0]]
    assert rel(torch.cat(static), want[20:26]) < 1e-4
    ours.capture(False).fuse(False)  # the reference layers
    assert rel(ours(ids, ours.new_state())[0], want) < 1e-4


def test_batched_pass_equals_each_alone(checkpoint):
    ours = load_model(checkpoint[0])
    gen = torch.Generator().manual_seed(2)
    items = []
    for n, pre in ((3, 5), (1, 9), (6, 2)):
        state = ours.new_state()
        ours(torch.randint(0, ours.config.vocab_size, (pre,), generator=gen), state)
        state.commit(pre)
        items.append((torch.randint(0, ours.config.vocab_size, (n,), generator=gen), state))
    want = []
    for ids, state in items:  # the same sequences, one at a time, on copies of their states
        copy = ours.new_state()
        copy.load_head(state.length, state.recurrent.conv, state.recurrent.state, state.kv(0, state.length))
        want.append(ours(ids, copy)[0])
    got = forward_batch(ours, items)
    for (logits, _), expected in zip(got, want):
        assert rel(logits, expected) < 1e-5


def test_zero_draft_rounds_after_accepted_ones(checkpoint):
    """The round sequence that corrupts other engines: rounds whose drafts are all accepted, each followed by a
    round of zero drafts (one token staged, committed), then a rejected tail; logits stay target-only's."""
    ours = load_model(checkpoint[0])
    prompt = torch.randint(0, ours.config.vocab_size, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    want = generate(ours, prompt, 24).token_ids
    tokens = prompt + want
    state = ours.new_state()
    ours(torch.tensor(prompt[:-1]), state)
    state.commit(len(prompt) - 1)
    at = len(prompt) - 1
    for k in (4, 0, 3, 0, 0, 5, 0):
        drafts = tokens[at + 1:at + 1 + k]
        logits, _ = ours(torch.tensor([tokens[at]] + drafts), state)
        accepted = 0
        while accepted < k and int(logits[accepted].argmax()) == drafts[accepted]:
            accepted += 1
        assert int(logits[accepted].argmax()) == tokens[at + accepted + 1]
        state.commit(accepted + 1)
        at += accepted + 1
    wrong = (tokens[at + 1] + 1) % ours.config.vocab_size  # a rejected draft, then a zero-draft round
    logits, _ = ours(torch.tensor([tokens[at], wrong, 5]), state)
    state.commit(1)
    logits, _ = ours(torch.tensor([tokens[at + 1]]), state)
    assert int(logits[0].argmax()) == tokens[at + 2]


def test_greedy_matches_hf_generate_with_every_drafter(checkpoint):
    directory, hf = checkpoint
    ours = load_model(directory)
    prompt = torch.randint(0, ours.config.vocab_size, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
    assert generate(ours, prompt, 20).token_ids == want
    for drafter, k in ((ModelDrafter(load_model(directory)), 1), (ModelDrafter(load_model(directory)), 4),
                       (NgramDrafter(), 4), (ModelDrafter(load_model(directory)), CostModelLength(CHEAP)),
                       (ModelDrafter(load_model(directory)), CostModelLength(DEAR))):
        assert generate(ours, prompt, 20, drafter, k).token_ids == want


def test_prefix_cache_hits_and_a_state_pool_give_hf_tokens(checkpoint):
    """Sessions in a state pool's slots resuming from cached prefixes (no K/V at all for a pure Mamba2) generate
    what HF generates."""
    directory, hf = checkpoint
    ours = load_model(directory)
    state_pool.attach(ours, state_pool.StatePool(ours.config.state_spec, 2**26))
    prefix_cache.attach(ours, block=4)
    prompt = torch.randint(0, ours.config.vocab_size, (14,), generator=torch.Generator().manual_seed(5)).tolist()
    for turn in (prompt, prompt[:11] + [3, 1]):  # a miss that fills the cache, then a hit on 8 of its tokens
        with torch.no_grad():  # a mask of ones: else HF masks the prompt's pad_token_id (Mamba2's is 1) as padding
            want = hf.generate(torch.tensor([turn]), attention_mask=torch.ones(1, len(turn), dtype=torch.long),
                               max_new_tokens=12, do_sample=False)[0, len(turn):].tolist()
        result = generate(ours, turn, 12, NgramDrafter(), 3)
        assert result.token_ids == want
    assert result.stats.cached_prompt_tokens == 8


def test_published_names_and_hand_written_configs_read_as_hf_reads_them(checkpoint, tmp_path):
    """A `mamba_ssm` conversion's `backbone.embedding.` loads as HF's load hook renames it (Mamba, Mamba2);
    FalconMamba's weightless norms, if a checkpoint carries them, are ignored as HF ignores them; a config without
    the fields `save_pretrained` fills in gets HF's defaults (Bamba's rotary on half of each head, Mamba's tie and
    dt rank, its width `intermediate_size` where given, else from `expand`); Granite's names; what `publish` writes
    of a Nemotron-H (stacked experts, the router's bias) HF loads back to its own logits."""
    directory, hf = checkpoint
    config = json.loads((directory / "config.json").read_text())
    model_type = config["model_type"]
    if model_type in ("mamba2", "mamba", "falcon_mamba"):
        tensors = load_file(directory / "model.safetensors")
        if model_type == "falcon_mamba":
            tensors |= {f"backbone.layers.0.mixer.{x}_layernorm.weight": torch.ones(1) for x in ("b", "c", "dt")}
        else:
            tensors["backbone.embedding.weight"] = tensors.pop("backbone.embeddings.weight")
        save_file(tensors, tmp_path / "model.safetensors")
        (tmp_path / "config.json").write_text(json.dumps(config))
        ids = torch.arange(12) % config["vocab_size"]
        want = load_model(directory)(ids, load_model(directory).new_state())[0]
        ours = load_model(tmp_path)
        assert torch.equal(ours(ids, ours.new_state())[0], want)
    if model_type in ("mamba", "falcon_mamba"):
        bare = {k: config[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "state_size")}
        for width in ({}, {"expand": 3}, {"intermediate_size": 40}):
            hf = getattr(transformers, CONFIGS[f"{model_type}-a"][0])(**bare, **width)
            ours = ModelConfig.from_dict({**bare, **width, "model_type": model_type})
            assert (ours.mamba_num_heads, ours.mamba_dt_rank) == (hf.intermediate_size, hf.time_step_rank)
        assert ours.tie_word_embeddings == hf.tie_word_embeddings is True
        assert ours.mamba_conv_kernel == hf.conv_kernel and ours.rms_norm_eps == hf.layer_norm_epsilon
    if model_type == "bamba":
        bare = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads", "num_key_value_heads", "mamba_n_heads", "mamba_d_state")}
        hf = transformers.BambaConfig(**bare, rope_theta=300.0)
        ours = ModelConfig.from_dict({**bare, "model_type": "bamba", "rope_theta": 300.0})
        assert ours.rotary_dim == hf.hidden_size // hf.num_attention_heads * hf.rope_parameters["partial_rotary_factor"]
        assert ours.rope_theta == hf.rope_parameters["rope_theta"] == 300.0
        assert ours.mamba_head_dim == hf.mamba_d_head and ours.num_key_value_heads == hf.num_key_value_heads
        assert ours.layer_types == tuple(hf.layers_block_type)
    if model_type == "recurrent_gemma":  # the published configs' layout: rotary and theta at the top, no head_dim
        bare = {k: config[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                       "intermediate_size", "attention_window_size")}
        bare |= {"rope_theta": 300.0, "partial_rotary_factor": 0.5, "embeddings_scale_by_sqrt_dim": True}
        read = transformers.RecurrentGemmaConfig(**bare)
        ours = ModelConfig.from_dict({**bare, "model_type": "recurrent_gemma"})
        assert ours.rotary_dim == int(read.head_dim * read.rope_parameters["partial_rotary_factor"])
        assert ours.rope_theta == read.rope_parameters["rope_theta"] == 300.0 and ours.head_dim == read.head_dim
        assert ours.layer_types == tuple(read.block_types * read.num_hidden_layers)[:read.num_hidden_layers]
        assert (ours.lru_width, ours.num_key_value_heads, ours.tie_word_embeddings) == (read.lru_width,
                                                                                         read.num_key_value_heads, True)
        again = transformers.RecurrentGemmaForCausalLM.from_pretrained(save_checkpoint(load_model(directory),
                                                                                       tmp_path))
        ids = torch.arange(12)[None] % config["vocab_size"]
        with torch.no_grad():
            assert torch.equal(again.eval()(ids).logits, hf(ids).logits)
    if model_type == "nemotron_h":
        again = transformers.NemotronHForCausalLM.from_pretrained(save_checkpoint(load_model(directory), tmp_path))
        ids = torch.arange(12)[None] % config["vocab_size"]
        with torch.no_grad():
            assert torch.equal(again.eval()(ids).logits, hf(ids).logits)
    if config["model_type"] == "granitemoehybrid":
        _granite_names_and_defaults(directory, config, tmp_path)
    if model_type == "olmo_hybrid":
        _olmo_names_and_defaults(directory, hf, config, tmp_path)
    if config["model_type"] == "lfm2_moe":
        _lfm2_moe_names_and_defaults(directory, config, tmp_path)
    if model_type == "jamba":
        _jamba_names_and_defaults(directory, config, tmp_path)
    if model_type == "kimi_linear":
        _kimi_names_and_defaults(directory, hf, config, tmp_path)
    if model_type == "bailing_hybrid":
        _bailing_names_and_defaults(directory, hf, config, tmp_path)
    if model_type == "minimax":
        _minimax_names_and_defaults(directory, hf, config, tmp_path)
    if model_type == "falcon_h1":
        _falcon_h1_names_and_defaults(directory, hf, config, tmp_path)
    if model_type == "zamba2":
        _zamba2_names_and_defaults(directory, hf, config, tmp_path)


def _loads_as_published(directory: Path, tensors: dict, config: dict, tmp_path: Path, bound: float = 0.0) -> None:
    """`tensors` (a family's other names: HF's in memory, a legacy layout) with `config` load the model that the
    published layout in `directory` does (equal logits; within `bound` relative where fused tensors read in place
    from the file rather than stacked afresh round differently in this CPU's matmuls), and `publish` writes back
    what `save_pretrained` wrote."""
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = torch.arange(12) % config["vocab_size"]
    want, ours = load_model(directory), load_model(tmp_path)
    got, expected = ours(ids, ours.new_state())[0], want(ids, want.new_state())[0]
    assert rel(got, expected) < bound if bound else torch.equal(got, expected)
    written = load_file(save_checkpoint(want, tmp_path / "saved") / "model.safetensors")
    original = load_file(directory / "model.safetensors")
    assert sorted(written) == sorted(original) and all(torch.equal(written[k], original[k]) for k in original)


def _granite_names_and_defaults(directory: Path, config: dict, tmp_path: Path) -> None:
    """HF's in-memory expert names and the published configs' layer kinds load the same model; `publish` writes the
    layout `save_pretrained` wrote; a bare config reads as HF's (8 experts, no rotary, multipliers 1)."""
    tensors = load_file(directory / "model.safetensors")
    for name in list(tensors):
        for old, new in (("router.layer.", "router."), ("input_linear.weight", "experts.gate_up_proj"),
                         ("output_linear.weight", "experts.down_proj")):
            if ".block_sparse_moe." in name and old in name:
                tensors[name.replace(old, new)] = tensors.pop(name)
    save_file(tensors, tmp_path / "model.safetensors")
    legacy = {"linear_attention": "mamba", "full_attention": "attention"}
    layers_block_type = [legacy[kind] for kind in config.pop("layer_types")]
    (tmp_path / "config.json").write_text(json.dumps({**config, "layers_block_type": layers_block_type}))
    ids = torch.arange(12) % config["vocab_size"]
    want = load_model(directory)
    ours = load_model(tmp_path)
    assert torch.equal(ours(ids, ours.new_state())[0], want(ids, want.new_state())[0])
    written = load_file(save_checkpoint(ours, tmp_path / "saved") / "model.safetensors")
    original = load_file(directory / "model.safetensors")
    assert sorted(written) == sorted(original) and all(torch.equal(written[k], original[k]) for k in original)
    bare = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "shared_intermediate_size",
                                   "num_hidden_layers", "num_attention_heads", "mamba_n_heads", "mamba_d_state")}
    hf = transformers.GraniteMoeHybridConfig(**bare)
    ours = ModelConfig.from_dict({**bare, "model_type": "granitemoehybrid"})
    assert (ours.num_experts, ours.num_experts_per_tok) == (hf.num_local_experts, hf.num_experts_per_tok)
    assert ours.layer_types == tuple(hf.layer_types) and ours.rotary_dim == 0 and hf.position_embedding_type is None
    assert (ours.attention_scale, ours.embedding_multiplier, ours.residual_multiplier, ours.logits_scaling) == (
        hf.attention_multiplier, hf.embedding_multiplier, hf.residual_multiplier, hf.logits_scaling)
    assert ours.num_key_value_heads == hf.num_key_value_heads and ours.mamba_head_dim == hf.mamba_d_head


def _olmo_names_and_defaults(directory: Path, hf: torch.nn.Module, config: dict, tmp_path: Path) -> None:
    """HF's in-memory names (one conv, HF's norm names) and an `mtp.*` tensor load the model `save_pretrained`'s
    names do; what `publish` writes (the conv split at q/k/v, as published) HF loads back to its own logits; a bare
    config reads as HF's (derived GDN head sizes, layer kinds, beta up to 2)."""
    tied = hf.config.tie_word_embeddings
    tensors = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(tensors | {"mtp.norm.weight": torch.ones(4)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = torch.arange(12) % config["vocab_size"]
    want, ours = load_model(directory), load_model(tmp_path)
    assert torch.equal(ours(ids, ours.new_state())[0], want(ids, want.new_state())[0])
    again = transformers.OlmoHybridForCausalLM.from_pretrained(save_checkpoint(want, tmp_path / "saved")).eval()
    with torch.no_grad():
        assert torch.equal(again(ids[None]).logits, hf(ids[None]).logits)
    bare = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads")}
    hf_cfg = transformers.OlmoHybridConfig(**bare, pad_token_id=None)
    ours = ModelConfig.from_dict({**bare, "model_type": "olmo_hybrid"})
    assert ours.layer_types == tuple(hf_cfg.layer_types) and ours.num_key_value_heads == hf_cfg.num_key_value_heads
    assert (ours.linear_num_key_heads, ours.linear_num_value_heads, ours.linear_key_head_dim,
            ours.linear_value_head_dim) == (hf_cfg.linear_num_key_heads, hf_cfg.linear_num_value_heads,
                                            hf_cfg.linear_key_head_dim, hf_cfg.linear_value_head_dim)
    assert ours.linear_beta_scale == 2.0 and ours.rope_theta == hf_cfg.rope_parameters["rope_theta"]
def fuse_experts(tensors: dict[str, torch.Tensor], prefix: str, projs: tuple[str, str, str], n: int) -> None:
    """Per-expert tensors `prefix.e.{gate, up, down}.weight` (named `projs`) -> HF's fused in-memory layout,
    `prefix.gate_up_proj` and `prefix.down_proj`, in place: the names a checkpoint saved from memory carries."""
    w = [[tensors.pop(f"{prefix}.{e}.{p}.weight") for p in projs] for e in range(n)]
    tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(e[:2]) for e in w])
    tensors[f"{prefix}.down_proj"] = torch.stack([e[2] for e in w])


def _lfm2_moe_names_and_defaults(directory: Path, config: dict, tmp_path: Path) -> None:
    """HF's in-memory fused expert names load the same model; `publish` writes the per-expert layout
    `save_pretrained` wrote; the expert bias stays float32 in a bfloat16 model, as HF keeps it; a bare config reads
    as HF's (32 experts, top-4, two dense layers, the bias on)."""
    tensors = load_file(directory / "model.safetensors")
    for i in range(config["num_dense_layers"], config["num_hidden_layers"]):
        fuse_experts(tensors, f"model.layers.{i}.feed_forward.experts", ("w1", "w3", "w2"), config["num_experts"])
    _loads_as_published(directory, tensors, config, tmp_path, bound=1e-6)
    sparse = load_model(directory, torch.bfloat16).model.layers[-1].mlp
    assert sparse.gate.weight.dtype == torch.bfloat16
    assert sparse.expert_bias is None if not config["use_expert_bias"] else sparse.expert_bias.dtype == torch.float32
    bare = {k: config[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "layer_types")}
    hf = transformers.Lfm2MoeConfig(**bare)
    ours = ModelConfig.from_dict({**bare, "model_type": "lfm2_moe"})
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size, ours.intermediate_size) == (
        hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.intermediate_size)
    assert ours.mlp_only_layers == tuple(range(hf.num_dense_layers)) and ours.use_expert_bias == hf.use_expert_bias
    assert (ours.norm_topk_prob, ours.routed_scaling_factor) == (hf.norm_topk_prob, hf.routed_scaling_factor)
    assert ours.tie_word_embeddings == hf.tie_word_embeddings and ours.rope_theta == hf.rope_parameters["rope_theta"]


def _jamba_names_and_defaults(directory: Path, config: dict, tmp_path: Path) -> None:
    """HF's in-memory fused expert names load the same model; `publish` writes what `save_pretrained` wrote; a bare
    config reads as HF's (layer kinds and sparse layers from the periods and offsets, dt rank, K/V heads, the tie)."""
    tensors = load_file(directory / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".experts.0.gate_proj.weight")]:
        fuse_experts(tensors, name[: -len(".0.gate_proj.weight")], ("gate_proj", "up_proj", "down_proj"),
                     config["num_experts"])
    _loads_as_published(directory, tensors, config, tmp_path, bound=1e-6)
    bare = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size")} | {"num_attention_heads": 16}
    for n_layers in (3, 17):
        hf = transformers.JambaConfig(**bare, num_hidden_layers=n_layers)
        ours = ModelConfig.from_dict({**bare, "num_hidden_layers": n_layers, "model_type": "jamba"})
        assert ours.layer_types == tuple(hf.layer_types)
        assert [ours.sparse(i) for i in range(n_layers)] == [n > 1 for n in hf.layers_num_experts]
        assert (ours.mamba_dt_rank, ours.num_key_value_heads, ours.ssm_state_size, ours.mamba_conv_kernel) == (
            hf.mamba_dt_rank, hf.num_key_value_heads, hf.mamba_d_state, hf.mamba_d_conv)
        assert ours.mamba_num_heads == hf.mamba_expand * hf.hidden_size and ours.num_experts == hf.num_experts
        assert ours.tie_word_embeddings == hf.tie_word_embeddings is False


def _minimax_names_and_defaults(directory: Path, hf: torch.nn.Module, config: dict, tmp_path: Path) -> None:
    """HF's in-memory names (fused experts, `mlp.`), without the lightning buffers, load the model the published
    layout does (`slope_rate` computed as HF's init computes it); `publish` writes what `save_pretrained` wrote,
    derived buffers included; a bare config reads as HF's (layer order, K/V heads, experts, rotary base, factors)."""
    tied = hf.config.tie_word_embeddings
    tensors = {k: v for k, v in hf.state_dict().items()
               if not (tied and k == "lm_head.weight") and not k.endswith(("_decay", "slope_rate"))}
    _loads_as_published(directory, tensors, config, tmp_path, bound=1e-6)
    bare = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size")} | {"num_attention_heads": 16}
    for n_layers in (3, 6):
        hf_cfg = transformers.MiniMaxConfig(**bare, num_hidden_layers=n_layers)
        ours = ModelConfig.from_dict({**bare, "num_hidden_layers": n_layers, "model_type": "minimax"})
        assert ours.layer_types == tuple(hf_cfg.layer_types) and ours.num_key_value_heads == hf_cfg.num_key_value_heads
        assert (ours.num_experts, ours.num_experts_per_tok, ours.head_dim) == (
            hf_cfg.num_local_experts, hf_cfg.num_experts_per_tok, hf_cfg.hidden_size // hf_cfg.num_attention_heads)
        assert ours.rope_theta == hf_cfg.rope_parameters["rope_theta"] and ours.rms_norm_eps == hf_cfg.rms_norm_eps
        assert ours.normed_residual == tuple((kind, (1.0, 1.0), (1.0, 1.0)) for kind in ("linear_attention",
                                                                                          "full_attention"))
        assert ours.tie_word_embeddings == hf_cfg.tie_word_embeddings is False


def _falcon_h1_names_and_defaults(directory: Path, hf: torch.nn.Module, config: dict, tmp_path: Path) -> None:
    """What `publish` writes HF loads back to its own logits; a bare config reads as HF's (the Mamba2 width 1024
    unless `mamba_d_ssm` is null, its head size from it, 8 K/V heads, the rope theta, multipliers 1)."""
    ids = torch.arange(12)[None] % config["vocab_size"]
    again = transformers.FalconH1ForCausalLM.from_pretrained(save_checkpoint(load_model(directory), tmp_path)).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)
    bare = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "mamba_d_state")} | {"mamba_n_heads": 8, "num_attention_heads": 16}
    for width in ({}, {"mamba_d_ssm": None}):
        hf_cfg = transformers.FalconH1Config(**bare, **width)
        ours = ModelConfig.from_dict({**bare, **width, "model_type": "falcon_h1"})
        assert ours.mamba_num_heads * ours.mamba_head_dim == hf_cfg.mamba_n_heads * hf_cfg.mamba_d_head
        assert (ours.num_key_value_heads, ours.rope_theta) == (hf_cfg.num_key_value_heads,
                                                               hf_cfg.rope_parameters["rope_theta"])
        assert ours.head_dim == hf_cfg.hidden_size // hf_cfg.num_attention_heads
        assert (ours.embedding_multiplier, ours.logits_multiplier) == (1.0, 1.0) and ours.layer_types == tuple(
            hf_cfg.layers_block_type)


def _zamba2_names_and_defaults(directory: Path, hf: torch.nn.Module, config: dict, tmp_path: Path) -> None:
    """A tied model's shared block is one module and one set of parameters, held (and saved) by its first layer;
    what `publish` writes HF loads back to its own logits; a bare config reads as HF's."""
    ours = load_model(directory)
    hybrids = [layer.mixer for layer in ours.model.layers if layer.kind == "hybrid"]
    n_blocks = config["num_mem_blocks"]
    for c, mixer in enumerate(hybrids):
        first = hybrids[c % n_blocks] if config["tie_word_embeddings"] else mixer
        assert mixer.shared is first.shared and (mixer is first) == ("shared_transformer" in mixer._modules)
    if config["tie_word_embeddings"] and len(hybrids) > n_blocks:
        owner, other = hybrids[0].shared.self_attn.q_proj.weight, hybrids[n_blocks].shared.self_attn.q_proj.weight
        assert owner is other
    ids = torch.arange(12)[None] % config["vocab_size"]
    again = transformers.Zamba2ForCausalLM.from_pretrained(save_checkpoint(ours, tmp_path)).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)
    bare = {k: config[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "layers_block_type")}
    hf_cfg = transformers.Zamba2Config(**bare)
    ours_cfg = ModelConfig.from_dict({**bare, "model_type": "zamba2"})
    assert (ours_cfg.intermediate_size, ours_cfg.num_key_value_heads, ours_cfg.head_dim) == (
        hf_cfg.intermediate_size, hf_cfg.num_key_value_heads, hf_cfg.attention_head_dim)
    assert (ours_cfg.mamba_num_heads, ours_cfg.mamba_head_dim, ours_cfg.ssm_state_size) == (
        hf_cfg.n_mamba_heads, hf_cfg.mamba_headdim, hf_cfg.mamba_d_state)
    assert ours_cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings and ours_cfg.rotary_dim == 0
    assert ours_cfg.mamba_dt_limit[0] == hf_cfg.time_step_min and ours_cfg.layer_types == tuple(
        hf_cfg.layers_block_type)


def test_unsupported_parts_are_refused_at_load(checkpoint, tmp_path):
    directory, _ = checkpoint
    config = json.loads((directory / "config.json").read_text())
    for change, named in REFUSED[config["model_type"]]:
        (tmp_path / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(CheckpointError, match=re.escape(named)):
            load_model(tmp_path)


def test_no_family_is_named_outside_the_model_and_state_floors():
    """Decoding, the services, the client and the RPC layer work for every family without naming one: none imports
    a family or a mixer, or branches on a family or model_type."""
    root = Path(__file__).resolve().parents[1]
    names = re.compile(r"model\.families\.\w|model\.mixers\.\w|\bfamily\s*[!=]=|model_type\s*[!=]="
                       r"|GatedDeltaNet|Mamba2")
    places = [root / "shared" / "decoding", root / "shared" / "rpc", root / "target_service", root / "draft_service",
              root / "shared" / "client.py"]
    files = [path for place in places for path in ([place] if place.is_file() else sorted(place.rglob("*.py")))]
    found = [f"{path.relative_to(root)}:{i}" for path in files
             for i, line in enumerate(path.read_text().splitlines(), 1) if names.search(line)]
    assert not found, found


# Mamba2, a conv window alone, Mamba1, KDA beside latent attention, lightning attention (no conv window) with
# experts, layers holding both states (a shared block reading the embeddings), and local attention beside the RG-LRU
@pytest.mark.parametrize("name", ["nemotron_h-a", "lfm2-a", "falcon_mamba-a", "kimi_linear-a", "minimax-b", "zamba2-a",
                                  "recurrent_gemma-a"])
def test_services_serve_hf_tokens(name, tmp_path):
    """serve-target beside serve-draft (the same checkpoint as draft: a near-copy), as an operator starts them:
    HF's greedy tokens through the target's loop and the client-driven one (pipelined), then five Generate streams
    of different lengths and k at once on a batching target, joining and leaving, each HF's."""
    hf = saved(name, tmp_path)
    prompt = torch.randint(0, CONFIGS[name][2]["vocab_size"], (10,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = hf.generate(prompt[None], attention_mask=torch.ones(1, 10, dtype=torch.long), max_new_tokens=16,
                           do_sample=False)[0, 10:].tolist()
    with Served("serve-draft", tmp_path) as drafted, \
            Served("serve-target", tmp_path, "--draft-addr", drafted.address, "--draft-timeout", "30") as served:
        assert both_loops(served, drafted, prompt.tolist(), 16, 3) == (want, want)
        streams = [(prompt.tolist(), 4, 16), (prompt[:6].tolist(), 2, 8), (prompt[:3].tolist(), 0, 12)] * 2
        out = run_threads(lambda i: generate_on_server(served.address, streams[i][0], "", streams[i][2],
                                                       streams[i][1])[0].token_ids, list(range(5)))
    for (ids, _, n), got in zip(streams, out):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
        assert got == expected



# layers holding both states, Mamba2 beside a shared block reading the embeddings, as one graph (4 layers); a Mamba2
# alone, a conv window alone, side by side (Falcon-H1) and per layer (Zamba2's 5) take 20-50 s each to compile on 2
# cores: run with `-m slow` (the suite's time goal)
@pytest.mark.parametrize("name", ["zamba2-a", *(pytest.param(name, marks=pytest.mark.slow)
                                                for name in ("mamba2-b", "lfm2-b", "falcon_h1-a", "zamba2-b"))])
def test_compiled_passes_equal_the_fused_path(name, tmp_path):
    """Decode and verify as compiled graphs (one token, then several: the token count symbolic), every commit."""
    saved(name, tmp_path)
    fused, compiled = load_model(tmp_path), load_model(tmp_path).compile()
    ids = torch.randint(0, fused.config.vocab_size, (12,), generator=torch.Generator().manual_seed(7))
    a, b = fused.new_state(), compiled.new_state()
    for piece, keep in ((ids[:4], 4), (ids[4:5], 1), (ids[5:9], 2), (ids[7:10], 3)):
        assert rel(compiled(piece, b)[0], fused(piece, a)[0]) < 1e-5
        a.commit(keep), b.commit(keep)


def test_compiling_a_mixer_without_compiled_passes_is_refused(tmp_path):
    saved("mamba-a", tmp_path)
    with pytest.raises(ValueError, match="not built for Mamba1Mixer layers"):
        load_model(tmp_path).compile()


def _kimi_names_and_defaults(directory: Path, hf: torch.nn.Module, config: dict, tmp_path: Path) -> None:
    """HF's in-memory names (the forget gate's module, one conv, fused experts, `mlp.`) load the model the published
    names do; `publish` writes what `save_pretrained` wrote; a bare config reads as HF's (layer kinds, dense layers,
    the KDA sizes, the expert fields under HF's names)."""
    _loads_as_published(directory, dict(hf.state_dict()), config, tmp_path, bound=1e-6)
    bare = {k: config[k] for k in ("vocab_size", "hidden_size", "num_attention_heads")} | {"num_hidden_layers": 6}
    hf_cfg = transformers.KimiLinearConfig(**bare)
    ours = ModelConfig.from_dict({**bare, "model_type": "kimi_linear"})
    assert ours.layer_types == tuple(hf_cfg.layer_types)
    assert [ours.sparse(i) for i in range(6)] == [kind == "sparse" for kind in hf_cfg.mlp_layer_types]
    assert (ours.linear_num_value_heads, ours.linear_value_head_dim, ours.linear_conv_kernel_dim) == (
        hf_cfg.linear_num_heads, hf_cfg.linear_head_dim, hf_cfg.linear_conv_kernel_dim)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.n_group, ours.topk_group, ours.norm_topk_prob) == (
        hf_cfg.num_local_experts, hf_cfg.num_experts_per_tok, hf_cfg.n_group, hf_cfg.topk_group,
        hf_cfg.norm_topk_prob)
    assert (ours.kv_lora_rank, ours.qk_rope_head_dim, ours.v_head_dim, ours.routed_scaling_factor) == (
        hf_cfg.kv_lora_rank, hf_cfg.qk_rope_head_dim, hf_cfg.v_head_dim, hf_cfg.routed_scaling_factor)


def _bailing_names_and_defaults(directory: Path, hf: torch.nn.Module, config: dict, tmp_path: Path) -> None:
    """HF's in-memory names (`self_attn.`, the forget gate's module, one conv, fused experts, the router's
    `e_score_correction_bias`) and an MTP layer's tensors load the model the published names do; `publish` writes
    what `save_pretrained` wrote; per-layer SwiGLU limits that differ between sparse layers are refused; a bare
    config reads as HF's (layer kinds from the group size, dense layers, the KDA sizes from `head_dim`, the rotary
    on `qk_rope_head_dim`)."""
    n = config["num_hidden_layers"]
    mtp = {f"model.layers.{n}.input_layernorm.weight": torch.ones(config["hidden_size"])}
    _loads_as_published(directory, dict(hf.state_dict()) | mtp, config, tmp_path, bound=1e-6)
    with pytest.raises(ConfigError, match="expert_swiglu_limit_list"):
        ModelConfig.from_dict({**config, "expert_swiglu_limit_list": [0] * (n - 2) + [0.5, 1.0]})
    bare = {k: config[k] for k in ("vocab_size", "hidden_size", "num_attention_heads")} | {
        "num_hidden_layers": 7, "head_dim": 24}
    hf_cfg = transformers.BailingHybridConfig(**bare)
    ours = ModelConfig.from_dict({**bare, "model_type": "bailing_hybrid"})
    assert ours.layer_types == tuple(hf_cfg.layer_types)
    assert [ours.sparse(i) for i in range(7)] == [kind == "sparse" for kind in hf_cfg.mlp_layer_types]
    assert (ours.linear_num_value_heads, ours.linear_value_head_dim, ours.linear_conv_kernel_dim) == (
        hf_cfg.linear_num_heads, hf_cfg.linear_head_dim, hf_cfg.linear_conv_kernel_dim)
    assert (ours.rotary_dim, ours.rope_theta) == (hf_cfg.head_dim, hf_cfg.rope_parameters["rope_theta"])
    assert (ours.num_experts, ours.num_experts_per_tok, ours.n_group, ours.topk_group, ours.kda_lower_bound) == (
        hf_cfg.num_local_experts, hf_cfg.num_experts_per_tok, hf_cfg.n_group, hf_cfg.topk_group,
        hf_cfg.kda_lower_bound)
