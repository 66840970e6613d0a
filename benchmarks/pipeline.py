"""Pipelined vs serial rounds over loopback gRPC with a network delay: tokens/s and bytes staged per round.

Each service runs as its own `serve-draft` / `serve-target` process (`benchmarks.loopback`), as on
its own host (the draft's work overlaps the target's only across processes). Where the machine has two
cores or more, each service also gets cores of its own (`pin` of them each, 1 by default: the targets the
first, the draft the next; the bench's own process, client and proxies, runs on the cores left, or on any
when none are): on its own host the draft's speculative work never takes the target's core, while on shared
cores every pass of it can delay a verify. With one core a service's gRPC, loop and model threads share it,
as they would not on a host of its own; `--cores-per-service N` gives each N, where the machine has them.
Every link passes a `TcpProxy` adding the same delay each way: client to target, client to draft, and target to draft.
Two target processes share the draft: one stages pipelined rounds and pipelines its own `Generate`
loop (`--pipeline-depth 1`), one does neither (0), so the server-side loop runs both ways; the
client-driven loop runs `pipeline=True` and `False` against them. Configurations alternate, and every
output is checked against in-process target-only greedy decoding. Each row notes the machine's 1-minute
load average when it ended: on a shared machine, other work takes the cores the overlap needs. It also
says what a round costs in CPU time (the target process's and the draft process's, from /proc) and in the
draft's forward passes (its own metrics): the overlap only pays while both fit on the machine's cores. And it
reads off the target's own outputs which rounds the pipelined loop can keep at all (`kept_rounds`), and how many
of the misses a second speculation, built on the draft's second choice, would have turned into kept rounds.
Both placements run one after the other (`--placement both`, the default): pinned, and unpinned, the services
sharing the cores as deployed with default settings. `deltaspec bench` runs it on 6 held-out prompts (text the
pair never trained on). Each row also gives the loop's own count of rounds whose speculated successor it used.
A third configuration (`--branches N`, 1 by default, 0 skips it) runs pipelined rounds against a second draft service
that stages branches for likely misses (`serve-draft --branches N`), alternated with the other two: its tokens/s
over serial and over pipelining without branches, how its branches ended, and the draft's time making them.
Run: `python -m benchmarks.pipeline [--quick] [--heldout N] [--placement both|pinned|unpinned]
[--branches N] [--save DIR]`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import ExitStack
from math import nan
from pathlib import Path

import torch

from benchmarks import report
from benchmarks.fault_proxy import TcpProxy
from benchmarks.loopback import Server, check_greedy, pin_threads, target_only_outputs
from benchmarks.speedup import heldout_prompts
from deltaspec.shared.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from deltaspec.shared.model.hybrid import HybridLM

PROMPTS = [list(b"def fibonacci(n):\n"), list(b"import os\nimport sys\n\n"), list(b"class Stack:\n    def __init__")]
LOOPS = ("client", "server")


def compare(target_dir: Path = DEFAULT_TARGET, draft_dir: Path = DEFAULT_DRAFT, prompts: list[list[int]] | None = None,
            max_new_tokens: int = 96, num_draft_tokens: int = 4, delays_ms: tuple[float, ...] = (0, 1, 5),
            repeats: int = 1, compile: bool = False, pin: int = 1, device: str = "cpu", branches: int = 1) -> list[dict]:
    """One row per (delay, loop): tokens/s serial, pipelined, and pipelined with the draft staging `branches` (a
    second draft service, `serve-draft --branches`; 0: not run), their ratios, bytes staged per round.

    `compile`: both services run `--compile` (their passes as compiled graphs). `pin`: cores for each service
    (0: none, all share), where there are that many for both; the bench's process then runs on the rest.
    `device="cuda"`: both services' models and states on the GPU."""
    from deltaspec.shared.model.loader import load_model
    from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server

    prompts = prompts or PROMPTS
    target = load_model(target_dir)
    expected = target_only_outputs(load_model(target_dir, device=device) if device != "cpu" else target, prompts,
                                   max_new_tokens)
    draft_model = load_model(draft_dir)
    plans = [serial_rounds(draft_model, p, out, num_draft_tokens) for p, out in zip(prompts, expected)]
    study = kept_rounds(plans)
    rows = []
    with ExitStack() as stack:
        options = ["--device", device, *(["--compile"] if compile else [])]
        modes = ("serial", "pipelined", *(("branches",) if branches else ()))
        # the draft each mode uses: a service staging no branches, and one staging them
        drafts = {mode: "branches" if mode == "branches" else "plain" for mode in modes}
        draft_servers = {name: Server("serve-draft", "--model", str(draft_dir), "--branches",
                                      str(branches if name == "branches" else 0), *options)
                         for name in dict.fromkeys(drafts.values())}
        for server in draft_servers.values():
            stack.callback(server.stop)
        to_draft = {name: TcpProxy([server.address]) for name, server in draft_servers.items()}
        targets: dict[str, Server] = {}
        for mode in modes:
            server = targets[mode] = Server("serve-target", "--model", str(target_dir), "--draft-addr",
                                            to_draft[drafts[mode]].address, "--draft-timeout", "30",
                                            "--pipeline-depth", str(int(mode != "serial")), *options)
            stack.callback(server.stop)
        cores = sorted(os.sched_getaffinity(0))
        pinned = pin if 0 < pin and 2 * pin <= len(cores) else 0
        if pinned:
            for server in draft_servers.values():
                server.pin(set(cores[pinned:2 * pinned]))
            for server in targets.values():
                server.pin(set(cores[:pinned]))
            if len(cores) > 2 * pinned:  # the client and proxies (this process's threads) off the services' cores
                pin_threads(os.getpid(), set(cores[2 * pinned:]))
                stack.callback(pin_threads, os.getpid(), set(cores))
        client_draft = {name: TcpProxy([server.address]) for name, server in draft_servers.items()}
        client_target = {mode: TcpProxy([server.address]) for mode, server in targets.items()}
        proxies = (*to_draft.values(), *client_draft.values(), *client_target.values())
        for proxy in proxies:
            stack.callback(proxy.close)

        def run(loop: str, mode: str, prompt: list[int], arrivals: list[tuple[float, int]] | None = None):
            """A generation; `arrivals` gets (when, how many) for each round's tokens as the client receives them."""
            address = client_target[mode].address
            on_tokens = None if arrivals is None else \
                lambda tokens, _: arrivals.append((time.perf_counter(), len(tokens))) if tokens else None
            if loop == "client":
                return generate_client_driven(address, client_draft[drafts[mode]].address, prompt, "", max_new_tokens,
                                              num_draft_tokens, draft_timeout_s=30.0, on_tokens=on_tokens,
                                              pipeline=mode != "serial")[0]
            return generate_on_server(address, prompt, "", max_new_tokens, num_draft_tokens, on_tokens=on_tokens)[0]

        for delay in delays_ms:
            for proxy in proxies:
                proxy.delay_s = delay / 1000
            for loop in LOOPS:
                totals = {mode: dict.fromkeys(("tokens", "seconds", "rounds", "staged", "target_cpu", "draft_cpu",
                                               "draft_passes", "kept", "spec_kept", "spec_missed", *BRANCH_COUNTS),
                                              0.0) for mode in modes}
                gaps: dict[str, list[float]] = {"serial": [], "after_kept": [], "after_miss": []}
                for mode in modes:  # warm: connections, sessions, caches
                    run(loop, mode, prompts[0])
                for _ in range(repeats):
                    for prompt, want, plan in zip(prompts, expected, plans):
                        for mode in modes:
                            draft_server = draft_servers[drafts[mode]]
                            before = _costs(targets[mode], draft_server)
                            arrivals: list[tuple[float, int]] = []
                            gen = run(loop, mode, prompt, arrivals)
                            check_greedy(gen.token_ids, want, f"{loop} loop, {mode}, {delay} ms")
                            if mode != "branches":
                                _round_gaps(gaps, plan, arrivals, mode == "pipelined")
                            t = totals[mode]
                            for name, value in _costs(targets[mode], draft_server).items():
                                t[name] += value - before[name]
                            t["tokens"] += len(gen.token_ids)
                            t["seconds"] += gen.stats.seconds
                            t["rounds"] += gen.stats.rounds
                            t["staged"] += gen.stats.staged_bytes
                            t["spec_kept"] += gen.stats.speculations_kept
                            t["spec_missed"] += gen.stats.speculations_missed
                rate = {mode: totals[mode]["tokens"] / totals[mode]["seconds"] for mode in modes}
                serial, piped = totals["serial"], totals["pipelined"]
                rows.append({"delay_ms": delay, "loop": loop, "serial_tokens_per_s": rate["serial"],
                             "pipelined_tokens_per_s": rate["pipelined"], "speedup": rate["pipelined"] / rate["serial"],
                             "serial_staged_bytes_per_round": serial["staged"] / serial["rounds"],
                             "pipelined_staged_bytes_per_round": piped["staged"] / piped["rounds"],
                             "rounds": (serial["rounds"], piped["rounds"]), "identical_tokens": True,
                             "kept_share": piped["kept"] / piped["rounds"],  # the pipeline's hit rate
                             # the loop's own count (GenerationStats): rounds whose speculated successor was used
                             "speculation_used": piped["spec_kept"] / max(piped["spec_kept"] + piped["spec_missed"], 1),
                             "num_draft_tokens": num_draft_tokens,
                             "round_ms": {name: statistics.median(v) for name, v in gaps.items() if v},
                             "rounds_timed": {name: len(v) for name, v in gaps.items()},
                             **_per_round(totals), "pinned": pinned, "placement": "pinned" if pinned else "unpinned",
                             "kept_rounds": study, "device": device,
                             **(_branch_row(totals, rate, branches) if branches else {}),
                             "load_average": os.getloadavg()[0]})
    return rows


