"""Draft length from a cost model: k per round from what a round costs and what the session accepts.

A round of k drafts costs one target pass of k+1 tokens and k draft steps, and yields (1 - a^(k+1)) / (1 - a)
tokens at per-token acceptance a (each draft accepted with probability a until the first rejection, plus the
target's own token). Decoding alone (k = 0) yields one token per pass of one. `CostModelLength` picks the k with the
most tokens per second from pass costs measured on this machine (`PassCosts.measure`, at start-up) and the
acceptance the session has shown, down to 0 where no k pays: a MoE target whose verify reads many more experts than
a decode step, a batch large enough that the target is compute bound, a draft that has stopped matching. At k = 0 it
still proposes one draft every `PROBE_EVERY` rounds, so a session whose text turns predictable gets speculation back.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

PROBE_EVERY = 16  # rounds at k = 0 between one-draft probes of the acceptance


@dataclass(frozen=True)
class PassCosts:
    """Seconds of a target pass of T = 1..k_max+1 tokens (`target_s[T - 1]`) and of one draft step."""

    target_s: tuple[float, ...]
    draft_s: float

    @property
    def k_max(self) -> int:
        return len(self.target_s) - 1

    @classmethod
    def measure(cls, target, draft, k_max: int, repeats: int = 5) -> PassCosts:
        """Median pass times on a scratch state of each model (`HybridLM`s), every length in turn, after a warm-up."""
        states = {id(m): m.new_state() for m in (target, draft)}
        times: dict[int, list[float]] = {T: [] for T in range(1, k_max + 2)}
        draft_times: list[float] = []
        for repeat in range(repeats + 1):
            for T in times:
                times[T].append(_timed(target, states[id(target)], T))
            draft_times.append(_timed(draft, states[id(draft)], 1))
        return cls(tuple(statistics.median(times[T][1:]) for T in times), statistics.median(draft_times[1:]))


def _timed(model, state, T: int) -> float:
    ids = torch.arange(T, device=model.device) % model.config.vocab_size
    start = time.perf_counter()
    model(ids, state)
    elapsed = time.perf_counter() - start
    state.revert()
    return elapsed


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round of k drafts yields at per-token acceptance a: 1 + a + ... + a^k."""
    return sum(acceptance**i for i in range(k + 1))


def best_k(costs: PassCosts, acceptance: float) -> int:
    """The k in 0..k_max with the most tokens per second."""
    def rate(k: int) -> float:
        return expected_tokens(acceptance, k) / (costs.target_s[k] + k * costs.draft_s)
    return max(range(costs.k_max + 1), key=rate)


class CostModelLength:
    """Chooses k per round (`choose`) and learns the session's acceptance from each verdict (`observe`): accepted
    drafts over accepted drafts plus rounds ended by a rejection (the geometric model's estimate), from a prior of
    `prior` worth `prior_rounds` rounds."""

    def __init__(self, costs: PassCosts, prior: float = 0.5, prior_rounds: float = 2.0) -> None:
        self.costs = costs
        self.accepted = prior * prior_rounds
        self.rejected = (1 - prior) * prior_rounds
        self.idle = 0  # rounds at k = 0 since the last probe

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self) -> int:
        k = best_k(self.costs, self.acceptance)
        if k > 0:
            self.idle = 0
            return k
        self.idle += 1
        if self.idle >= PROBE_EVERY:
            self.idle = 0
            return 1
        return 0

    def observe(self, proposed: int, accepted: int) -> None:
        self.accepted += accepted
        self.rejected += accepted < proposed
