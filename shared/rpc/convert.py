"""Conversions between deltaspec.v1 messages and engine types; each one in one place."""
from __future__ import annotations

import torch
from torch import Tensor

from deltaspec.v1 import sampling_pb2
from shared.decoding.sampling import SamplingParams
from shared.decoding.speculative import Stats
from shared.decoding.target import check_tokens
from shared.errors import InvalidArgument


def sampling_from_proto(msg: sampling_pb2.SamplingParams) -> SamplingParams:
    """`SamplingParams` refuses values out of range (InvalidArgument naming `sampling.<field>`); unset top_p is 1."""
    return SamplingParams(msg.temperature, msg.top_k, msg.top_p or 1.0, msg.seed)


def sampling_to_proto(params: SamplingParams) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                       seed=params.seed)


def probs_to_proto(probs: Tensor | None, greedy: bool) -> list[float]:
    """Draft distributions travel only when sampling: greedy verification never reads them."""
    return [] if probs is None or greedy else probs.float().flatten().tolist()


def probs_from_proto(values, tokens: list[int], vocab_size: int, field_name: str) -> Tensor | None:
    """A `(len(tokens), vocab)` float32 tensor of distributions that could have drawn `tokens`, or None when
    none were sent; anything else (wrong length, NaN, negative, not summing to 1, zero on a drafted token) is
    refused, since rejection sampling divides by it."""
    if not len(values):
        return None
    check_tokens(tokens, vocab_size, "draft_tokens")
    rows = len(tokens)
    if len(values) != rows * vocab_size:
        raise InvalidArgument(f"{len(values)} draft probabilities, expected {rows} x {vocab_size}", field_name)
    q = torch.tensor(values, dtype=torch.float32).view(rows, vocab_size)
    if not (torch.isfinite(q).all() and (q >= 0).all()):
        raise InvalidArgument("draft probabilities must be finite and >= 0", field_name)
    if not torch.allclose(q.sum(-1), torch.ones(rows), atol=1e-3):
        raise InvalidArgument(f"draft probabilities must sum to 1 per token, got {q.sum(-1).tolist()}", field_name)
    if not (q[torch.arange(rows), torch.tensor(tokens, dtype=torch.long)] > 0).all():
        raise InvalidArgument("draft probabilities give a drafted token probability 0", field_name)
    return q


def stats_to_proto(stats: Stats, draft_failures: int = 0) -> sampling_pb2.GenerationStats:
    return sampling_pb2.GenerationStats(
        rounds=stats.rounds, drafted=stats.drafted, accepted=stats.accepted, staged_bytes=stats.staged_bytes,
        seconds=stats.seconds, accepted_per_position=stats.accepted_per_position, draft_failures=draft_failures,
        drafts=stats.drafts)


def stats_from_proto(msg: sampling_pb2.GenerationStats) -> Stats:
    return Stats(msg.rounds, msg.drafted, msg.accepted, msg.staged_bytes, msg.seconds,
                 list(msg.accepted_per_position), drafts=msg.drafts)
