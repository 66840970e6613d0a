"""Side-by-side runs of served targets that differ in their flags: what `deltaspec bench --only cost_model`'s cells
cannot tell apart run to run (a cell moves by up to 0.17 between runs on the 2-core host; runs alternated within
one process share its drift).

    python -m benchmarks.served_ab --levels 8 --repeats 9 \\
        --server fixed='--draft-length fixed' --server cost='--draft-length cost' \\
        --run fixed:3 --run cost:3 --run cost:8

Each `--server NAME=FLAGS` is a `serve-target` of the embedded target (or `--target`) with those flags, speculating
with n-gram lookup on the cost-model bench's prompts (its changing draft), or with `--draft-model`'s draft service on
the loopback prompts. Each `--run NAME:K` asks that server for K drafts a round (a cost-model server's cap). At each
level every run goes once per repeat, in a rotating order, each stream generating back to back for `--window-s`
(`load.measure`, outputs checked against target-only decoding); the row: median tokens/s [range], drafts a round,
and each run's tokens/s over the first run's, paired by repeat. The targets share the first core, the rest the
others (`loopback.target_apart`).
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics

from benchmarks.cost_model import NGRAM_PROMPTS
from benchmarks.load import measure
from benchmarks.loopback import PROMPTS, Server, stop_all, target_apart, target_only_outputs, unpin
from deltaspec.shared.defaults import DEFAULT_TARGET
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.served_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="append", required=True, metavar="NAME=FLAGS",
                   help="a serve-target and its extra flags (repeatable)")
    p.add_argument("--run", action="append", required=True, metavar="NAME:K", help="a server and its k (repeatable)")
    p.add_argument("--levels", default="8", help="concurrent streams, comma-separated (default 8)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--window-s", type=float, default=2.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--target", default=str(DEFAULT_TARGET), help="target checkpoint (default: the embedded one)")
    p.add_argument("--draft-model", help="a draft checkpoint served beside the targets (default: n-gram lookup)")
    args = p.parse_args(argv)
    args.servers = dict(_split(s, "=", "--server") for s in args.server)
    args.runs = [(name, int(k)) for name, k in (_split(r, ":", "--run") for r in args.run)]
    unknown = sorted({name for name, _ in args.runs} - set(args.servers))
    if unknown:
        p.error(f"--run names servers not given with --server: {', '.join(unknown)}")
    args.levels = [int(n) for n in args.levels.split(",")]
    return args


def _split(text: str, sep: str, option: str) -> tuple[str, str]:
    name, found, rest = text.partition(sep)
    if not found or not name:
        raise SystemExit(f"{option} takes NAME{sep}..., got {text!r}")
    return name, rest


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    tokenizer = load_tokenizer(args.target)
    texts = PROMPTS[:4] if args.draft_model else NGRAM_PROMPTS
    prompts = [tokenizer.encode(t) for t in texts]
    expected = target_only_outputs(load_model(args.target), prompts, args.max_new_tokens)
    servers: dict[str, Server] = {}
    try:
        draft = ()
        if args.draft_model:
            servers["draft service"] = Server("serve-draft", "--model", args.draft_model)
            draft = ("--draft-addr", servers["draft service"].address)
        for name, flags in args.servers.items():
            servers[name] = Server("serve-target", "--model", args.target, *(draft or ("--draft", "ngram")),
                                   *shlex.split(flags))
        placed = target_apart([servers[name].proc.pid for name in args.servers],
                              [*([servers["draft service"].proc.pid] if draft else []), os.getpid()])
        print(f"placement: {placed}", flush=True)

        def rate(name: str, k: int, n: int, window: float | None = args.window_s, tokens: int = args.max_new_tokens,
                 first: int = 0) -> dict:
            used = {"target": servers[name], **({"draft": servers["draft service"]} if draft else {})}
            return measure(used, prompts, [e[:tokens] for e in expected], "server", k, n, tokens, 1, window, first)

        for name, k in args.runs:  # every path's first calls, and a cost model's first sessions, unrecorded
            rate(name, k, 1, None, 8)
            rate(name, k, 4, None)
        for n in args.levels:
            print(level(rate, args.runs, n, args.repeats), flush=True)
    finally:
        unpin()
        stop_all(servers)


def level(rate, runs: list[tuple[str, int]], n: int, repeats: int) -> str:
    tokens: dict[tuple[str, int], list[float]] = {r: [] for r in runs}
    drafts: dict[tuple[str, int], list[float]] = {r: [] for r in runs}
    for i in range(repeats):
        for run in runs[i % len(runs):] + runs[:i % len(runs)]:
            row = rate(*run, n, first=i)
            tokens[run].append(row["tokens_per_s"])
            drafts[run].append(row["drafts_per_round"])
    cells = [f"{name}:{k} {statistics.median(tokens[name, k]):.0f} [{min(tokens[name, k]):.0f}-"
             f"{max(tokens[name, k]):.0f}] tok/s, {statistics.median(drafts[name, k]):.2f} drafts a round"
             for name, k in runs]
    base = tokens[runs[0]]
    for run in runs[1:]:
        ratios = sorted(a / b for a, b in zip(tokens[run], base))
        cells.append(f"{run[0]}:{run[1]} / {runs[0][0]}:{runs[0][1]} {statistics.median(ratios):.3f} "
                     f"[{ratios[0]:.3f}-{ratios[-1]:.3f}]")
    return f"N = {n}: " + "; ".join(cells)


if __name__ == "__main__":
    main()
