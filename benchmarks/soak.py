"""`deltaspec soak`: many concurrent sessions for a fixed time against real `serve-target` and `serve-draft`.

The two servers run as child processes on loopback (so their resident memory is their own), the
target speculating with the draft. `sessions` worker threads each run generations back to back
until the time is up, cycling through four kinds: the server-side loop (`Generate`) and the
client-driven loop (Propose/Verify/Commit from here), each greedy and sampled. Every greedy
output is checked against in-process target-only decoding of the same prompt; a sampled one must
have its full length of in-vocabulary tokens (its exact tokens depend on which rounds the draft
made in time under load). A round's time is the time between two consecutive token deliveries.

Every `report_s` seconds, and at the end, a line: generations and errors so far, rounds and
p50/p99 round time in the window, each server's RSS. The summary adds RSS drift: the last
report's RSS over the first's, and the sessions each server still holds once every generation is over
(read from its /metrics; anything but 0 is a leak).
"""
from __future__ import annotations

import itertools
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.loopback import (PROMPTS, Server, check_greedy, percentile, start_pair, stop_all,
                                 target_only_outputs)

KINDS = [("server", False), ("client", False), ("server", True), ("client", True)]  # (loop, sampled)


@dataclass
class Totals:
    """What the workers record; read and reset under `lock` by the reporter."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    generations: dict[str, int] = field(default_factory=dict)  # by kind
    errors: list[str] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)  # this window's round times
    rounds: int = 0

    def add_rounds(self, times: list[float]) -> None:
        with self.lock:
            self.round_s += times
            self.rounds += len(times)

    def window(self) -> tuple[int, list[float]]:
        with self.lock:
            times, self.round_s = self.round_s, []
            return len(times), sorted(times)


def open_sessions(servers: dict[str, Server], settle_s: float = 5.0) -> dict[str, int]:
    """Sessions each server still holds once every generation is over: none should be. A target closes the draft
    session of a `Generate` just after its last answer left (so the answer waits for no close), so the counts are
    read until they are all 0 or `settle_s` has passed."""
    deadline = time.monotonic() + settle_s
    while True:
        left = {name: s.sessions() for name, s in servers.items()}
        if not any(left.values()) or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def run(target_dir: Path, draft_dir: Path, sessions: int = 64, seconds: float = 300.0, report_s: float = 30.0,
        max_new_tokens: int = 32, num_draft_tokens: int = 4, out=None) -> dict:
    """Soak, report as it goes, and return the summary (see the module docstring)."""
    import torch

    from deltaspec.shared.decoding.sampling import SamplingParams
    from deltaspec.shared.model.loader import load_model
    from deltaspec.shared.model.tokenizer import load_tokenizer
    from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server

    torch.set_num_threads(1)
    out = out or sys.stdout
    tokenizer = load_tokenizer(target_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    target = load_model(target_dir)
    vocab = target.config.vocab_size
    expected = target_only_outputs(target, prompts, max_new_tokens)
    eos = set(target.config.eos_token_id)
    servers = start_pair(target_dir, draft_dir, "--max-sessions", str(2 * sessions + 8))
    target_server, draft_server = servers["target"], servers["draft"]
    totals, counter = Totals(), itertools.count()
    deadline = time.monotonic() + seconds

    def one(n: int) -> None:
        loop, sampled = KINDS[n % len(KINDS)]
        prompt = n // len(KINDS) % len(prompts)
        sampling = SamplingParams(0.8, 0, 0.95, seed=n) if sampled else SamplingParams()
        stamps = [time.perf_counter()]
        on_tokens = lambda ids, text: stamps.append(time.perf_counter())  # noqa: E731
        if loop == "server":
            result, _ = generate_on_server(target_server.address, prompts[prompt], "", max_new_tokens,
                                           num_draft_tokens, sampling, timeout_s=120, on_tokens=on_tokens)
        else:
            result, _ = generate_client_driven(target_server.address, draft_server.address, prompts[prompt], "",
                                               max_new_tokens, num_draft_tokens, sampling, timeout_s=120,
                                               on_tokens=on_tokens)
        tokens = result.token_ids
        if not sampled:
            check_greedy(tokens, expected[prompt], f"prompt {prompt}")
        if sampled and not (all(0 <= t < vocab for t in tokens)
                            and (len(tokens) == max_new_tokens or tokens and tokens[-1] in eos)):
            raise AssertionError(f"sampled output malformed: {len(tokens)} tokens (prompt {prompt})")
        totals.add_rounds([b - a for a, b in zip(stamps[1:], stamps[2:])])  # the first includes the prefill
        with totals.lock:
            kind = f"{loop}-{'sampled' if sampled else 'greedy'}"
            totals.generations[kind] = totals.generations.get(kind, 0) + 1

    def worker() -> None:
        while time.monotonic() < deadline:
            try:
                one(next(counter))
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported, none stops the soak
                with totals.lock:
                    totals.errors.append(f"{type(e).__name__}: {e}")

    reports: list[dict] = []
    started = time.monotonic()

    def report() -> None:
        rounds, times = totals.window()
        with totals.lock:
            row = {"t_s": round(time.monotonic() - started), "generations": sum(totals.generations.values()),
                   "errors": len(totals.errors), "rounds": rounds, "round_p50_ms": percentile(times, 0.5) * 1e3,
                   "round_p99_ms": percentile(times, 0.99) * 1e3,
                   **{f"{name}_rss_mib": s.rss_mib() for name, s in servers.items()}}
        reports.append(row)
        print(f"[{row['t_s']:4d} s] generations {row['generations']:5d}  errors {row['errors']}  rounds "
              f"{rounds:6d}  round p50 {row['round_p50_ms']:6.1f} ms  p99 {row['round_p99_ms']:6.1f} ms  RSS target "
              f"{row['target_rss_mib']:.0f} MiB, draft {row['draft_rss_mib']:.0f} MiB", file=out, flush=True)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(sessions)]
    next_report = started + report_s
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):  # workers finish their generation in hand, then stop
            time.sleep(min(1.0, max(0.0, next_report - time.monotonic())))
            if time.monotonic() >= next_report:
                report()
                next_report += report_s
        report()
        left = open_sessions(servers)
    finally:
        stop_all(servers)
    drift = {name: reports[-1][f"{name}_rss_mib"] / reports[0][f"{name}_rss_mib"] - 1 for name in servers}
    summary = {"sessions": sessions, "seconds": round(time.monotonic() - started), "generations": totals.generations,
               "errors": len(totals.errors), "error_samples": totals.errors[:5], "rounds": totals.rounds,
               "rss_drift": drift, "sessions_left": left, "reports": reports}
    print(f"soak: {sessions} sessions, {summary['seconds']} s, {sum(totals.generations.values())} generations "
          f"({', '.join(f'{k} {v}' for k, v in sorted(totals.generations.items()))}), {totals.rounds} rounds, "
          f"{len(totals.errors)} errors; RSS drift (last report over first): "
          + ", ".join(f"{name} {d:+.1%}" for name, d in drift.items())
          + "; sessions left open: " + ", ".join(f"{name} {n}" for name, n in left.items()), file=out, flush=True)
    for error in totals.errors[:5]:
        print(f"  error: {error}", file=out)
    return summary
