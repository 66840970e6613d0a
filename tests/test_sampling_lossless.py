"""Speculative sampling is lossless: the first tokens are distributed exactly as the target alone draws them.

Over many seeded runs on tiny random models (vocabulary 16, so every cell of the test is populated; a dense
Qwen3.5 target and a Qwen3-Next MoE one with its MTP head, and a Mamba2, a short-conv, a Mamba1, a KDA and a
lightning-attention target, one of each other state kind), the empirical distribution of the first three generated tokens, taken as the marginal of t1, the joint
of (t1, t2) and the marginal of t3, is compared with the target's exact distribution, computed
from its logits (p(t1), p(t2 | t1), p(t3 | t1, t2) after temperature, top-k and top-p) rather
than sampled. The test is a G-test (likelihood-ratio chi-square; cells with expected count
below 5 pooled), each of the three rejecting at significance ALPHA = 1e-3. The same tests catch two
deliberately wrong acceptance rules. Seeds are fixed, so each test's verdict is deterministic.
Run counts are sized for power on this 2-core machine: at 300 runs the subtler wrong rule gives
p ~ 1e-5 on t1 (and ~3e-2 at 150), accept-always p < 1e-15 at 100.
"""
import functools

import pytest
import torch

from deltaspec.shared.decoding import target as target_module
from deltaspec.shared.decoding.drafters import make_drafter
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.drafters.mtp import MTPDrafter, MTPHead, random_mtp_weights
from deltaspec.shared.decoding.sampling import SamplingParams, draw, probabilities
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.decoding.verify import Verdict
from deltaspec.shared.model.checkpoint import hf_config, hf_moe_config, random_model

ALPHA = 1e-3
RUNS = 200  # per drafter; the test's size (false-alarm rate) does not depend on it, its power does
WRONG_RUNS = {"accept_always": 100, "resample_from_target": 300}
V = 16
SHAPE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
             linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"], eos_token_id=None)
CFG = hf_config(**SHAPE)
MOE_CFG = hf_moe_config("qwen3_next", **SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16)


def with_mtp(config: dict, seed: int):
    model = random_model(config, seed=seed)
    model.mtp = random_mtp_weights(model.config, 1, seed=seed + 3)
    return model


# one target of each other state kind: Mamba2 (`ssd`, Nemotron-H), a short conv (`conv`, LFM2), Mamba1 (`mamba`,
# FalconMamba: its norms on dt, B and C too)
SSD_CFG = dict(model_type="nemotron_h", vocab_size=V, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
               head_dim=16, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1,
               conv_kernel=4, layers_block_type=["linear_attention", "full_attention", "mlp"])
CONV_CFG = dict(model_type="lfm2", vocab_size=V, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=64, block_auto_adjust_ff_dim=False, conv_L_cache=3, num_hidden_layers=2,
                layer_types=["conv", "full_attention"])
MAMBA_CFG = dict(model_type="falcon_mamba", vocab_size=V, hidden_size=16, num_hidden_layers=2, state_size=6,
                 conv_kernel=3)
# KDA beside latent attention (`kda`, Kimi Linear), lightning attention (`lightning`, MiniMax), the RG-LRU beside
# local attention (`rglru`, RecurrentGemma: a window of 4 positions)
KDA_CFG = dict(model_type="kimi_linear", vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=2, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
               intermediate_size=32, linear_attn_config=dict(head_dim=8, num_heads=2, short_conv_kernel_size=3),
               num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, eos_token_id=None,
               layer_types=["linear_attention", "full_attention"])
LIGHTNING_CFG = dict(model_type="minimax", vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=4,
                     num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"])
RGLRU_CFG = dict(model_type="recurrent_gemma", vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, intermediate_size=64, lru_width=32, attention_window_size=4,
                 block_types=["recurrent", "attention"], eos_token_id=None)
TARGETS = {"dense": with_mtp(CFG, 1), "moe": with_mtp(MOE_CFG, 5), "ssd": random_model(SSD_CFG, seed=11),
           "conv": random_model(CONV_CFG, seed=12), "mamba": random_model(MAMBA_CFG, seed=13),
           "kda": random_model(KDA_CFG, seed=14), "lightning": random_model(LIGHTNING_CFG, seed=15),
           "rglru": random_model(RGLRU_CFG, seed=16)}
TARGET = TARGETS["dense"]
HEADS = {name: MTPHead(TARGETS[name]) for name in ("dense", "moe")}
DRAFT = random_model(CFG, seed=2)  # a different model: q differs from p, so both accepts and rejections occur
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so the n-gram drafter proposes in the first round
T1 = SamplingParams(temperature=1.0)
FILTERED = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)

DRAFTERS = {  # (target name, sampling) -> drafter
    "model": lambda t, s: ModelDrafter(DRAFT, s),
    "model-stop": lambda t, s: ModelDrafter(DRAFT, s, stop_below=0.35),  # proposals end where the draft is unsure
    "ngram": lambda t, s: make_drafter("ngram", TARGETS[t], s),
    "mtp": lambda t, s: MTPDrafter(TARGETS[t], s, HEADS[t]),
}


def target_probs(target: str, prefix: list[int], sampling: SamplingParams) -> torch.Tensor:
    model = TARGETS[target]
    logits, _ = model(torch.tensor(PROMPT + prefix), model.new_state())
    return probabilities(logits[-1], sampling).double()


