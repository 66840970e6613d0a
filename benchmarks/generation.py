"""Long generations, honestly timed: speculative, our target-only and HF transformers' `generate()`.

Every path is warmed first (one short generation each), then for each length and held-out
prompt the runs go back to back in an order that rotates, so a noisy neighbour slows them
alike; each figure is a ratio of runs on the same prompt at the same moment, reported as
the median with the min-max over prompts. Greedy: speculative tokens must equal target-only
tokens (checked for every run); HF's tokens are compared too. A round's time is split into
draft (propose), verify, commit (target commit + drafter advance), prefill and the loop's own
bookkeeping (everything else).

Speculative decoding runs twice: with k = 8 drafts a round (`ModelDrafter`'s default, exactly k) and
with dynamic draft length (`ModelDrafter(stop_below=STOP_BELOW)`, up to the target's limit of 16
drafts a round), so the two are compared in the same run.
"""
from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from deltaspec.shared.decoding.drafters.model_drafter import STOP_BELOW, ModelDrafter
from deltaspec.shared.decoding.speculative import Generation, generate
from deltaspec.shared.decoding.target import MAX_DRAFT_TOKENS
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.state.spec import CHAIN_LOG_CAPACITY

PHASES = ("propose", "verify", "commit", "prefill")
FIXED_K = 8
SPECULATIVE = {"speculative": f"k = {FIXED_K}", "dynamic": f"dynamic k <= {MAX_DRAFT_TOKENS}, stop_below {STOP_BELOW}"}


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


def long_generations(target: HybridLM, target_dir: Path, draft: HybridLM, prompts: list[list[int]],
                     lengths: tuple[int, ...], repeats: int = 1, progress: Callable[[], None] = lambda: None) -> list[dict]:
    """One row per length: tokens/s of each path, the ratios, and each speculative path's round phases and exactness.

    Every prompt runs `repeats` times; each (prompt, repeat) is one sample of every figure."""
    hf = HFRunner(target_dir)
    runs: dict[str, Callable[[list[int], int], tuple[list[int], float, Generation | None]]] = {
        "speculative": lambda p, n: _ours(generate(target, p, n, ModelDrafter(draft), FIXED_K)),
        "dynamic": lambda p, n: _ours(generate(target, p, n, ModelDrafter(draft, stop_below=STOP_BELOW),
                                               MAX_DRAFT_TOKENS)),
        "target_only": lambda p, n: _ours(generate(target, p, n)),
        "hf": lambda p, n: (*hf(p, n), None),
    }
    for run in runs.values():  # warm every path: first calls allocate, fault in weights, fill caches
        run(prompts[0], 32)
    rows = []
    for length in lengths:
        per_run: dict[str, list[float]] = {name: [] for name in runs}
        ratios: dict[str, list[float]] = {"speculative_over_target": [], "dynamic_over_target": [],
                                          "target_over_hf": [], "speculative_over_hf": []}
        totals = {name: dict.fromkeys((*PHASES, "total", "rounds", "tokens", "drafted", "accepted"), 0.0)
                  for name in SPECULATIVE}
        identical_hf = True
        for i, prompt in enumerate(p for p in prompts for _ in range(repeats)):
            names = list(runs)[i % len(runs):] + list(runs)[: i % len(runs)]  # rotate the order
            out = {name: runs[name](prompt, length) for name in names}
            tps = {name: len(toks) / seconds for name, (toks, seconds, _) in out.items()}
            for name, value in tps.items():
                per_run[name].append(value)
            for name in SPECULATIVE:
                ratios[f"{name}_over_target"].append(tps[name] / tps["target_only"])
            ratios["target_over_hf"].append(tps["target_only"] / tps["hf"])
            ratios["speculative_over_hf"].append(tps["speculative"] / tps["hf"])
            plain = out["target_only"][2]
            assert plain is not None
            identical_hf &= out["hf"][0] == plain.token_ids
            for name, t in totals.items():
                gen = out[name][2]
                assert gen is not None
                if gen.token_ids != plain.token_ids:
                    raise AssertionError(f"greedy {name} tokens differ from target-only at {length} tokens")
                s = gen.stats
                for phase in PHASES:
                    t[phase] += getattr(s, f"{phase}_seconds")
                t["total"] += s.seconds
                t["rounds"], t["tokens"] = t["rounds"] + s.rounds, t["tokens"] + len(gen.token_ids)
                t["drafted"], t["accepted"] = t["drafted"] + s.drafted, t["accepted"] + s.accepted
            progress()
        rows.append({
            "length": length, "prompts": len(prompts), "repeats": repeats,
            "tokens_per_s": {name: spread(v) for name, v in per_run.items()},
            "ratios": {name: spread(v) for name, v in ratios.items()},
            "rounds": {name: _round_figures(t) for name, t in totals.items()},
            "identical_to_target_only": True, "identical_to_hf": identical_hf,
        })
    return rows


