"""Load: what N concurrent sessions get from one target, over real loopback gRPC.

`serve-target` + `serve-draft` run as child processes (`benchmarks.loopback`). For each
concurrency N, each loop (`server`: one `Generate` stream the target drives; `client`: this process
drives Propose/Verify/Commit) and k (4: speculative with the draft service; 0: target-only), N client
threads start together and run greedy generations back to back until every thread has done its
share (at least `MIN_GENERATIONS` generations a row, so N = 1 has more than one); every output must
equal in-process target-only decoding of its prompt, else the run stops.

Per row: aggregate tokens/s (all output tokens over the row's wall time); time per output token (a
delivery of m tokens that arrives g seconds after the previous one counts m tokens of g/m each; the
first delivery, which carries the prefill and any queueing, is the time to first token instead),
p50 and p99 over the row's tokens; acceptance and the share of rounds that carried drafts (a Propose
slower than the target's `--draft-timeout` leaves its round target-only); each server's RSS before and
after; where the CPU went: the share of the cores this process may use that the three processes
(target, draft, this client) kept busy, and the target's CPU milliseconds per output token (falling with
N: sessions share forward passes); the mean number of sequences per forward pass on each server
(`deltaspec_batch_size`, `deltaspec.shared.decoding.batcher`). The servers' RSS from the first row to the last
says whether memory stays flat.

The thread policy: the server-side loop at concurrency 1 and 8, speculative and target-only, with the
servers' torch intra-op threads at 1 and at 2 (`--torch-threads`), each setting on a fresh pair.
"""
from __future__ import annotations

import itertools
import math
import os
import resource
import threading
import time
from pathlib import Path

from benchmarks.loopback import (PROMPTS, Server, check_greedy, percentile, start_pair, stop_all,
                                 target_only_outputs)

LEVELS, QUICK_LEVELS = (1, 2, 4, 8, 16, 32), (1, 2, 4)
LOOPS, KS = ("server", "client"), (4, 0)
MIN_GENERATIONS = 4
THREAD_LEVELS, THREAD_SETTINGS = (1, 8), (1, 2)
FIELDS = ("loop", "k", "concurrency", "torch_threads", "generations", "tokens", "seconds", "tokens_per_s",
          "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "acceptance", "drafted_rounds",
          "drafts_per_round",
          "target_rss_before_mib", "target_rss_after_mib", "draft_rss_before_mib", "draft_rss_after_mib",
          "cpu_busy", "target_cpu_ms_per_token", "target_batch", "draft_batch")


