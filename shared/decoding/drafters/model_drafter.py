"""Two-model drafting: a smaller hybrid model with the target's vocabulary proposes tokens.

The draft model rolls back exactly as the target does: proposing stages tokens on its
`ModelState`, and `advance` commits the accepted prefix. Inputs it has not yet consumed (the
next token, and after a full accept also the last draft) wait in `pending` and open the next
proposal's first forward pass; longer backlogs (the prompt, zero-draft rounds) are prefilled
first, so a round's staging stays within the state's log capacity. A zero-draft round runs no
draft pass at all: a cost model at k = 0 costs what plain decoding costs, and the tokens it
emitted are prefilled in one pass at the next round that drafts.

`speculate(k)` proposes the next round before this one's outcome is known (pipelined rounds): it
feeds the rest of this round, guesses the target's next token (the draft's most likely one), marks
the state there and proposes from the guess, on top of this round's staging. Called again, it
proposes another round on top of the last in the same way, up to `MAX_SPECULATIONS` (unmarked:
`CHAIN_LOG_CAPACITY` logs let the state find each round's start when it is needed). `advance` keeps
the first speculation when every draft was accepted and the guess was right (a pointer swap; the
others stay on top), and drops them otherwise; `discard_last` drops the newest alone. Random draws
are keyed by the same positions as the serial run's.

Branches (`stage_branches`, a draft service's idle time): the next round's drafts for the open round's likeliest
misses, each on a state of its own whose head is the open round's after the drafts kept (`ModelState.load_from`,
the same arithmetic as the commit). A miss is likelier where the draft was unsure: the outcome "first j drafts
kept, then the draft's runner-up at j" is scored by the draft's own probabilities, p_0 ... p_(j-1) x r_j. When the
outcome is one of them, `advance` swaps that state in and the next `propose` of the same k returns its drafts
without a forward pass: the proposal, and every state after it, equal bit for bit what this drafter would have
made after that outcome without the branch.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltaspec.shared.decoding.drafters import Proposal
from deltaspec.shared.decoding.sampling import SamplingParams, draw, probabilities
from deltaspec.shared.errors import ResourceExhausted
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.state.prefix_cache import Cursor, PrefixCache, commit_head
from deltaspec.shared.state.rollback import ModelState
from deltaspec.shared.state.spec import CHAIN_LOG_CAPACITY

# Dynamic draft length with k up to 16: the best threshold on the embedded pair (`deltaspec bench --only
# generations` compares it with k = 8: ahead at every length in each run). `deltaspec generate` drafts this way by
# default; a `ModelDrafter` and `serve-draft` default to exactly k drafts (stop_below 0).
STOP_BELOW = 0.3


MAX_SPECULATIONS = 3  # rounds proposed on top of the open one, each on the one before

Odds = tuple[float, int, float]  # at a drafted position: the draft's probability of its token, its runner-up, that one's


@dataclass
class Branch:
    """The next round's proposal for one outcome of the open round (`accepted` drafts kept, then `token`)."""

    accepted: int
    token: int
    k: int
    fed: int  # tokens of the open round (pending and drafts) its head holds
    state: ModelState
    proposal: Proposal
    odds: list[Odds]
    seconds: float  # the draft's time making it


