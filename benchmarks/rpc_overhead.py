"""What gRPC costs: tokens/s of the same generation in process, through `Generate`, and client-driven.

All three run the same rounds (same models, same k, greedy), with both services on loopback in
this process, so the ratio isolates serialisation, the loopback hop and the thread hand-offs.
Run: `python -m benchmarks.rpc_overhead [--max-new-tokens N] [--repeats R]`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from deltaspec.draft_service.servicer import service as draft_service
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer
from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server
from deltaspec.shared.rpc.server import BackgroundServer
from deltaspec.target_service.servicer import DraftPeer, service as target_service


def measure(target_dir: Path = DEFAULT_TARGET, draft_dir: Path = DEFAULT_DRAFT, prompt: list[int] | None = None,
            max_new_tokens: int = 64, num_draft_tokens: int = 4, repeats: int = 3) -> dict:
    prompt = prompt or list(b"def fibonacci(n):")
    target, draft = load_model(target_dir), load_model(draft_dir)
    runs: dict[str, list[float]] = {"in_process": [], "server_loop": [], "client_driven": []}
    with BackgroundServer([draft_service(lambda: draft)]) as d:
        t_svc = target_service(lambda: (target, load_tokenizer(target_dir)), draft=DraftPeer(d.address, 5.0))
        with BackgroundServer([t_svc]) as t:
            d.wait_loaded()
            t.wait_loaded()
            for _ in range(repeats):
                ref = generate(target, prompt, max_new_tokens, ModelDrafter(draft), num_draft_tokens)
                server, _ = generate_on_server(t.address, prompt, "", max_new_tokens, num_draft_tokens)
                client, _ = generate_client_driven(t.address, d.address, prompt, "", max_new_tokens, num_draft_tokens,
                                                   draft_timeout_s=5.0)
                assert server.token_ids == client.token_ids == ref.token_ids
                for name, g in (("in_process", ref), ("server_loop", server), ("client_driven", client)):
                    runs[name].append(len(g.token_ids) / g.stats.seconds)
            rounds = ref.stats.rounds
    best = {name: max(v) for name, v in runs.items()}
    return {"tokens_per_s": best, "rounds": rounds,
            "ratio_to_in_process": {k: v / best["in_process"] for k, v in best.items() if k != "in_process"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(measure(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
                             repeats=args.repeats)))


if __name__ == "__main__":
    main()
