"""The `deltaspec` command line: `deltaspec ...`, or `python -m deltaspec.cli ...`.

The commands themselves live in `deltaspec.shared.cli` (the repository's shared/cli.py); this is the public name.
"""
from __future__ import annotations

import sys

from deltaspec.shared.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
