"""Draft length from a cost model: k per round from what a round costs and what the session accepts.

A round of k drafts costs one target pass of k+1 tokens and k draft steps, and yields (1 - a^(k+1)) / (1 - a)
tokens at per-token acceptance a (each draft accepted with probability a until the first rejection, plus the
target's own token). Decoding alone (k = 0) yields one token per pass of one. `CostModelLength` picks the k with the
most tokens per second from pass costs measured on this machine (`PassCosts.measure`, at start-up) and the
acceptance the session has shown, down to 0 where no k pays: a MoE target whose verify reads many more experts than
a decode step, a batch large enough that the target is compute bound, a draft that has stopped matching. At k = 0 it
still proposes one draft after `PROBE_EVERY` rounds, so a session whose text turns predictable gets speculation back.
Each probe rejected doubles the wait for the next, and a probe that cost more than a decode step by much (a remote
draft reopening its session) spaces the next ones so that probing takes at most `PROBE_SHARE` of the rounds' time,
up to `MAX_PROBE_EVERY` rounds: a draft that never matches costs ever fewer probes.

In a server the same pass costs more per sequence or less as more sessions share it, so the target's passes are
measured at several batch sizes (`PassCosts.batched`) and each round reads the row of the batch it will join
(`CostModelLength`'s `batch_size`); what drafting costs is measured too, per step and, for a remote draft, per round
(its network round trip).
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from deltaspec.shared.model.batched import forward_batch

PROBE_EVERY = 4  # rounds at k = 0 before a one-draft probe of the acceptance (after an accepted probe): one bad
# round must not stop a good draft for long, and a useless one's probes double their spacing at each rejection
MAX_PROBE_EVERY = 256  # the longest wait, after rejected or dear probes
PROBE_SHARE = 0.01  # at most this share of the rounds' time goes to probes' extra cost
COST_MODEL_K_MAX = 8  # the most drafts a server's cost model measures (and so picks) a round
NEAR_BEST = 0.97  # a k whose expected gain over decoding is within 3 % of the best one's counts as good as it
PRIOR, PRIOR_ROUNDS = 0.9, 8.0  # a fresh session's acceptance, worth eight rounds: a draft someone chose is likely
# good, and starting low costs a good draft several short rounds while starting high costs a bad one one long round
SHADOW_SHARE = 0.01  # at k = 0, unverified drafts are asked for where they cost at most this share of a decode step
RUN_PRIOR = 4.0  # rounds' worth of the server's run acceptance the drafts after a round's first start from
DOUBT = 1.0  # standard errors of benefit of the doubt a drafting session gets before it stops (`_may_pay`)
START_DOUBT = 0.5  # standard errors below the estimate where drafting must still pay to start a session whose
# rounds at k = 0 keep teaching (unverified drafts, `_may_start`)
UNLIKELY = 0.01  # ... unless its last rounds all missed, which its estimate before them gave less chance than this
KEEP = 0.9  # weight of a session's past at each drafted round: its acceptance follows the last ten rounds or so
Situation = tuple[int, bool]  # the next batch, whether others verify in it
T = TypeVar("T")


@dataclass(frozen=True)
class PassCosts:
    """Seconds of a target pass of T = 1..k_max+1 tokens (`target_s[T - 1]`) and of one draft step; `batched`: the
    target's at other batch sizes, `(batch, target_s)` by increasing batch (each sequence passing T tokens)."""

    target_s: tuple[float, ...]
    draft_s: float
    batched: tuple[tuple[int, tuple[float, ...]], ...] = ()
    draft_fixed_s: float = 0.0  # what a round that drafts costs besides its steps (a remote draft's round trip)
    others: int = 0  # sequences sharing the pass, one token each: `target_s[k]` is then the pass with k more

    @property
    def k_max(self) -> int:
        return len(self.target_s) - 1

    @functools.lru_cache(maxsize=64)  # asked every round (`CostModelLength`): a few batch sizes, computed once each
    def at(self, batch: int, verifying: bool = False) -> PassCosts:
        """What one sequence's drafts cost in a pass it shares with others (`batch` in all: the smallest measured
        batch at least that large, else the largest): its k drafts add k tokens to a pass whose others decode one
        token each, costed as the measured pass of 1 + k/batch tokens a sequence (interpolated). The shared pass
        decides: drafts pay where their tokens are worth the time they add to everyone's pass. Where a pass's time
        grows with its tokens in a line, this is exactly the rule for every sequence drafting k (the measured row);
        where the first extra token costs most (a decode pass is cheaper than any verify), the first session to
        draft is not charged the whole batch's step up. `verifying`: others in the pass verify drafts, so it runs
        as a verify whatever this sequence adds, and its k drafts cost only their share of the verify line (from the
        pass of 2 tokens a sequence on): the step up is paid once a pass, not per drafting sequence (the embedded
        target, 8 sequences: 7.1 ms all decoding, 9.1 ms with one of them verifying 2 tokens, 9.3 ms all of them)."""
        if not self.batched:
            return self
        size, row = next(((size, row) for size, row in self.batched if size >= batch), self.batched[-1])
        start = size if verifying and size > 1 else 0

        def shared(k: int) -> float:
            whole, part = divmod(k, size)
            below, above = row[min(whole, len(row) - 1)], row[min(whole + 1, len(row) - 1)]
            return below + part / size * (above - below)
        return PassCosts(tuple(shared(start + k) for k in range(len(row))), self.draft_s,
                         draft_fixed_s=self.draft_fixed_s, others=size - 1)

    @classmethod
    def measure(cls, target, draft, k_max: int, repeats: int = 5, batches: tuple[int, ...] = ()) -> PassCosts:
        """Median pass times on scratch states of each model (`HybridLM`s; `draft` None: no draft model to time, 0 s,
        as for a server, which times its drafter with `drafting_cost`), every length in turn, after a warm-up; at
        each of `batches` too (one batched pass over that many states)."""
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
    return smoothed([statistics.median(times[T][1:]) for T in times])