def measure(servers: dict[str, Server], prompts: list[list[int]], expected: list[list[int]], loop: str, k: int,
            concurrency: int, max_new_tokens: int, torch_threads: int, window_s: float | None = None,
            first_prompt: int = 0) -> dict:
    """One row (see the module docstring); raises the first error or wrong output of any session. `window_s`: each
    thread instead runs generations back to back (its prompts in turn) for that long, and the row counts the tokens
    delivered within it: all N streams stay busy the whole time, as on a server under steady load, where a fixed
    share per thread ends with the slowest sessions running alone (a policy that finishes some sessions sooner
    then looks slower for it). `first_prompt`: where in `prompts` the threads start (a window holds a part of a
    cycle of unlike prompts, so runs compared over several repeats start each repeat somewhere else)."""
    from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server

    target, draft = servers["target"].address, servers["draft"].address if "draft" in servers else None
    per_thread = math.ceil(MIN_GENERATIONS / concurrency)
    start = threading.Barrier(concurrency + 1)
    lock, errors = threading.Lock(), []
    tpot, ttft, tokens, rounds, drafts, drafted, accepted = [], [], 0, 0, 0, 0, 0
    generations = 0

    def session(i: int) -> None:
        nonlocal tokens, rounds, drafts, drafted, accepted, generations
        start.wait()
        deadline = time.perf_counter() + window_s if window_s else math.inf
        for j in itertools.count() if window_s else range(per_thread):
            if time.perf_counter() >= deadline:
                return
            p = (first_prompt + i * per_thread + j) % len(prompts)
            began, last, gaps, within = time.perf_counter(), [0.0], [], [0]

            def on_tokens(ids: list[int], text: str) -> None:
                if not ids:  # the stream's closing message carries only text
                    return
                now = time.perf_counter()
                if now <= deadline:
                    within[0] += len(ids)
                gaps.extend([(now - last[0]) / len(ids)] * len(ids) if last[0] else [now - began])
                last[0] = now

            try:
                if loop == "server":
                    result, _ = generate_on_server(target, prompts[p], "", max_new_tokens, k, timeout_s=900,
                                                   on_tokens=on_tokens)
                else:
                    result, _ = generate_client_driven(target, draft if k else None, prompts[p], "", max_new_tokens,
                                                       k, timeout_s=900, on_tokens=on_tokens)
                check_greedy(result.token_ids, expected[p], f"{loop} loop, k = {k}, concurrency {concurrency}, "
                                                            f"prompt {p}")
            except Exception as e:  # noqa: BLE001 - re-raised by the caller once every session has stopped
                with lock:
                    errors.append(e)
                return
            s = result.stats
            with lock:
                ttft.append(gaps[0])
                tpot.extend(gaps[1:])
                tokens += within[0] if window_s else len(result.token_ids)
                generations += 1
                rounds, drafts, drafted, accepted = (rounds + s.rounds, drafts + s.drafts, drafted + s.drafted,
                                                     accepted + s.accepted)

    rss_before = {name: s.rss_mib() for name, s in servers.items()}
    batches_before = _batches(servers)
    cpu_before = _cpu_s(servers)
    threads = [threading.Thread(target=session, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    seconds = window_s or time.perf_counter() - began
    cpu_after = _cpu_s(servers)
    cpu = {name: cpu_after[name] - cpu_before[name] for name in cpu_before}
    batches = {name: [a - b for a, b in zip(after, batches_before[name])] for name, after in _batches(servers).items()}
    if errors:
        raise errors[0]
    tpot.sort()
    ttft.sort()
    return {"loop": loop, "k": k, "concurrency": concurrency, "torch_threads": torch_threads,
            "generations": generations, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "tpot_p50_ms": 1e3 * percentile(tpot, 0.5),
            "tpot_p99_ms": 1e3 * percentile(tpot, 0.99), "ttft_p50_ms": 1e3 * percentile(ttft, 0.5),
            "ttft_p99_ms": 1e3 * percentile(ttft, 0.99), "acceptance": accepted / drafted if drafted else 0.0,
            "drafted_rounds": drafts / rounds if rounds else 0.0,
            "drafts_per_round": drafted / rounds if rounds else 0.0,
            **{f"{name}_rss_before_mib": v for name, v in rss_before.items()},
            **{f"{name}_rss_after_mib": s.rss_mib() for name, s in servers.items()},
            "cpu_busy": sum(cpu.values()) / (seconds * len(os.sched_getaffinity(0))),
            "target_cpu_ms_per_token": 1e3 * cpu["target"] / tokens,
            **{f"{name}_batch": total / n if n else 0.0 for name, (total, n) in batches.items()}}


def _batches(servers: dict[str, Server]) -> dict[str, tuple[float, float]]:
    """Each server's (sequences, forward passes) so far."""
    return {name: (s.metric("deltaspec_batch_size_sum"), s.metric("deltaspec_batch_size_count"))
            for name, s in servers.items()}


def _cpu_s(servers: dict[str, Server]) -> dict[str, float]:
    """CPU seconds so far of each server and of this process (the client side: both loops' client threads)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return {**{name: s.cpu_s() for name, s in servers.items()}, "client": own.ru_utime + own.ru_stime}


def start_servers(target_dir: Path, draft_dir: Path, max_concurrency: int, torch_threads: int,
                  device: str = "cpu") -> dict[str, Server]:
    return start_pair(target_dir, draft_dir, "--max-sessions", str(2 * max_concurrency + 8),
                      "--torch-threads", str(torch_threads), "--device", device)


def run_rows(servers: dict[str, Server], prompts: list[list[int]], expected: list[list[int]],
             levels: tuple[int, ...], loops: tuple[str, ...], ks: tuple[int, ...], max_new_tokens: int,
             torch_threads: int, progress=lambda row: None) -> list[dict]:
    """Rows for every (level, loop, k), levels outermost; a short unrecorded generation per (loop, k) first,
    so the first row does not pay for the servers' first calls."""
    for loop in loops:
        for k in ks:
            measure(servers, prompts[:1], [expected[0][:8]], loop, k, 1, 8, torch_threads)
    rows = []
    for n in levels:
        for loop in loops:
            for k in ks:
                rows.append(measure(servers, prompts, expected, loop, k, n, max_new_tokens, torch_threads))
                progress(rows[-1])
    return rows


def load(target_dir: Path, draft_dir: Path, quick: bool = False, progress=lambda row: None,
         device: str = "cpu") -> dict:
    """The load table (levels x loops x k, default torch threads) and, on the CPU, the thread-policy rows.
    `device="cuda"`: both servers' models and states on the GPU (the bench's gpu section)."""
    from deltaspec.shared.model.loader import load_model
    from deltaspec.shared.model.tokenizer import load_tokenizer

    max_new_tokens = 24 if quick else 96
    tokenizer = load_tokenizer(target_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4 if quick else len(PROMPTS)]]
    expected = target_only_outputs(load_model(target_dir, device=device), prompts, max_new_tokens)

    def on_fresh_pair(levels: tuple[int, ...], loops: tuple[str, ...], torch_threads: int) -> list[dict]:
        servers = start_servers(target_dir, draft_dir, max(levels), torch_threads, device)
        try:
            return run_rows(servers, prompts, expected, levels, loops, KS, max_new_tokens, torch_threads, progress)
        finally:
            stop_all(servers)

    rows = on_fresh_pair(QUICK_LEVELS if quick else LEVELS, LOOPS, 1)
    threads = [row for t in THREAD_SETTINGS for row in on_fresh_pair(QUICK_LEVELS[:2] if quick else THREAD_LEVELS,
                                                                       ("server",), t)] if device == "cpu" else []
    return {"max_new_tokens": max_new_tokens, "rows": rows, "threads": threads, "goals": goals(rows)}


def goals(rows: list[dict]) -> dict:
    """Per loop and k, the issue's goals at 8 sessions (else the highest level run) against the lowest level
    run (one session in a full run): aggregate >= 4x, p99 time per output token <= 3x; and each server's RSS,
    last row over first."""
    out = {}
    for loop in dict.fromkeys(r["loop"] for r in rows):
        for k in dict.fromkeys(r["k"] for r in rows):
            by_n = {r["concurrency"]: r for r in rows if r["loop"] == loop and r["k"] == k}
            n = 8 if 8 in by_n else max(by_n)
            one, many = by_n[min(by_n)], by_n[n]
            out[f"{loop} k={k}"] = {"at": n, "base": min(by_n),
                                    "aggregate_x": many["tokens_per_s"] / one["tokens_per_s"],
                                    "p99_tpot_x": many["tpot_p99_ms"] / one["tpot_p99_ms"]}
    first, last = rows[0], rows[-1]
    out["rss_drift"] = {name: last[f"{name}_rss_after_mib"] / first[f"{name}_rss_before_mib"] - 1
                        for name in ("target", "draft")}
    return out


def print_rows(result: dict) -> None:
    print(f"\nLoad over loopback gRPC (serve-target + serve-draft processes, greedy, {result['max_new_tokens']} "
          "tokens a generation, every output equal to target-only; TPOT = time per output token)")
    header = (f"{'loop':<6} {'k':>1} {'N':>3} {'thr':>3} {'gens':>4} {'agg tok/s':>9} {'TPOT p50':>8} {'p99 ms':>7} "
              f"{'TTFT p50':>8} {'p99 ms':>7} {'accept':>6} {'drafted':>7} {'RSS target':>14} {'RSS draft':>14} "
              f"{'CPU busy':>8} {'target CPU ms/tok':>17} {'batch T':>7} {'batch D':>7}")
    for title, rows in (("", result["rows"]), ("\nThread policy: servers' torch intra-op threads (--torch-threads)",
                                                result["threads"])):
        if not rows:
            continue
        print(title + ("\n" if title else "") + header)
        for r in rows:
            print(f"{r['loop']:<6} {r['k']:>1} {r['concurrency']:>3} {r['torch_threads']:>3} {r['generations']:>4} "
                  f"{r['tokens_per_s']:>9.1f} {r['tpot_p50_ms']:>8.1f} {r['tpot_p99_ms']:>7.1f} "
                  f"{r['ttft_p50_ms']:>8.0f} {r['ttft_p99_ms']:>7.0f} {r['acceptance']:>6.2f} "
                  f"{r['drafted_rounds']:>7.2f} {r['target_rss_before_mib']:>6.0f}->{r['target_rss_after_mib']:<6.0f} "
                  f"{r['draft_rss_before_mib']:>6.0f}->{r['draft_rss_after_mib']:<6.0f} "
                  f"{100 * r['cpu_busy']:>7.0f}% {r['target_cpu_ms_per_token']:>17.1f} {r['target_batch']:>7.2f} "
                  f"{r['draft_batch']:>7.2f}")
    g = result["goals"]
    for name, v in g.items():
        if name != "rss_drift":
            print(f"{name}: at {v['at']} sessions, aggregate {v['aggregate_x']:.2f}x that of {v['base']} (goal >= 4), "
                  f"p99 TPOT {v['p99_tpot_x']:.2f}x (goal <= 3)")
    print("RSS, last row over first: " + ", ".join(f"{n} {d:+.1%}" for n, d in g["rss_drift"].items()))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    rows = result["rows"]
    for loop in LOOPS:
        for k in KS:
            series = [r for r in rows if r["loop"] == loop and r["k"] == k]
            if not series:
                continue
            n = [r["concurrency"] for r in series]
            label = f"{loop} loop, {'k = 4' if k else 'target-only'}"
            line, = left.plot(n, [r["tokens_per_s"] for r in series], marker="o", label=label)
            middle.plot(n, [r["tpot_p50_ms"] for r in series], marker="o", color=line.get_color(), label=f"{label}: p50")
            middle.plot(n, [r["tpot_p99_ms"] for r in series], marker="s", ls="--", color=line.get_color(),
                        label=f"{label}: p99")
    levels = sorted({r["concurrency"] for r in rows})
    for name in ("target", "draft"):
        right.plot(range(len(rows)), [r[f"{name}_rss_after_mib"] for r in rows], marker=".", label=f"serve-{name}")
    firsts = {r["concurrency"]: i for i, r in reversed(list(enumerate(rows)))}  # each level's first row
    right.set_xticks(list(firsts.values()), [f"N={n}" for n in firsts])
    for ax in (left, middle):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent sessions")
    left.set_ylabel("aggregate tokens/s")
    left.set_title("Throughput under load (2 CPU cores)")
    left.legend(fontsize=8)
    middle.set_yscale("log")
    middle.set_ylabel("ms per output token")
    middle.set_title("Time per output token, p50 and p99")
    middle.legend(fontsize=6, ncol=2)
    right.set_xlabel("rows of the run, in order (loops and k within each N)")
    right.set_ylabel("RSS after the row, MiB")
    right.set_title("Server memory over the run")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)