BRANCH_OUTCOMES = ("used", "unused", "cut")  # `deltaspec_draft_branches_total{outcome}`'s
BRANCH_COUNTS = (*(f"branches_{o}" for o in BRANCH_OUTCOMES), "branch_seconds")


def _branch_row(totals: dict[str, dict[str, float]], rate: dict[str, float], branches: int) -> dict:
    """Pipelined with branches against pipelined without, in the same run: the gain, what the branches did, and the
    draft's cost (its CPU per round, its time making branches)."""
    t, plain = totals["branches"], totals["pipelined"]
    return {"branches": branches, "branches_tokens_per_s": rate["branches"],
            "branches_speedup": rate["branches"] / rate["serial"],
            "branches_vs_pipelined": rate["branches"] / rate["pipelined"],
            "branches_kept_share": t["kept"] / t["rounds"],
            "branches_speculation_used": t["spec_kept"] / max(t["spec_kept"] + t["spec_missed"], 1),
            "branch_counts": {name: t[name] for name in BRANCH_COUNTS[:3]},
            "branch_ms_per_round": 1e3 * t["branch_seconds"] / t["rounds"],
            "draft_cpu_ms_per_round_branches": 1e3 * t["draft_cpu"] / t["rounds"],
            "draft_cpu_ms_per_round_pipelined": 1e3 * plain["draft_cpu"] / plain["rounds"],
            "wall_ms_per_round_branches": 1e3 * t["seconds"] / t["rounds"]}


