"""Cost of one forward step: ATen calls and time, layer path against fused path against compiled passes.

At the embedded pair's sizes a step's time is per-op dispatch, so the ATen-call count (every op
that reaches the dispatcher from Python, views included, counted with a `TorchDispatchMode`) is
the figure the fused path is built to cut; compiled passes (`deltaspec.shared.model.compiled`) run their
graph's kernels from generated code, which such a mode does not see, so for them only time is
reported. A step is a forward of T tokens plus its commit (decode: T = 1; verify: T = k + 1,
committing half). Times are medians of alternated blocks.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deltaspec.shared.model.hybrid import HybridLM


class CountCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _step(model: HybridLM, state, ids: torch.Tensor) -> None:
    model(ids, state)
    state.commit(max(1, len(ids) // 2))


PATHS = {"layers": lambda m: m.fuse(False), "fused": lambda m: m.fuse(),
         "compiled": lambda m: m.fuse().compile(warm_up=True)}


def step_costs(models: dict[str, HybridLM], k: int = 4, context: int = 64, blocks: int = 7, steps: int = 20,
               paths: tuple[str, ...] = ("layers", "fused")) -> list[dict]:
    """For each model, T in (1, k+1), and each of `paths` (`PATHS`): ATen calls and median ms per step."""
    rows = []
    for name, model in models.items():
        made = {path: PATHS[path](copy.deepcopy(model)) for path in paths}
        for T in (1, k + 1):
            ids = torch.arange(T) % model.config.vocab_size
            states, calls, times = {}, {}, {p: [] for p in paths}
            for path, m in made.items():
                states[path] = m.new_state(capacity=context + blocks * steps * T + 8)
                m(torch.arange(context) % m.config.vocab_size, states[path])
                states[path].commit(context)
                for _ in range(3):  # warm
                    _step(m, states[path], ids)
                if m.compiled is None:
                    with CountCalls() as counter:
                        _step(m, states[path], ids)
                    calls[path] = counter.calls
            for _ in range(blocks):  # alternate the paths block by block
                for path, m in made.items():
                    started = time.perf_counter()
                    for _ in range(steps):
                        _step(m, states[path], ids)
                    times[path].append((time.perf_counter() - started) / steps)
            for path in paths:
                rows.append({"model": name, "tokens": T, "path": path, "aten_calls": calls.get(path),
                             "ms": 1000 * statistics.median(times[path]), "ms_min": 1000 * min(times[path])})
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"\nOne step (forward of T tokens + commit): ATen calls and time, {' vs '.join(dict.fromkeys(r['path'] for r in rows))}")
    print(f"{'model':<16} {'T':>2} {'path':<8} {'ATen calls':>10} {'ms (median)':>11} {'ms (min)':>8}")
    for r in rows:
        calls = "-" if r["aten_calls"] is None else r["aten_calls"]
        print(f"{r['model']:<16} {r['tokens']:>2} {r['path']:<8} {calls:>10} {r['ms']:>11.2f} {r['ms_min']:>8.2f}")
