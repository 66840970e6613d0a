"""Two-model drafting: a smaller hybrid model with the target's vocabulary proposes tokens.

The draft model rolls back exactly as the target does: proposing stages tokens on its
`ModelState`, and `advance` commits the accepted prefix. Inputs it has not yet consumed (the
next token, and after a full accept also the last draft) wait in `pending` and open the next
proposal's first forward pass; longer backlogs (the prompt, zero-draft rounds) are prefilled
first, so a round's staging stays within the state's log capacity.
"""
from __future__ import annotations

import torch

from shared.decoding.drafters import Proposal
from shared.decoding.sampling import SamplingParams, draw, probabilities
from shared.model.hybrid import HybridLM


class ModelDrafter:
    def __init__(self, model: HybridLM, sampling: SamplingParams = SamplingParams()) -> None:
        self.model, self.sampling = model, sampling
        self.pending: list[int] = []
        self.proposed: list[int] = []
        self.state = model.new_state()

    def start(self, prompt_ids: list[int]) -> None:
        self.state = self.model.new_state(capacity=max(256, 2 * len(prompt_ids)))
        self.pending, self.proposed = list(prompt_ids), []

    def propose(self, k: int) -> Proposal:
        self.state.revert()
        self.proposed = []
        if len(self.pending) > 2:  # a prompt, or inputs piled up by zero-draft rounds: prefill all but the last
            self.model(torch.tensor(self.pending[:-1]), self.state)
            self.state.commit(self.state.staged)
            self.pending = self.pending[-1:]
        if k == 0:
            return Proposal([])
        inputs, dists = self.pending, []
        generator = self.sampling.generator(self.state.length + len(self.pending), stream=1)
        for _ in range(k):
            logits, _ = self.model(torch.tensor(inputs), self.state)
            q = probabilities(logits[-1], self.sampling)
            token = int(q.argmax()) if self.sampling.greedy else draw(q, generator)
            self.proposed.append(token)
            dists.append(q)
            inputs = [token]
        return Proposal(list(self.proposed), None if self.sampling.greedy else torch.stack(dists))

    def advance(self, accepted: int, next_token: int) -> None:
        """Commit pending + the accepted proposals that were fed; the rest waits in `pending`."""
        kept = self.pending + self.proposed[:accepted]
        fed = min(len(kept), self.state.staged)
        self.state.commit(fed)
        self.pending = kept[fed:] + [next_token]
        self.proposed = []
