"""The cost model's k against every fixed k on simulated rounds: what its estimates do, free of a host's noise.

Each case draws a round's verdict from a known acceptance (`Iid`: each draft kept with probability a until the
first rejection; `Runs`: the first draft kept with p, each next one with c, as n-gram lookup behaves; `Alternating`:
one in even sessions, another in odd ones, a draft whose quality changes with the prompt) and charges it
the pass costs of one of three measured shapes (`COSTS`: the embedded pair served with its remote draft's round
trip, overlapped by pipelining; n-gram lookup, free; the bench's MoE target with an in-process draft model). A run
is `GENERATIONS` generations of `TOKENS` tokens, each with a fresh `CostModelLength` on one server-wide `Tally`,
probes included, and the unverified shadow drafts a round at k = 0 asks for where drafting is free (n-gram lookup),
each taught at once as the tokens it guessed were emitted (served, they are taught over the next rounds). The
row: the cost model's tokens per simulated second over the best fixed k's (k = 0..8), median of `SEEDS` seeds.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from deltaspec.shared.decoding.draft_length import CostModelLength, PassCosts, Tally

MS = 1e-3
COSTS = {  # target passes of T = 1..9 tokens, then a draft step (and a remote draft's round trip)
    "pair": PassCosts(tuple(t * MS for t in (4.0, 5.6, 5.7, 5.8, 6.0, 6.1, 6.3, 6.4, 6.5)), 0.61 * MS,
                      draft_fixed_s=3.0 * MS),
    "ngram": PassCosts(tuple(t * MS for t in (4.0, 5.6, 5.7, 5.8, 6.0, 6.1, 6.3, 6.4, 6.5)), 0.01 * MS),
    "moe": PassCosts(tuple(t * MS for t in (5.5, 8.7, 9.8, 10.9, 12.0, 13.2, 14.3, 15.4, 16.5)), 0.9 * MS),
}
GENERATIONS, TOKENS, SEEDS = 60, 64, 5


@dataclass(frozen=True)
class Iid:
    a: float

    def kept(self, k: int, rng: random.Random) -> int:
        n = 0
        while n < k and rng.random() < self.a:
            n += 1
        return n

    @property
    def guess(self) -> float:  # the draft's guess of the token after a round kept whole
        return self.a


@dataclass(frozen=True)
class Runs:
    p: float
    c: float

    def kept(self, k: int, rng: random.Random) -> int:
        if not k or rng.random() > self.p:
            return 0
        n = 1
        while n < k and rng.random() < self.c:
            n += 1
        return n

    @property
    def guess(self) -> float:
        return self.c


@dataclass(frozen=True)
class Alternating:
    """A draft whose quality changes between sessions: `good` for even generations, `bad` for odd ones."""
    good: Iid | Runs
    bad: Iid | Runs

    def session(self, generation: int) -> Iid | Runs:
        return self.bad if generation % 2 else self.good


Draft = Iid | Runs | Alternating


def session_draft(draft: Draft, generation: int) -> Iid | Runs:
    return draft.session(generation) if isinstance(draft, Alternating) else draft


CASES = [("pair", True, Iid(0.96)), ("pair", True, Iid(0.9)), ("pair", True, Iid(0.8)), ("pair", True, Iid(0.75)),
         ("pair", True, Iid(0.65)), ("pair", True, Iid(0.5)), ("pair", True, Iid(0.0)), ("pair", True, Runs(0.4, 0.95)),
         ("ngram", False, Runs(0.3, 0.95)), ("ngram", False, Runs(0.5, 0.9)), ("ngram", False, Runs(0.1, 0.8)),
         ("ngram", False, Iid(0.6)), ("ngram", False, Alternating(Runs(0.7, 0.9), Iid(0.1))),
         ("moe", False, Iid(0.95)), ("moe", False, Iid(0.8)), ("moe", False, Iid(0.75)), ("moe", False, Iid(0.7)),
         ("moe", False, Iid(0.0)), ("moe", False, Runs(0.5, 0.9)), ("moe", False, Alternating(Iid(0.9), Iid(0.0)))]


def run(costs: PassCosts, source: Draft, k: int | None, overlapped: bool, seed: int) -> tuple[float, float]:
    """(tokens per simulated second, mean drafts a round) at fixed `k`, or (None) the cost model's."""
    rng, seconds, tokens, ks, tally = random.Random(seed), 0.0, 0, [], Tally()
    for generation in range(GENERATIONS):
        draft = session_draft(source, generation)
        model = CostModelLength(costs, tally=tally, overlapped=overlapped) if k is None else None
        made = 0
        while made < TOKENS:
            drafts = min(model.choose() if model else k, TOKENS - made - 1)  # type: ignore[arg-type]
            shadow = min(model.shadow_k(), TOKENS - made - 1) if model and not drafts else 0
            if shadow:  # unverified drafts (free ones: n-gram lookup), checked against the tokens emitted next
                matched = draft.kept(shadow, rng)
                model.shadow([0] * shadow, shadow)
                model.emitted([0] * matched + [1] * (matched < shadow))
            kept = draft.kept(drafts, rng)
            hidden = overlapped and drafts and kept == drafts and rng.random() < draft.guess
            seconds += costs.target_s[drafts] + (costs.draft_fixed_s + drafts * costs.draft_s
                                                 if drafts and not hidden else 0.0)
            if model:
                model.observe(drafts, kept)
            made += kept + 1
            tokens += kept + 1
            ks.append(drafts)
    return tokens / seconds, sum(ks) / len(ks)


def simulate(cases: list = CASES) -> list[dict]:
    rows = []
    for name, overlapped, draft in cases:
        costs = COSTS[name]
        fixed = {k: statistics.median(run(costs, draft, k, overlapped, seed)[0] for seed in range(SEEDS))
                 for k in range(costs.k_max + 1)}
        best = max(fixed, key=fixed.get)  # type: ignore[arg-type]
        model = [run(costs, draft, None, overlapped, seed) for seed in range(SEEDS)]
        rows.append({"costs": name, "draft": repr(draft), "best_fixed_k": best,
                     "cost_vs_best": statistics.median(rate for rate, _ in model) / fixed[best],
                     "mean_k": statistics.median(k for _, k in model)})
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"simulated rounds ({GENERATIONS} generations of {TOKENS} tokens a run, median of {SEEDS} seeds; "
          "benchmarks/cost_model_sim.py):")
    width = max(len(r["draft"]) for r in rows)
    print(f"{'costs':>6} {'acceptance':>{width}} {'best fixed k':>12} {'cost / best':>11} {'mean k':>6}")
    for r in rows:
        print(f"{r['costs']:>6} {r['draft']:>{width}} {r['best_fixed_k']:>12} {r['cost_vs_best']:>11.3f} "
              f"{r['mean_k']:>6.2f}")


if __name__ == "__main__":
    print_rows(simulate())