def smoothed(medians: list[float]) -> tuple[float, ...]:
    """Pass times by T = 1, 2, ... as a line through the verify passes (T >= 2; the robust Theil-Sen fit, never
    falling), the decode pass at most its start: one pass slowed by a busy machine at start-up would otherwise
    move the cost model's choice for the server's whole life."""
    if len(medians) < 4:
        return tuple(min(medians[i:]) for i in range(len(medians)))  # a pass of more tokens never costs less
    points = list(enumerate(medians[1:], start=2))
    slope = max(0.0, statistics.median((tj - ti) / (j - i) for n, (i, ti) in enumerate(points)
                                       for j, tj in points[n + 1:]))
    intercept = statistics.median(t - slope * T for T, t in points)
    line = [intercept + slope * T for T, _ in points]
    return (min(medians[0], line[0]), *line)


def _timed(model, states: list, T: int) -> float:
    ids = torch.arange(T, device=model.device) % model.config.vocab_size
    start = time.perf_counter()
    forward_batch(model, [(ids, state) for state in states])
    elapsed = time.perf_counter() - start
    for state in states:
        state.revert()
    return elapsed


Acceptance = float | Sequence[float]  # one a for every draft, or a_i for the i-th given the ones before were kept


def _runs(acceptance: Acceptance, n: int) -> list[float]:
    """a_1, a_1 a_2, ..., a_1 ... a_n: the chance that the first 1, 2, ..., n drafts are all kept."""
    if isinstance(acceptance, (int, float)):
        per_draft = [float(acceptance)] * n
    else:
        per_draft = [acceptance[min(i, len(acceptance) - 1)] for i in range(n)]
    return list(itertools.accumulate(per_draft, operator.mul))


def expected_tokens(acceptance: Acceptance, k: int) -> float:
    """Tokens a round of k drafts yields: 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k (one a for every draft: the
    geometric sum 1 + a + ... + a^k)."""
    return 1.0 + sum(_runs(acceptance, k))


