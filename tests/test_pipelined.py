"""Pipelined rounds: round r+1 staged on top of round r before r is committed, on both sides, exactly.

In process: the target's chain (kept, dropped, reverted, retried) leaves the same head as serial
rounds, checked against a fresh prefill of the committed tokens; the pipelined loop gives the
serial loop's tokens and target-only greedy tokens for several k; a verify naming a parent that is
itself still chained waits for the commit that decides it (then stages or is refused; bounded in
number and time); sampling stays
distribution-exact (the G-test of test_sampling_lossless) and draws, seed for seed, what the serial
loop draws. Over loopback gRPC (the random pair of test_rpc_support): both loops pipelined equal
target-only greedy; nothing of r+1 shows in GetSession before Commit(r+1); refusals name the round
and the field; retries are idempotent; the draft's speculative Propose equals the serial proposal
when the guess holds. The draft working two rounds ahead: a speculation on a speculation (confirmed,
refused for a wrong guess, a partial accept, too early, or late on a newer round, changing nothing),
speculations made ahead in the background (taken, remade for another k, dropped by an outcome), and
a speculation named on a speculation (two on top of the open round), and the client loop over a 5 ms
proxy with speculations in flight, greedy and sampled seed for seed.
"""
import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest
import torch

from deltaspec.v1 import draft_service_pb2 as dpb
from deltaspec.v1 import target_service_pb2 as pb
from deltaspec.shared.decoding import answers, draft_session
from deltaspec.shared.decoding.draft_session import DraftSession, Outcome
from deltaspec.shared.decoding.drafters import make_drafter
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.pipelined import decode_pipelined
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import Stats, decode, generate
from deltaspec.shared.decoding.target import TargetSession
from deltaspec.shared.errors import FailedPrecondition, NotFound
from deltaspec.shared.model.checkpoint import hf_config, random_model
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer
from benchmarks.fault_proxy import TcpProxy
from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server
from deltaspec.shared.rpc.server import answered_call
from deltaspec.shared.rpc.remote_drafter import RemoteDrafter
from deltaspec.shared.telemetry import Telemetry
from deltaspec.target_service import servicer as target_servicer
from test_rpc_support import (PROMPT, draft_service, draft_stub, one_torch_thread, pair, refused, start,  # noqa: F401
                              target_service, target_stub)
from test_sampling_lossless import ALPHA, DRAFT, T1, TARGET, p_values

CFG = hf_config(layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
MODEL = random_model(CFG, seed=3)
NOISY = random_model(CFG, seed=3)
with torch.no_grad():
    for p in NOISY.parameters():
        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.02 * p.abs().mean())
START = [7, 3, 9, 12, 5, 40, 2]


def greedy(n: int, prompt: list[int] = START) -> list[int]:
    return generate(MODEL, prompt, n, None, 0).token_ids


def assert_head_exact(session: TargetSession) -> None:
    """The head's next-token logits equal those of a fresh session prefilled with the committed tokens."""
    fresh = TargetSession(session.model, session.tokens)
    mine = session.model(torch.tensor([session.tokens[-1]]), session.state)[0]
    theirs = fresh.model(torch.tensor([fresh.tokens[-1]]), fresh.state)[0]
    session.state.revert()
    assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-4), (mine - theirs).abs().max()


def chained_pair(k: int = 3) -> tuple[TargetSession, list[int], int]:
    """A session with round r (k drafts the target accepts) pending and r+1 staged on it; r+1's drafts, r's bonus.
    `session.told`: how chained rounds ended, as `chain_ended` hears it."""
    ref = greedy(2 * k + 2)
    told: list[str] = []
    session = TargetSession(MODEL, START, chain_ended=told.append)
    session.told = told  # type: ignore[attr-defined]
    r = session.verify("r", ref[:k], 0)
    assert r.verdict.accepted == k and r.verdict.next_token == ref[k]
    child = session.verify("r+1", ref[k + 1:2 * k + 1], 1, parent="r", guess=ref[k])
    assert child.verdict.accepted == k and child.parent == "r"
    return session, ref, k


def test_chain_kept_is_the_serial_round():
    session, ref, k = chained_pair()
    assert session.version == 0 and session.tokens == START  # nothing of r (or r+1) in the head yet
    assert session.commit("r", k) == 1
    assert session.pending.round_id == "r+1" and session.chained is None
    assert session.commit("r", k) == 1  # a retried commit of r, after r+1 took its place
    assert session.told == ["kept"]  # type: ignore[attr-defined]
    assert session.verify("r+1", ref[k + 1:2 * k + 1], 1, parent="r", guess=ref[k]).verdict.accepted == k  # retry
    assert session.commit("r+1", 1) == 2  # a partial commit of the chained round
    assert session.generated == ref[:k + 2] + [ref[k + 2]]
    assert_head_exact(session)


@pytest.mark.parametrize("ending", ["fewer kept", "reverted"])
def test_chain_dropped_when_the_parent_ends_otherwise(ending):
    session, ref, k = chained_pair()
    if ending == "fewer kept":
        session.commit("r", 1)  # e.g. an accepted EOS: r+1 assumed all k
    else:
        session.revert("r")
    with pytest.raises(FailedPrecondition, match="'r\\+1'"):
        session.commit("r+1", 0)
    with pytest.raises(FailedPrecondition, match="'r\\+1'"):
        session.verify("r+1", ref[k + 1:2 * k + 1], 1, parent="r", guess=ref[k])
    assert session.pending is None and session.chained is None and session.told == ["dropped"]  # type: ignore
    assert session.generated == ([*ref[:1], ref[1]] if ending == "fewer kept" else [])
    session.verify("again", ref[len(session.generated):len(session.generated) + 2], session.version)
    session.commit("again", 2)
    assert session.generated == ref[:len(session.generated)]
    assert_head_exact(session)


def test_chained_round_reverted_alone():
    session, ref, k = chained_pair()
    session.revert("r+1")
    assert session.pending.round_id == "r" and session.chained is None and session.told == ["reverted"]  # type: ignore
    session.commit("r", k)
    session.verify("next", ref[k + 1:k + 3], 1)
    session.commit("next", 2)
    assert session.generated == ref[:k + 4]
    assert_head_exact(session)


def test_chain_refused_when_the_verdict_already_says_otherwise():
    ref = greedy(8)
    session = TargetSession(MODEL, START)
    session.verify("r", ref[:3], 0)
    wrong = (ref[3] + 1) % MODEL.config.vocab_size
    with pytest.raises(FailedPrecondition, match="not .*assumed") as info:
        session.verify("bad guess", ref[4:6], 1, parent="r", guess=wrong)
    assert info.value.field == "parent_next_token"
    partial = TargetSession(MODEL, START)
    partial.verify("r", [ref[0], (ref[1] + 1) % MODEL.config.vocab_size], 0)  # accepts 1 of 2
    with pytest.raises(FailedPrecondition, match="accepts 1 of 2"):
        partial.verify("r+1", ref[3:5], 1, parent="r", guess=ref[2])
    serial_only = TargetSession(MODEL, START, max_chain=0)
    serial_only.verify("r", ref[:3], 0)
    with pytest.raises(FailedPrecondition, match="pipeline depth 0"):
        serial_only.verify("r+1", ref[4:6], 1, parent="r", guess=ref[3])
    for s in (session, partial, serial_only):  # refusals changed nothing
        assert s.chained is None and s.state.marked == 0 and s.pending.round_id == "r"


