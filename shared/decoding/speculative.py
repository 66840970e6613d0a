"""The in-process speculative decoding loop: propose, verify, commit, repeat.

With `NoDrafter` (or k = 0) it is plain target-only decoding through the same round protocol.
`decode` is the one loop: in process, in the target service's `Generate`, and in the gRPC client.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Protocol

from torch import Tensor

from shared.decoding.drafters import Drafter, NoDrafter, attach
from shared.decoding.sampling import SamplingParams
from shared.decoding.target import Round, TargetSession
from shared.model.hybrid import HybridLM


@dataclass
class Stats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    staged_bytes: int = 0
    seconds: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)

    def add_round(self, drafted: int, accepted: int, staged_bytes: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.staged_bytes += staged_bytes
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def as_dict(self, new_tokens: int) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.accepted / self.drafted if self.drafted else 0.0
        d["mean_accepted_length"] = new_tokens / self.rounds if self.rounds else 0.0
        d["tokens_per_s"] = new_tokens / self.seconds if self.seconds > 0 else 0.0
        return d


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    stats: Stats

    def as_dict(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "token_ids": self.token_ids,
                "stats": self.stats.as_dict(len(self.token_ids))}


class Session(Protocol):
    """What the loop needs of a target session: a `TargetSession`, or a client of a remote one."""

    version: int

    def verify(self, round_id: str, drafts: list[int], base_version: int | None = None,
               draft_probs: Tensor | None = None) -> Round: ...

    def commit(self, round_id: str, accepted: int) -> int: ...

    @property
    def generated(self) -> list[int]: ...


def decode(session: Session, drafter: Drafter, max_new_tokens: int, num_draft_tokens: int, eos: set[int],
           stats: Stats) -> Iterator[list[int]]:
    """Run rounds until `max_new_tokens` or an EOS (included), yielding the tokens each round commits."""
    out = session.generated
    while len(out) < max_new_tokens and not (out and out[-1] in eos):
        room = max_new_tokens - len(out)
        proposal = drafter.propose(min(num_draft_tokens, room - 1))
        rnd = session.verify(f"r{stats.rounds}", proposal.tokens, session.version, proposal.probs)
        keep = rnd.verdict.accepted
        for i, token in enumerate(proposal.tokens[:keep]):  # stop at an accepted EOS
            if token in eos:
                keep = i
                break
        session.commit(rnd.round_id, keep)
        stats.add_round(len(proposal.tokens), keep, rnd.staged_bytes)
        new = session.generated
        drafter.advance(keep, new[-1])
        yield new[len(out):]
        out = new


def generate(
    target: HybridLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    drafter: Drafter | None = None,
    num_draft_tokens: int = 4,
    sampling: SamplingParams = SamplingParams(),
) -> Generation:
    """Exactly `max_new_tokens` new tokens unless the target's EOS appears (it is included, then we stop)."""
    drafter = drafter or NoDrafter()
    started = time.perf_counter()
    session = TargetSession(target, prompt_ids, sampling)
    drafter.start(list(prompt_ids))
    attach(drafter, session)
    stats = Stats()
    for _ in decode(session, drafter, max_new_tokens, num_draft_tokens, set(target.config.eos_token_id), stats):
        pass
    stats.seconds = time.perf_counter() - started
    return Generation(list(prompt_ids), session.generated, stats)