def placements(prompts: list[list[int]], pins: tuple[int, ...] = (1, 0), **options) -> list[dict]:
    """`compare` once per placement, in one run: each service pinned to cores of its own (standing in for hosts of
    their own), then sharing the machine's cores as deployed with default settings."""
    return [row for pin in pins for row in compare(prompts=prompts, pin=pin, **options)]


def kept_rounds(plans: list[list[tuple[int, str, bool]]]) -> dict[str, int]:
    """Which greedy rounds a pipelined loop can keep, counted over generations' `serial_rounds`.
    `second_choice_*`: misses where the draft's second most likely token at the position that decided the round
    is the target's, i.e. where a second speculation, built on that token, would have held."""
    counts = dict.fromkeys(("rounds", "kept", "rejected", "wrong_guess", "second_choice_rejected",
                            "second_choice_wrong_guess"), 0)
    for plan in plans:
        for _, kind, second in plan:
            counts["rounds"] += 1
            counts[kind] += 1
            if kind != "kept":
                counts[f"second_choice_{kind}"] += second
    return counts


def serial_rounds(draft: HybridLM, prompt: list[int], output: list[int], k: int) -> list[tuple[int, str, bool]]:
    """The serial loop's greedy rounds of k drafts along the target's own `output` (all but the one it ends inside),
    read off it: accepted drafts are the target's tokens, so the draft's choices along the output (one pass over
    it) are those it makes in the rounds. Each round: the tokens it commits; "kept" when its k drafts and the
    guessed next token hold (a pipelined loop keeps its speculation), else "rejected" (a draft) or "wrong_guess";
    whether the draft's second choice at the position that decided it is the target's token."""
    ids = prompt + output
    with torch.no_grad():
        logits, _ = draft(torch.tensor(ids[:-1]), draft.new_state(capacity=len(ids)))
    top2 = logits.topk(2, -1).indices.tolist()  # top2[p]: the draft's choices for ids[p + 1]
    rounds, start = [], len(prompt)  # the round's first token
    while start + k < len(ids):
        held = next((i for i in range(k) if top2[start + i - 1][0] != ids[start + i]), k)
        decided = start + held  # the target's correction, or after k drafts its next token
        kind = "kept" if top2[decided - 1][0] == ids[decided] else "rejected" if held < k else "wrong_guess"
        rounds.append((held + 1, kind, top2[decided - 1][1] == ids[decided]))
        start = decided + 1
    return rounds


