"""Conversions between deltaspec.v1 messages and engine types; each one in one place."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from deltaspec.v1 import sampling_pb2
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import Stats
from deltaspec.shared.decoding.target import check_tokens
from deltaspec.shared.errors import InvalidArgument


def sampling_from_proto(msg: sampling_pb2.SamplingParams) -> SamplingParams:
    """`SamplingParams` refuses values out of range (InvalidArgument naming `sampling.<field>`); unset top_p is 1."""
    return SamplingParams(msg.temperature, msg.top_k, msg.top_p or 1.0, msg.seed)


def sampling_to_proto(params: SamplingParams) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                       seed=params.seed)


def put_probs(msg, probs: Tensor | None, greedy: bool, sparse: bool = False) -> None:
    """Write draft distributions q into a fresh `msg` (a VerifyRequest or ProposeResponse): nothing when greedy
    (verification never reads them); `draft_probs_sparse` when the peer reads it (`sparse`) and most entries are 0,
    as top-k and top-p leave them (exact: every entry left out is 0); else the dense `draft_probs`, written as
    the wire has it (a packed float32 array: a list of a million Python floats costs ten times as much)."""
    if probs is None or greedy:
        return
    probs = probs.detach().float().cpu()
    if sparse and 2 * int(torch.count_nonzero(probs)) < probs.numel():  # an entry costs two numbers
        rows, ids = probs.nonzero(as_tuple=True)
        msg.draft_probs_sparse.CopyFrom(sampling_pb2.SparseDistributions(
            row_sizes=torch.bincount(rows, minlength=probs.shape[0]).tolist(), token_ids=ids.tolist(),
            probs=probs[rows, ids].tolist()))
        return
    data = probs.numpy().astype("<f4", copy=False).tobytes()
    number = msg.DESCRIPTOR.fields_by_name["draft_probs"].number
    msg.MergeFromString(_varint(number << 3 | 2) + _varint(len(data)) + data)  # wire type 2: length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def probs_from_proto(msg, tokens: list[int], vocab_size: int) -> Tensor | None:
    """A `(len(tokens), vocab)` float32 tensor of the distributions in `msg.draft_probs` (dense, row-major) or
    `msg.draft_probs_sparse`, or None when neither is set. Anything else (both set, wrong sizes, a token outside
    the vocabulary or twice in a row, NaN, negative, rows not summing to 1, zero on a drafted token) is refused
    naming the field, since rejection sampling divides by it."""
    dense = msg.draft_probs
    sparse = msg.draft_probs_sparse if msg.HasField("draft_probs_sparse") else None
    if sparse is not None and len(dense):
        raise InvalidArgument("draft_probs and draft_probs_sparse are both set: send one", "draft_probs_sparse")
    rows = len(tokens)
    if sparse is None and not len(dense):
        return None
    check_tokens(tokens, vocab_size, "draft_tokens")
    if sparse is not None:
        field_name = "draft_probs_sparse"
        q, values = _dense(sparse, rows, vocab_size)
    else:
        field_name = "draft_probs"
        if len(dense) != rows * vocab_size:
            raise InvalidArgument(f"{len(dense)} draft probabilities, expected {rows} x {vocab_size}", field_name)
        values = torch.from_numpy(np.array(dense, dtype=np.float32))  # read as one buffer, not float by float
        q = values.view(rows, vocab_size)
    if not (torch.isfinite(values).all() and (values >= 0).all()):
        raise InvalidArgument("draft probabilities must be finite and >= 0",
                              field_name if sparse is None else f"{field_name}.probs")
    if not torch.allclose(q.sum(-1), torch.ones(rows), atol=1e-3):
        raise InvalidArgument(f"draft probabilities must sum to 1 per token, got {q.sum(-1).tolist()}", field_name)
    if not (q[torch.arange(rows), torch.tensor(tokens, dtype=torch.long)] > 0).all():
        raise InvalidArgument("draft probabilities give a drafted token probability 0", field_name)
    return q


def _dense(msg: sampling_pb2.SparseDistributions, rows: int, vocab_size: int) -> tuple[Tensor, Tensor]:
    """The `(rows, vocab)` tensor a `SparseDistributions` lists, its layout checked, and the listed values."""
    field_name = "draft_probs_sparse"
    sizes, ids = list(msg.row_sizes), list(msg.token_ids)
    if len(sizes) != rows:
        raise InvalidArgument(f"{len(sizes)} rows for {rows} draft tokens", f"{field_name}.row_sizes")
    if sum(sizes) != len(ids) or len(ids) != len(msg.probs):
        raise InvalidArgument(f"row sizes sum to {sum(sizes)}, with {len(ids)} token ids and {len(msg.probs)} "
                              "probabilities: all three must agree", field_name)
    check_tokens(ids, vocab_size, f"{field_name}.token_ids")
    at = torch.repeat_interleave(torch.arange(rows), torch.tensor(sizes, dtype=torch.long)) * vocab_size + \
        torch.tensor(ids, dtype=torch.long)
    if torch.unique(at).numel() != at.numel():
        raise InvalidArgument("a token id appears twice in one row", f"{field_name}.token_ids")
    values = torch.from_numpy(np.array(msg.probs, dtype=np.float32))
    q = torch.zeros(rows * vocab_size)
    q[at] = values
    return q.view(rows, vocab_size), values


def stats_to_proto(stats: Stats, draft_failures: int = 0) -> sampling_pb2.GenerationStats:
    return sampling_pb2.GenerationStats(
        rounds=stats.rounds, drafted=stats.drafted, accepted=stats.accepted, staged_bytes=stats.staged_bytes,
        seconds=stats.seconds, accepted_per_position=stats.accepted_per_position, draft_failures=draft_failures,
        drafts=stats.drafts, cached_prompt_tokens=stats.cached_prompt_tokens,
        speculations_kept=stats.speculations_kept, speculations_missed=stats.speculations_missed)


def stats_from_proto(msg: sampling_pb2.GenerationStats) -> Stats:
    return Stats(msg.rounds, msg.drafted, msg.accepted, msg.staged_bytes, msg.seconds,
                 list(msg.accepted_per_position), drafts=msg.drafts, cached_prompt_tokens=msg.cached_prompt_tokens,
                 speculations_kept=msg.speculations_kept, speculations_missed=msg.speculations_missed)
