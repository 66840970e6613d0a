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
import time
from dataclasses import dataclass

import torch

from shared.model.hybrid import HybridLM
from shared.state.rollback import GDNLayerState, ModelState


@dataclass
class RoundCost:
    verify_s: float = 0.0  # the target forward over k+1 tokens (plus what the strategy adds to it)
    rollback_s: float = 0.0  # everything spent to keep the head exact: commit, revert, copies, replay
    staged_bytes: int = 0  # bytes written per round beyond the forward pass itself
    rounds: int = 0

    @property
    def round_s(self) -> float:
        return (self.verify_s + self.rollback_s) / max(self.rounds, 1)

    @property
    def rollback_share(self) -> float:
        total = self.verify_s + self.rollback_s
        return self.rollback_s / total if total else 0.0

    @property
    def bytes_per_round(self) -> float:
        return self.staged_bytes / max(self.rounds, 1)


def _gdn(state: ModelState) -> list[GDNLayerState]:
    return [layer for layer in state.layers if isinstance(layer, GDNLayerState)]


def _state_bytes(layer: GDNLayerState) -> int:
    return layer.recurrent.numel() * 4 + layer.conv.numel() * layer.conv.element_size()


def round_closed_form(model: HybridLM, state: ModelState, tokens: torch.Tensor, keep: int, cost: RoundCost) -> None:
    t0 = time.perf_counter()
    model(tokens, state)
    t1 = time.perf_counter()
    cost.staged_bytes += state.staged_bytes() + sum(l.spare.numel() * 4 for l in _gdn(state))
    state.commit(keep)
    t2 = time.perf_counter()
    cost.verify_s += t1 - t0
    cost.rollback_s += t2 - t1


def round_snapshots(model: HybridLM, state: ModelState, tokens: torch.Tensor, keep: int, cost: RoundCost) -> None:
    t0 = time.perf_counter()
    model(tokens, state)
    # materialise the state after each position: what a per-position snapshot kernel writes
    snaps = []
    for layer in _gdn(state):
        k, delta, g = layer.k_log[-1], layer.delta_log[-1], layer.g_log[-1]
        slots = torch.empty((len(tokens), *layer.recurrent.shape))
        s = layer.recurrent
        for t in range(len(tokens)):
            s = g[t].exp()[:, None, None] * s + k[t][:, :, None] * delta[t][:, None, :]
            slots[t] = s
        window = torch.cat([layer.conv, layer.x_log[-1].t()], dim=1)
        width = layer.conv.shape[1]
        convs = torch.stack([window[:, t + 1 : t + 1 + width] for t in range(len(tokens))])
        snaps.append((slots, convs))
        cost.staged_bytes += slots.numel() * 4 + convs.numel() * convs.element_size()
    t1 = time.perf_counter()
    for layer, (slots, convs) in zip(_gdn(state), snaps):  # commit: copy slot keep-1 into the head
        layer.recurrent.copy_(slots[keep - 1])
        layer.conv = convs[keep - 1].clone()
        layer.clear()
    state.length += keep
    state.staged = 0
    t2 = time.perf_counter()
    cost.verify_s += t1 - t0
    cost.rollback_s += t2 - t1


def round_checkpoint_replay(model: HybridLM, state: ModelState, tokens: torch.Tensor, keep: int,
                            cost: RoundCost) -> None:
    t0 = time.perf_counter()
    saved = [(l.conv.clone(), l.recurrent.clone()) for l in _gdn(state)]
    cost.staged_bytes += sum(_state_bytes(l) for l in _gdn(state))
    t1 = time.perf_counter()
    model(tokens, state)
    state.commit(len(tokens))  # a verify pass without rollback advances the head over every token
    t2 = time.perf_counter()
    if keep < len(tokens):
        for layer, (conv, recurrent) in zip(_gdn(state), saved):
            layer.conv, layer.recurrent = conv, recurrent
        state.length -= len(tokens)
        model(tokens[:keep], state)  # replay the accepted tokens through the whole model
        state.commit(keep)
    t3 = time.perf_counter()
    cost.verify_s += t2 - t1
    cost.rollback_s += (t1 - t0) + (t3 - t2)


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
        for a, b in zip(_gdn(state), _gdn(ref)):
            err = (a.recurrent - b.recurrent).abs().max().item()
            if err > 1e-4:
                raise AssertionError(f"{name} ends {err:.2e} away from the closed-form head")
    return costs
