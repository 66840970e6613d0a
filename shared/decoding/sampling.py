"""Turning logits into the distribution a token is drawn from, and drawing it.

Both sides of speculative decoding use the same `SamplingParams` so that the draft's q and the
target's p are comparable. Temperature 0 means greedy: p is the one-hot argmax.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from deltaspec.shared.errors import InvalidArgument

# The smallest positive temperature: float32 logits of a few hundred divided by it stay finite, so the softmax
# never sees inf - inf. Below it (1e-300, subnormals) a request is refused; 0 means greedy.
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < math.inf:  # also refuses NaN
            raise InvalidArgument(f"temperature must be finite and >= 0, got {self.temperature}",
                                  "sampling.temperature")
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # logits / temperature would overflow to inf, softmax to NaN
            raise InvalidArgument(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got "
                                  f"{self.temperature:g}", "sampling.temperature")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}", "sampling.top_k")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}", "sampling.top_p")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, position: int, stream: int = 0) -> torch.Generator:
        """Random draws keyed by (seed, stream, position), not by how many draws came before.

        A round's draws then depend only on where it starts, so a session recreated from its
        committed history (after a restart) draws exactly what the lost one would have.
        Streams keep the target's and each drafter's draws apart.
        """
        return torch.Generator().manual_seed(hash((self.seed, stream, position)) & (2**63 - 1))


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """`(..., V)` float32 logits -> `(..., V)` probabilities after temperature, top-k and top-p."""
    if params.greedy:  # a scatter: `one_hot` checks its input's range first (two more calls and host reads)
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p >= params.top_p  # keep the smallest prefix reaching top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: Tensor, generator: torch.Generator) -> int:
    """One token from a 1-D distribution; deterministic for a given generator state."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
