"""The soak in CI: 10 s of 16 concurrent sessions against serve-target and serve-draft processes.

Both loops, greedy and sampled (`benchmarks.soak`). Asserted: no errors (every greedy output
equal to target-only decoding is part of that), every kind ran, no session left open on either
server afterwards, and resident memory roughly flat. Timings are printed, never asserted; the
5-minute, 64-session run is `deltaspec soak`.
"""
from __future__ import annotations

from benchmarks.soak import KINDS, run
from test_rpc_support import one_torch_thread, pair  # noqa: F401


def test_soak_10_s(pair, capsys):
    with capsys.disabled():
        print()
        summary = run(pair[0], pair[1], sessions=16, seconds=10, report_s=5)
    assert summary["errors"] == 0, summary["error_samples"]
    assert len(summary["generations"]) == len(KINDS) and min(summary["generations"].values()) > 0
    assert summary["sessions_left"] == {"target": 0, "draft": 0}
    assert all(drift < 0.25 for drift in summary["rss_drift"].values()), summary["rss_drift"]
