"""What `deltaspec bench`, `deltaspec study` and `deltaspec soak` run, once `deltaspec.shared.cli` has parsed their
options and found this checkout's benchmarks/ (they are not in the wheel)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from deltaspec.shared import demo
from deltaspec.shared.defaults import DEFAULT_DRAFT, DEFAULT_TARGET


def bench(args: argparse.Namespace) -> int:
    from benchmarks.suite import main

    return main(args)


def study(args: argparse.Namespace) -> int:
    from benchmarks.no_rollback import main

    return main(args)


def soak(args: argparse.Namespace) -> int:
    demo.quiet_grpc()
    from benchmarks.soak import run

    summary = run(Path(args.target or DEFAULT_TARGET), Path(args.draft or DEFAULT_DRAFT), args.sessions, args.seconds,
                  args.report_every, args.max_new_tokens, args.num_draft_tokens)
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["errors"] == 0 else 1


COMMANDS = {"bench": bench, "study": study, "soak": soak}