@functools.cache
def exact_distributions(target: str, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint of (t1, t2) `(V, V)` and marginal of t3 `(V,)`, from the target's logits."""
    p1 = target_probs(target, [], sampling)
    joint = torch.stack([p1[a] * target_probs(target, [a], sampling) for a in range(V)])
    p3 = torch.zeros(V, dtype=torch.float64)
    for a in range(V):
        for b in range(V):
            if joint[a, b] > 0:
                p3 += joint[a, b] * target_probs(target, [a, b], sampling)
    return joint, p3


def sample(drafter_name: str, sampling: SamplingParams, runs: int = RUNS, k: int = 2,
           target: str = "dense") -> tuple[torch.Tensor, dict]:
    """`runs` seeded generations of 3 tokens: (runs, 3) tokens, and totals of drafted / accepted tokens."""
    out, totals = [], {"drafted": 0, "accepted": 0, "rounds": 0}
    for seed in range(runs):
        s = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed)
        result = generate(TARGETS[target], PROMPT, 3, DRAFTERS[drafter_name](target, s), k, s)
        out.append(result.token_ids)
        totals["drafted"] += result.stats.drafted
        totals["accepted"] += result.stats.accepted
        totals["rounds"] += result.stats.drafts
    return torch.tensor(out), totals


def g_test(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed `counts` under `probs` (same shape); cells expected below 5 are pooled."""
    counts, expected = counts.flatten().double(), probs.flatten().double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    if (obs[~keep] > 0).any():
        return 0.0  # a token the target never draws
    obs, exp = obs[keep], exp[keep]
    assert len(obs) > 1, "every cell expected below 5: too few runs for this distribution to test anything"
    g = 2 * float((obs[obs > 0] * (obs[obs > 0] / exp[obs > 0]).log()).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(g / 2)))


def p_values(tokens: torch.Tensor, sampling: SamplingParams, target: str = "dense") -> tuple[float, float, float]:
    """G-test p-values of t1, of (t1, t2) jointly, and of t3."""
    joint, p3 = exact_distributions(target, sampling)
    joint_counts = torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V).view(V, V)
    return (g_test(joint_counts.sum(1), joint.sum(1)), g_test(joint_counts, joint),
            g_test(torch.bincount(tokens[:, 2], minlength=V), p3))


@pytest.mark.parametrize("target, drafter, sampling",
                         [("dense", "model", T1), ("dense", "model-stop", T1), ("dense", "ngram", T1),
                          ("dense", "mtp", FILTERED), ("moe", "model", T1), ("moe", "mtp", FILTERED),
                          ("ssd", "model", T1), ("conv", "model", FILTERED), ("mamba", "model", T1),
                          ("kda", "model", T1), ("lightning", "model", FILTERED), ("rglru", "model", T1)],
                         ids=["model-T1", "model-stop_below-T1", "ngram-T1", "mtp-T0.8-topk10-topp0.9",
                              "moe-model-T1", "moe-mtp-T0.8-topk10-topp0.9", "ssd-model-T1",
                              "conv-model-T0.8-topk10-topp0.9", "mamba-model-T1", "kda-model-T1",
                              "lightning-model-T0.8-topk10-topp0.9", "rglru-model-T1"])
def test_speculative_sampling_matches_target(target, drafter, sampling):
    tokens, totals = sample(drafter, sampling, target=target)
    assert 0 < totals["accepted"] < totals["drafted"], totals  # both accepts and rejections happened
    if drafter == "model-stop":  # some proposals stopped short of k = 2, some did not
        assert totals["rounds"] < totals["drafted"] < 2 * totals["rounds"], totals
    p = p_values(tokens, sampling, target)
    assert min(p) > ALPHA, p


def accept_always(target_probs, drafts, draft_probs, generator):
    return Verdict(len(drafts), draw(target_probs[len(drafts)], generator))


def resample_from_target(target_probs, drafts, draft_probs, generator):
    """Right acceptance test, wrong recovery: on rejection draws from p instead of max(0, p - q)."""
    for i, token in enumerate(drafts):
        p = target_probs[i]
        q = draft_probs[i] if draft_probs is not None else torch.nn.functional.one_hot(torch.tensor(token), len(p))
        if float(torch.rand((), generator=generator)) >= min(1.0, float(p[token]) / max(float(q[token]), 1e-30)):
            return Verdict(i, draw(p, generator))
    return Verdict(len(drafts), draw(target_probs[len(drafts)], generator))


@pytest.mark.parametrize("rule", [accept_always, resample_from_target], ids=lambda f: f.__name__)
def test_wrong_acceptance_rule_is_caught(rule, monkeypatch):
    monkeypatch.setattr(target_module, "accept_rejection", rule)
    tokens, _ = sample("model", T1, WRONG_RUNS[rule.__name__])
    p = p_values(tokens, T1)
    assert min(p) < ALPHA, p


@pytest.mark.parametrize("drafter", ["none", *DRAFTERS])
def test_same_seed_same_tokens(drafter):
    factory = DRAFTERS.get(drafter, lambda t, s: None)
    runs = [generate(TARGET, PROMPT, 12, factory("dense", s), 3, s).token_ids
            for s in (SamplingParams(1.0, seed=7), SamplingParams(1.0, seed=7), SamplingParams(1.0, seed=8))]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_g_test_itself():
    probs = torch.full((V,), 1 / V, dtype=torch.float64)
    assert g_test(torch.full((V,), 100), probs) == pytest.approx(1.0)
    skewed = torch.full((V,), 100)
    skewed[0] = 200
    assert g_test(skewed, probs) < 1e-6
    assert g_test(torch.tensor([10, 1]), torch.tensor([1.0, 0.0])) == 0.0  # a token the target never draws
