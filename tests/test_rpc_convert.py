"""Draft distributions on the wire: dense or sparse, what arrives is exactly what was sent."""
from __future__ import annotations

import pytest
import torch

from deltaspec.v1 import draft_service_pb2 as dpb
from deltaspec.v1 import target_service_pb2 as pb
from benchmarks.wire import draft_probs_wire
from deltaspec.shared.decoding.sampling import SamplingParams, draw, probabilities
from deltaspec.shared.rpc.convert import probs_from_proto, put_probs

VOCAB = 1000


def proposal(sampling: SamplingParams, k: int = 4, seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """k draft distributions from random logits, and a token drawn from each."""
    gen = torch.Generator().manual_seed(seed)
    q = probabilities(torch.randn(k, VOCAB, generator=gen) * 3, sampling)
    return q, [draw(row, gen) for row in q]


def sent(message, q: torch.Tensor, tokens: list[int], greedy: bool = False, sparse: bool = False):
    msg = message(draft_tokens=tokens)
    put_probs(msg, q, greedy, sparse)
    return msg


@pytest.mark.parametrize("sampling, sparse", [
    (SamplingParams(temperature=0.8, top_k=40), True),
    (SamplingParams(temperature=1.2, top_p=0.9), True),
    (SamplingParams(temperature=0.7, top_k=300, top_p=0.95), True),
    (SamplingParams(temperature=0.9), False),  # nothing is 0: dense
])
@pytest.mark.parametrize("message", [pb.VerifyRequest, dpb.ProposeResponse])
def test_draft_distributions_arrive_exactly(sampling, sparse, message):
    for seed in range(3):
        q, tokens = proposal(sampling, seed=seed)
        msg = sent(message, q, tokens, sparse=True)
        assert msg.HasField("draft_probs_sparse") == sparse and bool(msg.draft_probs) != sparse
        assert torch.equal(probs_from_proto(message.FromString(msg.SerializeToString()), tokens, VOCAB), q)
        if sparse:  # a few numbers a row instead of the vocabulary
            assert msg.ByteSize() < sent(message, q, tokens).ByteSize() / 4


@pytest.mark.parametrize("message", [pb.VerifyRequest, dpb.ProposeResponse])
def test_dense_distributions_are_the_bytes_protobuf_itself_writes(message):
    """The dense field is written as raw packed float32: byte for byte what protobuf writes from a list."""
    q, tokens = proposal(SamplingParams(temperature=0.9))
    reference = message(draft_tokens=tokens, draft_probs=q.flatten().tolist())
    assert sent(message, q, tokens).SerializeToString() == reference.SerializeToString()


def test_a_peer_that_reads_no_sparse_field_gets_dense_and_greedy_gets_none():
    q, tokens = proposal(SamplingParams(temperature=0.8, top_k=40))
    dense = sent(pb.VerifyRequest, q, tokens)
    assert not dense.HasField("draft_probs_sparse") and torch.equal(probs_from_proto(dense, tokens, VOCAB), q)
    greedy = sent(pb.VerifyRequest, q, tokens, greedy=True, sparse=True)
    assert greedy == pb.VerifyRequest(draft_tokens=tokens) and probs_from_proto(greedy, tokens, VOCAB) is None


def test_the_wire_bench_sends_top_k_sparse_and_temperature_alone_dense():
    rows = {(r["sampling"], r["peer_reads_sparse"]): r for r in draft_probs_wire(vocab=VOCAB, repeats=1)}
    assert rows["top-k 50", True]["field"] == "draft_probs_sparse"
    assert rows["top-k 50", True]["bytes"] < rows["top-k 50", False]["bytes"] / 4
    assert rows["temperature only", True]["field"] == rows["top-k 50", False]["field"] == "draft_probs"