def round_s(costs: PassCosts, acceptance: Acceptance, k: int, overlapped: bool = False) -> float:
    """Seconds a round of k drafts costs: the target's pass of k + 1 tokens and the drafting. In a pipelined loop
    (`overlapped`) a round's proposal is made while the round before is verified, and is used when that round keeps
    every draft and the draft guessed its next token (a_1 ... a_(k+1)); only the other rounds wait for it."""
    return _round_s(costs, k, _runs(acceptance, k + 1)[k] if overlapped else 0.0)


def _round_s(costs: PassCosts, k: int, hidden: float) -> float:
    """`round_s`, its drafting hidden behind the round before with probability `hidden`."""
    if not k:
        return costs.target_s[0]
    return costs.target_s[k] + (costs.draft_fixed_s + k * costs.draft_s) * (1 - hidden)


def rates(costs: PassCosts, acceptance: Acceptance, overlapped: bool = False,
          continuation: float = 1.0) -> list[float]:
    """Expected tokens per second at each k in 0..k_max (of the whole pass where `costs.others` share it). A drafter
    that may end a round early (a draft model's dynamic length, n-gram lookup whose match runs out) proposes each
    next draft with probability `continuation`, so a round asked for k drafts has i < k of them with probability
    c^i (1 - c), and k with c^k: its worth is the expectation over those lengths of what a round of that length
    yields and costs (taking k drafts every round would charge a self-limiting drafter for drafts it never makes,
    and leave it under-used). One pass over k (every round a session learns from asks for them again: 28 us a round
    when each k summed its own products)."""
    c, runs = continuation, _runs(acceptance, costs.k_max + 1)
    out, tokens_below, seconds_below = [], 0.0, 0.0  # sum over i < k of c^i (1 - c) x (tokens, seconds) of i drafts
    tokens, reach = 1.0, 1.0  # a round of k drafts yields `tokens`; one asked for k makes all k with `reach` = c^k
    for k in range(costs.k_max + 1):
        seconds = _round_s(costs, k, runs[k] if overlapped else 0.0)
        out.append((costs.others + tokens_below + reach * tokens) / (seconds_below + reach * seconds))
        tokens_below += reach * (1 - c) * tokens
        seconds_below += reach * (1 - c) * seconds
        tokens += runs[k]
        reach *= c
    return out


def best_k(costs: PassCosts, acceptance: Acceptance, overlapped: bool = False, continuation: float = 1.0) -> int:
    """The k in 0..k_max with the most tokens per second."""
    per_k = rates(costs, acceptance, overlapped, continuation)
    return max(range(len(per_k)), key=per_k.__getitem__)


def drafting_cost(target, drafter, ks: tuple[int, ...] = (1, 2, 4, 8),
                  repeats: int = 3) -> tuple[float, float] | None:
    """(fixed, step) seconds of a round's drafting (`draft_line`), timed on a scratch session as the loop runs it:
    `drafter.propose(k)` at each k in turn, each round verified and committed on `target` (a `HybridLM`, or what
    stands in for one), after a first round that warms up. A drafter whose proposals come back empty (a remote draft
    that did not answer) gives None."""
    from deltaspec.shared.decoding.drafters import attach
    from deltaspec.shared.decoding.target import TargetSession

    prompt = [(1 + i % 8) % target.config.vocab_size for i in range(16)]  # repeating: n-gram lookup has matches
    session = TargetSession(target, prompt)
    drafter.start(list(prompt))
    attach(drafter, session)
    times: dict[int, list[float]] = {}  # by drafts proposed: a drafter may make fewer than it is asked for
    for i, k in enumerate([ks[0]] + [k for _ in range(repeats) for k in ks]):
        began = time.perf_counter()
        proposal = drafter.propose(k)
        if i and proposal.tokens:
            times.setdefault(len(proposal.tokens), []).append(time.perf_counter() - began)
        if not proposal.tokens and not i:  # a remote draft that does not answer (each try would wait for it)
            return None
        rnd = session.verify(f"r{i}", proposal.tokens, session.version)
        session.commit(rnd.round_id, rnd.verdict.accepted)
        drafter.advance(rnd.verdict.accepted, session.generated[-1])
    return draft_line(times) if times else None


