"""A bench section's record: its table as printed (under benchmarks/results/), its plot (under docs/figures/, where
the documentation pages show it), and the line saying where and when it ran."""
from __future__ import annotations

import contextlib
import io
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]  # the source checkout: the benchmarks are not installed
RESULTS = REPO / "benchmarks" / "results"  # raw outputs: tables (.txt) and data (.json)
FIGURES = REPO / "docs" / "figures"  # plots the documentation displays (MkDocs serves only files inside docs/)
HELDOUT_LIST = REPO / "benchmarks" / "heldout_files.txt"  # written by scripts/train_default_pair.py, read here


def save(name: str, result: Any, print_rows: Callable[[Any], None], plot: Callable[[Any, Path], None] | None = None,
         results: Path = RESULTS, figures: Path = FIGURES) -> None:
    """results/<name>.txt (what `print_rows(result)` prints) and, with `plot`, figures/<name>.png
    (`plot(result, path)`)."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_rows(result)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.txt").write_text(text.getvalue().lstrip("\n"))
    if plot is not None:
        figures.mkdir(parents=True, exist_ok=True)
        plot(result, figures / f"{name}.png")


def header(command: str, started: float) -> str:
    """The command, when it ran (from `started`, a `time.time()`, to now), the machine, torch and the commit."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or "unknown"
    when = f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(started))}-{time.strftime('%H:%M')}"
    return (f"{command}, {when}, {cpu} ({os.cpu_count()} cores), torch {torch.__version__}, "
            f"{torch.get_num_threads()} torch thread(s), commit {commit}")


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(low, high, coverage): the order statistics around the median that hold the true median of repeated
    measurements with at least `confidence` whatever their distribution (the binomial count of repeats below it;
    nine repeats: the 2nd and 8th, 96.1 %); too few repeats for it: their range, and its lower coverage (five:
    93.8 %)."""
    ordered, n = sorted(values), len(values)
    below = 0.0  # chance that fewer than j of n repeats fall below the median
    for j in range(1, n // 2 + 1):
        below += math.comb(n, j - 1) / 2**n
        if 2 * (below + math.comb(n, j) / 2**n) > 1 - confidence:
            return ordered[j - 1], ordered[n - j], 1 - 2 * below
    return ordered[0], ordered[-1], 1 - 2 / 2**n


def median_verdict(values: list[float], low: float | None = None, high: float | None = None) -> str:
    """Whether the median of repeated ratios meets a goal (at least `low`, at most `high`), and where it does not,
    whether the repeats resolve the miss: the interval of the median (`median_interval`) still reaching the goal says
    they do not."""
    median = statistics.median(values)
    if (low is None or median >= low) and (high is None or median <= high):
        return "met"
    lo, hi, coverage = median_interval(values)
    reaches = (low is None or hi >= low) and (high is None or lo <= high)
    return f"missed ({coverage:.0%} interval {lo:.3f}-{hi:.3f}" + (
        ", reaching the goal: not resolved by these repeats)" if reaches else ")")