def test_chained_verify_after_the_parent_commit_is_a_plain_round():
    ref = greedy(8)
    session = TargetSession(MODEL, START)
    session.verify("r", ref[:2], 0)
    session.commit("r", 2)
    rnd = session.verify("r+1", ref[3:5], 1, parent="r", guess=ref[2])
    assert rnd is session.pending and session.chained is None
    session.commit("r+1", 2)
    assert session.generated == ref[:6]


def test_answered_call_gives_back_every_count():
    """A served engine call's answer counts until the handler returns, or, when the RPC is cancelled while the call
    still runs, until the call ends: a cancelled call never leaves speculative work waiting for good."""
    gate = answers.Answers(sent_by_caller=True)
    release = threading.Event()

    def engine(value: int) -> int:
        with gate.call():
            release.wait(5)
            return value

    async def handlers() -> None:
        release.set()
        assert await answered_call(gate, engine, 7) == 7 and gate.unsent == 1
        await asyncio.sleep(0)  # the answer's send started in the handler's last step: now it counts as sent
        assert gate.unsent == 0
        release.clear()
        cancelled = asyncio.ensure_future(answered_call(gate, engine, 8))
        while gate.unsent == 0:
            await asyncio.sleep(0.001)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert gate.unsent == 1  # the engine call still runs
        release.set()
        while gate.unsent:
            await asyncio.sleep(0.001)

    asyncio.run(asyncio.wait_for(handlers(), 10))


def test_served_chained_verify_waits_for_the_verdicts_to_leave(monkeypatch):
    """Served, a verdict leaves on the serving thread after `verify` returns: a chained verify starts once the
    servicer says the answers already made have left (bounded), and stages what it would have."""
    ref = greedy(8)
    session = TargetSession(MODEL, START, answers_sent_by_caller=True)
    monkeypatch.setattr(answers, "WAIT_S", 5.0)
    session.verify("r", ref[:3], 0)  # its verdict has not left yet
    with ThreadPoolExecutor(1) as pool:
        chained = pool.submit(session.verify, "r+1", ref[4:7], 1, None, "r", ref[3])
        time.sleep(0.05)
        assert not chained.done() and session.chained is None
        session.answers.sent()
        child = chained.result(timeout=5)
    session.answers.sent()
    assert session.chained is child and child.verdict.accepted == 3
    session.commit("r", 3)
    session.answers.sent()
    session.commit("r+1", 3)
    assert session.tokens == START + ref[:8]
    assert_head_exact(session)


def test_verify_on_a_chained_parent_waits_for_the_commit(monkeypatch):
    """r+2 named on r+1 while r+1 is still chained waits, staging nothing, until r's commit decides r+1."""
    from concurrent.futures import ThreadPoolExecutor

    from deltaspec.shared.decoding import target
    k = 2
    ref = greedy(3 * k + 3)
    r2_drafts = ref[2 * k + 2:3 * k + 2]

    def chain() -> TargetSession:
        session = TargetSession(MODEL, START)
        session.verify("r", ref[:k], 0)
        session.verify("r+1", ref[k + 1:2 * k + 1], 1, parent="r", guess=ref[k])
        return session

    def waiting(session: TargetSession, pool: ThreadPoolExecutor, round_id: str = "r+2"):
        call = pool.submit(session.verify, round_id, r2_drafts, 2, None, "r+1", ref[2 * k + 1])
        deadline = time.monotonic() + 10
        while session.waiting == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert session.waiting == 1 and not call.done() and session.state.marked  # waits; r+1 still staged alone
        return call

    with ThreadPoolExecutor(4) as pool:
        kept = chain()  # r commits as r+1 assumed: r+2 is staged on r+1, as the serial loop would stage it
        call = waiting(kept, pool)
        kept.commit("r", k)
        rnd = call.result(10)
        assert rnd is kept.chained and rnd.parent == "r+1" and rnd.verdict.accepted == k and kept.waiting == 0
        kept.commit("r+1", k)
        kept.commit("r+2", k)
        assert kept.generated == ref[:3 * k + 3]
        assert_head_exact(kept)

        dropped = chain()  # r keeps fewer: r+1 is dropped and the waiting r+2 refused, naming r+1
        call = waiting(dropped, pool)
        dropped.commit("r", 1)
        with pytest.raises(FailedPrecondition, match="'r\\+1' ended otherwise"):
            call.result(10)
        assert dropped.chained is None and dropped.pending is None and dropped.generated == ref[:2]

        crowded = chain()  # at most MAX_WAITING calls wait; the next is refused at once
        calls = [waiting(crowded, pool)]
        while crowded.waiting < target.MAX_WAITING:
            calls.append(pool.submit(crowded.verify, f"again{len(calls)}", r2_drafts, 2, None, "r+1",
                                     ref[2 * k + 1]))
            time.sleep(0.01)
        with pytest.raises(FailedPrecondition, match="already wait"):
            crowded.verify("one too many", r2_drafts, 2, None, "r+1", ref[2 * k + 1])
        crowded.revert("r")
        for c in calls:
            with pytest.raises(FailedPrecondition):
                c.result(10)

    late = chain()  # nobody commits r: refused after WAIT_S, nothing staged
    monkeypatch.setattr(target, "WAIT_S", 0.05)
    with pytest.raises(FailedPrecondition, match="not committed within"):
        late.verify("r+2", r2_drafts, 2, None, "r+1", ref[2 * k + 1])
    wrong = (ref[2 * k + 1] + 1) % MODEL.config.vocab_size  # r+1's verdict contradicts the guess: no wait
    with pytest.raises(FailedPrecondition, match="not .*assumed"):
        late.verify("r+2", r2_drafts, 2, None, "r+1", wrong)
    assert late.chained.round_id == "r+1" and late.waiting == 0
    late.commit("r", k)
    late.commit("r+1", k)
    assert late.generated == ref[:2 * k + 2]
    assert_head_exact(late)


class Counting(TargetSession):
    """Counts the rounds staged on a parent (to show the loop did pipeline)."""

    chained_rounds = 0

    def verify(self, *args, **kwargs):
        rnd = super().verify(*args, **kwargs)
        Counting.chained_rounds += rnd.parent is not None
        return rnd


