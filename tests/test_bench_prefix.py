"""The prefix-cache benchmark's machinery (`benchmarks.prefix`) at its tiny size on the embedded pair.

Asserted: cached outputs equal uncached ones (a difference stops the run), a hit serves every whole block of the
shared prefix, to the target and to the draft, and prefills only the rest, speculation changes no cached count,
and the measured bytes of a cached prefix are the computed ones. Timings are printed, never asserted; the figures
come from `deltaspec bench --only prefix`.
"""
from __future__ import annotations

import pytest

from benchmarks.prefix import TINY, check_same, prefix, print_rows, side_name


def test_prefix_rows_exact_and_complete(capsys):
    result = prefix(plan=TINY)
    p = TINY
    for r in result["system"]:
        assert r["cached"] == p.system_tokens and r["prefill_on"] == r["prompt"] - 1 - p.system_tokens
        assert r["prefill_off"] == r["prompt"] - 1 and r["same_as_spec_off"]
        assert r["draft_cached"] == (p.system_tokens if r["spec"] else 0)
    for r in result["short"]:
        assert r["cached"] == p.short_prefix and r["prefill_on"] == r["prefill_off"] - p.short_prefix
    for section in ("system", "short", "conversation"):
        off, on = (sum(r["cached_total"] for r in result[section] if r["spec"] == s) for s in (False, True))
        assert off == on, section
    turns = {(r["turn"], r["spec"]): r for r in result["conversation"]}
    assert sorted(turns) == [(t, s) for t in range(1, p.turns + 1) for s in (False, True)]
    assert turns[(1, False)]["cached"] == 0 and turns[(p.turns, False)]["cached"] > 0
    assert all(r["cached"] % p.block == 0 and r["cached"] + r["prefill_on"] == r["prompt"] - 1
               for r in result["conversation"])
    extended = result["extended"]
    assert [r["turn"] for r in extended] == list(range(1, p.turns + 1)) and all(r["same_replies"] for r in extended)
    sparse = result["sparse"]  # every request but the first resumes where the system prompt's last block ends,
    _, dense, every = sparse["names"]  # except the second with sparse states: it resumes on the grid below
    boundary = sparse["system_tokens"] // p.block * p.block
    assert [r[dense]["cached"] for r in sparse["rows"]] == [0] + [boundary] * p.requests
    assert [r[every]["cached"] for r in sparse["rows"]] \
        == [0, boundary // sparse["grid"] * sparse["grid"]] + [boundary] * (p.requests - 1)
    assert 0 < sparse["bytes"][every] < sparse["bytes"][dense]
    measured = [m for m in result["memory"] if m["how"] == "measured"]
    assert [(m["model"], m["every"]) for m in measured] == [("embedded target", 1), ("embedded target", 16),
                                                           ("embedded draft", 1)]
    assert all(m["entries"] == p.system_tokens // p.block for m in measured)
    assert [m["states"] for m in measured] == [p.system_tokens // p.block, 1, p.system_tokens // p.block]
    print_rows(result)
    table = capsys.readouterr().out
    assert "conversation" in table and "continued each turn by extending it" in table and "Memory per" in table
    with capsys.disabled():
        print(table)


def test_a_cached_output_that_differs_stops_the_run():
    runs = {side_name(spec, cache): {"tokens": [1, 2, 3]} for spec in (False, True) for cache in (False, True)}
    check_same(runs, "request 0")
    runs[side_name(True, True)]["tokens"] = [1, 2, 4]
    with pytest.raises(AssertionError, match="speculation on: cache on"):
        check_same(runs, "request 0")
