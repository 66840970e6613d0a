"""Draft length from a cost model: the k it picks, what it learns from verdicts, and exactness whatever it picks."""
import pytest
import torch

from deltaspec.shared.decoding.draft_length import (PROBE_EVERY, CostModelLength, PassCosts, best_k,
                                                     expected_tokens)
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.checkpoint import hf_config, hf_moe_config, random_model

TARGET = random_model(hf_moe_config("qwen3_next"), seed=3).fuse()
DRAFT = random_model(hf_config(layer_types=["linear_attention", "full_attention"]), seed=4).fuse()
CHEAP = PassCosts(target_s=(1.0, 1.05, 1.1, 1.15, 1.2), draft_s=0.01)  # verify costs about what a decode does
DEAR = PassCosts(target_s=(1.0, 2.0, 3.0, 4.0, 5.0), draft_s=0.2)  # a verify costs a decode per token (and more)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_best_k_follows_costs_and_acceptance():
    assert best_k(CHEAP, 0.9) == 4 and best_k(CHEAP, 0.05) in (0, 1)
    assert best_k(DEAR, 0.99) == 0  # nothing pays when every drafted token costs a whole pass and a draft step
    middle = PassCosts(target_s=(1.0, 1.3, 1.6, 2.4, 3.2), draft_s=0.05)
    rates = {k: expected_tokens(0.8, k) / (middle.target_s[k] + k * middle.draft_s) for k in range(5)}
    assert best_k(middle, 0.8) == max(rates, key=rates.get)


def test_learns_the_sessions_acceptance_and_probes_at_zero():
    length = CostModelLength(PassCosts(target_s=(1.0, 1.5, 1.8, 2.1, 2.5), draft_s=0.05), prior=0.95)
    assert length.choose() == 4
    for _ in range(20):  # every round rejects its first draft (a round of k = 0 teaches nothing)
        length.observe(length.choose(), 0)
    assert length.acceptance < 0.5
    picks = [length.choose() for _ in range(2 * PROBE_EVERY)]
    # at k = 0, one draft every PROBE_EVERY rounds, to see whether acceptance came back
    probes = [i for i, k in enumerate(picks) if k]
    assert set(picks) == {0, 1} and len(probes) == 2 and probes[1] - probes[0] == PROBE_EVERY
    for _ in range(60):  # it did: every probe accepted
        length.observe(1, 1)
    assert length.acceptance > 0.7 and length.choose() > 1


@pytest.mark.parametrize("costs", [CHEAP, DEAR], ids=["cheap-verify", "dear-verify"])
def test_generation_equals_target_only_whatever_k_it_picks(costs):
    prompt = torch.randint(0, 257, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    want = generate(TARGET, prompt, 40).token_ids
    got = generate(TARGET, prompt, 40, ModelDrafter(DRAFT), CostModelLength(costs))
    assert got.token_ids == want
    if costs is DEAR:  # only the probes draft
        assert got.stats.drafted <= 40 // PROBE_EVERY + 1
    else:
        assert got.stats.drafted > 0


def test_pass_costs_measured_for_every_length():
    costs = PassCosts.measure(TARGET, DRAFT, k_max=3, repeats=2)
    assert costs.k_max == 3 and all(t > 0 for t in costs.target_s) and costs.draft_s > 0
