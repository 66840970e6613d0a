"""k per round from the cost model, served (`deltaspec bench --only cost_model`): does speculation that chooses its
own k give at least 0.97x the better of no speculation and the best fixed k, whatever the draft and the load?

Three drafts, each on its own servers: a `serve-target --draft-length fixed` and a `serve-target --draft-length
cost` (`deltaspec.shared.decoding.draft_length`), the same draft behind both:
- a good draft: the embedded pair (acceptance about 0.9; a draft service);
- a useless one: a random sparse MoE target (32 experts, top-4; `moe.moe_config`) with a random dense draft, which
  never matches, and whose verify reads several times a decode step's experts;
- a draft whose quality changes: n-gram lookup in the target's process, on prompts where it matches well (the
  target repeats itself) and where it does not, in turn: at N = 1 one session after another alternates, and within
  a session the acceptance moves as the text starts or stops repeating; at N >= 4 one batch mixes both kinds.
At 1, 4 and 8 concurrent `Generate` streams (the server loop, greedy, every output checked against in-process
target-only decoding) it measures aggregate tokens/s, each stream generating back to back for `WINDOW_S` (the tokens
delivered within it: every stream busy throughout, as under steady load; a fixed number of generations a stream
would end each run with the slowest sessions alone): first every fixed k in `FIXED_KS` once, on the fixed server,
to find the best; then k = 0 (on the cost server, so the two runs it is compared with most share a process), that
best fixed k and the cost model (up to `COST_K_MAX`), alternated in a rotating order, `REPEATS` times. The cost
server first serves `WARM_GENERATIONS` generations, as a server that has run a while has (its sessions start from
what earlier ones showed: `draft_length.Tally`). Each repeat's ratio is the cost model's rate over the better of
that repeat's k = 0 and best fixed k; medians with their spread. The targets run on a core of their own, the draft
service and the clients on the rest (`loopback.target_apart`), where the machine has two or more.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import cost_model_sim, report
from benchmarks.load import measure
from benchmarks.loopback import PROMPTS, Server, stop_all, target_apart, target_only_outputs, unpin
from benchmarks.moe_passes import moe_config
from deltaspec.shared.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from deltaspec.shared.model.checkpoint import hf_config, random_model, save_checkpoint
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer

LEVELS, QUICK_LEVELS = (1, 4, 8), (1, 4)
FIXED_KS, QUICK_FIXED_KS = tuple(range(1, 9)), (1, 2, 4, 8)
COST_K_MAX = 8
REPEATS, QUICK_REPEATS = 9, 2
WARM_GENERATIONS = 8
GOAL = 0.97
WINDOW_S, QUICK_WINDOW_S = 2.0, 0.5  # each run: every stream generating back to back for this long (`load.measure`)
# n-gram lookup matches well where the embedded target repeats itself (acceptance 0.9) and badly where it does not
# (0.2-0.3); alternated, so that one batch of 4 or 8 mixes them
NGRAM_PROMPTS = ["import os\nimport sys\n\n", "def area(r):\n    return 3.14 * r * r\n\n" * 3,
                 "# Read a file and count its lines\n", "def fibonacci(n):\n"]


def moe_pair(root: Path) -> tuple[Path, Path]:
    """A random MoE target and a random dense draft of its vocabulary, saved as checkpoints."""
    target = save_checkpoint(random_model(moe_config("qwen3_5_moe_text"), seed=3), root / "moe-target")
    draft = save_checkpoint(random_model(hf_config(layer_types=["linear_attention", "full_attention"]), seed=4),
                            root / "random-draft")
    return target, draft


def servers_for(target_dir: Path, draft_dir: Path | None, flags: tuple[str, ...] = ()) -> dict[str, Server]:
    """The fixed and the cost-model target, speculating with a draft service on `draft_dir`, or (None) with n-gram
    lookup in their own process; `flags` for both targets."""
    servers: dict[str, Server] = {}
    try:
        if draft_dir is not None:
            servers["draft"] = Server("serve-draft", "--model", str(draft_dir))
        flags = ("--model", str(target_dir), *flags,
                 *(("--draft-addr", servers["draft"].address) if draft_dir is not None else ("--draft", "ngram")))
        servers["fixed"] = Server("serve-target", *flags, "--draft-length", "fixed")
        servers["cost"] = Server("serve-target", *flags, "--draft-length", "cost")
        return servers
    except BaseException:
        stop_all(servers)
        raise


def served(target_dir: Path, draft_dir: Path | None, prompts: list[list[int]], levels: tuple[int, ...],
           fixed_ks: tuple[int, ...], repeats: int, max_new_tokens: int, window_s: float = WINDOW_S,
           flags: tuple[str, ...] = ()) -> list[dict]:
    """Per level: tokens/s at every fixed k (once), then k = 0, the best fixed k and the cost model, every repeat;
    `flags` for both targets (`--max-batch 1`: no pass costs timed at larger batches)."""
    expected = target_only_outputs(load_model(target_dir), prompts, max_new_tokens)
    servers = servers_for(target_dir, draft_dir, flags)
    try:
        placed = target_apart([servers[name].proc.pid for name in ("fixed", "cost")],
                              [*([servers["draft"].proc.pid] if "draft" in servers else []), os.getpid()])
        def rate(server: str, k: int, n: int, tokens: int = max_new_tokens, window: float | None = window_s,
                 first: int = 0) -> dict:
            used = {"target": servers[server], **({"draft": servers["draft"]} if "draft" in servers else {})}
            return measure(used, prompts, [e[:tokens] for e in expected], "server", k, n, tokens, 1, window, first)

        for server, k in (("cost", 0), ("cost", COST_K_MAX), *(("fixed", k) for k in fixed_ks)):
            rate(server, k, 1, 8, None)  # first calls of every path, unrecorded
        for _ in range(WARM_GENERATIONS // 4):  # the cost-model server's first sessions
            rate("cost", COST_K_MAX, 4, window=None)
        return [{**level(rate, n, fixed_ks, repeats), "placement": placed} for n in levels]
    finally:
        unpin()
        stop_all(servers)


def level(rate: Callable[..., dict], n: int, fixed_ks: tuple[int, ...], repeats: int) -> dict:
    fixed = {k: rate("fixed", k, n)["tokens_per_s"] for k in fixed_ks}
    best = max(fixed, key=fixed.get)
    runs = {"k = 0": ("cost", 0), f"fixed k = {best}": ("fixed", best), "cost model": ("cost", COST_K_MAX)}
    names = list(runs)
    rates: dict[str, list[float]] = {name: [] for name in names}
    cost_k, acceptance = [], []
    for i in range(repeats):
        for name in names[i % 3:] + names[:i % 3]:  # a repeat's three runs start at the same prompt, each repeat
            r = rate(*runs[name], n, first=i)  # at the next (a window holds a part of the prompts' cycle)
            rates[name].append(r["tokens_per_s"])
            if name == "cost model":
                cost_k.append(r["drafts_per_round"])
                acceptance.append(r["acceptance"])
    k0, best_fixed, cost = rates.values()
    return {"concurrency": n, "fixed_once": fixed, "best_fixed_k": best, "tokens_per_s": rates, "cost_k": cost_k,
            "acceptance": acceptance, "cost_vs_best": [c / max(z, f) for c, z, f in zip(cost, k0, best_fixed)],
            "cost_vs_k0": [c / z for c, z in zip(cost, k0)], "cost_vs_fixed": [c / f for c, f in zip(cost, best_fixed)]}


def cost_model(quick: bool = False) -> dict:
    started = time.time()
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    ngram_prompts = [tokenizer.encode(p) for p in NGRAM_PROMPTS]
    levels, repeats, ks = (QUICK_LEVELS, QUICK_REPEATS, QUICK_FIXED_KS) if quick else (LEVELS, REPEATS, FIXED_KS)
    tokens = 32 if quick else 64
    window_s = QUICK_WINDOW_S if quick else WINDOW_S
    with tempfile.TemporaryDirectory() as root:
        moe_target, random_draft = moe_pair(Path(root))
        drafts = {"good draft: the embedded pair": (DEFAULT_TARGET, DEFAULT_DRAFT, prompts),
                  "useless draft: MoE target, random draft": (moe_target, random_draft, prompts),
                  "changing draft: n-gram, prompts it matches and does not, in turn": (DEFAULT_TARGET, None,
                                                                                       ngram_prompts)}
        pairs = {name: served(target, draft, p, levels, ks, repeats, tokens, window_s)
                 for name, (target, draft, p) in drafts.items()}
    command = "deltaspec bench --only cost_model" + (" --quick" if quick else "")
    return {"header": report.header(command, started), "cost_k_max": COST_K_MAX, "max_new_tokens": tokens,
            "window_s": window_s, "simulated": cost_model_sim.simulate(),
            "warm_generations": WARM_GENERATIONS, "repeats": repeats, "pairs": pairs}


def _spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def print_rows(result: dict) -> None:
    print(f"\n{result['header']}")
    print(f"k per round from the cost model (up to {result['cost_k_max']}), served (server loop, greedy, "
          f"{result['max_new_tokens']} tokens a generation, outputs equal to target-only; the cost-model server "
          f"warmed by {result['warm_generations']} generations; aggregate tok/s, every stream generating back to "
          f"back for {result['window_s']:g} s a run, median [min-max] of "
          f"{result['repeats']} alternated runs; fixed k once each)")
    for pair, rows in result["pairs"].items():
        print(f"{pair}:" + (f" ({rows[0]['placement']})" if "placement" in rows[0] else ""))
        print(f"{'N':>3} {'k = 0':>19} {'best fixed k':>24} {'cost model':>19} {'accept':>6} {'mean k':>6} "
              f"{'cost / better':>18} {'cost / k=0':>18} {'cost / fixed':>18}  fixed k once")
        for r in rows:
            t = list(r["tokens_per_s"].values())
            once = " ".join(f"{k}:{v:.0f}" for k, v in r["fixed_once"].items())
            best = f"k={r['best_fixed_k']} {_spread(t[1], 1)}"
            print(f"{r['concurrency']:>3} {_spread(t[0], 1):>19} {best:>24} "
                  f"{_spread(t[2], 1):>19} {statistics.median(r['acceptance']):>6.2f} "
                  f"{statistics.median(r['cost_k']):>6.2f} {_spread(r['cost_vs_best'], 3):>18} "
                  f"{_spread(r['cost_vs_k0']):>18} {_spread(r['cost_vs_fixed']):>18}  {once}")
    print(f"goal: cost / better (the better of k = 0 and the best fixed k, each repeat) >= {GOAL} in every row")
    for pair, rows in result["pairs"].items():
        print(f"  {pair.split(':')[0]}: " + "; ".join(
            f"N = {r['concurrency']} {report.median_verdict(r['cost_vs_best'], low=GOAL)}" for r in rows))
    if "simulated" in result:
        cost_model_sim.print_rows(result["simulated"])