class ModelDrafter:
    def __init__(self, model: HybridLM, sampling: SamplingParams = SamplingParams(),
                 stop_below: float = 0.0) -> None:
        if not 0.0 <= stop_below <= 1.0:
            raise ValueError(f"stop_below must be in [0, 1], got {stop_below}")
        self.model, self.sampling, self.stop_below = model, sampling, stop_below
        self.pending: list[int] = []
        self.proposed: list[int] = []
        # speculations, each on the one before: (guess, drafts, their odds, the guess's odds when known)
        self.chain: list[tuple[int, list[int], list[Odds], Odds | None]] = []
        self.guessed: tuple[int, int] | None = None  # (position, the most likely token there) once fed
        self.branching = False  # record each draft's odds (`Odds`), so that `stage_branches` can rank the misses
        self.odds: list[Odds] = []  # the open round's drafts' (with `branching`)
        self.branches: list[Branch] = []  # staged for the open round's outcomes
        self.ready: Branch | None = None  # the branch `advance` swapped in: the next `propose` of its k returns it
        # told how each branch ended (used, unused or cut short) and the draft's seconds making it (a metric)
        self.branch_ended: Callable[[str, float], None] = lambda outcome, seconds: None
        self.state: ModelState  # made by `start`: on a server each state takes a pool slot, none before it is needed
        # told how speculations end, (outcome, how many): kept (made the open round) or dropped (a metric)
        self.speculation_ended: Callable[[str, int], None] = lambda outcome, n: None

    def start(self, prompt_ids: list[int]) -> None:
        self._drop_chain()
        self._drop_branches()
        self.ready, self.odds = None, []
        self.state = self.model.new_state(capacity=max(256, 2 * len(prompt_ids)), log_capacity=CHAIN_LOG_CAPACITY)
        cache: PrefixCache | None = self.model.prefix_cache
        self.cursor = Cursor(cache, self.state) if cache is not None else None  # its place in the prefix cache
        self.pending, self.proposed, self.guessed = list(prompt_ids), [], None

    @property
    def cached_tokens(self) -> int:
        """Prompt positions taken from the prefix cache instead of prefilled."""
        return self.cursor.cached_tokens if self.cursor is not None else 0

    def propose(self, k: int) -> Proposal:
        ready, self.ready = self.ready, None
        if ready is not None and ready.k == k:  # a branch made for this outcome: its state is in, drafts staged
            return ready.proposal
        self._drop_branches()
        self.state.revert()
        self._drop_chain()
        self.proposed = []
        if not k:  # a round without drafts runs no draft pass: its inputs wait for the next round that drafts
            return Proposal([])
        if len(self.pending) > 2:  # a prompt, or inputs piled up by zero-draft rounds: prefill all but the last
            if self.cursor is not None:  # a prompt resumes from its longest cached prefix
                self.cursor.prefill(self.model, self.pending[:-1])
            else:
                self.model(torch.tensor(self.pending[:-1]), self.state)
                self.state.commit(self.state.staged)
            self.pending = self.pending[-1:]
        proposal, self.odds = self._draw(self.pending, k, self.state.length + len(self.pending))
        self.proposed = list(proposal.tokens)
        return proposal

    def _inputs(self) -> list[int]:
        """Everything the open round and the speculations feed, from the head on."""
        return self.pending + self.proposed + [t for guess, tokens, *_ in self.chain for t in (guess, *tokens)]

    def can_speculate(self, k: int, replacing_last: bool = False) -> bool:
        """Whether one more round of k drafts fits on top (the chain's length, the state's logs); `replacing_last`:
        once the newest speculation is dropped for it."""
        chain = self.chain[:-1] if replacing_last else self.chain
        inputs = len(self._inputs()) - (len(self.chain[-1][1]) + 1 if replacing_last and self.chain else 0)
        return len(chain) < MAX_SPECULATIONS and inputs + k <= self.state.recurrent.log_capacity

    def speculate(self, k: int, stop: Callable[[], bool] | None = None) -> tuple[int, Proposal]:
        """The next round's proposal if the newest one (open or speculative) keeps every draft, and the token it
        assumes after them. `stop()`, asked before each draft, ends it early (a proposal no longer wanted: the caller
        drops it with `discard_last`)."""
        if not self.can_speculate(k):
            raise ValueError(f"no room for another speculation of {k} drafts")
        unfed, guess_odds = self._inputs()[self.state.staged:], None
        if unfed:  # else a speculation was dropped: the round is fed already and its guess stands
            logits, _ = self.model(torch.tensor(unfed), self.state)
            guess = int(logits[-1].argmax())
            self.guessed = (self.state.length + self.state.staged, guess)
            guess_odds = _odds(logits[-1].softmax(-1), guess) if self.branching else None
        assert self.guessed is not None and self.guessed[0] == self.state.length + self.state.staged
        guess = self.guessed[1]
        if not self.chain:
            self.state.mark()
        proposal, odds = self._draw([guess], k, self.state.length + self.state.staged + 1, stop)
        self.chain.append((guess, list(proposal.tokens), odds, guess_odds))
        return guess, proposal

    def _draw(self, inputs: list[int], k: int, position: int, stop: Callable[[], bool] | None = None,
              state: ModelState | None = None) -> tuple[Proposal, list[Odds]]:
        """Up to k tokens, one forward each, from `inputs` (on `state`, the drafter's by default); draws keyed by
        the first proposal's position. With `branching`, also each token's `Odds`.

        Drafting stops after a token whose draft probability (the draft's top one) is below `stop_below`: the
        decision reads only the draft, so the output stays exactly the target's, greedy or sampled."""
        tokens, dists, odds = [], [], []
        greedy, stop_below = self.sampling.greedy, self.stop_below
        generator = None if greedy else self.sampling.generator(position, stream=1)
        for _ in range(k):
            if stop is not None and stop():
                break
            logits = self.model(torch.tensor(inputs), state or self.state)[0][-1]
            if greedy:  # no distribution to return: the argmax, and the top probability only when it is read
                if stop_below:
                    top, best = logits.softmax(-1).max(-1)
                    token, sure = int(best), float(top) >= stop_below
                else:
                    token, sure = int(logits.argmax()), True
                if self.branching:
                    odds.append(_odds(logits.softmax(-1), token))
            else:
                q = probabilities(logits, self.sampling)
                token, sure = draw(q, generator), not stop_below or float(q.max()) >= stop_below
                dists.append(q)
                if self.branching:
                    odds.append(_odds(q, token))
            tokens.append(token)
            if not sure:
                break
            inputs = [token]
        return Proposal(tokens, None if greedy or not tokens else torch.stack(dists)), odds

    def likely_misses(self, n: int) -> list[tuple[int, int]]:
        """The open round's n likeliest misses by the draft's own odds, likeliest first: (drafts kept, next token),
        the next token the draft's runner-up where the target would reject its draft (or, once a speculation fed
        the round, differ from its guess)."""
        scored, kept, points = [], 1.0, list(self.odds)
        if self.chain and self.chain[0][3] is not None and len(points) == len(self.proposed):
            points.append(self.chain[0][3])  # every draft kept, then not the guess
        for j, (p, runner_up, r) in enumerate(points):
            scored.append((kept * r, j, runner_up))
            kept *= p
        return [(j, token) for _, j, token in sorted(scored, key=lambda s: -s[0])[:n]]

    def stage_branches(self, n: int, k: int, stop: Callable[[int, int], bool]) -> int:
        """Stage the next round's k drafts for the open round's n likeliest misses (those not staged yet), each on a
        state of its own, until `stop(accepted, token)` (asked before each forward pass of the branch for that
        outcome) says to: a branch cut short is dropped. Returns how many are staged. A miss after drafts the state
        has not fed yet gets none."""
        for accepted, token in self.likely_misses(n):
            fed = len(self.pending) + accepted
            if any((b.accepted, b.token) == (accepted, token) for b in self.branches) or \
                    not 0 < fed <= self.state.staged:
                continue
            cut = lambda: stop(accepted, token)  # noqa: E731
            pool = self.model.state_pool
            if cut() or pool is not None and pool.slots - pool.in_use < 2:  # the last free slot is a new session's
                break
            started = time.perf_counter()
            try:
                capacity = self.state.attn[0].k.shape[1] if self.state.attn else 256
                fork = self.model.new_state(capacity=capacity, log_capacity=CHAIN_LOG_CAPACITY)
                fork.load_from(self.state, fed)
                proposal, odds = self._draw([token], k, fork.length + 1, cut, fork)
            except ResourceExhausted:  # no memory to spare on a full server: no branch
                break
            seconds = time.perf_counter() - started
            if cut() and len(proposal.tokens) < k:  # cut short: not the proposal made without it
                self.branch_ended("cut", seconds)
                break
            self.branches.append(Branch(accepted, token, k, fed, fork, proposal, odds, seconds))
        return len(self.branches)

    def _drop_branches(self, used: Branch | None = None) -> None:
        for branch in self.branches:
            if branch is not used:
                self.branch_ended("unused", branch.seconds)
        self.branches = []

    def discard_speculation(self) -> None:
        """Drop every speculation (back to the mark after the open round)."""
        if self.chain:
            self.state.drop_marked()
            self.guessed = (self.state.length + self.state.staged, self.chain[0][0])
            self._drop_chain()

    def _drop_chain(self) -> None:
        if self.chain:
            self.speculation_ended("dropped", len(self.chain))
        self.chain = []

    def discard_last(self) -> None:
        """Drop the newest speculation, keep the others."""
        if len(self.chain) == 1:
            self.discard_speculation()
        elif self.chain:
            guess, *_ = self.chain.pop()
            self.state.truncate(len(self._inputs()))
            self.guessed = (self.state.length + self.state.staged, guess)
            self.speculation_ended("dropped", 1)

    def advance(self, accepted: int, next_token: int) -> None:
        """Commit pending + the accepted proposals that were fed; the rest waits in `pending`. A first speculation
        whose assumption holds becomes the open round (the others stay on top of it); a branch staged for this
        outcome becomes the drafter's state, its drafts the next proposal."""
        self.ready = None
        branch = next((b for b in self.branches if (b.accepted, b.token) == (accepted, next_token)), None)
        self._drop_branches(used=branch)
        if self.chain:
            guess, tokens, odds, _ = self.chain[0]
            if accepted == len(self.proposed) and next_token == guess:
                commit_head(self.cursor, self.pending + self.proposed, self.state.commit_marked)
                self.pending, self.proposed, self.chain, self.odds = [guess], tokens, self.chain[1:], odds
                if self.chain:  # the next one stays staged on top: mark where it starts (from the logs)
                    self.state.mark(1 + len(tokens))
                self.speculation_ended("kept", 1)
                return
            self.discard_speculation()
        kept = self.pending + self.proposed[:accepted]
        fed = min(len(kept), self.state.staged)
        commit_head(self.cursor, kept[:fed], lambda: self.state.commit(fed))
        if branch is not None and fed == len(kept) == branch.fed:  # its head is this one: swap it in
            self.state, self.ready = branch.state, branch
            if self.cursor is not None:
                self.cursor.state = branch.state
            self.pending, self.proposed, self.odds = [next_token], list(branch.proposal.tokens), branch.odds
            self.guessed = None
            self.branch_ended("used", branch.seconds)
            return
        if branch is not None:
            self.branch_ended("unused", branch.seconds)
        self.pending = kept[fed:] + [next_token]
        self.proposed = []


def _odds(probs: torch.Tensor, token: int) -> Odds:
    """The draft's probability of `token`, its likeliest other token and that one's probability."""
    top, ids = probs.topk(2)
    other = 1 if int(ids[0]) == token else 0
    return float(probs[token]), int(ids[other]), float(top[other])
