"""A bench section's record in docs/: its table as printed and its plot."""
from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any


def save(docs: Path, name: str, result: Any, print_rows: Callable[[Any], None],
         plot: Callable[[Any, Path], None] | None = None) -> None:
    """docs/<name>.txt (what `print_rows(result)` prints) and, with `plot`, docs/<name>.png (`plot(result, path)`)."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_rows(result)
    docs.mkdir(exist_ok=True)
    (docs / f"{name}.txt").write_text(text.getvalue().lstrip("\n"))
    if plot is not None:
        plot(result, docs / f"{name}.png")
