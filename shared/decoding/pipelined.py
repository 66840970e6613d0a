"""The pipelined decoding loop: the draft proposes round r+1 while the target verifies round r.

Serial rounds leave each side idle while the other works and while messages cross the network:

    serial     draft  [propose r]                        [propose r+1]
               target             [verify r][commit r]                [verify r+1][commit r+1]

    pipelined  draft  [propose r][speculate r+1]   [speculate r+2]
               target            [verify r][verify r+1][commit r][verify r+2][commit r+1] ...

While round r is verified, the drafter proposes round r+1 (`speculate`) as if r kept all its drafts
and were followed by the draft's own guess of the next token; the target stages r+1 on top of r
(`verify(..., parent=r, guess=g)`) as soon as the proposal arrives, before r is committed. When r's
verdict matches (every draft kept, the next token equal to the guess) r+1 is already verified and the
draft is already speculating r+2; otherwise the target and the draft drop r+1 and the next round is an
ordinary one. Either way the committed tokens are those of the serial loop (`speculative.decode`): a
kept round r+1 is exactly the round the serial loop would have run, its random draws keyed by the
same positions. The drafter must offer `speculate(k) -> (guess, Proposal) | None`.

A remote drafter (`speculate_async`) works two rounds ahead: as soon as r's verdict keeps every
draft, the request for r+2 leaves, carrying r's outcome, without waiting for r+1's proposal to come
back; so with a network delay d the draft's round trip (2d plus its forwards) overlaps the target's
verify instead of adding to it each round, and the draft service, which speculated r+2 on top of r+1 in
the background after answering for r+1, answers at once. The draft refuses r+2 when r's outcome does not
confirm r+1, and nothing changes. After a miss, the requests for the two speculations on top of the new
round leave right behind the plain one (`propose_and_speculate`), so they are made while the new round is
verified instead of a round trip after each. A chained verify is sent as soon as its proposal is in: the
target holds it until the round below is the pending one.

A round's tokens go out at its verdict, which decides them, while its commit is in flight: after a kept
round the commit waits behind the next round's chained verify, and after a miss the plain proposal is
on its way.

Target and draft calls overlap through a small thread pool; each call carries the caller's
context, so RPC spans stay in the generation's trace.
"""
from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from opentelemetry.trace import Span, Tracer, use_span

from deltaspec.shared.decoding.draft_length import CostModelLength
from deltaspec.shared.decoding.drafters import Drafter, Proposal
from deltaspec.shared.decoding.speculative import (NO_TRACER, Session, Stats, _ids, decode, draft_length_attributes,
                                                   drafts_kept, note_draft_length)
from deltaspec.shared.decoding.target import Round, check_num_draft_tokens
from deltaspec.shared.errors import FailedPrecondition, NotFound
from deltaspec.shared.telemetry import attributes as attr
from deltaspec.shared.telemetry.spans import round_attributes


@dataclass
class _Planned:
    """A round whose drafts are known: its id, base version, proposal and the verify in flight."""

    round_id: str
    base: int
    proposal: Proposal
    verifying: Future
    guess: int | None = None  # a speculative round: the token assumed after its parent


