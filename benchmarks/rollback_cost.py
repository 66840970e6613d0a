"""Rollback strategies side by side: this project's closed-form commit against the two known designs.

Benchmark-only code: the alternatives below exist to be measured and are never reachable from the
CLI's generate path or the services. All three run the same model over the same rounds (same
drafts, same accept counts) and must end with the same head.

- `closed_form` (ours): verify stages (x_t, k_t, delta_t, g_t) and one spare state; commit
  rebuilds S_a in the spare and swaps (a pointer swap on full acceptance).
- `snapshots` (vLLM, llama.cpp): verify also materialises the state after every position,
  k+1 full states per GDN layer; commit copies slot a into the head.
- `checkpoint_replay`: copy the GDN states before verify, let verify advance the head over all
  k+1 tokens, and on a partial accept restore the copy and re-run the accepted tokens through
  the whole model.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.state.rollback import ModelState


@dataclass
class RoundCost:
    """Per-round timings; medians, because a shared machine preempts a few rounds at random."""

    verify: list[float] = field(default_factory=list)  # the forward over k+1 tokens (plus what the strategy adds)
    rollback: list[float] = field(default_factory=list)  # all spent keeping the head exact: commit, copies, replay
    staged_bytes: int = 0  # bytes written per round beyond the forward pass itself
    rounds: int = 0

    def add(self, verify_s: float, rollback_s: float) -> None:
        self.verify.append(verify_s)
        self.rollback.append(rollback_s)

    @property
    def round_s(self) -> float:
        return statistics.median(v + r for v, r in zip(self.verify, self.rollback))

    @property
    def rollback_share(self) -> float:
        return statistics.median(self.rollback) / self.round_s

    @property
    def bytes_per_round(self) -> float:
        return self.staged_bytes / max(self.rounds, 1)


def _head_bytes(state: ModelState) -> int:
    gdn = state.recurrent
    return gdn.state.numel() * 4 + gdn.conv.numel() * gdn.conv.element_size()


def round_closed_form(model: HybridLM, state: ModelState, tokens: torch.Tensor, keep: int, cost: RoundCost) -> None:
    t0 = time.perf_counter()
    model(tokens, state)
    t1 = time.perf_counter()
    staged = state.staged_bytes() + state.recurrent.spare.numel() * 4
    t2 = time.perf_counter()
    state.commit(keep)
    t3 = time.perf_counter()
    cost.staged_bytes += staged
    cost.add(t1 - t0, t3 - t2)


def round_snapshots(model: HybridLM, state: ModelState, tokens: torch.Tensor, keep: int, cost: RoundCost) -> None:
    t0 = time.perf_counter()
    model(tokens, state)
    # materialise the state after each position: what a per-position snapshot kernel writes
    gdn, T = state.recurrent, len(tokens)
    slots = torch.empty((T, *gdn.state.shape))
    s = gdn.state
    for t in range(T):
        s = gdn.g[..., t, None, None].exp() * s + gdn.k[..., t, None] * gdn.delta[:, :, t, None, :]
        slots[t] = s
    width = gdn.conv.shape[1]
    window = torch.cat([gdn.conv, gdn.x[:, :T]], dim=1)
    convs = torch.stack([window[:, t + 1 : t + 1 + width] for t in range(T)])
    cost.staged_bytes += slots.numel() * 4 + convs.numel() * convs.element_size()
    t1 = time.perf_counter()
    gdn.state.copy_(slots[keep - 1])  # commit: copy slot keep-1 into the head
    gdn.conv.copy_(convs[keep - 1])
    state.length += keep
    state.staged = 0
    t2 = time.perf_counter()
    cost.add(t1 - t0, t2 - t1)


def round_checkpoint_replay(model: HybridLM, state: ModelState, tokens: torch.Tensor, keep: int,
                            cost: RoundCost) -> None:
    t0 = time.perf_counter()
    saved = state.recurrent.conv.clone(), state.recurrent.state.clone()
    cost.staged_bytes += _head_bytes(state)
    t1 = time.perf_counter()
    model(tokens, state)
    state.commit(len(tokens))  # a verify pass without rollback advances the head over every token
    t2 = time.perf_counter()
    if keep < len(tokens):
        state.recurrent.conv.copy_(saved[0])
        state.recurrent.state.copy_(saved[1])
        state.length -= len(tokens)
        model(tokens[:keep], state)  # replay the accepted tokens through the whole model
        state.commit(keep)
    t3 = time.perf_counter()
    cost.add(t2 - t1, (t1 - t0) + (t3 - t2))


STRATEGIES = {
    "closed_form": round_closed_form,
    "snapshots": round_snapshots,
    "checkpoint_replay": round_checkpoint_replay,
}


def compare(model: HybridLM, prompt: list[int], k: int, rounds: int, seed: int = 0) -> dict[str, RoundCost]:
    """Run the same `rounds` rounds (random tokens, accept counts uniform in 0..k) under each strategy."""
    rng = random.Random(seed)
    plan = [(torch.tensor([rng.randrange(model.config.vocab_size) for _ in range(k + 1)]), rng.randint(0, k) + 1)
            for _ in range(rounds)]
    costs, heads = {}, {}
    for name, run_round in STRATEGIES.items():
        state = model.new_state(capacity=len(prompt) + rounds * (k + 1) + 1)
        model(torch.tensor(prompt), state)
        state.commit(state.staged)
        cost = RoundCost()
        for tokens, keep in plan:
            run_round(model, state, tokens, keep, cost)
            cost.rounds += 1
        costs[name] = cost
        heads[name] = state
    ref = heads["closed_form"]
    for name, state in heads.items():
        err = (state.recurrent.state - ref.recurrent.state).abs().max().item()
        if err > 1e-4:
            raise AssertionError(f"{name} ends {err:.2e} away from the closed-form head")
    return costs
