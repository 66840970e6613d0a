"""Long generations, honestly timed: speculative, our target-only and HF transformers' `generate()`.

Every path is warmed first (one short generation each), then for each length and held-out
prompt the three runs go back to back in an order that rotates, so a noisy neighbour slows all
three alike; each figure is a ratio of runs on the same prompt at the same moment, reported as
the median with the min-max over prompts. Greedy: speculative tokens must equal target-only
tokens (checked for every run); HF's tokens are compared too. A round's time is split into
draft (propose), verify, commit (target commit + drafter advance), prefill and the loop's own
bookkeeping (everything else).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from shared.decoding.drafters import Drafter
from shared.decoding.speculative import Generation, generate
from shared.model.hybrid import HybridLM

PHASES = ("propose", "verify", "commit", "prefill")


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


class HFRunner:
    """HF's `Qwen3_5ForCausalLM.generate()` on the same checkpoint: greedy, `use_cache=True`, its own EOS stop."""

    def __init__(self, directory: Path) -> None:
        from transformers import Qwen3_5ForCausalLM

        self.model = Qwen3_5ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        self.eos = self.model.config.eos_token_id

    def __call__(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        with torch.inference_mode():
            started = time.perf_counter()
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                      use_cache=True, pad_token_id=self.eos)
            seconds = time.perf_counter() - started
        return out[0, len(prompt):].tolist(), seconds


def long_generations(target: HybridLM, target_dir: Path, drafter: Callable[[], Drafter], k: int,
                     prompts: list[list[int]], lengths: tuple[int, ...], repeats: int = 1,
                     progress: Callable[[], None] = lambda: None) -> list[dict]:
    """One row per length: tokens/s of each path, the three ratios, round phases, exactness.

    Every prompt runs `repeats` times; each (prompt, repeat) is one sample of every figure."""
    hf = HFRunner(target_dir)
    runs: dict[str, Callable[[list[int], int], tuple[list[int], float, Generation | None]]] = {
        "speculative": lambda p, n: _ours(generate(target, p, n, drafter(), k)),
        "target_only": lambda p, n: _ours(generate(target, p, n)),
        "hf": lambda p, n: (*hf(p, n), None),
    }
    for run in runs.values():  # warm every path: first calls allocate, fault in weights, fill caches
        run(prompts[0], 32)
    rows = []
    for length in lengths:
        per_run: dict[str, list[float]] = {name: [] for name in runs}
        ratios: dict[str, list[float]] = {"speculative_over_target": [], "target_over_hf": [],
                                          "speculative_over_hf": []}
        phases: dict[str, float] = dict.fromkeys((*PHASES, "bookkeeping", "total"), 0.0)
        identical = identical_hf = True
        rounds = tokens_spec = drafted = accepted = 0
        for i, prompt in enumerate(p for p in prompts for _ in range(repeats)):
            names = list(runs)[i % 3:] + list(runs)[: i % 3]  # rotate the order
            out = {name: runs[name](prompt, length) for name in names}
            tps = {name: len(toks) / seconds for name, (toks, seconds, _) in out.items()}
            for name, value in tps.items():
                per_run[name].append(value)
            ratios["speculative_over_target"].append(tps["speculative"] / tps["target_only"])
            ratios["target_over_hf"].append(tps["target_only"] / tps["hf"])
            ratios["speculative_over_hf"].append(tps["speculative"] / tps["hf"])
            spec, plain = out["speculative"][2], out["target_only"][2]
            assert spec is not None and plain is not None
            identical &= spec.token_ids == plain.token_ids
            identical_hf &= out["hf"][0] == plain.token_ids
            s = spec.stats
            for phase in PHASES:
                phases[phase] += getattr(s, f"{phase}_seconds")
            phases["total"] += s.seconds
            phases["bookkeeping"] += s.seconds - sum(getattr(s, f"{p}_seconds") for p in PHASES)
            rounds, tokens_spec = rounds + s.rounds, tokens_spec + len(spec.token_ids)
            drafted, accepted = drafted + s.drafted, accepted + s.accepted
            progress()
        if not identical:
            raise AssertionError(f"greedy speculative tokens differ from target-only at {length} tokens")
        total = phases.pop("total")
        in_rounds = total - phases["prefill"]
        rows.append({
            "length": length, "prompts": len(prompts), "repeats": repeats, "k": k,
            "tokens_per_s": {name: spread(v) for name, v in per_run.items()},
            "ratios": {name: spread(v) for name, v in ratios.items()},
            "phase_share": {name: v / (total if name == "prefill" else in_rounds) for name, v in phases.items()},
            "round_ms": 1000 * in_rounds / max(rounds, 1),
            "acceptance_rate": accepted / max(drafted, 1), "mean_accepted_length": tokens_spec / max(rounds, 1),
            "identical_to_target_only": identical, "identical_to_hf": identical_hf,
        })
    return rows


def _ours(g: Generation) -> tuple[list[int], float, Generation]:
    return g.token_ids, g.stats.seconds, g


def print_rows(rows: list[dict]) -> None:
    r0 = rows[0]
    print(f"\nLong generations (greedy, {r0['prompts']} held-out prompts x {r0['repeats']}, k = {r0['k']}, warmed, "
          "alternated; median [min-max] over runs)")
    print(f"{'tokens':>6} {'spec tok/s':>11} {'target tok/s':>12} {'HF tok/s':>9} {'spec/target':>17} "
          f"{'target/HF':>17} {'spec/HF':>17} {'accept':>6} {'mean len':>8} identical")
    for r in rows:
        t, q = r["tokens_per_s"], r["ratios"]
        cells = [f"{x['median']:.2f} [{x['min']:.2f}-{x['max']:.2f}]" for x in
                 (q["speculative_over_target"], q["target_over_hf"], q["speculative_over_hf"])]
        same = "yes" if r["identical_to_target_only"] else "NO"
        print(f"{r['length']:>6} {t['speculative']['median']:>11.1f} {t['target_only']['median']:>12.1f} "
              f"{t['hf']['median']:>9.1f} {cells[0]:>17} {cells[1]:>17} {cells[2]:>17} {r['acceptance_rate']:>6.2f} "
              f"{r['mean_accepted_length']:>8.2f} {same} (HF: {'yes' if r['identical_to_hf'] else 'no'})")
    print("\nWhere a speculative round's time goes (draft + verify + commit + bookkeeping = 100 %; "
          "prefill: share of the whole generation)")
    print(f"{'tokens':>6} {'round ms':>9} {'draft':>6} {'verify':>7} {'commit':>7} {'bookkeep':>8} {'prefill':>7}")
    for r in rows:
        p = r["phase_share"]
        print(f"{r['length']:>6} {r['round_ms']:>9.2f} {100 * p['propose']:>5.1f}% {100 * p['verify']:>6.1f}% "
              f"{100 * p['commit']:>6.2f}% {100 * p['bookkeeping']:>7.2f}% {100 * p['prefill']:>6.2f}%")