def draft_line(times: dict[int, list[float]]) -> tuple[float, float]:
    """(fixed, step): a round's drafting time as fixed + k x step, the least-squares line through the median time of
    the rounds at each k (a remote draft's round trip is the fixed part; one k: all of it per step)."""
    points = [(k, statistics.median(ts)) for k, ts in times.items() if ts]
    if len(points) < 2:
        return (0.0, points[0][1] / points[0][0]) if points else (0.0, 0.0)
    mean_k = statistics.fmean(k for k, _ in points)
    mean_t = statistics.fmean(t for _, t in points)
    step = max(0.0, sum((k - mean_k) * (t - mean_t) for k, t in points) / sum((k - mean_k) ** 2 for k, _ in points))
    fixed = mean_t - step * mean_k
    return (fixed, step) if fixed >= 0 else (0.0, mean_t / mean_k)


class Tally:
    """What a server's sessions have shown: per-token acceptance, recent rounds weighing most, and the probe
    schedule. A new session's `CostModelLength` starts from it rather than from a guess, whose mistakes its first
    rounds would pay (rounds that do not pay, or a draft left unused). The schedule counts every session's rounds at
    k = 0: a wait longer than one generation's rounds, counted per session, would never come, and a draft written
    off early would never be tried again (simulated: 0.84x the best fixed k at acceptance 0.75). Thread-safe."""

    def __init__(self, keep: float = 0.99) -> None:
        self.keep = keep  # weight of the past at each round
        self.first_reached = self.first_kept = 0.0  # rounds that drafted, and kept their first draft
        self.run_reached = self.run_kept = 0.0  # drafts after a round's first reached (all before kept), and kept
        self.wait = PROBE_EVERY  # rounds at k = 0 between probes, from the last probe's outcome and cost
        self.idle = 0  # rounds at k = 0 since the last probe
        self.lock = threading.Lock()

    def probe_due(self) -> bool:
        """Count a round at k = 0; True (and the count starts again) when it is the one to probe."""
        with self.lock:
            self.idle += 1
            if self.idle < self.wait:
                return False
            self.idle = 0
            return True

    def acceptance(self) -> float | None:
        """The first draft's acceptance; None before a round's worth."""
        return self.first()[0]

    def first(self) -> tuple[float | None, float]:
        """(the first draft's acceptance, or None before a round's worth; the weighed rounds it is estimated from)."""
        with self.lock:
            return (self.first_kept / self.first_reached if self.first_reached >= 1 else None), self.first_reached

    def run(self) -> float | None:
        """The acceptance of a round's drafts after its first, once a run has begun; None before a draft's worth."""
        with self.lock:
            return self.run_kept / self.run_reached if self.run_reached >= 1 else None

    def add(self, proposed: int, accepted: int) -> None:
        """A round that kept `accepted` of `proposed` drafts."""
        keep = self.keep
        with self.lock:
            self.first_reached, self.first_kept, self.run_reached, self.run_kept = learnt(
                (self.first_reached, self.first_kept, self.run_reached, self.run_kept), keep, proposed, accepted)


def learnt(counts: tuple[float, float, float, float], keep: float, proposed: int,
           accepted: int) -> tuple[float, float, float, float]:
    """(first reached, first kept, run reached, run kept) after a round of `proposed` drafts that kept `accepted`,
    the past weighed `keep`: every round that drafts reaches its first draft; the drafts after it are reached while
    every one before them was kept."""
    first_reached, first_kept, run_reached, run_kept = counts
    if not proposed:
        return counts
    return (keep * first_reached + 1, keep * first_kept + (accepted > 0),
            keep * run_reached + max(0, min(accepted, proposed - 1)), keep * run_kept + max(0, accepted - 1))


