"""The OpenAI front bench's reading of the front's added-time histogram: bucket arithmetic and the printed goal.
(Scraping a live front's page: test_openai_api.py.)"""
from __future__ import annotations

import bisect
import contextlib
import io
import math
import random
import statistics

from benchmarks.openai_front import (FIELDS, KS, LEVELS, PATHS, _cell, bucket_quantile, bucket_sum, print_rows)
from deltaspec.openai_service.metrics import ADDED_BUCKETS

INF = math.inf


def histogram(values: list[float], bounds: tuple[float, ...] = ADDED_BUCKETS) -> list[tuple[float, float]]:
    """Cumulative buckets as Prometheus keeps them (an observation counts in every bucket whose bound is >= it)."""
    ordered = sorted(values)
    return [(b, float(bisect.bisect_right(ordered, b))) for b in (*bounds, INF)]


def test_the_median_is_interpolated_within_its_bucket_as_prometheus_does():
    assert bucket_quantile([(1.0, 0), (2.0, 4), (3.0, 4), (INF, 4)], 0.5) == 1.5
    assert bucket_quantile([(1.0, 2), (2.0, 2), (3.0, 4), (INF, 4)], 0.5) == 1.0  # empty buckets are skipped
    assert bucket_quantile([(1.0, 1), (INF, 3)], 0.5) == 1.0  # in +Inf's bucket: the last finite bound
    assert bucket_quantile([(1.0, 0), (INF, 0)], 0.5) is None


def test_the_bucket_median_of_millisecond_times_is_the_exact_median_to_a_bucket():
    """Odd counts: the median is one of the times, and the estimate lies in its 0.1 ms bucket."""
    rng = random.Random(0)
    for n in (1, 3, 7, 41, 501):
        values = [rng.lognormvariate(math.log(0.0012), 0.4) for _ in range(n)]
        assert abs(bucket_quantile(histogram(values), 0.5) - statistics.median(values)) <= 1e-4, n


def test_scrapes_subtract_and_runs_pool():
    earlier, later = histogram([0.0011, 0.0031]), histogram([0.0011, 0.0031, 0.0005, 0.0015, 0.0016])
    assert bucket_sum([later], minus=earlier) == histogram([0.0005, 0.0015, 0.0016])
    assert bucket_sum([histogram([0.001]), histogram([0.002, 0.5])]) == histogram([0.001, 0.002, 0.5])


def run(path: str, added_ms: list[float]) -> dict:
    """A run as `row` gives it, its requests' added times `added_ms`."""
    added = histogram([ms / 1000 for ms in added_ms]) if path != "grpc" else None
    return {"tokens": 96, "tokens_per_s": 300.0, "ttft_ms_p50": 40.0, "tpot_ms_p50": 3.0, "front_ms_tok": 0.1,
            "front_ms_req": 10.0, "client_ms_tok": 0.05, "added": added,
            "added_ms_p50": None if added is None else 1000 * bucket_quantile(added, 0.5)}


def printed(worst_ms: float) -> str:
    """print_rows' text for a bench whose http cell at concurrency 8, k 0 has requests adding `worst_ms`."""
    rows = [_cell(path, k, c, [run(path, [worst_ms] * 3 if (path, k, c) == ("http", 0, 8) else [0.82, 1.04, 1.33])
                               for _ in range(2)])
            for c in LEVELS for k in KS for path in PATHS]
    assert all("added" not in r for row in rows for r in row["runs"])
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_rows(rows)
    return text.getvalue()


def test_the_rows_give_the_pooled_median_and_the_goal_reads_the_largest_cell():
    text = printed(1.55)
    header, grpc, openai = text.splitlines()[2:5]
    assert header.split() == list(FIELDS)
    assert grpc.split()[FIELDS.index("added_ms_p50")] == "-"
    assert openai.split()[FIELDS.index("added_ms_p50")] == "1.05"
    assert "front adds 1.05 [1.05 to 1.05] ms" in text
    assert goal(text, "goal: the front adds").startswith(
        "goal: the front adds at most 2 ms of median time to first token: largest cell, openai 1.05 [1.05 to 1.05] ms "
        "(concurrency 1, k 4), http 1.55 [1.55 to 1.55] ms (concurrency 8, k 0): met")
    assert ": missed (" in goal(printed(2.45), "goal: the front adds")


def goal(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


def test_the_throughput_goals_pair_each_repeat_at_the_top_concurrency():
    """Front over gRPC tok/s per k, and the front's speedup over gRPC's, each repeat's runs paired."""
    speeds = {("grpc", 4): (600.0, 500.0), ("grpc", 0): (400.0, 400.0), ("openai", 4): (570.0, 450.0),
              ("openai", 0): (380.0, 400.0), ("http", 4): (600.0, 500.0), ("http", 0): (400.0, 400.0)}

    def runs(path: str, k: int) -> list[dict]:
        return [{**run(path, [1.0]), "tokens_per_s": v} for v in speeds[path, k]]

    rows = [_cell(path, k, c, runs(path, k)) for c in LEVELS for k in KS for path in PATHS]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_rows(rows)
    # openai: 570/600 and 450/500 at k 4; 380/400 and 1.0 at k 0; speedups (1.5, 1.125) over gRPC's (1.5, 1.25)
    # each with whether its median meets the goal, and where it misses, whether two repeats resolve that (no)
    assert goal(text.getvalue(), "goals at concurrency 8, openai").endswith(
        "k 4 0.925 [0.900 to 0.950], missed (50% interval 0.900-0.950, reaching the goal: not resolved by these "
        "repeats), k 0 0.975 [0.950 to 1.000], met; speculative / target-only through the front over the same over "
        "gRPC (within 1 +- 0.05) 0.950 [0.900 to 1.000], met")
    assert goal(text.getvalue(), "goals at concurrency 8, http").endswith("1.000 [1.000 to 1.000], met")
