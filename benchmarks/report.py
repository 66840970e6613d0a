"""A bench section's record: its table as printed (under benchmarks/results/), its plot (under docs/figures/, where
the documentation pages show it), and the line saying where and when it ran."""
from __future__ import annotations

import contextlib
import io
import os
import platform
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
