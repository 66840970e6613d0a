"""Every model_type deltaspec loads, on one small random checkpoint each (`deltaspec bench --only families`).

Per model_type, in one run on this machine: target-only greedy tokens/s against HF transformers' `generate()` on
the same checkpoint, weights and threads (alternated, medians); one verify pass of 5 tokens over one decode step
(each with its commit); the bytes a round of 4 drafts stages (the logs the commit reads); and the commit's share of
a round (a partial commit of 3 of the 5, against the verify pass and that commit together), beside the bytes of a
sequence's recurrent state and conv windows over the weights' (what a commit reads and writes against what a pass
reads: the share follows it). Checkpoints are written by HF's own `save_pretrained` from random weights and loaded
as a user would (`load_model`).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.loader import load_model

WIDE = dict(vocab_size=512, hidden_size=256)
# model_type -> (HF config class, HF model class, its fields): about 6 layers of width 256 each
CHECKPOINTS = {
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        **WIDE, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        **WIDE, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=256,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        **WIDE, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64, mamba_num_heads=8,
        mamba_head_dim=64, ssm_state_size=64, n_groups=2, conv_kernel=4,
        layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp",
                           "linear_attention"])),
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(
        **WIDE, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        attn_layer_indices=[2, 5], mamba_n_heads=8, mamba_d_head=64, mamba_d_state=64, mamba_n_groups=2,
        mamba_d_conv=4)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        **WIDE, intermediate_size=128, shared_intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2, mamba_n_heads=8, mamba_d_head=64,
        mamba_d_state=64, mamba_n_groups=2, mamba_d_conv=4, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.015625, logits_scaling=4.0)),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        **WIDE, num_hidden_layers=6, num_heads=8, head_dim=64, state_size=64, n_groups=2, conv_kernel=4)),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        **WIDE, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["conv", "conv", "full_attention"] * 2)),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
        **WIDE, intermediate_size=512, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
        num_dense_layers=1, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["conv", "conv", "full_attention"] * 2)),
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(**WIDE, num_hidden_layers=6, state_size=16, conv_kernel=4)),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(
        **WIDE, num_hidden_layers=6, state_size=16, conv_kernel=4)),
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(
        **WIDE, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        attn_layer_period=3, attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, num_experts=8,
        num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2)),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
        **WIDE, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        pad_token_id=None, eos_token_id=None,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2)),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        **WIDE, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, moe_intermediate_size=128,
        num_local_experts=8, num_experts_per_tok=2, linear_attn_config=dict(head_dim=64, num_heads=4,
                                                                            short_conv_kernel_size=4),
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2)),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM", dict(
        **WIDE, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, head_dim=64,
        moe_intermediate_size=128, num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, layer_group_size=3, pad_token_id=None, eos_token_id=None)),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(
        **WIDE, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_local_experts=8, num_experts_per_tok=2,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2)),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(  # every layer Mamba2 beside attention
        **WIDE, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        mamba_d_ssm=512, mamba_n_heads=8, mamba_d_state=64, mamba_n_groups=2, mamba_d_conv=4, mamba_rms_norm=True,
        embedding_multiplier=5.0, lm_head_multiplier=0.05, key_multiplier=0.4, mlp_multipliers=[0.8, 0.3],
        ssm_multipliers=[0.3, 0.2, 0.5, 0.5, 0.6])),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", dict(  # two shared blocks over three hybrid layers, adapters
        **WIDE, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8, n_mamba_heads=8, mamba_d_state=64,
        mamba_ngroups=2, mamba_d_conv=4, num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=16,
        use_mem_rope=True, layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "mamba", "hybrid"])),
    "recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", dict(  # HF's cycle, MQA, as published
        **WIDE, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
        lru_width=256)),
}


def _checkpoint(model_type: str, directory: Path):
    import transformers

    config_class, model_class, fields = CHECKPOINTS[model_type]
    torch.manual_seed(0)
    hf = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random weights, decays kept in their usual range
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif not name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.ndim == 1 else p.shape[-1] ** -0.5))
    hf.save_pretrained(directory)
    return hf


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _round_costs(model, repeats: int) -> dict:
    """Medians over `repeats` of: decode (1 token + commit), verify (5 + commit of 3), and the commit alone."""
    ids = torch.arange(40) % model.config.vocab_size
    decode, verify, commit, staged = [], [], [], 0
    state = model.new_state()
    model(ids[:32], state)
    state.commit(32)
    for r in range(repeats + 2):  # two warm-up rounds
        d = _seconds(lambda: (model(ids[r:r + 1], state), state.commit(1)))
        forward = _seconds(lambda: model(ids[r:r + 5], state))
        staged = state.staged_bytes()
        c = _seconds(lambda: state.commit(3))
        if r >= 2:
            decode.append(d)
            verify.append(forward + c)
            commit.append(c)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head = sum(t.numel() * t.element_size() for t in (state.recurrent.conv, state.recurrent.state))
    return {"verify_over_decode": statistics.median(verify) / statistics.median(decode),
            "staged_kib": staged / 1024, "commit_share": statistics.median(commit) / statistics.median(verify),
            "state_over_weights": head / weights}


def families(quick: bool) -> list[dict]:
    repeats, new_tokens = (3, 32) if quick else (5, 64)
    rows = []
    for model_type in CHECKPOINTS:
        with tempfile.TemporaryDirectory() as tmp:
            hf = _checkpoint(model_type, Path(tmp))
            ours = load_model(tmp)
        prompt = (torch.arange(16) * 7 % ours.config.vocab_size).tolist()
        ids = torch.tensor([prompt])

        def run_ours() -> list[int]:
            return generate(ours, prompt, new_tokens).token_ids

        def run_hf() -> list[int]:
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False)
            return out[0, len(prompt):].tolist()

        same = run_ours() == run_hf()  # and both warmed
        ours_s, hf_s = [], []
        for _ in range(repeats):  # alternated
            ours_s.append(_seconds(run_ours))
            hf_s.append(_seconds(run_hf))
        ours_tps, hf_tps = new_tokens / statistics.median(ours_s), new_tokens / statistics.median(hf_s)
        rows.append({"model_type": model_type, "state_kind": ours.config.state_spec.recurrent.kind,
                     "ours_tok_s": ours_tps, "hf_tok_s": hf_tps, "over_hf": ours_tps / hf_tps,
                     "over_hf_range": (min(hf_s) / max(ours_s), max(hf_s) / min(ours_s)), "identical": same,
                     **_round_costs(ours, 4 * repeats)})
    return rows


def print_rows(rows: list[dict]) -> None:
    print("\nFamilies: target-only greedy against HF generate() on the same random checkpoint (medians, alternated)")
    print(f"{'model_type':<16} {'kind':<9} {'ours tok/s':>10} {'HF tok/s':>9} {'x HF':>6} {'range':>11} "
          f"{'verify5/decode':>14} {'staged KiB':>10} {'commit %':>8} {'state/weights %':>15} same")
    for r in rows:
        low, high = r["over_hf_range"]
        print(f"{r['model_type']:<16} {r['state_kind']:<9} {r['ours_tok_s']:>10.1f} {r['hf_tok_s']:>9.1f} "
              f"{r['over_hf']:>6.2f} {low:>5.2f}-{high:<5.2f} {r['verify_over_decode']:>14.2f} "
              f"{r['staged_kib']:>10.1f} {100 * r['commit_share']:>8.2f} {100 * r['state_over_weights']:>15.1f} "
              f"{r['identical']}")