def _round_gaps(gaps: dict[str, list[float]], plan: list[tuple[int, str, bool]], arrivals: list[tuple[float, int]],
                pipelined: bool) -> None:
    """Milliseconds from one round's tokens to the next's at the client, for a generation whose rounds are those
    of `plan` (else nothing): all alike when serial; pipelined, apart after a round the loop could keep and after
    one it could not (a miss, after which the next proposal is asked for only at the verdict)."""
    if [n for _, n in arrivals[:len(plan)]] != [size for size, _, _ in plan]:
        return
    for i in range(1, len(plan)):
        name = "serial" if not pipelined else "after_kept" if plan[i - 1][1] == "kept" else "after_miss"
        gaps[name].append(1e3 * (arrivals[i][0] - arrivals[i - 1][0]))


def _per_round(totals: dict[str, dict[str, float]]) -> dict[str, tuple[float, float]]:
    """(serial, pipelined) per round: wall and CPU milliseconds, the draft's passes."""
    def both(name: str, scale: float = 1.0) -> tuple[float, float]:
        return tuple(scale * totals[m][name] / totals[m]["rounds"]  # type: ignore[return-value]
                     for m in ("serial", "pipelined"))
    return {"wall_ms_per_round": both("seconds", 1e3), "target_cpu_ms_per_round": both("target_cpu", 1e3),
            "draft_cpu_ms_per_round": both("draft_cpu", 1e3), "draft_passes_per_round": both("draft_passes")}


def _costs(target: Server, draft: Server) -> dict[str, float]:
    """CPU seconds the two processes have used so far, the draft's forward passes, and the pipelined rounds the
    target kept (staged on a pending round, then made the pending round by its commit)."""
    drafts = draft.samples()  # one scrape for all of the draft's
    return {"target_cpu": target.cpu_s(), "draft_cpu": draft.cpu_s(),
            "draft_passes": drafts["deltaspec_batch_pass_seconds_count"],
            "kept": target.metric('deltaspec_pipelined_rounds_total{outcome="kept"}', 0.0),
            **{f"branches_{o}": drafts.get(f'deltaspec_draft_branches_total{{outcome="{o}"}}', 0.0)
               for o in BRANCH_OUTCOMES},
            "branch_seconds": sum(drafts.get(f'deltaspec_draft_branch_seconds_total{{outcome="{o}"}}', 0.0)
                                  for o in BRANCH_OUTCOMES)}


def print_rows(rows: list[dict]) -> None:
    """One set of tables per placement (pinned, unpinned), in the order run."""
    for placement in dict.fromkeys(r.get("placement", "pinned") for r in rows):
        _print_placement([r for r in rows if r.get("placement", "pinned") == placement])