def decode_pipelined(session: Session, drafter: Drafter, max_new_tokens: int,
                     num_draft_tokens: int | CostModelLength, eos: set[int], stats: Stats, tracer: Tracer = NO_TRACER,
                     metrics=None, until: Callable[[], bool] | None = None) -> Iterator[list[int]]:
    """Rounds until `max_new_tokens` or an EOS (included), pipelined; yields what each round commits.
    `num_draft_tokens`: k for every round, or a `CostModelLength` whose choice makes each fresh round and whose
    current k the rounds speculated ahead take (it learns from every verdict). `until()`: asked where a round ends
    with nothing staged ahead of it; true ends the rounds there."""
    length = None if isinstance(num_draft_tokens, int) else num_draft_tokens
    if length is None:
        check_num_draft_tokens(num_draft_tokens)
    out = session.generated
    if len(out) >= max_new_tokens or (out and out[-1] in eos):
        return
    # named apart from every round before, a loop begun again after serial rounds (`decode_adaptive`) included: the
    # target keeps the round before and the last dropped one for retries, and refuses a name reused with other drafts
    first = stats.rounds
    names = (f"p{first}.{n}" for n in range(1 << 62))
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="pipeline") as pool:
        def submit(fn, *args, span: Span | None = None) -> Future:
            """Run `fn` in the pool, in this context (under `span` when given: its RPC spans become its children)."""
            def call():
                if span is None:
                    return fn(*args)
                with use_span(span, end_on_exit=False):
                    return fn(*args)
            return pool.submit(contextvars.copy_context().run, call)

        def plan(proposal: Proposal) -> _Planned:
            name, base = next(names), session.version
            if not proposal.tokens:  # a decode step: nothing to overlap it with, so no thread of its own
                return _Planned(name, base, proposal, resolved(session.verify(name, [], base)))
            return _Planned(name, base, proposal, submit(session.verify, name, proposal.tokens, base, proposal.probs))

        def speculate(parent: Future, k: int, after: tuple[int, int] | None = None) -> Future | None:
            """The round after `parent` (a future of its `_Planned`) if it keeps every draft: its proposal requested
            now, then verified on top of `parent` as soon as both are in (a future of `_Planned`, or of None)."""
            guessed = _start_speculation(drafter, k, after)
            if guessed is None:
                return None
            return submit(_chain, session, next(names), parent, guessed, submit)

        def k_on(room: int, below: list[int]) -> int:
            """Drafts for a round on top of rounds of `below` drafts each kept whole (the serial loop's k)."""
            most = num_draft_tokens if length is None else length.current()
            return min(most, room - sum(k + 1 for k in below) - 1)

        def propose(room: int) -> tuple[Proposal, list[tuple[Future, int]]]:
            """A plain proposal; from a remote drafter also the two rounds after it, speculated at once: (proposal,
            [(future of (guess, proposal) | None, k asked)])."""
            k = min(num_draft_tokens if length is None else length.choose(), room - 1)
            ks = [k_on(room, [k])]
            ks.append(k_on(room, [k, ks[0]]))
            if ks[0] < 1 or not hasattr(drafter, "propose_and_speculate"):
                return drafter.propose(k), []
            proposal, *guessed = drafter.propose_and_speculate(k, ks[0], max(ks[1], 0))  # type: ignore[attr-defined]
            return proposal, list(zip(guessed, ks))

        def start(fresh: tuple[Proposal, list[tuple[Future, int]]]) -> tuple[_Planned, list[tuple[Future, int]]]:
            """A fresh proposal verified on the head, and its speculations, if any, chained on it, each on the last."""
            proposal, guessed = fresh
            planned = plan(proposal)
            queue, parent = [], resolved(planned)
            for answer, k in guessed:
                if k < 1:
                    break
                parent = submit(_chain, session, next(names), parent, answer, submit)
                queue.append((parent, k))
            return planned, queue

        t = time.perf_counter()
        # queue: rounds cur+1 (and cur+2) speculated, each then staged at the target once the one below is pending,
        # with the draft tokens asked for each
        cur, queue = start(propose(max_new_tokens - len(out)))
        propose_s = time.perf_counter() - t
        while True:
            span = tracer.start_span("round")  # open until the round's commit returns, after its tokens went out
            try:
                with use_span(span, end_on_exit=False):
                    traced = span.is_recording()
                    ids = _ids(session, cur.round_id) if traced else {}
                    room = max_new_tokens - len(out)
                    t0 = time.perf_counter()
                    if not queue:  # speculate the next round while this one is verified
                        with tracer.start_as_current_span("propose"):
                            k = k_on(room, [len(cur.proposal.tokens)])
                            ahead = speculate(resolved(cur), k) if k >= 1 else None
                            queue = [] if ahead is None else [(ahead, k)]
                    t1 = time.perf_counter()
                    with tracer.start_as_current_span("verify") as phase:
                        rnd: Round = cur.verifying.result()
                        if traced:
                            phase.set_attributes({**ids, attr.BASE_VERSION: cur.base,
                                                  attr.DRAFT_TOKENS: len(rnd.drafts),
                                                  attr.ACCEPTED_TOKENS: rnd.verdict.accepted,
                                                  attr.STAGED_BYTES: rnd.staged_bytes})
                    t2 = time.perf_counter()
                    drafts = list(rnd.drafts)
                    if length is not None:
                        why = note_draft_length(length, len(drafts), metrics)
                        if traced:
                            span.set_attributes(draft_length_attributes(length, len(drafts), why))
                        length.observe(len(drafts), rnd.verdict.accepted, propose_s)
                    keep = drafts_kept(rnd, eos)
                    next_token = rnd.verdict.next_token if keep == rnd.verdict.accepted else drafts[keep]
                    commit_span = tracer.start_span("commit")  # open until the commit returns, around the next propose
                    if drafts or queue:
                        committing = submit(session.commit, cur.round_id, keep, span=commit_span)
                    else:  # a decode step: nothing would run beside its commit
                        with use_span(commit_span, end_on_exit=False):
                            committing = resolved(session.commit(cur.round_id, keep))
                    room_after = room - keep - 1
                    t3 = time.perf_counter()
                    fresh: Future | None = None  # after a miss: the plain proposal, asked for now, waited for once this
                    # round's tokens are out (they stream to the caller during the draft's round trip, not after it)
                    propose_span = tracer.start_span("propose")  # open until the proposal it asks for is in
                    with use_span(propose_span, end_on_exit=False):
                        full = bool(queue) and keep == len(drafts) and next_token not in eos
                        if full and queue[0][0].done():  # cur+1's proposal is in: ask for more only if its guess holds
                            known = queue[0][0].result()  # (the plain Propose after a miss would first wait for a
                            full = known is not None and known.guess == next_token  # doomed request)
                        # round cur+2, requested before cur+1's proposal is back (a remote drafter; after a miss it is
                        # queued already)
                        k = k_on(room, [len(drafts), queue[0][1]]) if queue else 0
                        if full and hasattr(drafter, "speculate_async") and len(queue) == 1 and k >= 1:
                            ahead = speculate(queue[0][0], k, (keep, next_token))
                            queue = queue if ahead is None else [*queue, (ahead, k)]
                        # cur+1's proposal, when it could be kept (else it is not waited for)
                        planned: _Planned | None = queue[0][0].result() if queue and keep == len(drafts) else None
                        kept = planned is not None and next_token == planned.guess
                        if queue and room_after > 0 and next_token not in eos:  # a next round was speculated
                            stats.speculations_kept += kept
                            stats.speculations_missed += not kept
                            if metrics is not None:
                                metrics.speculation_used(kept)
                        drafter.advance(keep, next_token)  # keeps the draft's speculation or drops it
                        if kept:
                            queue = queue[1:]
                            k = k_on(room_after, [len(planned.proposal.tokens)])  # type: ignore[union-attr]
                            if not queue and k >= 1:
                                ahead = speculate(resolved(planned), k)
                                queue = [] if ahead is None else [(ahead, k)]
                        elif room_after > 0 and next_token not in eos:
                            if until is None or not until():
                                fresh = submit(propose, room_after)
                    if fresh is None:
                        propose_span.end()
                    else:
                        fresh.add_done_callback(lambda _: propose_span.end())
                    t4 = time.perf_counter()
            except BaseException:
                span.end()
                raise
            tokens = [*drafts[:keep], next_token]  # what the commit in flight records: the verdict decided them
            try:
                yield tokens  # out now, not once the commit returns (after a kept round it waits for the next verify)
            finally:
                with use_span(span, end_on_exit=True):
                    t5 = time.perf_counter()
                    with use_span(commit_span, end_on_exit=True):
                        version = committing.result()
                        if traced:
                            commit_span.set_attributes({**ids, attr.BASE_VERSION: cur.base, attr.NEW_VERSION: version,
                                                        attr.ACCEPTED_TOKENS: keep})
                    phases = (propose_s + (t1 - t0) + (t4 - t3), t2 - t1, (t3 - t2) + (time.perf_counter() - t5))
                    stats.add_round(len(drafts), keep, rnd.staged_bytes, phases)
                    if metrics is not None:
                        metrics.round(len(drafts), keep, rnd.staged_bytes, *phases, rnd.collective_s)
                    if traced:
                        span.set_attributes({**ids, attr.BASE_VERSION: cur.base, attr.NEW_VERSION: version,
                                             attr.DRAFT_TOKENS: len(drafts), attr.ACCEPTED_TOKENS: keep,
                                             **round_attributes(rnd.staged_bytes, rnd.collective_s)})
            out = [*out, *tokens]
            if len(out) >= max_new_tokens or out[-1] in eos or (not kept and fresh is None):
                return  # done, or `until` ended the rounds
            propose_s = 0.0
            if kept:  # cur+1 becomes the current round; its verify may have been refused: then run it plainly
                cur = planned  # type: ignore[assignment]
                cur.verifying = _or_verify(cur, session, submit)
            else:
                t = time.perf_counter()
                cur, queue = start(fresh.result())  # type: ignore[union-attr]
                propose_s = time.perf_counter() - t  # the next round's: it waited for its own proposal


