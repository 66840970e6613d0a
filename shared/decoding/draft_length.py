"""Draft length from a cost model: k per round from what a round costs and what the session accepts.

A round of k drafts costs one target pass of k+1 tokens and k draft steps, and yields (1 - a^(k+1)) / (1 - a)
tokens at per-token acceptance a (each draft accepted with probability a until the first rejection, plus the
target's own token). Decoding alone (k = 0) yields one token per pass of one. `CostModelLength` picks the k with the
most tokens per second from pass costs measured on this machine (`PassCosts.measure`, at start-up) and the
acceptance the session has shown, down to 0 where no k pays: a MoE target whose verify reads many more experts than
a decode step, a batch large enough that the target is compute bound, a draft that has stopped matching. At k = 0 it
still proposes one draft every `PROBE_EVERY` rounds, so a session whose text turns predictable gets speculation back.

In a server the same pass costs more per sequence or less as more sessions share it, so the target's passes are
measured at several batch sizes (`PassCosts.batched`) and each round reads the row of the batch it will join
(`CostModelLength`'s `batch_size`); a draft's step cost is what the session's own proposals took (a remote draft's
includes its network round trip), learned as rounds go.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltaspec.shared.model.batched import forward_batch

PROBE_EVERY = 16  # rounds at k = 0 between one-draft probes of the acceptance
COST_MODEL_K_MAX = 8  # the most drafts a server's cost model measures (and so picks) a round
DRAFT_COST_WEIGHT = 0.2  # weight of the latest round in the running draft step cost


@dataclass(frozen=True)
class PassCosts:
    """Seconds of a target pass of T = 1..k_max+1 tokens (`target_s[T - 1]`) and of one draft step; `batched`: the
    target's at other batch sizes, `(batch, target_s)` by increasing batch (each sequence passing T tokens)."""

    target_s: tuple[float, ...]
    draft_s: float
    batched: tuple[tuple[int, tuple[float, ...]], ...] = ()

    @property
    def k_max(self) -> int:
        return len(self.target_s) - 1

    def at(self, batch: int) -> PassCosts:
        """The costs one sequence sees in a pass of `batch` sequences: the smallest measured batch at least that
        large (a pass never costs less with more sequences), else the largest measured."""
        target_s = next((row for size, row in self.batched if size >= batch),
                        self.batched[-1][1] if self.batched else self.target_s)
        return PassCosts(target_s, self.draft_s)

    @classmethod
    def measure(cls, target, draft, k_max: int, repeats: int = 5, batches: tuple[int, ...] = ()) -> PassCosts:
        """Median pass times on scratch states of each model (`HybridLM`s; `draft` None: a draft step of 0 s until
        rounds show one), every length in turn, after a warm-up; at each of `batches` too (one batched pass over that
        many states)."""
        batched = tuple((size, target_pass_s(target, size, k_max, repeats)) for size in sorted(set(batches)))
        draft_s = target_pass_s(draft, 1, 0, repeats)[0] if draft is not None else 0.0
        single = dict(batched).get(1) or target_pass_s(target, 1, k_max, repeats)
        return cls(single, draft_s, batched)


def target_pass_s(model, batch: int, k_max: int, repeats: int) -> tuple[float, ...]:
    """Median seconds of a pass of T = 1..k_max+1 tokens for each of `batch` fresh states at once (the first of
    `repeats` + 1 rounds warms up)."""
    states = [model.new_state() for _ in range(batch)]
    times: dict[int, list[float]] = {T: [] for T in range(1, k_max + 2)}
    for _ in range(repeats + 1):
        for T in times:
            times[T].append(_timed(model, states, T))
    return tuple(statistics.median(times[T][1:]) for T in times)


def _timed(model, states: list, T: int) -> float:
    ids = torch.arange(T, device=model.device) % model.config.vocab_size
    start = time.perf_counter()
    forward_batch(model, [(ids, state) for state in states])
    elapsed = time.perf_counter() - start
    for state in states:
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
    """Chooses k per round (`choose`) and learns the session's acceptance and draft step cost from each round
    (`observe`): accepted drafts over accepted drafts plus rounds ended by a rejection (the geometric model's
    estimate), from a prior of `prior` worth `prior_rounds` rounds. `batch_size()`: sequences the next target pass
    will carry (a server's batcher); `k_max`: the most drafts a round may take (at most what `costs` measured)."""

    def __init__(self, costs: PassCosts, prior: float = 0.5, prior_rounds: float = 2.0,
                 batch_size: Callable[[], int] = lambda: 1, k_max: int | None = None) -> None:
        self.costs, self.batch_size = costs, batch_size
        self.k_max = costs.k_max if k_max is None else max(0, min(k_max, costs.k_max))
        self.accepted = prior * prior_rounds
        self.rejected = (1 - prior) * prior_rounds
        self.draft_s = costs.draft_s
        self.timed = False  # draft_s is still the prior (no round proposed anything yet)
        self.idle = 0  # rounds at k = 0 since the last probe

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self) -> int:
        if not self.k_max:
            return 0
        target_s = self.costs.at(self.batch_size()).target_s[:self.k_max + 1]
        k = best_k(PassCosts(target_s, self.draft_s), self.acceptance)
        if k > 0:
            self.idle = 0
            return k
        self.idle += 1
        if self.idle >= PROBE_EVERY:
            self.idle = 0
            return 1
        return 0

    def observe(self, proposed: int, accepted: int, propose_s: float | None = None) -> None:
        """A round's verdict: `accepted` of `proposed` drafts, which took `propose_s` seconds to get."""
        self.accepted += accepted
        self.rejected += accepted < proposed
        if proposed and propose_s is not None:
            step = propose_s / proposed
            self.draft_s = step if not self.timed else self.draft_s + DRAFT_COST_WEIGHT * (step - self.draft_s)
            self.timed = True
