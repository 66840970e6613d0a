"""The in-process speculative decoding loop: propose, verify, commit, repeat.

With `NoDrafter` (or k = 0) it is plain target-only decoding through the same round protocol.
`decode` is the one loop: in process, in the target service's `Generate`, and in the gRPC client.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Protocol

from opentelemetry.trace import NoOpTracer, Tracer
from torch import Tensor

from deltaspec.shared.decoding.draft_length import CostModelLength
from deltaspec.shared.decoding.drafters import Drafter, NoDrafter, Proposal, attach
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.target import Round, TargetSession, check_num_draft_tokens
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.telemetry import attributes as attr
from deltaspec.shared.telemetry.spans import generation_span, record_usage, round_attributes

NO_TRACER = NoOpTracer()


@dataclass
class Stats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    staged_bytes: int = 0
    seconds: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts: int = 0  # rounds that carried at least one draft token (vLLM's num_drafts)
    first_token_seconds: float = 0.0  # from the start of the generation to its first token
    propose_seconds: float = 0.0  # round phases, summed (measured where the loop runs)
    verify_seconds: float = 0.0
    commit_seconds: float = 0.0  # the target's commit and the drafter's advance (its own commit)
    prefill_seconds: float = 0.0  # opening the target session (prompt prefill), in process only
    cached_prompt_tokens: int = 0  # prompt positions the target took from its prefix cache
    # pipelined loops: rounds whose next round had been speculated, by whether it was kept (else made afresh)
    speculations_kept: int = 0
    speculations_missed: int = 0

    def add_round(self, drafted: int, accepted: int, staged_bytes: int,
                  phase_seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> None:
        self.rounds += 1
        self.drafts += drafted > 0
        self.propose_seconds += phase_seconds[0]
        self.verify_seconds += phase_seconds[1]
        self.commit_seconds += phase_seconds[2]
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
        speculated = self.speculations_kept + self.speculations_missed
        d["speculations_kept_rate"] = self.speculations_kept / speculated if speculated else 0.0
        d["time_per_output_token_s"] = ((self.seconds - self.first_token_seconds) / (new_tokens - 1)
                                        if new_tokens > 1 and self.first_token_seconds > 0 else 0.0)
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


def drafts_kept(rnd: Round, eos: set[int]) -> int:
    """Drafts the loop commits of a verified round: those accepted, up to an accepted EOS (which is then the
    round's next token, so the generation ends there)."""
    return next((i for i, token in enumerate(rnd.drafts[:rnd.verdict.accepted]) if token in eos),
                rnd.verdict.accepted)


def decode(session: Session, drafter: Drafter, max_new_tokens: int, num_draft_tokens: int | CostModelLength,
           eos: set[int], stats: Stats, tracer: Tracer = NO_TRACER, metrics=None,
           until: Callable[[], bool] | None = None) -> Iterator[list[int]]:
    """Run rounds until `max_new_tokens` or an EOS (included), or `until()` after a round, yielding the tokens each
    round commits.

    `num_draft_tokens`: k for every round, or a `CostModelLength` that chooses k per round and learns from each
    verdict.

    Each round is a span `round` with children `propose`, `verify`, `commit` (no-op spans unless
    `tracer` records); `metrics` (a `deltaspec.shared.telemetry.Metrics`) counts the round when given.
    """
    length = None if isinstance(num_draft_tokens, int) else num_draft_tokens
    if length is None:
        check_num_draft_tokens(num_draft_tokens)
    out = session.generated
    while len(out) < max_new_tokens and not (out and out[-1] in eos):
        room = max_new_tokens - len(out)
        with tracer.start_as_current_span("round") as span:
            traced = span.is_recording()
            ids = _ids(session, f"r{stats.rounds}") if traced else {}
            t0 = time.perf_counter()
            with tracer.start_as_current_span("propose") as phase:
                asked = min(num_draft_tokens if length is None else length.choose(), room - 1)
                shadow = 0 if length is None or asked else min(length.shadow_k(), room - 1)
                proposal = drafter.propose(asked or shadow)
                if shadow:  # drafts to learn from, not to verify (the cost model's `shadow`)
                    length.shadow(proposal.tokens, shadow)  # type: ignore[union-attr]
                    proposal = Proposal([])
                if traced:
                    phase.set_attributes({**ids, attr.DRAFT_TOKENS: len(proposal.tokens)})
            t1 = time.perf_counter()
            with tracer.start_as_current_span("verify") as phase:
                base = session.version
                rnd = session.verify(f"r{stats.rounds}", proposal.tokens, base, proposal.probs)
                if traced:
                    phase.set_attributes({**ids, attr.BASE_VERSION: base, attr.DRAFT_TOKENS: len(proposal.tokens),
                                          attr.ACCEPTED_TOKENS: rnd.verdict.accepted,
                                          attr.STAGED_BYTES: rnd.staged_bytes})
            t2 = time.perf_counter()
            if length is not None:
                why = note_draft_length(length, len(proposal.tokens), metrics)
                if traced:
                    span.set_attributes(draft_length_attributes(length, len(proposal.tokens), why))
                length.observe(len(proposal.tokens), rnd.verdict.accepted, t1 - t0, asked)
            keep = drafts_kept(rnd, eos)
            with tracer.start_as_current_span("commit") as phase:
                version = session.commit(rnd.round_id, keep)
                if traced:
                    phase.set_attributes({**ids, attr.BASE_VERSION: base, attr.NEW_VERSION: version,
                                          attr.ACCEPTED_TOKENS: keep})
            t3 = time.perf_counter()
            stats.add_round(len(proposal.tokens), keep, rnd.staged_bytes, (t1 - t0, t2 - t1, t3 - t2))
            if metrics is not None:
                metrics.round(len(proposal.tokens), keep, rnd.staged_bytes, t1 - t0, t2 - t1, t3 - t2, rnd.collective_s)
            if traced:
                span.set_attributes({**ids, attr.BASE_VERSION: base, attr.NEW_VERSION: version,
                                     attr.DRAFT_TOKENS: len(proposal.tokens), attr.ACCEPTED_TOKENS: keep,
                                     **round_attributes(rnd.staged_bytes, rnd.collective_s)})
        new = session.generated
        if length is not None:
            length.emitted(new[len(out):])
        t4 = time.perf_counter()
        drafter.advance(keep, new[-1])
        stats.commit_seconds += time.perf_counter() - t4
        yield new[len(out):]
        out = new
        if until is not None and until():
            return


def note_draft_length(length: CostModelLength, drafts: int, metrics=None) -> str:
    """Why a round took the cost model's `drafts` drafts (it paid, it may still pay (the benefit of the doubt),
    nothing paid, a probe, or none made: the drafter had none, or the generation's end left no room), counted in the
    metrics."""
    if drafts:
        reason = "probe" if length.probing else "doubt" if length.reason == "doubt" else "pays"
    else:
        reason = "none made" if length.reason in ("pays", "doubt", "probe") else length.reason
    if metrics is not None:
        metrics.draft_length_chosen(drafts, reason)
    return reason


def draft_length_attributes(length: CostModelLength, drafts: int, reason: str) -> dict:
    """A round's span attributes for the cost model's choice: k, why, and the rates it expected at each k."""
    return {attr.DRAFT_LENGTH_K: drafts, attr.DRAFT_LENGTH_REASON: reason,
            attr.DRAFT_LENGTH_ACCEPTANCE: length.acceptance, attr.DRAFT_LENGTH_TOKENS_PER_S: length.rates()}


def _ids(session: Session, round_id: str) -> dict:
    return {attr.SESSION_ID: getattr(session, "session_id", None) or "", attr.ROUND_ID: round_id}


def generate(
    target: HybridLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    drafter: Drafter | None = None,
    num_draft_tokens: int | CostModelLength = 4,
    sampling: SamplingParams = SamplingParams(),
    tracer: Tracer = NO_TRACER,
    model: str = "deltaspec-target",
    eos_token_ids: tuple[int, ...] = (),
) -> Generation:
    """Exactly `max_new_tokens` new tokens unless the target's EOS appears (it is included, then we stop): the
    config's `eos_token_id` or one of `eos_token_ids` (a checkpoint's generation_config.json lists them).

    With a recording `tracer`: one trace, a root span named for `model` over the rounds' spans."""
    drafter = drafter or NoDrafter()
    with generation_span(tracer, "in_process", model, max_new_tokens) as span:
        started = time.perf_counter()
        session = TargetSession(target, prompt_ids, sampling)
        drafter.start(list(prompt_ids))
        attach(drafter, session)
        stats = Stats(prefill_seconds=time.perf_counter() - started, cached_prompt_tokens=session.cached_tokens)
        eos = set(target.config.eos_token_id) | set(eos_token_ids)
        for _ in decode(session, drafter, max_new_tokens, num_draft_tokens, eos, stats, tracer):
            stats.first_token_seconds = stats.first_token_seconds or time.perf_counter() - started
        stats.seconds = time.perf_counter() - started
        session.finish()
        record_usage(span, list(prompt_ids), session.generated)
    return Generation(list(prompt_ids), session.generated, stats)