def run_pipelined(target, drafter, prompt, n: int, k: int, sampling: SamplingParams = SamplingParams(),
                  pipelined: bool = True) -> tuple[list[int], Stats]:
    session, stats = Counting(target, prompt, sampling), Stats()
    drafter.start(list(prompt))
    eos = set(target.config.eos_token_id or [])
    for _ in (decode_pipelined if pipelined else decode)(session, drafter, n, k, eos, stats):
        pass
    return session.generated, stats


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_pipelined_loop_equals_serial_and_target_only(k):
    n = 40
    expected = greedy(n)
    pipelined, stats = run_pipelined(MODEL, ModelDrafter(NOISY), START, n, k)
    serial, serial_stats = run_pipelined(MODEL, ModelDrafter(NOISY), START, n, k, pipelined=False)
    assert pipelined == serial == expected
    assert (stats.rounds, stats.accepted) == (serial_stats.rounds, serial_stats.accepted)
    assert 0 < stats.accepted < stats.drafted  # full, partial and zero acceptance all occur


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_pipelined_loop_without_speculation_equals_target_only(drafter):
    """Drafters without `speculate` (here: none, n-gram; the MTP head likewise) run the pipelined loop unpipelined."""
    prompt = START * 3  # repeats, so the n-gram drafter proposes
    assert run_pipelined(MODEL, make_drafter(drafter, MODEL), prompt, 24, 4)[0] == greedy(24, prompt)


def _caller_has(seen: list, rounds: int, wait_s: float) -> bool:
    """Whether the caller has `rounds` rounds, waiting for them at most `wait_s`."""
    deadline = time.monotonic() + wait_s
    while len(seen) < rounds and time.monotonic() < deadline:
        time.sleep(0.001)
    return len(seen) >= rounds


class _WaitsForTheStream(ModelDrafter):
    """A draft whose plain proposals after the first wait (at most 2 s) until the caller has every round before."""

    def __init__(self, model, seen: list) -> None:
        super().__init__(model)
        self.seen, self.rounds, self.late = seen, 0, 0

    def propose(self, k: int):
        self.late += not _caller_has(self.seen, self.rounds, 2)
        return super().propose(k)

    def advance(self, accepted: int, next_token: int) -> None:
        super().advance(accepted, next_token)
        self.rounds += 1


def test_pipelined_loop_streams_a_missed_round_before_the_next_proposal():
    """After a miss the round's tokens reach the caller while the plain proposal is still being made."""
    seen: list[list[int]] = []
    drafter = _WaitsForTheStream(NOISY, seen)
    session, stats = Counting(MODEL, START), Stats()
    drafter.start(list(START))
    for new in decode_pipelined(session, drafter, 40, 3, set(MODEL.config.eos_token_id or []), stats):
        seen.append(new)
    assert session.generated == greedy(40) and stats.accepted < stats.drafted  # rounds were missed
    assert drafter.late == 0