def fast_paths(target: HybridLM, draft: HybridLM, prompts: list[list[int]], length: int, repeats: int = 2,
               paths: tuple[str, ...] = ("compiled",)) -> dict:
    """Tokens/s of greedy target-only and dynamic speculative generations (`deltaspec generate`'s default), eager
    and on each of `paths` for both models ("compiled": their passes compiled; "captured": replayed as CUDA graphs),
    on the models' device: every run's tokens equal eager target-only's. Warmed, the runs of each (prompt, repeat) in
    a rotating order; median [min-max] per path, and each path over eager per sample."""
    models = {"eager": (target, draft)}
    if "compiled" in paths:
        models["compiled"] = (copy.deepcopy(target).compile(warm_up=True),
                              copy.deepcopy(draft).compile(warm_up=True, log_capacity=CHAIN_LOG_CAPACITY))
    if "captured" in paths:
        models["captured"] = (copy.deepcopy(target).capture(), copy.deepcopy(draft).capture())
    runs: dict[str, Callable[[list[int], int], Generation]] = {}
    for path, (t, d) in models.items():
        runs[f"{path} target_only"] = lambda p, n, t=t: generate(t, p, n)
        runs[f"{path} dynamic"] = lambda p, n, t=t, d=d: generate(t, p, n, ModelDrafter(d, stop_below=STOP_BELOW),
                                                                  MAX_DRAFT_TOKENS)
    for run in runs.values():
        run(prompts[0], 32)
    tps: dict[str, list[float]] = {name: [] for name in runs}
    ratio: dict[str, list[float]] = {f"{path} {kind}": [] for path in paths for kind in ("target_only", "dynamic")}
    for i, prompt in enumerate(p for p in prompts for _ in range(repeats)):
        names = list(runs)[i % len(runs):] + list(runs)[: i % len(runs)]
        out = {name: runs[name](prompt, length) for name in names}
        want = out["eager target_only"].token_ids
        for name, g in out.items():
            if g.token_ids != want:
                raise AssertionError(f"{name}: tokens differ from eager target-only on prompt {i // repeats}")
            tps[name].append(len(g.token_ids) / g.stats.seconds)
        for name in ratio:
            ratio[name].append(tps[name][-1] / tps[f"eager {name.split()[1]}"][-1])
    return {"length": length, "device": str(target.device), "paths": list(paths),
            "tokens_per_s": {n: spread(v) for n, v in tps.items()},
            "over_eager": {n: spread(v) for n, v in ratio.items()}}


