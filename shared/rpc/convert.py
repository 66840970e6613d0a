"""Conversions between deltaspec.v1 messages and engine types; each one in one place."""
from __future__ import annotations

import torch
from torch import Tensor

from deltaspec.v1 import sampling_pb2
from shared.decoding.sampling import SamplingParams
from shared.decoding.speculative import Stats
from shared.errors import InvalidArgument


def sampling_from_proto(msg: sampling_pb2.SamplingParams) -> SamplingParams:
    try:
        return SamplingParams(msg.temperature, msg.top_k, msg.top_p or 1.0, msg.seed)
    except ValueError as e:
        raise InvalidArgument(str(e), "sampling") from None


def sampling_to_proto(params: SamplingParams) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                       seed=params.seed)


def probs_to_proto(probs: Tensor | None, greedy: bool) -> list[float]:
    """Draft distributions travel only when sampling: greedy verification never reads them."""
    return [] if probs is None or greedy else probs.float().flatten().tolist()


def probs_from_proto(values, rows: int, vocab_size: int, field_name: str) -> Tensor | None:
    """A `(rows, vocab)` float32 tensor, or None when no distributions were sent."""
    if not len(values):
        return None
    if len(values) != rows * vocab_size:
        raise InvalidArgument(f"{len(values)} draft probabilities, expected {rows} x {vocab_size}", field_name)
    return torch.tensor(values, dtype=torch.float32).view(rows, vocab_size)


def stats_to_proto(stats: Stats, draft_failures: int = 0) -> sampling_pb2.GenerationStats:
    return sampling_pb2.GenerationStats(
        rounds=stats.rounds, drafted=stats.drafted, accepted=stats.accepted, staged_bytes=stats.staged_bytes,
        seconds=stats.seconds, accepted_per_position=stats.accepted_per_position, draft_failures=draft_failures,
        drafts=stats.drafts)


def stats_from_proto(msg: sampling_pb2.GenerationStats) -> Stats:
    return Stats(msg.rounds, msg.drafted, msg.accepted, msg.staged_bytes, msg.seconds,
                 list(msg.accepted_per_position), drafts=msg.drafts)