class _CommitsAfterTheStream(TargetSession):
    """A target session whose commits wait (at most 1 s) until the caller has the round they record."""

    def __init__(self, *args, seen: list, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen, self.commits, self.late = seen, 0, 0

    def commit(self, round_id: str, accepted: int) -> int:
        self.late += not _caller_has(self.seen, self.commits + 1, 1)
        self.commits += 1
        return super().commit(round_id, accepted)


@pytest.mark.parametrize("draft", ["target", "noisy"])
def test_pipelined_loop_streams_each_round_at_its_verdict(draft):
    """A round's tokens reach the caller before its commit returns (after a kept round the commit waits for the
    next round's verify), and they are the tokens the commit records."""
    seen: list[list[int]] = []
    session, stats = _CommitsAfterTheStream(MODEL, START, seen=seen), Stats()
    drafter = ModelDrafter(MODEL if draft == "target" else NOISY)
    drafter.start(list(START))
    for new in decode_pipelined(session, drafter, 40, 3, set(MODEL.config.eos_token_id or []), stats):
        seen.append(new)
    assert [t for chunk in seen for t in chunk] == session.generated == greedy(40)
    assert session.late == 0 and session.commits == stats.rounds == len(seen)


def test_pipelined_loop_pipelines():
    Counting.chained_rounds = 0
    out, stats = run_pipelined(MODEL, ModelDrafter(MODEL), START, 30, 3)  # the target drafts: every guess holds
    assert out == greedy(30)
    assert Counting.chained_rounds >= stats.rounds - 3


def test_pipelined_sampling_draws_what_the_serial_loop_draws():
    """Random draws are keyed by position, and a kept speculative round is the serial loop's round: same seed,
    same tokens."""
    drafted = accepted = 0
    for seed in range(4):
        s = SamplingParams(0.9, 0, 0.95, seed)
        piped, stats = run_pipelined(MODEL, ModelDrafter(NOISY, s), START, 32, 4, s)
        serial, _ = run_pipelined(MODEL, ModelDrafter(NOISY, s), START, 32, 4, s, pipelined=False)
        assert piped == serial, seed
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted


def test_pipelined_sampling_matches_target():
    """200 seeded runs of the pipelined loop (k = 1, 5 tokens, so round 2 is speculated on round 1): the first
    three tokens are distributed as the target draws them."""
    tokens, totals = [], Stats()
    for seed in range(200):
        s = SamplingParams(T1.temperature, T1.top_k, T1.top_p, seed)
        out, stats = run_pipelined(TARGET, ModelDrafter(DRAFT, s), [1, 2, 3, 1, 2, 3, 1, 2], 5, 1, s)
        tokens.append(out[:3])
        totals.drafted += stats.drafted
        totals.accepted += stats.accepted
    assert 0 < totals.accepted < totals.drafted
    p = p_values(torch.tensor(tokens), T1)
    assert min(p) > ALPHA, p


def test_draft_speculation_equals_the_serial_proposal():
    history = [1, 2, 3, 4, 5]
    serial, piped = DraftSession(NOISY, history), DraftSession(NOISY, history)
    first = serial.propose("a", 3).proposal.tokens
    assert piped.propose("a", 3).proposal.tokens == first
    spec = piped.propose("b", 3, None, speculative=True)
    assert piped.propose("b", 3, None, speculative=True) is spec  # a retry
    expected = serial.propose("b", 3, Outcome("a", 3, spec.guess)).proposal.tokens
    assert spec.proposal.tokens == expected
    third = piped.propose("c", 2, Outcome("a", 3, spec.guess), speculative=True)  # confirms b, speculates on it
    assert piped.round.round_id == "b" and piped.speculations == [third]
    serial_c = serial.propose("c", 2, Outcome("b", 3, third.guess)).proposal.tokens
    assert third.proposal.tokens == serial_c
    # an outcome that does not match drops the speculation: the next proposal is the serial one
    after = piped.propose("d", 2, Outcome("b", 1, 0)).proposal.tokens
    reference = DraftSession(NOISY, history)
    reference.propose("a", 3)
    reference.propose("b", 3, Outcome("a", 3, spec.guess))
    assert after == reference.propose("d", 2, Outcome("b", 1, 0)).proposal.tokens
    with pytest.raises(FailedPrecondition, match="dropped"):
        piped.commit(Outcome("c", 0, 1))


# ---- over loopback gRPC ----


TARGET_METRICS = Telemetry()  # the served target's


def pipelined_rounds(outcome: str) -> float:
    return TARGET_METRICS.metrics.registry.get_sample_value("deltaspec_pipelined_rounds_total",
                                                            {"outcome": outcome}) or 0.0


@pytest.fixture(scope="module")
def servers(pair):
    target_dir, draft_dir = pair
    load = (lambda: (load_model(target_dir), load_tokenizer(target_dir)))
    with start(draft_service(draft_dir)) as d, start(target_servicer.service(
            load, draft=target_servicer.DraftPeer(d.address, 10.0), telemetry=TARGET_METRICS)) as t:
        yield t.address, d.address, load_model(target_dir)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_both_loops_pipelined_equal_target_only(servers, k, monkeypatch):
    t_addr, d_addr, target = servers
    N = 64  # the random pair keeps every draft of a round of 6 about once in 30 tokens
    monkeypatch.setattr(target_servicer, "TargetSession", Counting)
    expected = generate(target, PROMPT, N, None, 0).token_ids
    Counting.chained_rounds = 0
    piped, _ = generate_client_driven(t_addr, d_addr, PROMPT, "", N, k, draft_timeout_s=10.0)
    assert Counting.chained_rounds > 0
    serial, _ = generate_client_driven(t_addr, d_addr, PROMPT, "", N, k, draft_timeout_s=10.0, pipeline=False)
    Counting.chained_rounds = 0
    server, _ = generate_on_server(t_addr, PROMPT, "", N, k)
    assert Counting.chained_rounds > 0
    assert piped.token_ids == serial.token_ids == server.token_ids == expected
    assert piped.stats.rounds == serial.stats.rounds and 0 < piped.stats.accepted < piped.stats.drafted


def test_server_loop_does_not_pipeline_on_a_dynamic_draft_length(pair, monkeypatch):
    """A draft service with a dynamic draft length says so when the session opens; the target's `Generate` then
    runs serial rounds (its rounds end where the draft is unsure, so speculations rarely hold), still exactly
    target-only. The client-driven loop still pipelines against it."""
    target_dir, draft_dir = pair
    monkeypatch.setattr(target_servicer, "TargetSession", Counting)
    with start(draft_service(draft_dir, stop_below=0.3)) as d, \
            start(target_service(target_dir, draft_address=d.address, draft_timeout_s=10.0)) as t:
        opened = draft_stub(d.address).CreateSession(dpb.DraftServiceCreateSessionRequest(token_ids=PROMPT))
        assert opened.stop_below == pytest.approx(0.3)
        expected = generate(load_model(target_dir), PROMPT, 48, None, 0).token_ids
        Counting.chained_rounds = 0
        served, _ = generate_on_server(t.address, PROMPT, "", 48, 8)
        assert served.token_ids == expected and served.stats.drafted > 0 and Counting.chained_rounds == 0
        client, _ = generate_client_driven(t.address, d.address, PROMPT, "", 48, 8, draft_timeout_s=10.0)
        assert client.token_ids == expected and Counting.chained_rounds > 0


def test_chain_over_grpc(servers):
    t_addr, _, target = servers
    stub = target_stub(t_addr)
    ref = generate(target, PROMPT, 10, None, 0).token_ids
    before = {o: pipelined_rounds(o) for o in ("kept", "dropped", "reverted")}
    sid = stub.CreateSession(pb.CreateSessionRequest(prompt_ids=PROMPT)).session_id
    stub.Verify(pb.VerifyRequest(session_id=sid, round_id="r", base_version=0, draft_tokens=ref[:2]))
    chained = pb.VerifyRequest(session_id=sid, round_id="r+1", base_version=1, draft_tokens=ref[3:5],
                               parent_round_id="r", parent_next_token=ref[2])
    first, again = stub.Verify(chained), stub.Verify(chained)
    assert first == again and first.round.parent_round_id == "r" and first.accepted == 2
    seen = stub.GetSession(pb.GetSessionRequest(session_id=sid))
    assert (seen.length, list(seen.generated_ids), seen.head_version) == (len(PROMPT), [], 0)
    assert seen.pending_round.round_id == "r" and seen.chained_round.round_id == "r+1"
    commit = pb.CommitRequest(session_id=sid, round_id="r", accepted=2)
    assert stub.Commit(commit) == stub.Commit(commit)  # a retry
    seen = stub.GetSession(pb.GetSessionRequest(session_id=sid))
    assert list(seen.generated_ids) == ref[:3] and seen.pending_round.round_id == "r+1"
    assert not seen.HasField("chained_round")
    assert list(stub.Commit(pb.CommitRequest(session_id=sid, round_id="r+1", accepted=2)).committed_tokens) == ref[3:6]
    # refusals: the verdict of r already contradicts the assumption; no round to build on
    stub.Verify(pb.VerifyRequest(session_id=sid, round_id="s", base_version=2, draft_tokens=ref[6:7]))
    wrong = pb.VerifyRequest(session_id=sid, round_id="s+1", base_version=3, draft_tokens=[1],
                             parent_round_id="s", parent_next_token=(ref[7] + 1) % target.config.vocab_size)
    err = refused(lambda: stub.Verify(wrong), grpc.StatusCode.FAILED_PRECONDITION, "parent_next_token")
    assert "'s+1'" in err.details()
    unknown = pb.VerifyRequest(session_id=sid, round_id="t", base_version=3, draft_tokens=[1],
                               parent_round_id="nope", parent_next_token=1)
    refused(lambda: stub.Verify(unknown), grpc.StatusCode.NOT_FOUND, "parent_round_id")
    no_guess = pb.VerifyRequest(session_id=sid, round_id="t", base_version=3, draft_tokens=[1], parent_round_id="s")
    refused(lambda: stub.Verify(no_guess), grpc.StatusCode.INVALID_ARGUMENT, "parent_next_token")
    outside = pb.VerifyRequest(session_id=sid, round_id="t", base_version=3, draft_tokens=[1], parent_round_id="s",
                               parent_next_token=target.config.vocab_size)
    refused(lambda: stub.Verify(outside), grpc.StatusCode.INVALID_ARGUMENT, "parent_next_token")
    # r dropped at its commit: later calls naming the chained round are refused, naming it
    stub.Verify(pb.VerifyRequest(session_id=sid, round_id="s+1", base_version=3, draft_tokens=ref[8:9],
                                 parent_round_id="s", parent_next_token=ref[7]))
    stub.Commit(pb.CommitRequest(session_id=sid, round_id="s", accepted=0))
    err = refused(lambda: stub.Commit(pb.CommitRequest(session_id=sid, round_id="s+1", accepted=0)),
                  grpc.StatusCode.FAILED_PRECONDITION, "round_id")
    assert "'s+1'" in err.details()
    assert list(stub.GetSession(pb.GetSessionRequest(session_id=sid)).generated_ids) == ref[:7]
    # the metric: r+1 kept, s+1 dropped (the refused verifies staged nothing)
    assert {o: pipelined_rounds(o) - before[o] for o in before} == {"kept": 1, "dropped": 1, "reverted": 0}


def test_speculative_propose_over_grpc(servers):
    _, d_addr, _ = servers
    stub = draft_stub(d_addr)
    sid = stub.CreateSession(dpb.DraftServiceCreateSessionRequest(token_ids=PROMPT)).session_id
    stub.Propose(dpb.ProposeRequest(session_id=sid, round_id="a", k=2))
    spec = stub.Propose(dpb.ProposeRequest(session_id=sid, round_id="b", k=2, speculative=True))
    assert spec.HasField("assumed_next_token") and len(spec.draft_tokens) == 2
    refused(lambda: stub.Propose(dpb.ProposeRequest(session_id=sid, round_id="c", k=2, speculative=True)),
            grpc.StatusCode.FAILED_PRECONDITION, "speculative")  # one speculation at a time
    stub.Revert(dpb.DraftServiceRevertRequest(session_id=sid, round_id="b"))
    again = stub.Propose(dpb.ProposeRequest(session_id=sid, round_id="b2", k=2, speculative=True))
    assert (again.assumed_next_token, list(again.draft_tokens)) == (spec.assumed_next_token, list(spec.draft_tokens))


def test_draft_two_rounds_ahead_and_late_speculations(monkeypatch):
    """A speculation on top of a speculation (the open round's outcome confirming the first) equals the serial
    proposal; one whose outcome does not confirm, or that comes before the first, or late on a newer round, is
    refused and changes nothing."""
    monkeypatch.setattr(draft_session, "OVERTAKE_WAIT_S", 0.05)  # no plain proposal comes: refused after the wait
    history = [1, 2, 3, 4, 5]
    serial, piped = DraftSession(NOISY, history), DraftSession(NOISY, history)
    serial.propose("a", 3)
    piped.propose("a", 3)
    early = DraftSession(NOISY, history)
    early.propose("a", 3)
    with pytest.raises(FailedPrecondition, match="no open round"):  # before the first speculation: refused
        early.propose("c", 3, Outcome("a", 3, 0), speculative=True)
    assert early.round.round_id == "a" and early.round.state == "proposed" and early.speculations == []
    b = piped.propose("b", 3, None, speculative=True)
    wrong = Outcome("a", 3, (b.guess + 1) % NOISY.config.vocab_size)
    with pytest.raises(FailedPrecondition, match="no open round"):  # the outcome does not confirm b
        piped.propose("c", 3, wrong, speculative=True)
    with pytest.raises(FailedPrecondition, match="no open round"):  # nor does a partial accept
        piped.propose("c", 3, Outcome("a", 2, b.guess), speculative=True)
    assert piped.round.round_id == "a" and piped.speculations == [b] and b.state == "proposed"
    c = piped.propose("c", 3, Outcome("a", 3, b.guess), speculative=True)
    assert piped.round is b and piped.speculations == [c]
    assert b.proposal.tokens == serial.propose("b", 3, Outcome("a", 3, b.guess)).proposal.tokens
    assert c.proposal.tokens == serial.propose("c", 3, Outcome("b", 3, c.guess)).proposal.tokens
    # a round proposed plainly after a miss; a speculation naming it by the outcome that opened it builds on it
    opener = Outcome("c", 1, 7)
    d = piped.propose("d", 2, opener)
    assert piped.propose("e", 2, opener, speculative=True).guess is not None and piped.round is d
    piped.propose("f", 2, Outcome("d", 0, 9))
    with pytest.raises((FailedPrecondition, NotFound)):  # late: the open round is f now (c is forgotten)
        piped.propose("g", 2, opener, speculative=True)
    assert piped.round.round_id == "f" and piped.speculations == []


def test_draft_speculation_that_overtakes_its_plain_proposal_waits_for_it(monkeypatch):
    """After a miss the plain Propose and the speculation on top of it leave together on separate streams; one
    that arrives first waits for the plain proposal and then builds on it, as if in order. One waiter per session:
    a second is refused at once, and one whose plain proposal never comes is refused after the wait; neither
    changes anything."""
    history = [1, 2, 3, 4, 5]
    serial, piped = DraftSession(NOISY, history), DraftSession(NOISY, history)
    for session in (serial, piped):
        session.propose("a", 3)
    miss = Outcome("a", 1, 9)
    with ThreadPoolExecutor(2) as pool:
        early = pool.submit(piped.propose, "c", 2, miss, speculative=True)
        while not piped.overtaken:
            time.sleep(0.001)
        monkeypatch.setattr(draft_session, "OVERTAKE_WAIT_S", 0.05)
        with pytest.raises(FailedPrecondition, match="no open round"):  # a second waiter: refused at once
            piped.propose("x", 2, miss, speculative=True)
        assert piped.round.round_id == "a" and piped.round.state == "proposed" and piped.speculations == []
        b = piped.propose("b", 3, miss)
        c = early.result(timeout=5)
    assert piped.round is b and piped.speculations == [c]
    assert b.proposal.tokens == serial.propose("b", 3, miss).proposal.tokens
    assert c.proposal.tokens == serial.propose("c", 2, Outcome("b", 3, c.guess)).proposal.tokens
    started = time.monotonic()
    with pytest.raises(FailedPrecondition, match="no open round"):  # nothing opens a round: refused after the wait
        piped.propose("y", 2, Outcome("b", 0, 1), speculative=True)
    assert time.monotonic() - started >= 0.05 and piped.round is b and piped.speculations == [c]


def test_draft_speculative_work_waits_for_the_answers_to_leave(monkeypatch):
    """Served, a proposal's answer leaves on the serving thread after `propose` returns: speculative work (a
    speculative request, or one made ahead) waits until the caller says it has left, so it does not hold the CPU
    and the interpreter meanwhile; the wait is bounded, and what is proposed is the same."""
    history = [1, 2, 3, 4, 5]
    serial, served = DraftSession(NOISY, history), DraftSession(NOISY, history, answers_sent_by_caller=True)
    serial.propose("a", 3)
    served.propose("a", 3)  # its answer has not left yet
    monkeypatch.setattr(answers, "WAIT_S", 5.0)
    with ThreadPoolExecutor(1) as pool:
        spec = pool.submit(served.propose, "b", 3, None, speculative=True)
        time.sleep(0.05)
        assert not spec.done() and served.speculations == []
        served.answers.sent()
        b = spec.result(timeout=5)
    served.answers.sent()
    assert b.proposal.tokens == serial.propose("b", 3, Outcome("a", 3, b.guess)).proposal.tokens
    monkeypatch.setattr(answers, "WAIT_S", 0.05)  # a caller that never says so delays it this long
    c = served.propose("c", 3, Outcome("a", 1, 9))
    started = time.monotonic()
    d = served.propose("d", 3, None, speculative=True)
    assert time.monotonic() - started >= 0.05 and served.round is c and served.speculations == [d]
    for _ in (c, d):
        served.answers.sent()
    until = time.monotonic() + 10
    while served.ahead is None and time.monotonic() < until:  # the one made ahead on d: done before the test ends
        time.sleep(0.01)
    assert served.ahead is not None and served.ahead[0] is d


def test_draft_speculation_on_a_named_speculation():
    """A speculation named on the newest speculative round (two on top of the open one) equals the serial
    proposal; an outcome confirming the round below keeps the rest, one that does not drops them all; a request on
    a round not the newest, a third one, or an unknown round is refused and changes nothing; reverting a
    speculation drops the one above it."""
    history = [1, 2, 3, 4, 5]
    serial, piped = DraftSession(NOISY, history), DraftSession(NOISY, history)
    serial.propose("a", 3)
    piped.propose("a", 3)
    b = piped.propose("b", 3, None, speculative=True)
    c = piped.propose("c", 2, None, speculative=True, parent="b")
    assert piped.speculations == [b, c] and c.parent == "b"
    assert piped.propose("c", 2, None, speculative=True, parent="b") is c  # a retry
    with pytest.raises(FailedPrecondition, match="other input"):
        piped.propose("c", 2, None, speculative=True)
    with pytest.raises(FailedPrecondition, match="not the newest") as info:
        piped.propose("x", 2, None, speculative=True, parent="b")
    assert info.value.field == "parent_round_id"
    with pytest.raises(FailedPrecondition, match="the most"):
        piped.propose("x", 2, None, speculative=True, parent="c")
    with pytest.raises(NotFound):
        piped.propose("x", 2, None, speculative=True, parent="zz")
    with pytest.raises(FailedPrecondition, match="already proposed on top"):
        piped.propose("x", 2, None, speculative=True)
    assert piped.round.round_id == "a" and piped.speculations == [b, c]
    d = piped.propose("d", 3, Outcome("a", 3, b.guess), speculative=True, parent="c")  # b opens, c stays under d
    assert piped.round is b and piped.speculations == [c, d]
    assert b.proposal.tokens == serial.propose("b", 3, Outcome("a", 3, b.guess)).proposal.tokens
    assert c.proposal.tokens == serial.propose("c", 2, Outcome("b", 3, c.guess)).proposal.tokens
    assert d.proposal.tokens == serial.propose("d", 3, Outcome("c", 2, d.guess)).proposal.tokens
    piped.commit(Outcome("c", 2, d.guess))  # names c: b kept all, then c's guess; d opens
    assert piped.round is d and piped.speculations == [] and b.state == c.state == "committed"
    miss = Outcome("d", 1, 7)
    assert piped.propose("e", 2, miss).proposal.tokens == serial.propose("e", 2, miss).proposal.tokens
    f = piped.propose("f", 2, None, speculative=True)
    g = piped.propose("g", 2, None, speculative=True, parent="f")
    partial = Outcome("e", 0, 5)  # drops f and g
    assert piped.propose("h", 2, partial).proposal.tokens == serial.propose("h", 2, partial).proposal.tokens
    assert f.state == g.state == "dropped" and piped.speculations == []
    i = piped.propose("i", 2, None, speculative=True)
    j = piped.propose("j", 2, None, speculative=True, parent="i")
    piped.revert("i")
    assert i.state == "reverted" and j.state == "dropped" and piped.speculations == []
    i2 = piped.propose("i2", 3, None, speculative=True)
    assert i2.proposal.tokens == serial.propose("i2", 3, Outcome("h", 2, i2.guess)).proposal.tokens
    j2 = piped.propose("j2", 2, None, speculative=True, parent="i2")
    piped.revert("j2")
    assert piped.speculations == [i2] and i2.state == "proposed"
    piped.commit(Outcome("h", 2, i2.guess))
    assert piped.round is i2 and j2.state == "reverted"
    l_ = piped.propose("l", 2, None, speculative=True, parent="i2")  # the parent may be the open round
    m = piped.propose("m", 2, Outcome("i2", 3, l_.guess), speculative=True, parent="l")  # l opens, m on it
    assert piped.round is l_ and piped.speculations == [m]
    miss = Outcome("l", 0, 3)
    n = piped.propose("n", 2, miss)
    with pytest.raises(FailedPrecondition, match="not the newest"):  # late, naming a round that is gone
        piped.propose("o", 2, miss, speculative=True, parent="m")
    assert piped.round is n and piped.speculations == [] and n.state == "proposed"
    full = DraftSession(NOISY, history)  # a speculation the logs cannot hold is refused, changing nothing
    full.propose("a", 16)
    full.propose("b", 16, None, speculative=True)
    full.drafter.state.recurrent.log_capacity = 49  # one short of a third round of 16 (the buffers stay larger)
    with pytest.raises(FailedPrecondition, match="no room"):
        full.propose("c", 16, None, speculative=True, parent="b")
    assert [s.round_id for s in full.speculations] == ["b"]


@pytest.fixture
def slow_draft(servers):
    """The draft reached through a proxy adding 5 ms each way, so two speculations are in flight at once."""
    proxy = TcpProxy([servers[1]])
    proxy.delay_s = 0.005
    yield proxy.address
    proxy.close()


def test_speculations_no_longer_wanted_never_fail_the_draft(servers, monkeypatch, caplog):
    """A speculation in flight when the loop asks for a plain round (here the last one, k = 0) or ends the draft
    session is no longer wanted: its failure at a slow peer (its deadline passing) neither counts against the draft
    nor backs it off, and `close` cancels it rather than leave it to fail after the generation."""
    _, d_addr, target = servers
    slow = threading.Event()
    propose = DraftSession.propose

    def late_speculations(self, round_id, k, previous=None, speculative=False, parent=None):
        if speculative and slow.is_set():
            time.sleep(1.0)  # past the drafter's 0.3 s deadline
        return propose(self, round_id, k, previous, speculative, parent)

    monkeypatch.setattr(DraftSession, "propose", late_speculations)
    slow.set()
    for end in ("last round", "close"):
        drafter = RemoteDrafter(draft_stub(d_addr), SamplingParams(), target.config.vocab_size, timeout_s=0.3)
        drafter.start(list(PROMPT))
        assert drafter.propose(3).tokens
        speculation = drafter.speculate_async(3)
        if end == "close":
            call = drafter.speculations[-1].call
            drafter.close()
            assert speculation.result(timeout=5) is None and call.code() == grpc.StatusCode.CANCELLED
        else:
            assert drafter.propose(0).tokens == []  # waits for the speculation, which fails at its deadline
            assert speculation.result(timeout=5) is None
        time.sleep(0.05)  # its failure handled on gRPC's threads
        assert (drafter.failures, drafter.paused_s) == (0, 0.0), end
    assert "draft failed" not in caplog.text


@pytest.mark.parametrize("k", [2, 4])
def test_client_loop_speculations_in_flight(servers, slow_draft, k, monkeypatch):
    """With a slow draft link the client asks for round r+2 before r+1's proposal is back, and after a miss for the
    two speculations on top of the new round right behind its plain request (the second naming the first); partial
    accepts and wrong guesses occur; the tokens are target-only greedy's and the draft never counted as failed."""
    t_addr, _, target = servers
    sent, behind, drafters = [], [], []
    start_speculation, start_both = RemoteDrafter.speculate_async, RemoteDrafter.propose_and_speculate

    def counting(self, k, after=None):
        drafters.append(self)
        answer = start_speculation(self, k, after)
        sent.append((after, answer))
        return answer

    def counting_both(self, k, k_next, k_third=0):
        drafters.append(self)
        proposal, answer, third = start_both(self, k, k_next, k_third)
        behind.append((answer, third))
        return proposal, answer, third

    monkeypatch.setattr(RemoteDrafter, "speculate_async", counting)
    monkeypatch.setattr(RemoteDrafter, "propose_and_speculate", counting_both)
    expected = generate(target, PROMPT, 40, None, 0).token_ids
    piped, _ = generate_client_driven(t_addr, slow_draft, PROMPT, "", 40, k, draft_timeout_s=10.0)
    serial, _ = generate_client_driven(t_addr, slow_draft, PROMPT, "", 40, k, draft_timeout_s=10.0, pipeline=False)
    assert piped.token_ids == serial.token_ids == expected
    assert piped.stats.rounds == serial.stats.rounds and 0 < piped.stats.accepted < piped.stats.drafted
    assert drafters[0].failures == 0
    assert len(behind) > 1 and any(answer.result() for answer, _ in behind)  # the first round's, and after misses
    # rounds asked for before the proposal of the round below is back: behind a plain request, or at a verdict
    assert any(third.result() for _, third in behind) or any(a.result() for after, a in sent if after)


def test_client_loop_sampled_equals_serial_seed_for_seed(servers, slow_draft):
    """Sampled, the pipelined client loop (speculations in flight) draws what the serial loop draws."""
    t_addr, _, _ = servers
    for seed in range(3):
        s = SamplingParams(0.9, 0, 0.95, seed)
        piped, _ = generate_client_driven(t_addr, slow_draft, PROMPT, "", 24, 3, s, draft_timeout_s=10.0)
        serial, _ = generate_client_driven(t_addr, slow_draft, PROMPT, "", 24, 3, s, draft_timeout_s=10.0,
                                           pipeline=False)
        assert piped.token_ids == serial.token_ids, seed


def wait_ahead(session: DraftSession) -> tuple:
    for _ in range(500):
        if session.ahead is not None:
            return session.ahead
        time.sleep(0.01)
    raise AssertionError("no speculation made ahead")


def test_draft_speculates_ahead_once_asked():
    """After a first speculative request, each plain proposal is followed by the speculation on top of it, made in
    the background: a request with the same k takes it, another k or an outcome drops it; every proposal equals
    the serial one."""
    history = [1, 2, 3, 4, 5]
    serial, piped = DraftSession(NOISY, history), DraftSession(NOISY, history)
    assert piped.propose("a", 3).proposal.tokens == serial.propose("a", 3).proposal.tokens
    time.sleep(0.05)
    assert piped.ahead is None  # not asked to speculate yet
    b = piped.propose("b", 3, None, speculative=True)
    partial = Outcome("a", 1, (b.guess + 1) % NOISY.config.vocab_size)
    c = piped.propose("c", 3, partial)
    assert c.proposal.tokens == serial.propose("c", 3, partial).proposal.tokens
    made = wait_ahead(piped)
    d = piped.propose("d", 3, partial, speculative=True)  # names c by the outcome that opened it
    assert d.proposal is made[3] and d.guess == made[2] and (piped.ahead is None or piped.ahead[0] is d)
    assert d.proposal.tokens == serial.propose("d", 3, Outcome("c", 3, d.guess)).proposal.tokens
    miss = Outcome("d", 0, 11)
    e = piped.propose("e", 3, miss)
    assert e.proposal.tokens == serial.propose("e", 3, miss).proposal.tokens
    wait_ahead(piped)
    f = piped.propose("f", 2, miss, speculative=True)  # another k: made afresh
    assert f.proposal.tokens == serial.propose("f", 2, Outcome("e", 3, f.guess)).proposal.tokens
    again = Outcome("f", 1, 13)
    g = piped.propose("g", 3, again)
    assert g.proposal.tokens == serial.propose("g", 3, again).proposal.tokens
    wait_ahead(piped)
    last = Outcome("g", 2, 17)  # an outcome before any request: the speculation made ahead is dropped
    assert piped.propose("h", 3, last).proposal.tokens == serial.propose("h", 3, last).proposal.tokens


def serial_proposal(history: list[int], rounds: list[tuple[str, int, Outcome | None]]) -> list[int]:
    """The last of `rounds` (id, k, the previous round's outcome) proposed by a fresh serial draft session."""
    session = DraftSession(NOISY, history)
    for round_id, k, previous in rounds:
        rnd = session.propose(round_id, k, previous)
    return rnd.proposal.tokens


def test_draft_second_speculation_made_ahead():
    """On top of a speculative round the draft speculates once more in the background (the drafter's second level):
    taken when the open round's outcome confirms the first, equal to the serial proposal; dropped by an outcome that
    does not, by another k, or by reverting the round under it; the proposals after each equal the serial ones."""
    history = [1, 2, 3, 4, 5]
    piped = DraftSession(NOISY, history)
    a = piped.propose("a", 3)
    assert a.proposal.tokens == serial_proposal(history, [("a", 3, None)])
    b = piped.propose("b", 3, None, speculative=True)
    made = wait_ahead(piped)
    assert made[0] is b and len(piped.drafter.chain) == 2
    c = piped.propose("c", 3, Outcome("a", 3, b.guess), speculative=True)
    assert c.proposal is made[3] and c.guess == made[2]
    kept = [("a", 3, None), ("b", 3, Outcome("a", 3, b.guess))]
    assert b.proposal.tokens == serial_proposal(history, kept)
    assert c.proposal.tokens == serial_proposal(history, [*kept, ("c", 3, Outcome("b", 3, c.guess))])
    assert wait_ahead(piped)[0] is c
    miss = Outcome("b", 2, 11)  # b keeps two drafts: c and the round made ahead on it are dropped
    d = piped.propose("d", 2, miss)
    kept.append(("d", 2, miss))
    assert d.proposal.tokens == serial_proposal(history, kept)
    e = piped.propose("e", 2, miss, speculative=True)  # the background speculation on d (same k) is taken
    kept.append(("e", 2, Outcome("d", 2, e.guess)))
    assert e.proposal.tokens == serial_proposal(history, kept)
    assert wait_ahead(piped)[0] is e
    f = piped.propose("f", 1, Outcome("d", 2, e.guess), speculative=True)  # confirms e; another k: made afresh
    assert f.proposal.tokens == serial_proposal(history, [*kept, ("f", 1, Outcome("e", 2, f.guess))])
    assert wait_ahead(piped)[0] is f
    piped.revert("f")  # drops f and what was made on it; e stays open
    assert piped.ahead is None and piped.drafter.chain == [] and piped.round is e
    g = piped.propose("g", 3, Outcome("e", 2, 5))
    assert g.proposal.tokens == serial_proposal(history, [*kept, ("g", 3, Outcome("e", 2, 5))])


class _PlainArrives:
    """The draft model, but at its `at`-th forward pass a plain proposal starts waiting for the session's lock."""

    def __init__(self, model, at: int) -> None:
        self.model, self.at, self.calls = model, at, 0
        self.session: DraftSession | None = None

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, ids, state):
        self.calls += 1
        if self.calls == self.at:
            self.session.waiting = True  # type: ignore[union-attr]
        return self.model(ids, state)


