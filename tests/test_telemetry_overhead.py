"""The benchmark's "compiled out" loop is the real loop minus its tracing, and the figure is computed."""
from __future__ import annotations

import ast
import inspect

from deltaspec.shared.decoding import speculative
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.model.checkpoint import hf_config, random_model
from benchmarks.telemetry_overhead import (_StripTracing, decode_without_tracing, loop_seconds_per_round,
                                           tracing_overhead)


def test_compiled_out_loop_keeps_every_other_statement():
    stripped = decode_without_tracing()
    tree = _StripTracing().visit(ast.parse(inspect.getsource(speculative.decode)))
    text = ast.unparse(tree)
    assert "start_as_current_span" not in text and "set_attributes" not in text
    for kept in ("drafter.propose", "session.verify", "session.commit", "stats.add_round", "metrics.round",
                 "drafter.advance", "yield"):
        assert kept in text, kept
    assert loop_seconds_per_round(stripped, rounds=200) > 0


def test_overhead_figures_on_a_tiny_pair():
    target = random_model(hf_config(), seed=11)
    out = tracing_overhead(target, ModelDrafter(random_model(hf_config(), seed=11)), [1, 2, 3, 4, 5],
                           new_tokens=8, k=2, repeats=1)
    assert out["compiled_out_tokens_per_s"] > 0 and out["off_tokens_per_s"] > 0 and out["on_tokens_per_s"] > 0
    assert 0 < out["off_added_us_per_round"] < 1000 and out["off_cost_from_added_time"] < 0.02
