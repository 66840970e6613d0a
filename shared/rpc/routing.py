"""A routing key for the prefix cache: requests that share a prefix go to the replica that holds it.

Each target replica has a prefix cache of its own (`deltaspec.shared.state.prefix_cache`), so a prompt is cheap
only on a replica that has seen its prefix. A balancer that spreads requests round robin makes every replica
prefill the same system prompt, and sends each turn of a conversation (which resends the whole history) to a
replica that may never have seen the turns before. So the clients send `HEADER` on CreateSession and Generate,
whose value is a short hash of what requests sharing a prefix repeat: the first chat message (the system prompt,
which every request of an application and every turn of a conversation repeat), else the first `TEXT_CHARS`
characters of the text, else the first `IDS` token ids. An L7 balancer that hashes the header (Istio's
`consistentHash.httpHeaderName`: deploy/k8s/components/prefix-routing) sends every request with one key to one
replica, and spreads the keys over the replicas by consistent hashing, so a replica that joins or leaves moves only
its own share of them. A header, because a balancer cannot tokenize: the key comes from what the client sends.

Limits: the key names the start of a prompt, not all of it. Two prompts that share their first 64 ids (or 512
characters, or first message) and nothing after still hash alike; harmless: they just share a replica. And one key
is one replica: an application that puts one system prompt in front of every request sends all of it to one
replica, unless the balancer bounds each replica's load (Envoy's `hash_balance_factor`) or a cache-aware router
weighs load against what each replica holds (`deltaspec_prefix_cache_root_tokens`).
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence

HEADER = "x-deltaspec-prefix"  # gRPC metadata keys are lower case
TEXT_CHARS = 512  # of a text prompt: a system prompt's worth, fewer than most prompts that share one
IDS = 64  # of a prompt given as ids: four 16-token blocks of the prefix cache


def prefix_key(prompt_ids: Sequence[int] | None = None, prompt_text: str = "",
               messages: Sequence[Mapping[str, str]] | None = None) -> str:
    """The routing key of a prompt (16 hex digits), from whichever form it is given in: messages, text or ids."""
    if messages:
        first = messages[0]
        data = b"m" + first["role"].encode() + b"\0" + first["content"].encode()
    elif prompt_text:
        data = b"t" + prompt_text[:TEXT_CHARS].encode()
    else:
        data = b"i" + array("q", list(prompt_ids or ())[:IDS]).tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def prefix_metadata(prompt_ids: Sequence[int] | None = None, prompt_text: str = "",
                    messages: Sequence[Mapping[str, str]] | None = None) -> list[tuple[str, str]]:
    """`HEADER` with the prompt's key, as gRPC metadata for CreateSession and Generate."""
    return [(HEADER, prefix_key(prompt_ids, prompt_text, messages))]