def _print_placement(rows: list[dict]) -> None:
    pinned = rows[0].get("pinned", 0) if rows else 0
    cores = "sharing the cores" if not pinned else "a core each" if pinned == 1 else f"{pinned} cores each"
    if rows and rows[0].get("device", "cpu") != "cpu":
        cores += f", models on {rows[0]['device']}"
    print(f"\nPipelined vs serial rounds over loopback gRPC, services in their own processes ({cores}), delay each "
          "way on every link (greedy; every output equal to target-only decoding)")
    print(f"{'delay ms':>8} {'loop':>6} {'serial tok/s':>12} {'pipelined':>9} {'x serial':>8} "
          f"{'staged B/round serial':>21} {'pipelined':>9} {'kept':>5} {'used':>5} {'load':>5}")
    for r in rows:
        print(f"{r['delay_ms']:>8g} {r['loop']:>6} {r['serial_tokens_per_s']:>12.1f} "
              f"{r['pipelined_tokens_per_s']:>9.1f} {r['speedup']:>8.2f} {r['serial_staged_bytes_per_round']:>21.0f} "
              f"{r['pipelined_staged_bytes_per_round']:>9.0f} {r.get('kept_share', float('nan')):>5.0%} "
              f"{r.get('speculation_used', float('nan')):>5.0%} {r['load_average']:>5.1f}")
    print("kept: pipelined rounds the target staged on the round before and kept (its "
          "deltaspec_pipelined_rounds_total{outcome=\"kept\"}), over all pipelined rounds; used: rounds whose "
          "speculated next round the loop used, over rounds that had one (GenerationStats.speculations_kept)")
    print("\nWhat a round costs, serial -> pipelined: wall time, CPU time of the target and draft processes (not the "
          "bench's own: client and proxies), the draft's forward passes, and the cores those two processes kept busy")
    print(f"{'delay ms':>8} {'loop':>6} {'wall ms':>13} {'target CPU ms':>13} {'draft CPU ms':>13} "
          f"{'draft passes':>12} {'cores busy':>11}")
    for r in rows:
        wall, target, draft = r["wall_ms_per_round"], r["target_cpu_ms_per_round"], r["draft_cpu_ms_per_round"]
        busy = tuple((target[i] + draft[i]) / wall[i] for i in (0, 1))
        print(f"{r['delay_ms']:>8g} {r['loop']:>6} {_pair(wall):>13} {_pair(target):>13} {_pair(draft):>13} "
              f"{_pair(r['draft_passes_per_round']):>12} {_pair(busy, 2):>11}")  # type: ignore[arg-type]
    if rows and "round_ms" in rows[0]:
        print("\nFrom one round's tokens to the next's, read at the client (median ms): serial rounds; pipelined "
              "rounds after one whose speculation could hold (every draft and the guess kept, read off the output), "
              "and after one whose could not")
        print(f"{'delay ms':>8} {'loop':>6} {'serial':>7} {'after kept':>10} {'after miss':>10} {'miss / serial':>13}")
        for r in rows:
            ms = r["round_ms"]
            serial, kept, miss = (ms.get(name, nan) for name in ("serial", "after_kept", "after_miss"))
            print(f"{r['delay_ms']:>8g} {r['loop']:>6} {serial:>7.1f} {kept:>10.1f} {miss:>10.1f} {miss / serial:>13.2f}")
    if rows and "branches" in rows[0]:
        _print_branches(rows)
    if rows and "kept_rounds" in rows[0]:
        _print_kept(rows[0]["kept_rounds"], rows[0]["num_draft_tokens"])


def _print_branches(rows: list[dict]) -> None:
    print(f"\nPipelined with the draft staging branches for likely misses (serve-draft --branches "
          f"{rows[0]['branches']}), same run: the gain, what the branches did, and what they cost the draft")
    print(f"{'delay ms':>8} {'loop':>6} {'tok/s':>7} {'x serial':>8} {'x pipelined':>11} {'used':>5} "
          f"{'branches used/unused/cut':>24} {'branch ms/round':>15} {'draft CPU ms/round':>18}")
    for r in rows:
        c = r["branch_counts"]
        counts = f"{c['branches_used']:.0f}/{c['branches_unused']:.0f}/{c['branches_cut']:.0f}"
        cpu = f"{r['draft_cpu_ms_per_round_pipelined']:.1f} -> {r['draft_cpu_ms_per_round_branches']:.1f}"
        print(f"{r['delay_ms']:>8g} {r['loop']:>6} {r['branches_tokens_per_s']:>7.1f} {r['branches_speedup']:>8.2f} "
              f"{r['branches_vs_pipelined']:>11.2f} {r['branches_speculation_used']:>5.0%} {counts:>24} "
              f"{r['branch_ms_per_round']:>15.2f} {cpu:>18}")
    print("used: rounds whose speculated next round the loop used; branches used: plain proposals after a miss "
          "answered from a branch (no forward pass); branch ms/round: the draft's time making branches; draft CPU: "
          "the draft process's, pipelined without -> with branches")


