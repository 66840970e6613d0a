"""N-gram drafting (prompt lookup): no model, the context proposes its own continuation.

For n from `max_n` down to `min_n`, find the most recent earlier occurrence of the context's
last n tokens and propose the k tokens that followed it (Saxena 2023, "prompt lookup decoding";
vLLM's `ngram` proposer). When no suffix recurs the proposal is empty: the round then verifies
only the pending token, which is plain target-only decoding. Proposals are deterministic, so
`probs` is None and rejection sampling treats q as one-hot on each draft token.
"""
from __future__ import annotations

from deltaspec.shared.decoding.drafters import Proposal


def lookup(context: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest recurring suffix."""
    L = len(context)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = context[L - n:]
        for start in range(L - n - 1, -1, -1):  # latest occurrence that ends before the suffix does
            if context[start:start + n] == suffix:
                return context[start + n:start + n + k]
    return []


class NgramDrafter:
    def __init__(self, max_n: int = 4, min_n: int = 1, window: int = 4096) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n, self.window = max_n, min_n, window
        self.tokens: list[int] = []
        self.proposed: list[int] = []

    def start(self, prompt_ids: list[int]) -> None:
        self.tokens, self.proposed = list(prompt_ids), []

    def propose(self, k: int) -> Proposal:
        self.proposed = lookup(self.tokens[-self.window:], k, self.max_n, self.min_n) if k > 0 else []
        return Proposal(list(self.proposed))

    def advance(self, accepted: int, next_token: int) -> None:
        self.tokens += [*self.proposed[:accepted], next_token]
        self.proposed = []
