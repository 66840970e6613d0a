"""How good a target/draft pair is, on text neither model trained on: the figures issue 12 asks of the
embedded pair.

* held-out loss: the target's cross-entropy in nats per byte on held-out standard-library text;
* repetition: the share of distinct 4-grams among all 4-grams of a long generation (1.0: no 4-gram
  repeats; a model caught in a loop such as `self._set_set_set` falls towards 0);
* acceptance: accepted / drafted at k drafts a round.

Generations go through the engine's `generate`, so they are what a user of the pair gets, for greedy
decoding and for sampled decoding (which speculative sampling keeps distribution-exact).
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.hybrid import HybridLM


def distinct_ngrams(ids: list[int], n: int = 4) -> float:
    """Distinct n-grams over all n-grams of `ids` (needs at least n ids)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    if not grams:
        raise ValueError(f"distinct_ngrams needs at least {n} ids, got {len(ids)}")
    return len(set(grams)) / len(grams)


def heldout_loss(model: HybridLM, texts: list[list[int]]) -> float:
    """Mean next-token cross-entropy (nats per token) of `model` over each text, read from its start."""
    total, count = 0.0, 0
    for ids in texts:
        logits, _ = model(torch.tensor(ids[:-1]), model.new_state(capacity=len(ids)))
        total += F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
    return total / count


def generation_quality(target: HybridLM, draft: HybridLM, prompts: list[list[int]], sampling: SamplingParams,
                       new_tokens: int = 256, k: int = 4) -> dict:
    """Speculative generations of `new_tokens` from each prompt: acceptance at k and repetition."""
    drafted = accepted = rounds = produced = 0
    distinct, samples = [], []
    for prompt in prompts:
        g = generate(target, prompt, new_tokens, ModelDrafter(draft, sampling), k, sampling)
        drafted, accepted = drafted + g.stats.drafted, accepted + g.stats.accepted
        rounds, produced = rounds + g.stats.rounds, produced + len(g.token_ids)
        distinct.append(distinct_ngrams(g.token_ids))
        samples.append(g.token_ids)
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "k": k, "new_tokens": new_tokens,
            "prompts": len(prompts), "acceptance_rate": accepted / max(drafted, 1),
            "mean_accepted_length": produced / max(rounds, 1), "distinct_4grams": statistics.mean(distinct),
            "distinct_4grams_min": min(distinct), "samples": samples}


def pair_quality(target: HybridLM, draft: HybridLM, prompts: list[list[int]], texts: list[list[int]],
                 settings: dict[str, SamplingParams], new_tokens: int = 256, k: int = 4) -> dict:
    """Held-out loss of both models on `texts`, and `generation_quality` under each named sampling setting."""
    return {"heldout_loss": {"target": heldout_loss(target, texts), "draft": heldout_loss(draft, texts),
                             "bytes": sum(len(t) for t in texts)},
            "generation": {name: generation_quality(target, draft, prompts, s, new_tokens, k)
                           for name, s in settings.items()}}