def decode_adaptive(session: Session, drafter: Drafter, max_new_tokens: int, length: CostModelLength, eos: set[int],
                    stats: Stats, tracer: Tracer = NO_TRACER, metrics=None) -> Iterator[list[int]]:
    """The cost model's rounds: serial while it drafts nothing (a decode step has nothing to overlap, and the
    pipelined loop's threads and bookkeeping cost one: 0.86-0.93x plain decoding at 4 sessions, measured served on
    a MoE target with a draft that never matched), pipelined while it drafts; one loop hands over to the other where
    a round ends with nothing staged ahead of it."""
    def done() -> bool:
        out = session.generated
        return len(out) >= max_new_tokens or bool(out and out[-1] in eos)

    while not done():
        if length.current() == 0:
            yield from decode(session, drafter, max_new_tokens, length, eos, stats, tracer, metrics,
                              until=lambda: length.current() > 0)
        else:
            yield from decode_pipelined(session, drafter, max_new_tokens, length, eos, stats, tracer, metrics,
                                        until=lambda: length.current() == 0)


def resolved(value) -> Future:
    """A future that already holds `value`."""
    done: Future = Future()
    done.set_result(value)
    return done


NOTHING = resolved(None)  # the answer of a round that asks for nothing: one future for all (a done one never changes)


