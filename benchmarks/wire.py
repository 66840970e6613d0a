"""What draft distributions cost on the wire: bytes a round and the time to encode and decode them, dense
(`draft_probs`, k x vocab floats) against sparse (`draft_probs_sparse`, the nonzero entries only), at
Qwen3.5's vocabulary. Top-k and top-p leave all but a few entries at exactly 0, so the sparse form is exact.

The distributions come from random logits; how many entries survive top-p depends on how peaked real
logits are, so the rows use top-k, whose count is fixed, and temperature alone (nothing is 0: dense).
"""
from __future__ import annotations

import statistics
import time

import torch

from deltaspec.v1 import target_service_pb2 as pb
from deltaspec.shared.decoding.sampling import SamplingParams, draw, probabilities
from deltaspec.shared.rpc.convert import probs_from_proto, put_probs

QWEN35_VOCAB = 248320
CASES = (("top-k 50", SamplingParams(temperature=0.8, top_k=50)),
         ("top-k 1000", SamplingParams(temperature=0.8, top_k=1000)),
         ("temperature only", SamplingParams(temperature=0.8)))


def draft_probs_wire(vocab: int = QWEN35_VOCAB, k: int = 4, repeats: int = 5) -> list[dict]:
    """One row per (sampling, encoding): bytes of a Verify's distributions and the median ms to encode
    (`put_probs` + serialise) and decode (parse + `probs_from_proto`, checks included)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, sampling in CASES:
        q = probabilities(torch.randn(k, vocab, generator=gen) * 3, sampling)
        tokens = [draw(row, gen) for row in q]
        for sparse in (False, True):
            encode, decode = [], []
            for _ in range(repeats + 1):  # the first warms
                t0 = time.perf_counter()
                msg = pb.VerifyRequest(draft_tokens=tokens)
                put_probs(msg, q, False, sparse)
                wire = msg.SerializeToString()
                t1 = time.perf_counter()
                got = probs_from_proto(pb.VerifyRequest.FromString(wire), tokens, vocab)
                t2 = time.perf_counter()
                encode.append(t1 - t0)
                decode.append(t2 - t1)
            assert torch.equal(got, q)  # type: ignore[arg-type]
            field = "draft_probs_sparse" if msg.HasField("draft_probs_sparse") else "draft_probs"
            rows.append({"sampling": name, "peer_reads_sparse": sparse, "field": field, "vocab": vocab, "k": k,
                         "bytes": len(wire), "encode_ms": 1e3 * statistics.median(encode[1:]),
                         "decode_ms": 1e3 * statistics.median(decode[1:])})
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"\nDraft distributions on the wire (k = {rows[0]['k']}, vocabulary {rows[0]['vocab']}; medians)")
    print(f"{'sampling':<17} {'peer reads sparse':>17} {'field':<19} {'bytes':>9} {'encode ms':>9} {'decode ms':>9}")
    for r in rows:
        print(f"{r['sampling']:<17} {str(r['peer_reads_sparse']):>17} {r['field']:<19} {r['bytes']:>9} "
              f"{r['encode_ms']:>9.2f} {r['decode_ms']:>9.2f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    print_rows(draft_probs_wire())
