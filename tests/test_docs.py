"""The documentation: the MkDocs site under docs/ builds in strict mode, and the front-door README stays short
and links only to files that exist.

`mkdocs build --strict` fails on any warning, and mkdocs.yml's `validation` makes broken links, missing
anchors, absolute links and pages left out of the nav warnings. The README is not part of the site, so its
links are checked here: each relative link names an existing file, and an anchor into a page under docs/
names one of that page's headings.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 200

LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^\s*```")


def _outside_code_blocks(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _slugify(value: str, separator: str = "-") -> str:
    """Python-Markdown's toc slugify (the extension mkdocs.yml enables), on a heading's text."""
    value = re.sub(r"[`*_]", "", value)
    value = unicodedata.normalize("NFKD", value).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(rf"[{separator}\s]+", separator, value)


def _anchors(page: Path) -> set[str]:
    return {_slugify(line.lstrip("#").strip())
            for line in _outside_code_blocks(page.read_text(encoding="utf-8")) if re.match(r"#{1,6} ", line)}


def _relative_links(text: str) -> list[str]:
    links = []
    for line in _outside_code_blocks(text):
        links += [t for t in LINK.findall(line) if not re.match(r"(?i)([a-z][a-z0-9+.-]*:|#)", t)]
    return links


def test_site_builds_in_strict_mode(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (it comes with the dev extras: pip install -e '.[dev]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's end-of-life banner, not a build warning
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}\n{result.stdout}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_at_most_200_lines():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the limit is {README_MAX_LINES}: move detail to docs/"


def test_readme_relative_links_point_at_existing_files():
    links = _relative_links(README.read_text(encoding="utf-8"))
    assert links, "README.md links to no file: the parser no longer finds its links"
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = (README.parent / path).resolve()
        if not target.is_file():
            broken.append(f"{link}: no file {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: {path} has no heading with anchor #{anchor}")
    assert not broken, "README.md has broken links:\n" + "\n".join(broken)
