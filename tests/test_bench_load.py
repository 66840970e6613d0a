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
import time

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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="placing the target apart needs two cores")
def test_the_target_is_placed_on_a_core_of_its_own_and_the_rest_on_the_others():
    """`target_apart`: every thread of the target processes on the first core, the others' on the rest, said in
    words; `unpin` gives this process every core back."""
    import subprocess
    import sys

    from benchmarks.loopback import target_apart, unpin

    cores = sorted(os.sched_getaffinity(0))
    target = subprocess.Popen([sys.executable, "-c", "import threading, time; threading.Thread(target=time.sleep, "
                                                     "args=(30,)).start(); time.sleep(30)"])
    try:
        time.sleep(0.5)  # its second thread started
        placed = target_apart([target.pid], [os.getpid()], "the clients")
        threads = os.listdir(f"/proc/{target.pid}/task")
        assert len(threads) == 2 and all(os.sched_getaffinity(int(t)) == {cores[0]} for t in threads)
        assert os.sched_getaffinity(0) == set(cores[1:])
        assert placed.startswith(f"the target alone on core {cores[0]}; the clients on core")
    finally:
        unpin()
        target.kill()
        target.wait()
    assert os.sched_getaffinity(0) == set(cores)