def test_requested_speculation_stops_short_for_a_waiting_plain_proposal():
    """A plain proposal drops every speculation, so one that arrives while a requested speculation runs does not
    wait for all its drafts: the speculation stops before its next draft (its tokens a prefix of the full one); the
    plain proposal after it equals the serial one."""
    history, k = [1, 2, 3, 4, 5], 4
    slow = _PlainArrives(NOISY, at=10**9)
    piped = slow.session = DraftSession(slow, history)  # type: ignore[arg-type]
    piped.propose("a", k)
    full = DraftSession(NOISY, history)
    full.propose("a", k)
    whole = full.propose("b", k, None, speculative=True)
    slow.at = slow.calls + 3  # the guess's pass, the first draft's, then the plain proposal comes
    short = piped.propose("b", k, None, speculative=True)
    piped.waiting = False  # the plain proposal has the lock now
    assert short.guess == whole.guess and short.proposal.tokens == whole.proposal.tokens[:2]
    miss = Outcome("a", 1, 11)
    assert piped.propose("c", k, miss).proposal.tokens == serial_proposal(history, [("a", k, None), ("c", k, miss)])
    assert piped.speculations == []


def test_kept_rounds_study_reads_the_serial_rounds_off_the_output():
    """The pipeline bench's study of which rounds could be kept: with the target as its own draft every round is
    kept; with another draft every round is counted once, and its rounds are the serial loop's (all but the round
    the output ends in)."""
    from benchmarks.pipeline import kept_rounds, serial_rounds

    n, k = 40, 3
    output = greedy(n)
    own = kept_rounds([serial_rounds(MODEL, START, output, k)])
    assert own["kept"] == own["rounds"] > 0
    c = kept_rounds([serial_rounds(NOISY, START, output, k)])
    assert c["rounds"] == c["kept"] + c["rejected"] + c["wrong_guess"] and c["rejected"] > 0
    assert c["second_choice_rejected"] <= c["rejected"] and c["second_choice_wrong_guess"] <= c["wrong_guess"]
    stats = generate(MODEL, START, n, ModelDrafter(NOISY), k).stats
    assert stats.rounds - 2 <= c["rounds"] < stats.rounds


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the draft went away"


