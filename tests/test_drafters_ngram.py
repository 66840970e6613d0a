"""N-gram (prompt lookup) drafting: what it proposes, and greedy output identical to target-only.

Rounds with zero drafts mixed with drafted rounds are the case that corrupts output elsewhere
(vLLM #39273): a repetitive prompt makes the drafter propose often, a random one rarely.
"""
import functools
import random

import pytest

from deltaspec.shared.decoding.drafters import make_drafter
from deltaspec.shared.decoding.drafters.ngram import NgramDrafter, lookup
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.checkpoint import hf_config, random_model

TARGET = random_model(hf_config(), seed=11)
N = 40


@functools.cache
def target_only(prompt: tuple[int, ...]) -> list[int]:
    return generate(TARGET, list(prompt), N).token_ids


def test_lookup_prefers_longest_then_latest():
    ctx = [1, 2, 3, 9, 2, 3, 7, 5, 1, 2, 3]
    assert lookup(ctx, 3, max_n=3, min_n=1) == [9, 2, 3]  # [1,2,3] recurs at 0
    assert lookup(ctx[:-1] + [8, 2, 3], 2, max_n=3, min_n=1) == [7, 5]  # [2,3]: latest earlier occurrence
    assert lookup([4, 5, 6], 4, max_n=3, min_n=1) == []  # nothing recurs
    assert lookup([7, 7, 7], 4, max_n=2, min_n=1) == [7]  # overlapping match, continuation cut at the end
    assert lookup([1, 2, 1], 0, max_n=2, min_n=1) == []


def test_drafter_follows_accepts_and_proposes_nothing_when_nothing_recurs():
    d = NgramDrafter(max_n=2)
    d.start([5, 6, 7])
    assert d.propose(4).tokens == []
    d.advance(0, 5)  # context 5 6 7 5
    assert d.propose(4).tokens == [6, 7, 5]
    d.advance(2, 9)  # 6, 7 accepted, then 9
    assert d.tokens == [5, 6, 7, 5, 6, 7, 9]
    assert d.propose(3).tokens == []


PROMPTS = {
    "repetitive": [10, 20, 30, 40, 10, 20, 30, 40, 10, 20, 30, 40, 10, 20],
    "code-like": list(b"for i in range(10):\n    x = i\nfor j in range(10):\n    y = "),
    "random": [random.Random(3).randrange(256) for _ in range(12)],
    "single": [42],
}


@pytest.mark.parametrize("k", [1, 3, 8], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("name", list(PROMPTS))
def test_ngram_greedy_equals_target_only(name, k):
    prompt = PROMPTS[name]
    want = target_only(tuple(prompt))
    result = generate(TARGET, prompt, N, make_drafter("ngram", TARGET), k)
    assert result.token_ids == want
    if name == "repetitive":
        assert result.stats.drafted > 0


def test_ngram_mixes_zero_and_drafted_rounds():
    """A random model on a repetitive prompt: some rounds draft (accepted or not), some draft nothing."""
    drafter = NgramDrafter()
    drafted = []
    orig = drafter.propose

    def spy(k):
        p = orig(k)
        drafted.append(len(p.tokens))
        return p

    drafter.propose = spy
    prompt = PROMPTS["repetitive"]
    assert generate(TARGET, prompt, N, drafter, 4).token_ids == target_only(tuple(prompt))
    assert 0 in drafted and any(drafted)