def print_fast_paths(r: dict) -> None:
    print(f"\nEager, {' and '.join(r['paths'])} passes on {r['device']} ({r['length']} tokens, greedy, dynamic = "
          f"{SPECULATIVE['dynamic']}; median [min-max] tok/s; identical tokens)")
    for kind in ("target_only", "dynamic"):
        e = r["tokens_per_s"][f"eager {kind}"]
        line = f"{kind:>11}: eager {e['median']:.1f} [{e['min']:.1f}-{e['max']:.1f}]"
        for path in r["paths"]:
            c, q = r["tokens_per_s"][f"{path} {kind}"], r["over_eager"][f"{path} {kind}"]
            line += (f", {path} {c['median']:.1f} [{c['min']:.1f}-{c['max']:.1f}], {path}/eager {q['median']:.2f} "
                     f"[{q['min']:.2f}-{q['max']:.2f}]")
        print(line)


def _round_figures(t: dict[str, float]) -> dict:
    """Phase shares (of the rounds' time; prefill of the whole generation), round length, acceptance."""
    in_rounds = t["total"] - t["prefill"]
    shares = {phase: t[phase] / (t["total"] if phase == "prefill" else in_rounds) for phase in PHASES}
    shares["bookkeeping"] = (in_rounds - sum(t[p] for p in PHASES if p != "prefill")) / in_rounds
    rounds = max(t["rounds"], 1)
    return {"phase_share": shares, "round_ms": 1000 * in_rounds / rounds,
            "acceptance_rate": t["accepted"] / max(t["drafted"], 1), "drafted_per_round": t["drafted"] / rounds,
            "mean_accepted_length": t["tokens"] / rounds}


def _ours(g: Generation) -> tuple[list[int], float, Generation]:
    return g.token_ids, g.stats.seconds, g


def print_rows(rows: list[dict], path: str = "eager fused path") -> None:
    r0 = rows[0]
    print(f"\nLong generations, {path} (greedy, {r0['prompts']} held-out prompts x {r0['repeats']}, warmed, alternated; median "
          f"[min-max] over runs). spec: {SPECULATIVE['speculative']}; dynamic: {SPECULATIVE['dynamic']}")
    print(f"{'tokens':>6} {'spec tok/s':>11} {'dyn tok/s':>11} {'target tok/s':>12} {'HF tok/s':>9} {'spec/target':>17} "
          f"{'dynamic/target':>17} {'target/HF':>17} {'spec/HF':>17} identical")
    for r in rows:
        t, q = r["tokens_per_s"], r["ratios"]
        cells = [f"{x['median']:.2f} [{x['min']:.2f}-{x['max']:.2f}]" for x in
                 (q["speculative_over_target"], q["dynamic_over_target"], q["target_over_hf"], q["speculative_over_hf"])]
        print(f"{r['length']:>6} {t['speculative']['median']:>11.1f} {t['dynamic']['median']:>11.1f} "
              f"{t['target_only']['median']:>12.1f} {t['hf']['median']:>9.1f} {cells[0]:>17} {cells[1]:>17} {cells[2]:>17} "
              f"{cells[3]:>17} yes (HF: {'yes' if r['identical_to_hf'] else 'no'})")
    print("\nWhere a speculative round's time goes (draft + verify + commit + bookkeeping = 100 %; "
          "prefill: share of the whole generation)")
    print(f"{'tokens':>6} {'path':<7} {'drafted':>7} {'accept':>6} {'mean len':>8} {'round ms':>9} {'draft':>6} {'verify':>7} "
          f"{'commit':>7} {'bookkeep':>8} {'prefill':>7}")
    for r in rows:
        for name, f in r["rounds"].items():
            p = f["phase_share"]
            print(f"{r['length']:>6} {'k = 8' if name == 'speculative' else 'dynamic':<7} {f['drafted_per_round']:>7.2f} {f['acceptance_rate']:>6.2f} "
                  f"{f['mean_accepted_length']:>8.2f} {f['round_ms']:>9.2f} {100 * p['propose']:>5.1f}% "
                  f"{100 * p['verify']:>6.1f}% {100 * p['commit']:>6.2f}% {100 * p['bookkeeping']:>7.2f}% "
                  f"{100 * p['prefill']:>6.2f}%")
