"""The load benchmark's machinery (`benchmarks.load`) at concurrency 2 on a tiny random pair.

Real `serve-target` and `serve-draft` processes on loopback, both loops, speculative and
target-only. Asserted: every output equals target-only decoding (a wrong expectation stops the
run), and every row and the goals summary carry all their fields; a server pinned to a core (as the
pipeline bench pins each service) keeps every thread on it, also those started later. Timings are
printed, never asserted; the figures come from `deltaspec bench --only load`.
"""
from __future__ import annotations

import math
import os

import pytest

from benchmarks.load import (FIELDS, KS, LOOPS, MIN_GENERATIONS, goals, measure, print_rows, run_rows,
                             start_servers)
from benchmarks.loopback import PROMPTS, stop_all, target_only_outputs
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer
from test_rpc_support import one_torch_thread, pair  # noqa: F401

NEW_TOKENS = 12


def test_load_rows_exact_and_complete(pair, capsys):
    target_dir, draft_dir = pair
    tokenizer = load_tokenizer(target_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    expected = target_only_outputs(load_model(target_dir), prompts, NEW_TOKENS)
    servers = start_servers(target_dir, draft_dir, 2, torch_threads=1)
    core = {min(os.sched_getaffinity(0))}
    servers["target"].pin(core)  # as the pipeline bench does; threads started later inherit it
    try:
        rows = run_rows(servers, prompts, expected, (2,), LOOPS, KS, NEW_TOKENS, 1)
        cores = _thread_affinities(servers["target"].proc.pid)
        assert len(cores) > 1 and all(c == core for c in cores)
        wrong = [expected[0], expected[1][:-1] + [expected[1][-1] + 1]]
        with pytest.raises(AssertionError, match="differs from target-only"):
            measure(servers, prompts, wrong, "server", 4, 2, NEW_TOKENS, 1)
        with pytest.raises(AssertionError, match="differs from target-only"):
            measure(servers, prompts, wrong, "client", 0, 2, NEW_TOKENS, 1)
    finally:
        stop_all(servers)
    assert [(r["loop"], r["k"], r["concurrency"]) for r in rows] == [(loop, k, 2) for loop in LOOPS for k in KS]
    for r in rows:
        assert set(r) == set(FIELDS)
        assert r["generations"] == MIN_GENERATIONS
        assert r["tokens"] == 2 * (len(expected[0]) + len(expected[1]))  # each thread ran prompts 0 and 1
        assert all(math.isfinite(r[f]) and r[f] > 0 for f in FIELDS[6:12])
        assert 0 <= r["acceptance"] <= 1 and 0 <= r["drafted_rounds"] <= 1
        assert 0 < r["cpu_busy"] <= 1.05 and r["target_cpu_ms_per_token"] > 0  # clock ticks round up a little
        if r["k"] == 0:
            assert r["drafted_rounds"] == 0
    summary = goals(rows)
    assert set(summary) == {f"{loop} k={k}" for loop in LOOPS for k in KS} | {"rss_drift"}
    print_rows({"max_new_tokens": NEW_TOKENS, "rows": rows, "threads": rows[:2], "goals": summary})
    table = capsys.readouterr().out
    assert "aggregate" in table
    with capsys.disabled():
        print(table)


def _thread_affinities(pid: int) -> list[set[int]]:
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found.append(os.sched_getaffinity(int(tid)))
        except ProcessLookupError:  # ended meanwhile
            pass
    return found
