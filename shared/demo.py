"""`deltaspec demo`: both services of the embedded pair on loopback, one generation streamed over gRPC.

The pair is two small byte-level models trained on the Python standard library
(scripts/train_default_pair.py). Greedy decoding from a model this small soon falls into loops
(`self._set_set_set...`), so the demo samples by default, at a moderate temperature with top-p;
speculative sampling keeps the output distributed exactly as the target's own sampling would be.
`--temperature 0` shows greedy decoding. Kept free of torch and grpc imports: the parser reads the
defaults, and gRPC's logging must be configured before grpc is first imported. `embedded_pair` also serves
`deltaspec serve-openai --embedded`.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deltaspec.shared.rpc.server import BackgroundServer

PROMPT = "class Point:\n    def __init__(self, x, y):\n"
TEMPERATURE, TOP_P, SEED = 0.9, 0.9, 1  # picked by eye among 5 prompts x 2 seeds, like any demo's defaults
MAX_NEW_TOKENS, NUM_DRAFT_TOKENS = 256, 4


def quiet_grpc() -> None:
    """Keep gRPC C-core's log lines (e.g. `Got goaway` when a channel sees its server stop) off the terminal.

    The C core reads these variables once, when grpc is first imported; a user's own settings win.
    """
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    os.environ.setdefault("GRPC_TRACE", "")


@contextmanager
def embedded_pair() -> Iterator[tuple[BackgroundServer, BackgroundServer]]:
    """The embedded pair's draft and target services on free loopback ports, loaded (a bar while they load)."""
    quiet_grpc()
    from tqdm import tqdm

    from deltaspec.draft_service.servicer import service as draft_service
    from deltaspec.shared.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, EMBEDDED_MODEL_NAME
    from deltaspec.shared.model.loader import load_model
    from deltaspec.shared.model.tokenizer import load_tokenizer
    from deltaspec.shared.rpc.server import BackgroundServer
    from deltaspec.target_service.servicer import DraftPeer, service as target_service

    with BackgroundServer([draft_service(lambda: load_model(DEFAULT_DRAFT))]) as draft:
        target_svc = target_service(lambda: (load_model(DEFAULT_TARGET), load_tokenizer(DEFAULT_TARGET)),
                                    draft=DraftPeer(draft.address), model_name=EMBEDDED_MODEL_NAME)
        with BackgroundServer([target_svc]) as target:
            with tqdm(total=2, desc="loading the embedded pair", unit="model", file=sys.stderr, leave=False) as bar:
                for server in (draft, target):
                    server.wait_loaded()
                    bar.update()
            yield draft, target


def run(prompt: str, max_new_tokens: int, sampling, num_draft_tokens: int = NUM_DRAFT_TOKENS) -> int:
    """Serve the pair, stream one generation to stdout, then a one-line report; a bar while models load."""
    quiet_grpc()  # before the first import of grpc
    from deltaspec.shared.rpc.generation import generate_on_server

    started = time.perf_counter()
    with embedded_pair() as (draft, target):
        how = "greedy" if sampling.greedy else (f"sampling at temperature {sampling.temperature:g}, "
                                                f"top-p {sampling.top_p:g}, seed {sampling.seed}")
        print(f"[draft service on {draft.address}, target service on {target.address}, loaded in "
              f"{time.perf_counter() - started:.1f} s; {how}, {num_draft_tokens} drafts a round]",
              file=sys.stderr)
        print(prompt, end="", flush=True)
        result, _ = generate_on_server(target.address, None, prompt, max_new_tokens, num_draft_tokens, sampling,
                                       on_tokens=lambda ids, text: print(text, end="", flush=True))
    s = result.as_dict()["stats"]
    print(f"\n[{len(result.token_ids)} tokens in {s['seconds']:.2f} s: {s['tokens_per_s']:.1f} tok/s, "
          f"acceptance rate {s['acceptance_rate']:.2f}, mean accepted length {s['mean_accepted_length']:.2f}]")
    return 0