def _print_kept(c: dict[str, int], k: int) -> None:
    print(f"\nRounds the pipelined loop can keep (greedy, k = {k}, read off the target's own output): {c['rounds']} "
          f"rounds, {c['kept']} kept ({c['kept'] / max(c['rounds'], 1):.0%}); missed by a rejected draft "
          f"{c['rejected']}, by a wrong guess of the next token {c['wrong_guess']}; of these, the draft's second "
          f"choice at the deciding position is the target's token in {c['second_choice_rejected']} and "
          f"{c['second_choice_wrong_guess']}")


def _pair(values: tuple[float, float], digits: int = 1) -> str:
    return f"{values[0]:.{digits}f} -> {values[1]:.{digits}f}"


def plot(rows: list[dict], path: Path) -> None:
    """Tokens/s by delay, serial vs pipelined, both loops."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LOOPS), figsize=(10, 3.8), sharey=True)
    placement = rows[0].get("placement", "pinned") if rows else "pinned"  # the first placement run (pinned)
    for ax, loop in zip(axes, LOOPS):
        series = [r for r in rows if r["loop"] == loop and r.get("placement", "pinned") == placement]
        x = range(len(series))
        ax.bar([i - 0.2 for i in x], [r["serial_tokens_per_s"] for r in series], 0.4, label="serial")
        bars = ax.bar([i + 0.2 for i in x], [r["pipelined_tokens_per_s"] for r in series], 0.4, label="pipelined")
        ax.bar_label(bars, [f"{r['speedup']:.2f}x" for r in series], fontsize=8)
        ax.set_xticks(list(x), [f"{r['delay_ms']:g} ms" for r in series])
        ax.set_xlabel("delay each way, every link")
        ax.set_title(f"{'client-driven' if loop == 'client' else 'server-side (Generate)'} loop")
    axes[0].set_ylabel("tokens/s")
    axes[0].legend()
    fig.suptitle(f"Pipelined vs serial rounds over loopback gRPC (embedded pair, k = 4, greedy, {placement})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="two prompts, 64 tokens, no repeat")
    parser.add_argument("--heldout", type=int, default=0, metavar="N",
                        help="N prompts cut from files the embedded pair never trained on, not the 3 fixed ones")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="both services run with --compile")
    parser.add_argument("--cores-per-service", type=int, default=1,
                        help="cores pinned to each service, the bench's client and proxies on the rest (default 1)")
    parser.add_argument("--placement", choices=("both", "pinned", "unpinned"), default="both",
                        help="pinned: a core (--cores-per-service) per service; unpinned: they share the cores; "
                             "both (default): one after the other in this run")
    parser.add_argument("--device", default="cpu", help="where both services run their models (cpu, cuda)")
    parser.add_argument("--branches", type=int, default=1,
                        help="also run pipelined rounds against a draft staging this many branches for likely "
                             "misses (serve-draft --branches; default 1, 0: not run)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--save", type=Path, help="write pipeline.txt and pipeline.png to this folder (the bench "
                                                  "writes them to benchmarks/results/ and docs/figures/)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompts = heldout_prompts(args.heldout, 96) if args.heldout else PROMPTS[:2] if args.quick else PROMPTS
    pins = {"both": (args.cores_per_service, 0), "pinned": (args.cores_per_service,), "unpinned": (0,)}
    rows = placements(prompts, pins[args.placement], max_new_tokens=64 if args.quick else args.max_new_tokens,
                      num_draft_tokens=args.num_draft_tokens, repeats=1 if args.quick else args.repeats,
                      compile=args.compile, device=args.device, branches=args.branches)
    print(json.dumps(rows)) if args.json else print_rows(rows)
    if args.save:
        report.save("pipeline", rows, print_rows, plot, results=args.save, figures=args.save)


if __name__ == "__main__":
    main()