def _start_speculation(drafter: Drafter, k: int, after: tuple[int, int] | None) -> Future | None:
    """A future of (guess, proposal) | None: sent at once by a remote drafter, computed here by an in-process one."""
    if k < 1:
        return None
    if hasattr(drafter, "speculate_async"):
        return drafter.speculate_async(k, after)
    speculate = getattr(drafter, "speculate", None)
    if speculate is None or after is not None:
        return None
    return resolved(speculate(k))


def _chain(session: Session, round_id: str, parent: Future, guessed: Future, submit) -> _Planned | None:
    """Once the draft's proposal is in: the round, its verify on top of the parent in flight (None when there is
    no proposal)."""
    spec, planned = guessed.result(), parent.result()
    if spec is None or planned is None:
        return None
    guess, proposal = spec
    return _Planned(round_id, planned.base + 1, proposal,
                    submit(_verify_on, session, round_id, proposal, planned, guess), guess)


def _verify_on(session: Session, round_id: str, proposal: Proposal, parent: _Planned, guess: int) -> Round | None:
    """Verify on top of `parent` at once: the target holds the call until the parent is the pending round, and
    refuses it when the parent ends otherwise (None). Only a call that overtakes the parent's own verify (the target
    knows no such round yet) waits here for the parent's verdict and goes again."""
    try:
        return session.verify(round_id, proposal.tokens, parent.base + 1, proposal.probs, parent.round_id,
                              guess)  # type: ignore[call-arg]
    except FailedPrecondition:
        return None
    except NotFound:
        pass
    rnd = parent.verifying.result()
    if rnd is None or rnd.verdict.accepted < len(rnd.drafts) or rnd.verdict.next_token != guess:
        return None
    return _verify_chained(session, round_id, proposal, parent.base + 1, parent.round_id, guess)


def _verify_chained(session: Session, round_id: str, proposal: Proposal, base: int, parent: str,
                    guess: int) -> Round | None:
    """Verify on top of `parent`; None when the target refuses (the parent ended otherwise, or no pipelining)."""
    try:
        return session.verify(round_id, proposal.tokens, base, proposal.probs, parent, guess)  # type: ignore[call-arg]
    except (FailedPrecondition, NotFound):
        return None


def _or_verify(planned: _Planned, session: Session, submit) -> Future:
    """The chained verify's round, or, when it was refused, the same round verified on the new head."""
    if planned.verifying.result() is not None:
        return planned.verifying
    return submit(session.verify, planned.round_id, planned.proposal.tokens, planned.base, planned.proposal.probs)