class _AnsweredWhenAsked(Future):
    """A call's future that completes (and runs its callbacks) only when its result is asked for."""

    def __init__(self, reply) -> None:
        super().__init__()
        self.reply = reply

    def result(self, timeout=None):
        if not self.done():
            self.set_result(self.reply)
        return super().result(timeout)


def test_a_speculation_failing_before_its_plain_propose_answers_counts_as_a_failure():
    """The speculation fails while the plain Propose it was sent behind is still out; that one then succeeds: the
    failure is counted once the plain one is in (it used to be lost: the callback read an unbound exception)."""
    plain = _AnsweredWhenAsked(dpb.ProposeResponse(draft_tokens=[1, 2]))
    failed: Future = Future()
    failed.set_exception(_Unavailable())
    calls = iter([plain, failed])
    stub = SimpleNamespace(
        CreateSession=SimpleNamespace(future=lambda *a, **k: _AnsweredWhenAsked(
            dpb.DraftServiceCreateSessionResponse(session_id="s"))),
        Propose=SimpleNamespace(future=lambda *a, **k: next(calls)),
        CloseSession=SimpleNamespace(future=lambda *a, **k: _AnsweredWhenAsked(
            dpb.DraftServiceCloseSessionResponse())))
    drafter = RemoteDrafter(stub, SamplingParams(), vocab_size=MODEL.config.vocab_size)
    drafter.start([1, 2, 3])
    proposal, speculation, _ = drafter.propose_and_speculate(2, 2)
    assert proposal.tokens == [1, 2] and speculation.result() is None
    assert drafter.failures == 1 and drafter.paused_s > 0  # the next rounds (10 ms) go without the draft


