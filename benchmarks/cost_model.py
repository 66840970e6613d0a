"""k per round from the cost model, served (`deltaspec bench --only cost_model`): does speculation that chooses its
own k stay within 3 % of no speculation where drafts do not pay, and keep what they gain where they do?

Two pairs, each served as `serve-draft` and two `serve-target` processes speculating with it, one with a fixed k and
one with `--draft-length cost` (`deltaspec.shared.decoding.draft_length`):
- the embedded pair, whose draft matches the target (acceptance about 0.9): speculation pays;
- a random sparse MoE target (32 experts, top-4; `moe.moe_config`) with a random dense draft, which never matches
  (acceptance about 0): every drafted token is wasted, and a verify reads several times a decode step's experts.
At 1, 4 and 8 concurrent `Generate` streams (the server loop, greedy, every output checked against in-process
target-only decoding) it measures aggregate tokens/s target-only (k = 0), at a fixed k = 4, and with the cost model
(up to 4). The cost-model server first serves `WARM_GENERATIONS` generations, as a server that has run a while has
(its sessions start from what earlier ones showed: `draft_length.Tally`). The three runs alternate, in a rotating
order, `REPEATS` times; medians with their spread.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import report
from benchmarks.load import measure
from benchmarks.loopback import PROMPTS, Server, stop_all, target_only_outputs
from benchmarks.moe_passes import moe_config
from deltaspec.shared.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from deltaspec.shared.model.checkpoint import hf_config, random_model, save_checkpoint
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer

LEVELS, QUICK_LEVELS = (1, 4, 8), (1, 4)
K = 4
REPEATS, QUICK_REPEATS = 3, 2
WARM_GENERATIONS = 8
RUNS = ("k = 0", f"k = {K}", "cost model")


def moe_pair(root: Path) -> tuple[Path, Path]:
    """A random MoE target and a random dense draft of its vocabulary, saved as checkpoints."""
    target = save_checkpoint(random_model(moe_config("qwen3_5_moe_text"), seed=3), root / "moe-target")
    draft = save_checkpoint(random_model(hf_config(layer_types=["linear_attention", "full_attention"]), seed=4),
                            root / "random-draft")
    return target, draft


def served(target_dir: Path, draft_dir: Path, prompts: list[list[int]], levels: tuple[int, ...], repeats: int,
           max_new_tokens: int) -> list[dict]:
    """Per level: tokens/s of each run (k = 0 and k = 4 on the fixed server, the cost model's), every repeat."""
    expected = target_only_outputs(load_model(target_dir), prompts, max_new_tokens)
    servers = {"draft": Server("serve-draft", "--model", str(draft_dir))}
    try:
        flags = ("--model", str(target_dir), "--draft-addr", servers["draft"].address)
        servers["fixed"] = Server("serve-target", *flags)
        servers["cost"] = Server("serve-target", *flags, "--draft-length", "cost")
        run = {RUNS[0]: ("fixed", 0), RUNS[1]: ("fixed", K), RUNS[2]: ("cost", K)}

        def row(name: str, n: int, tokens: int = max_new_tokens) -> dict:
            target, k = run[name]
            return measure({"target": servers[target], "draft": servers["draft"]}, prompts,
                           [e[:tokens] for e in expected], "server", k, n, tokens, 1)

        for name in RUNS:  # first calls of every path, unrecorded
            row(name, 1, 8)
        for _ in range(WARM_GENERATIONS // 4):  # the cost-model server's first sessions
            row(RUNS[2], 4)
        out = []
        for n in levels:
            rates: dict[str, list[float]] = {name: [] for name in RUNS}
            acceptance: dict[str, list[float]] = {name: [] for name in RUNS}
            k_mean: list[float] = []
            for i in range(repeats):
                for name in RUNS[i % 3:] + RUNS[:i % 3]:
                    r = row(name, n)
                    rates[name].append(r["tokens_per_s"])
                    acceptance[name].append(r["acceptance"])
                    if name == RUNS[2]:
                        k_mean.append(r["drafts_per_round"])
            out.append({"concurrency": n, "tokens_per_s": rates, "acceptance": acceptance, "cost_k": k_mean,
                        "cost_vs_k0": [c / z for c, z in zip(rates[RUNS[2]], rates[RUNS[0]])],
                        "cost_vs_fixed": [c / f for c, f in zip(rates[RUNS[2]], rates[RUNS[1]])]})
        return out
    finally:
        stop_all(servers)


def cost_model(quick: bool = False) -> dict:
    started = time.time()
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    levels, repeats = (QUICK_LEVELS, QUICK_REPEATS) if quick else (LEVELS, REPEATS)
    tokens = 32 if quick else 64
    with tempfile.TemporaryDirectory() as root:
        moe_target, random_draft = moe_pair(Path(root))
        pairs = {"embedded pair (trained draft)": served(DEFAULT_TARGET, DEFAULT_DRAFT, prompts, levels, repeats,
                                                         tokens),
                 "MoE target, random draft": served(moe_target, random_draft, prompts, levels, repeats, tokens)}
    command = "deltaspec bench --only cost_model" + (" --quick" if quick else "")
    return {"header": report.header(command, started), "k": K, "max_new_tokens": tokens,
            "warm_generations": WARM_GENERATIONS, "pairs": pairs}


def _spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def print_rows(result: dict) -> None:
    print(f"\n{result['header']}")
    print(f"k per round from the cost model, served (server loop, greedy, {result['max_new_tokens']} tokens a "
          f"generation, outputs equal to target-only; the cost-model server warmed by {result['warm_generations']} "
          f"generations; aggregate tok/s, median [min-max])")
    for pair, rows in result["pairs"].items():
        print(f"{pair}:")
        print(f"{'N':>3} {'k = 0':>19} {'k = ' + str(result['k']):>19} {'cost model':>19} {'accept':>6} "
              f"{'mean k':>6} {'cost / k=0':>18} {'cost / k=' + str(result['k']):>18}")
        for r in rows:
            t = r["tokens_per_s"]
            print(f"{r['concurrency']:>3} {_spread(t[RUNS[0]], 1):>19} {_spread(t[RUNS[1]], 1):>19} "
                  f"{_spread(t[RUNS[2]], 1):>19} {statistics.median(r['acceptance'][RUNS[2]]):>6.2f} "
                  f"{statistics.median(r['cost_k']):>6.2f} "
                  f"{_spread(r['cost_vs_k0']):>18} {_spread(r['cost_vs_fixed']):>18}")
    print("goal: the cost model never more than 3 % slower than k = 0 (cost / k=0 >= 0.97) at every N")
