"""What tracing costs the decoding loop: off (the default) against compiled out, and on.

"Compiled out" is the loop itself with its tracing removed from the syntax tree: each `with
tracer.start_as_current_span(...)` replaced by its body, the `if traced:` blocks and the
`traced`/`ids` assignments dropped. It is built from `decode`'s source at run time, so it never
drifts from the real loop. Off: the shipped loop with the API's no-op tracer (what every process
runs when OTEL_TRACES_EXPORTER is unset; no gRPC interceptors are installed then, so the loop is
the only place off-tracing code runs). On: an SDK provider exporting to memory.

The loop runs in process (no gRPC), where a round is shortest and the relative cost largest.
Runs alternate between variants; medians of tokens/s are reported.
"""
from __future__ import annotations

import ast
import inspect
import statistics
import textwrap
import time
from collections.abc import Callable

from deltaspec.shared.decoding import speculative
from deltaspec.shared.decoding.drafters import Drafter, attach
from deltaspec.shared.decoding.speculative import Stats
from deltaspec.shared.decoding.target import TargetSession
from deltaspec.shared.model.hybrid import HybridLM

_TRACING_NAMES = {"traced", "ids"}


class _StripTracing(ast.NodeTransformer):
    def visit_With(self, node: ast.With):
        self.generic_visit(node)
        if all(isinstance(i.context_expr, ast.Call) and isinstance(i.context_expr.func, ast.Attribute)
               and i.context_expr.func.attr == "start_as_current_span" for i in node.items):
            return node.body
        return node

    def visit_If(self, node: ast.If):
        self.generic_visit(node)
        return None if isinstance(node.test, ast.Name) and node.test.id in _TRACING_NAMES else node

    def visit_Assign(self, node: ast.Assign):
        return None if any(isinstance(t, ast.Name) and t.id in _TRACING_NAMES for t in node.targets) else node


def decode_without_tracing() -> Callable:
    """`speculative.decode` with every tracing statement removed (same module globals)."""
    tree = _StripTracing().visit(ast.parse(textwrap.dedent(inspect.getsource(speculative.decode))))
    left = {n.id for n in ast.walk(tree.body[0]) if isinstance(n, ast.Name)} & {"tracer", "span", "phase", *_TRACING_NAMES}
    if left:
        raise AssertionError(f"tracing left in the compiled-out loop: {sorted(left)}")
    namespace = dict(vars(speculative))
    exec(compile(ast.fix_missing_locations(tree), "<decode without tracing>", "exec"), namespace)  # noqa: S102
    return namespace["decode"]


class _Instant:
    """A session and drafter that cost nothing: the loop's own time per round is all that is left."""

    def __init__(self, k: int) -> None:
        from deltaspec.shared.decoding.drafters import Proposal
        from deltaspec.shared.decoding.target import Round
        from deltaspec.shared.decoding.verify import Verdict

        self.proposal, self.version, self.tokens = Proposal(list(range(1, k + 1))), 0, [0]
        self.round = Round("r", 0, tuple(range(1, k + 1)), Verdict(k // 2, 0), 0, hidden=None)  # type: ignore[arg-type]
        self.generated = self.tokens

    def start(self, prompt_ids) -> None: ...

    def propose(self, k):
        return self.proposal

    def advance(self, accepted, next_token) -> None: ...

    def verify(self, round_id, drafts, base_version=None, draft_probs=None):
        return self.round

    def commit(self, round_id, accepted) -> int:
        self.tokens += [0] * (accepted + 1)
        self.version += 1
        return self.version


def loop_seconds_per_round(decode: Callable, tracer=None, rounds: int = 5000, k: int = 4) -> float:
    """Seconds one round of `decode` itself takes, around a session and drafter that take none."""
    instant = _Instant(k)
    extra = {} if tracer is None else {"tracer": tracer}
    started = time.perf_counter()
    for _ in decode(instant, instant, rounds * (k // 2 + 1), k, set(), Stats(), **extra):
        pass
    return (time.perf_counter() - started) / rounds


def _tokens_per_s(decode: Callable, tracer, target: HybridLM, drafter: Drafter, prompt: list[int],
                  new_tokens: int, k: int) -> tuple[float, list[int], int]:
    session = TargetSession(target, prompt)
    drafter.start(list(prompt))
    attach(drafter, session)
    stats, eos = Stats(), set(target.config.eos_token_id)
    extra = {} if tracer is None else {"tracer": tracer}
    started = time.perf_counter()
    for _ in decode(session, drafter, new_tokens, k, eos, stats, **extra):
        pass
    seconds = time.perf_counter() - started  # the loop only: prefill is outside it
    return len(session.generated) / seconds, session.generated, stats.rounds


def tracing_overhead(target: HybridLM, drafter: Drafter, prompt: list[int], new_tokens: int = 64, k: int = 4,
                     repeats: int = 7, with_on: bool = True) -> dict:
    """Median tokens/s of the loop compiled out, off, and (`with_on`) on; `off_cost` = 1 - off / compiled out.

    `off_cost_from_added_time`: the loop's own added time per round with tracing off (measured around
    a session and drafter that cost nothing, best of 3) over the median round time; steadier than
    `off_cost` on a busy machine.
    """
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    variants = {"compiled_out": (decode_without_tracing(), None), "off": (speculative.decode, speculative.NO_TRACER)}
    if with_on:
        variants["on"] = (speculative.decode, provider.get_tracer("deltaspec"))
    rates: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list[int]] = {}
    _tokens_per_s(*variants["off"], target, drafter, prompt, new_tokens, k)  # warm-up
    for _ in range(repeats):
        for name, (decode, tracer) in variants.items():
            rate, tokens[name], rounds = _tokens_per_s(decode, tracer, target, drafter, prompt, new_tokens, k)
            rates[name].append(rate)
            exporter.clear()
    if len({tuple(t) for t in tokens.values()}) != 1:
        raise AssertionError("the variants generated different tokens")
    out = {f"{name}_tokens_per_s": statistics.median(r) for name, r in rates.items()}
    out["off_cost"] = 1 - out["off_tokens_per_s"] / out["compiled_out_tokens_per_s"]
    # The same cost without the noise of a shared machine: the loop's own added time per round, over a round.
    added = min(loop_seconds_per_round(variants["off"][0], variants["off"][1]) for _ in range(3)) - min(
        loop_seconds_per_round(variants["compiled_out"][0]) for _ in range(3))
    round_s = len(tokens["off"]) / out["compiled_out_tokens_per_s"] / rounds
    out["off_added_us_per_round"] = added * 1e6
    out["round_ms"] = round_s * 1e3
    out["off_cost_from_added_time"] = added / round_s
    if with_on:
        out["on_cost"] = 1 - out["on_tokens_per_s"] / out["compiled_out_tokens_per_s"]
    out.update(new_tokens=new_tokens, k=k, repeats=repeats)
    return out