def test_every_draft_speculation_is_told_kept_or_dropped():
    """`speculation_ended` hears of each speculation once, kept or dropped, whatever the loop does with it; the
    draft service counts them in `deltaspec_draft_speculations_total`."""
    told = {"kept": 0, "dropped": 0}
    made = 0

    class Counted(ModelDrafter):
        def speculate(self, *args, **kwargs):
            nonlocal made
            made += 1
            return super().speculate(*args, **kwargs)

    drafter = Counted(NOISY)
    drafter.speculation_ended = lambda outcome, n: told.__setitem__(outcome, told[outcome] + n)
    for k in (2, 4):
        tokens, _ = run_pipelined(MODEL, drafter, START, 48, k)
        assert tokens == greedy(48)
    assert told["kept"] > 0 and told["dropped"] > 0
    assert made == told["kept"] + told["dropped"] + len(drafter.chain)
    drafter.start(START)  # a new generation drops what is left
    assert made == told["kept"] + told["dropped"] and not drafter.chain

    session = DraftSession(NOISY, START, speculation_ended=drafter.speculation_ended)  # the same hook, served
    first = session.propose("a", 2)
    spec = session.propose("b", 2, speculative=True)
    before = dict(told)
    session.propose("c", 2, Outcome("a", len(first.proposal.tokens), spec.guess), speculative=True, parent="b")
    assert told["kept"] == before["kept"] + 1  # b became the open round
