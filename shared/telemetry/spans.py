"""The root span of one generation, wherever its loop runs, named and attributed as the GenAI conventions say."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry.trace import Span, SpanKind, Tracer

from deltaspec.shared.telemetry import attributes as attr


@contextmanager
def generation_span(tracer: Tracer, loop: str, model: str, max_new_tokens: int) -> Iterator[Span]:
    """`loop`: where the rounds run (in_process | server | client); a client span, since it asks for tokens."""
    with tracer.start_as_current_span(f"{attr.OPERATION} {model}", kind=SpanKind.CLIENT, attributes={
            attr.GEN_AI_OPERATION_NAME: attr.OPERATION, attr.GEN_AI_PROVIDER_NAME: attr.PROVIDER,
            attr.GEN_AI_REQUEST_MODEL: model, attr.GEN_AI_REQUEST_MAX_TOKENS: max_new_tokens,
            attr.LOOP: loop}) as span:
        yield span


def round_attributes(staged_bytes: int, collective_s: float) -> dict[str, int | float]:
    """A round's cost attributes: the bytes it staged, and (on rank 0 of a tensor-parallel group only) the seconds its
    verify and commit spent in the group's all-reduces and broadcasts."""
    if collective_s:
        return {attr.STAGED_BYTES: staged_bytes, attr.TP_COLLECTIVE_S: collective_s}
    return {attr.STAGED_BYTES: staged_bytes}


def record_usage(span: Span, prompt: list[int], generated: list[int]) -> None:
    span.set_attributes({attr.GEN_AI_USAGE_INPUT_TOKENS: len(prompt), attr.GEN_AI_USAGE_OUTPUT_TOKENS: len(generated)})