class CostModelLength:
    """Chooses k per round (`choose`) and learns the session's acceptance from each round (`observe`): how often a
    round keeps its first draft, and how often a draft after it is kept once the ones before were (`positions`), each
    round's past weighed by `keep` (so a draft that stops matching mid-generation is noticed within a few rounds, and
    one that starts matching again at the next probe), the first from a prior worth `prior_rounds` rounds: what
    `tally` (a server's sessions) has shown, else `prior`. What drafting costs is measured, as the target's passes
    are (`PassCosts`: per step, and per round for a remote draft's round trip), not learned from the rounds: at
    several sessions a draft's answer also waits for the others' drafts, time in which the target runs the others'
    passes, and an estimate that made drafting look too dear would never be timed again. `batch_size()`: sequences
    the next target pass will carry (a server's batcher); `k_max`: the most drafts a round may take (at most what
    `costs` measured); `overlapped`: the rounds are pipelined (`round_s`). `k` and `reason` (`pays`, `doubt`,
    `none pays`, `probe`, or `capped` by a request that asked for no drafts) are the last choice, `rates()` why: for
    spans and metrics."""

    def __init__(self, costs: PassCosts, prior: float = PRIOR, prior_rounds: float = PRIOR_ROUNDS,
                 batch_size: Callable[[], int] = lambda: 1, k_max: int | None = None,
                 tally: Tally | None = None, overlapped: bool = False, keep: float = KEEP,
                 drafting: Callable[[], int] = lambda: 0) -> None:
        self.costs, self.batch_size, self.drafting = costs, batch_size, drafting
        self.costs_at: dict[Situation, PassCosts] = {}  # `_pass_costs`
        self.tally = tally if tally is not None else Tally()  # a session of its own keeps its own
        self.k_max = costs.k_max if k_max is None else max(0, min(k_max, costs.k_max))
        self._overlapped, self.keep = overlapped, keep
        shown = self.tally.acceptance()
        prior = prior if shown is None else shown
        # rounds that drafted and kept their first draft, from the prior; drafts after a round's first that were
        # reached (every draft before them kept), and kept
        self.first_reached, self.first_kept = prior_rounds, prior * prior_rounds
        self.run_reached = self.run_kept = 0.0
        self.continued, self.stopped = prior_rounds, 0.0  # drafts made and rounds the drafter ended early
        self.misses, self.miss_from = 0, 1.0  # rounds in a row that kept no draft, and the acceptance before them
        self.doubting = False  # the last k chosen drafts on the benefit of the doubt (`_may_pay`)
        self.probing = False  # the last k chosen was a probe
        self.k, self.reason = 0, "none"
        self.shadows: list[list] = []  # [drafts, matched so far, asked] of unverified proposals (`shadow`)
        # `rates`, `_may_pay`, `_may_start` by situation, until the next round learnt from (`_in_situation`)
        self.kept: dict[tuple[str, Situation], Any] = {}
        # the session drafts (its last k chosen was more than 0, and no probe): the doubt is its to keep. A new one
        # does where the server's sessions have shown drafting may pay (`_shown_to_pay`)
        self.drafts = self._shown_to_pay()

    @property
    def overlapped(self) -> bool:
        return self._overlapped

    @overlapped.setter
    def overlapped(self, value: bool) -> None:
        """Whether the rounds are pipelined, told once the loop is known (a server learns it after asking whether a
        round would draft, `expects_drafts`): what was kept was worked out for the other loop (kept serial rates at
        eight sessions left a good draft's sessions at k = 0, where pipelined rounds of 7 or 8 pay most)."""
        if value != self._overlapped:
            self.kept.clear()
        self._overlapped = value

    @property
    def wait(self) -> int:
        """Rounds at k = 0 between probes (the tally's: every session's rounds count)."""
        return self.tally.wait

    @property
    def acceptance(self) -> float:
        """The chance a round keeps its first draft (what a span reports, and where the doubt is measured)."""
        return self.first_kept / self.first_reached

    def positions(self) -> list[float]:
        """a_i, the chance the i-th draft is kept once the ones before it were, for i = 1 .. k_max + 1: the first
        draft's `acceptance`, and for every later one (and the guess of the token after a round kept whole) the
        acceptance once a run has begun: what the rounds kept of the drafts after their first they reached, shrunk by
        `RUN_PRIOR` rounds towards what the server's sessions have shown of it (`Tally.run`: many more runs than one
        session's; this session's first-draft acceptance before any). Acceptance comes in runs (a draft that matched
        the first tokens of a passage matches its next ones), which one a for every draft misjudges both ways: n-gram
        lookup keeping a fifth of its drafts still paid at k = 6 where that a said k = 0, and drafts pooled over a
        round put the first one's acceptance above what it is where runs are long, so a draft whose first token
        matches once in ten looked worth drafting. Simulated (`benchmarks/cost_model_sim.py`, the best fixed k over
        the cost model's: docs/drafters.md), one estimate for each position was noisy where few rounds reach it (a
        draft at a = 0.96 ran at 3-6 drafts a round where 8 pays most); runs shrunk towards the pooled acceptance of
        the session swung with its last rounds (n-gram runs first kept a third of the time, then 0.95: 6.6 drafts a
        round where 8 pay, 0.958x; 7.3 and 0.996x now)."""
        a = self.acceptance
        shown = self.tally.run()
        run = (self.run_kept + RUN_PRIOR * (a if shown is None else shown)) / (self.run_reached + RUN_PRIOR)
        return [a, *[run] * (self.k_max - 1), run][-self.k_max - 1:]

    @property
    def continuation(self) -> float:
        """How likely the drafter is to make each next draft it is asked for (1: it always makes k)."""
        return self.continued / (self.continued + self.stopped)

    def choose(self) -> int:
        """This round's k, moving the probe schedule on."""
        k = self.current()
        self.probing, self.drafts = False, k > 0
        if k > 0 or not self.k_max:
            self.k, self.reason = k, ("doubt" if self.doubting else "pays") if k else "capped"
            return k
        if self.tally.probe_due():
            self.probing = True
            self.k, self.reason = 1, "probe"
            return 1
        self.k, self.reason = 0, "none pays"
        return 0

    def current(self) -> int:
        """The k a round would take now, probes aside (a pipelined loop's rounds speculated ahead take it)."""
        if not self.k_max:
            return 0
        per_k = self.rates()
        best = max(range(len(per_k)), key=per_k.__getitem__)
        self.doubting = not best and self.drafts and not self._unverified() and self._may_pay()
        if self.doubting:
            return max(range(1, len(per_k)), key=per_k.__getitem__)
        if best and not self.drafts and self._unverified() and not self._may_start():
            return 0
        # the rate is flat near its best k and read at an estimate: where a longer round promises about the best
        # gain over decoding, the longest (simulated: a draft at a = 0.96 behind a remote draft, 0.993x the best
        # fixed k; 0.986x with the best k at the estimate)
        gain = per_k[best] - per_k[0]
        return max(k for k in range(best, len(per_k)) if per_k[k] - per_k[0] >= NEAR_BEST * gain) if best else 0

    def _may_pay(self) -> bool:
        """Whether drafting pays at an acceptance `DOUBT` standard errors above the estimate: a session that drafts
        stops only once its rounds show drafting loses. The estimate of the last ten rounds or so dips below the truth
        by chance, and a session that stopped at every dip learnt nothing more (a round at k = 0 shows nothing of
        the draft) and kept the low estimate: it stopped where the rounds were worst, so the server's estimate, the
        next sessions' start, fell too (simulated: a remote draft at a = 0.75, where 4 drafts pay 1.18x decoding, ran
        at 0.7 drafts a round, 0.88x the best fixed k; 0.98x with this). No doubt after rounds in a row that kept
        nothing, which the estimate before them made unlikely (`UNLIKELY`), nor where rounds at k = 0 keep teaching
        (`shadow`): a draft that stopped matching is dropped as soon as without the doubt (a draft kept every time,
        then never: 10 rounds to stop, with or without it)."""
        if self.misses and (1 - self.miss_from) ** self.misses < UNLIKELY:
            return False
        return self._in_situation("doubt", lambda key: self._pays_above(self.acceptance, self.first_reached, key,
                                                                       DOUBT))

    def _may_start(self) -> bool:
        """Whether drafting pays at an acceptance `START_DOUBT` standard errors below the estimate: what a session
        whose rounds at k = 0 keep teaching (`shadow`) needs to start drafting. Its estimate of ten rounds or so swings
        by chance, and a swing up started long rounds that a draft kept a tenth of the time could not pay for
        (simulated: n-gram drafts whose first is kept 10 % of the time, each next one 80 %, where no k pays: 0.954x
        decoding, 0.972x with this)."""
        return self._in_situation("start", lambda key: self._pays_above(self.acceptance, self.first_reached, key,
                                                                       -START_DOUBT))

    def _shown_to_pay(self) -> bool:
        """Whether drafting pays at the server's acceptance (`tally`) plus `DOUBT` standard errors of its count: a new
        session then starts as a drafting one, with the doubt to keep. Its own prior is worth a few rounds, and a
        session that stopped at its first dip drafted only where the server's estimate was above break-even by
        chance (simulated: a draft model on a MoE target at a = 0.7, where 2 drafts pay 1.04x decoding, ran at
        0.3 drafts a round, 0.965x the best fixed k; 0.984x with this)."""
        shown, seen = self.tally.first()
        return shown is not None and bool(self.k_max) and self._pays_above(shown, seen, self._situation(), DOUBT)

    def _pays_above(self, a: float, seen: float, key: Situation, errors: float) -> bool:
        """Whether some k > 0 pays at acceptance `a` plus `errors` standard errors of its estimate from `seen` rounds
        (the drafts after a round's first at theirs plus the same margin)."""
        margin = errors * math.sqrt(a * (1 - a) / seen) if seen else 0.0
        per_k = rates(self._pass_costs(*key), [min(1.0, max(0.0, p + margin)) for p in self.positions()],
                      self.overlapped, self.continuation)
        return max(per_k[1:]) > per_k[0]

    def rates(self) -> list[float]:
        """Expected tokens per second at each k up to `k_max`, at this session's acceptance and the next batch's
        pass costs; kept until either changes (a round at k = 0 learns nothing, and asks twice)."""
        return self._in_situation("rates", lambda key: rates(self._pass_costs(*key), self.positions(),
                                                             self.overlapped, self.continuation))

    def _situation(self) -> Situation:
        """What `rates`, `_may_pay` and `_may_start` depend on besides the costs and the rounds learnt from: the next
        batch, whether others verify in it."""
        return self.batch_size(), self.others_verify()

    def _in_situation(self, name: str, compute: Callable[[Situation], T]) -> T:
        """`compute(situation)`, kept under `name` for each situation until the next round learnt from (`_learn`):
        the batch size moves between a few values from round to round, and a round at k = 0 learns nothing."""
        key = name, self._situation()
        if key not in self.kept:
            self.kept[key] = compute(key[1])
        return self.kept[key]

    def _pass_costs(self, batch: int, verifying: bool) -> PassCosts:
        """The costs of a round in this situation, up to this session's `k_max` (made once each)."""
        key = batch, verifying
        if key not in self.costs_at:
            costs = self.costs.at(batch, verifying)
            self.costs_at[key] = replace(costs, target_s=costs.target_s[:self.k_max + 1], batched=())
        return self.costs_at[key]

    def others_verify(self) -> bool:
        """Whether other sessions drafted in the last pass (this one's own last round aside): the next pass then
        runs as a verify whatever this session adds (`PassCosts.at`)."""
        return self.drafting() - (self.k > 0) > 0

    def expects_drafts(self) -> bool:
        """Whether a round would draft now, probes aside (a remote draft's session is then worth opening early)."""
        return self.current() > 0

    def shadow_k(self) -> int:
        """Drafts to ask for and not verify in a round of k = 0 (`shadow`): as many as cost at most `SHADOW_SHARE` of
        a decode step to draft (n-gram lookup: microseconds each; a draft model: none). Checked against the tokens
        the target then emits, such drafts teach the acceptance for no pass at all, where probes cost a verify each:
        a session whose text starts repeating gets n-gram drafts back within a few tokens."""
        return 0 if self.k else self._unverified()

    def _unverified(self) -> int:
        """Drafts a round at k = 0 asks for and does not verify (`shadow_k`, whatever the last k)."""
        if not self.k_max:
            return 0
        costs = self.costs.at(self.batch_size())
        budget = SHADOW_SHARE * costs.target_s[0] - costs.draft_fixed_s
        if budget <= 0:
            return 0
        return self.k_max if costs.draft_s * self.k_max <= budget else int(budget / costs.draft_s)

    def shadow(self, drafts: list[int], asked: int) -> None:
        """Drafts proposed (of `asked`) in a round of k = 0 and not verified: learnt from as the target emits the
        tokens they guess (`emitted`); its first draft guesses the round's own token."""
        self.shadows.append([list(drafts), 0, asked])
        self.emitted([])

    def emitted(self, tokens: list[int]) -> None:
        """Tokens the target emitted, in order: each shadow compares its next draft with each, and ends, taught as a
        round of that many drafts would teach, at its first miss or once every draft matched. (Under sampling a
        one-hot draft matches the target's draw with the chance rejection sampling keeps it: the same estimate.)"""
        for token in tokens:
            for shadow in self.shadows:
                drafts, matched, _ = shadow
                if matched < len(drafts):
                    shadow[1] = matched + 1 if drafts[matched] == token else -1 - matched  # a miss: -1 - matched
        live = []
        for drafts, matched, asked in self.shadows:
            if matched < 0 or matched == len(drafts):
                self._learn(len(drafts), matched if matched >= 0 else -1 - matched, asked)
            else:
                live.append([drafts, matched, asked])
        self.shadows = live

    def observe(self, proposed: int, accepted: int, propose_s: float | None = None, asked: int | None = None) -> None:
        """A round's verdict: `accepted` of `proposed` drafts, which took `propose_s` seconds to get, `asked` for
        (None: as many as were proposed; fewer proposed: the drafter ended the round early)."""
        asked = proposed if asked is None else asked
        if not asked:  # a round that asked for no drafts shows nothing of the draft
            return
        self._learn(proposed, accepted, asked)
        if self.probing:  # what it cost spaces the next probe
            decode_s, verify_s = self.costs.at(self.batch_size()).target_s[:2]
            extra = verify_s - decode_s + (propose_s or 0.0)  # over the decode step the round would have been
            wait = max(PROBE_EVERY if accepted else 2 * self.wait, math.ceil(extra / (PROBE_SHARE * decode_s)))
            self.tally.wait = min(wait, MAX_PROBE_EVERY)

    def _learn(self, proposed: int, accepted: int, asked: int) -> None:
        """What a round of `proposed` drafts (of `asked`), `accepted` of them, teaches; the past weighed `keep`."""
        keep = self.keep
        self.kept.clear()  # every situation's results are of the rounds before
        if proposed:
            if not accepted and not self.misses:
                self.miss_from = self.acceptance
            self.misses = 0 if accepted else self.misses + 1
        self.continued, self.stopped = keep * self.continued + proposed, keep * self.stopped + (proposed < asked)
        self.first_reached, self.first_kept, self.run_reached, self.run_kept = learnt(
            (self.first_reached, self.first_kept, self.run_reached, self.run_kept), keep, proposed, accepted)
        self.tally.add(proposed, accepted)
