"""Two-model drafting: a smaller hybrid model with the target's vocabulary proposes tokens.

The draft model rolls back exactly as the target does: proposing stages tokens on its
`ModelState`, and `advance` commits the accepted prefix. Inputs it has not yet consumed (the
next token, and after a full accept also the last draft) wait in `pending` and open the next
proposal's first forward pass; longer backlogs (the prompt, zero-draft rounds) are prefilled
first, so a round's staging stays within the state's log capacity.

`speculate(k)` proposes the next round before this one's outcome is known (pipelined rounds): it
feeds the rest of this round, guesses the target's next token (the draft's most likely one), marks
the state there and proposes from the guess, on top of this round's staging. Called again, it
proposes another round on top of the last in the same way, up to `MAX_SPECULATIONS` (unmarked:
`CHAIN_LOG_CAPACITY` logs let the state find each round's start when it is needed). `advance` keeps
the first speculation when every draft was accepted and the guess was right (a pointer swap; the
others stay on top), and drops them otherwise; `discard_last` drops the newest alone. Random draws
are keyed by the same positions as the serial run's.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from deltaspec.shared.decoding.drafters import Proposal
from deltaspec.shared.decoding.sampling import SamplingParams, draw, probabilities
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.state.prefix_cache import Cursor, PrefixCache
from deltaspec.shared.state.rollback import CHAIN_LOG_CAPACITY, ModelState

# Dynamic draft length with k up to 16: the best threshold on the embedded pair (`deltaspec bench --only
# generations` compares it with k = 8: ahead at every length in each run). `deltaspec generate` drafts this way by
# default; a `ModelDrafter` and `serve-draft` default to exactly k drafts (stop_below 0).
STOP_BELOW = 0.3


MAX_SPECULATIONS = 3  # rounds proposed on top of the open one, each on the one before


class ModelDrafter:
    def __init__(self, model: HybridLM, sampling: SamplingParams = SamplingParams(),
                 stop_below: float = 0.0) -> None:
        if not 0.0 <= stop_below <= 1.0:
            raise ValueError(f"stop_below must be in [0, 1], got {stop_below}")
        self.model, self.sampling, self.stop_below = model, sampling, stop_below
        self.pending: list[int] = []
        self.proposed: list[int] = []
        self.chain: list[tuple[int, list[int]]] = []  # speculations (guess, proposal), each on the one before
        self.guessed: tuple[int, int] | None = None  # (position, the most likely token there) once fed
        self.state: ModelState  # made by `start`: on a server each state takes a pool slot, none before it is needed
        # told how speculations end, (outcome, how many): kept (made the open round) or dropped (a metric)
        self.speculation_ended: Callable[[str, int], None] = lambda outcome, n: None

    def start(self, prompt_ids: list[int]) -> None:
        self._drop_chain()
        self.state = self.model.new_state(capacity=max(256, 2 * len(prompt_ids)), log_capacity=CHAIN_LOG_CAPACITY)
        cache: PrefixCache | None = getattr(self.model, "prefix_cache", None)
        self.cursor = Cursor(cache, self.state) if cache is not None else None  # its place in the prefix cache
        self.pending, self.proposed, self.guessed = list(prompt_ids), [], None

    @property
    def cached_tokens(self) -> int:
        """Prompt positions taken from the prefix cache instead of prefilled."""
        return self.cursor.cached_tokens if self.cursor is not None else 0

    def _commit(self, ids: list[int], commit: Callable[[], None]) -> None:
        """`commit()` keeps the staged `ids`; with a prefix cache, the blocks they complete are cached."""
        if self.cursor is None:
            commit()
        else:
            self.cursor.commit(ids, commit)

    def propose(self, k: int) -> Proposal:
        self.state.revert()
        self._drop_chain()
        self.proposed = []
        if len(self.pending) > 2:  # a prompt, or inputs piled up by zero-draft rounds: prefill all but the last
            if self.cursor is not None:  # a prompt resumes from its longest cached prefix
                self.cursor.prefill(self.model, self.pending[:-1])
            else:
                self.model(torch.tensor(self.pending[:-1]), self.state)
                self.state.commit(self.state.staged)
            self.pending = self.pending[-1:]
        proposal = self._draw(self.pending, k, self.state.length + len(self.pending))
        self.proposed = list(proposal.tokens)
        return proposal

    def _inputs(self) -> list[int]:
        """Everything the open round and the speculations feed, from the head on."""
        return self.pending + self.proposed + [t for guess, tokens in self.chain for t in (guess, *tokens)]

    def can_speculate(self, k: int, replacing_last: bool = False) -> bool:
        """Whether one more round of k drafts fits on top (the chain's length, the state's logs); `replacing_last`:
        once the newest speculation is dropped for it."""
        chain = self.chain[:-1] if replacing_last else self.chain
        inputs = len(self._inputs()) - (len(self.chain[-1][1]) + 1 if replacing_last and self.chain else 0)
        return len(chain) < MAX_SPECULATIONS and inputs + k <= self.state.gdn.log_capacity

    def speculate(self, k: int, stop: Callable[[], bool] | None = None) -> tuple[int, Proposal]:
        """The next round's proposal if the newest one (open or speculative) keeps every draft, and the token it
        assumes after them. `stop()`, asked before each draft, ends it early (a proposal no longer wanted: the caller
        drops it with `discard_last`)."""
        if not self.can_speculate(k):
            raise ValueError(f"no room for another speculation of {k} drafts")
        unfed = self._inputs()[self.state.staged:]
        if unfed:  # else a speculation was dropped: the round is fed already and its guess stands
            logits, _ = self.model(torch.tensor(unfed), self.state)
            self.guessed = (self.state.length + self.state.staged, int(logits[-1].argmax()))
        assert self.guessed is not None and self.guessed[0] == self.state.length + self.state.staged
        guess = self.guessed[1]
        if not self.chain:
            self.state.mark()
        proposal = self._draw([guess], k, self.state.length + self.state.staged + 1, stop)
        self.chain.append((guess, list(proposal.tokens)))
        return guess, proposal

    def _draw(self, inputs: list[int], k: int, position: int, stop: Callable[[], bool] | None = None) -> Proposal:
        """Up to k tokens, one forward each, from `inputs`; draws keyed by the first proposal's position.

        Drafting stops after a token whose draft probability (the draft's top one) is below `stop_below`: the
        decision reads only the draft, so the output stays exactly the target's, greedy or sampled."""
        tokens, dists = [], []
        greedy, stop_below = self.sampling.greedy, self.stop_below
        generator = None if greedy else self.sampling.generator(position, stream=1)
        for _ in range(k):
            if stop is not None and stop():
                break
            logits = self.model(torch.tensor(inputs), self.state)[0][-1]
            if greedy:  # no distribution to return: the argmax, and the top probability only when it is read
                if stop_below:
                    top, best = logits.softmax(-1).max(-1)
                    token, sure = int(best), float(top) >= stop_below
                else:
                    token, sure = int(logits.argmax()), True
            else:
                q = probabilities(logits, self.sampling)
                token, sure = draw(q, generator), not stop_below or float(q.max()) >= stop_below
                dists.append(q)
            tokens.append(token)
            if not sure:
                break
            inputs = [token]
        return Proposal(tokens, None if greedy or not tokens else torch.stack(dists))

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
            guess, _ = self.chain.pop()
            self.state.truncate(len(self._inputs()))
            self.guessed = (self.state.length + self.state.staged, guess)
            self.speculation_ended("dropped", 1)

    def advance(self, accepted: int, next_token: int) -> None:
        """Commit pending + the accepted proposals that were fed; the rest waits in `pending`. A first speculation
        whose assumption holds becomes the open round (the others stay on top of it)."""
        if self.chain:
            guess, tokens = self.chain[0]
            if accepted == len(self.proposed) and next_token == guess:
                self._commit(self.pending + self.proposed, self.state.commit_marked)
                self.pending, self.proposed, self.chain = [guess], tokens, self.chain[1:]
                if self.chain:  # the next one stays staged on top: mark where it starts (from the logs)
                    self.state.mark(1 + len(tokens))
                self.speculation_ended("kept", 1)
                return
            self.discard_speculation()
        kept = self.pending + self.proposed[:accepted]
        fed = min(len(kept), self.state.staged)
        self._commit(kept[:fed], lambda: self.state.commit(fed))
        self.pending = kept[fed:] + [next_token]
        self.proposed = []
