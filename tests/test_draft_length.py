"""Draft length from a cost model: the k it picks, what it learns from verdicts, and exactness whatever it picks."""
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_rpc_support import PROMPT, draft_service, pair, start  # noqa: F401 - pair: a fixture

from deltaspec.v1 import draft_service_pb2_grpc
from deltaspec.draft_service.servicer import NAME, DraftServicer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from deltaspec.shared.decoding.draft_length import (MAX_PROBE_EVERY, PRIOR, PROBE_EVERY, PROBE_SHARE, CostModelLength,
                                                     PassCosts, Tally, best_k, draft_line, drafting_cost,
                                                     expected_tokens, rates, round_s)
from deltaspec.shared.decoding.pipelined import decode_adaptive, decode_pipelined
from deltaspec.shared.decoding.speculative import Stats
from deltaspec.shared.telemetry import attributes as attr
from deltaspec.shared.telemetry.metrics import Metrics
from deltaspec.shared.decoding.drafters import attach
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.decoding.target import TargetSession
from deltaspec.shared.model.checkpoint import hf_config, hf_moe_config, random_model
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer
from deltaspec.shared.rpc.generation import generate_on_server
from deltaspec.shared.rpc.options import channel
from deltaspec.shared.rpc.remote_drafter import RemoteDrafter
from deltaspec.shared.rpc.server import Service
from deltaspec.target_service import servicer

TARGET = random_model(hf_moe_config("qwen3_next"), seed=3).fuse()
DRAFT = random_model(hf_config(layer_types=["linear_attention", "full_attention"]), seed=4).fuse()
CHEAP = PassCosts(target_s=(1.0, 1.05, 1.1, 1.15, 1.2), draft_s=0.01)  # verify costs about what a decode does
DEAR = PassCosts(target_s=(1.0, 2.0, 3.0, 4.0, 5.0), draft_s=0.2)  # a verify costs a decode per token (and more)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def naive_round_s(costs: PassCosts, acceptance: list[float], i: int, overlapped: bool) -> float:
    """`round_s` written out: a round of i drafts, its drafting hidden when all i and the next token were kept."""
    hidden = math.prod(acceptance[:i + 1]) if overlapped else 0.0
    return costs.target_s[i] + (costs.draft_fixed_s + i * costs.draft_s) * (1 - hidden) if i else costs.target_s[0]


def naive_rates(costs: PassCosts, acceptance: list[float], overlapped: bool, c: float) -> list[float]:
    """`rates` written out: each k's worth the expectation over the lengths i <= k a round asked for k drafts has,
    every product of acceptances taken afresh."""
    def tokens(i: int) -> float:
        return 1 + sum(math.prod(acceptance[:j]) for j in range(1, i + 1))

    def chance(i: int, k: int) -> float:
        return c**i * (1 - c) if i < k else c**k

    return [(costs.others + sum(chance(i, k) * tokens(i) for i in range(k + 1)))
            / sum(chance(i, k) * naive_round_s(costs, acceptance, i, overlapped) for i in range(k + 1))
            for k in range(costs.k_max + 1)]


def test_rates_equal_their_naive_form():
    """`rates` sums in one pass over k what the naive form recomputes for every k and length."""
    g = torch.Generator().manual_seed(11)
    for trial in range(40):
        u = torch.rand(12, generator=g, dtype=torch.float64).tolist()
        costs = PassCosts(tuple(1.0 + 0.3 * t + u[0] * t * t for t in range(9)), draft_s=u[1] / 5,
                          draft_fixed_s=u[2] / 3, others=trial % 4)
        positions = u[3:12]
        for acceptance in (positions, u[3]):
            spelled = positions if acceptance is positions else [u[3]] * 9
            for overlapped in (False, True):
                c = 1.0 if trial % 5 == 0 else u[4]
                assert rates(costs, acceptance, overlapped, c) == pytest.approx(
                    naive_rates(costs, spelled, overlapped, c), rel=1e-12)
                for k in range(9):
                    assert round_s(costs, acceptance, k, overlapped) == pytest.approx(
                        naive_round_s(costs, spelled, k, overlapped), rel=1e-12)


def test_best_k_follows_costs_and_acceptance():
    assert best_k(CHEAP, 0.9) == 4 and best_k(CHEAP, 0.05) in (0, 1)
    assert best_k(DEAR, 0.99) == 0  # nothing pays when every drafted token costs a whole pass and a draft step
    middle = PassCosts(target_s=(1.0, 1.3, 1.6, 2.4, 3.2), draft_s=0.05)
    rates = {k: expected_tokens(0.8, k) / (middle.target_s[k] + k * middle.draft_s) for k in range(5)}
    assert best_k(middle, 0.8) == max(rates, key=rates.get)


def test_learns_the_sessions_acceptance_and_probes_at_zero():
    length = CostModelLength(PassCosts(target_s=(1.0, 1.5, 1.8, 2.1, 2.5), draft_s=0.05), prior=0.95)
    assert length.choose() == 4
    for _ in range(20):  # every round rejects its first draft (a round of k = 0 teaches nothing)
        length.observe(length.choose(), 0)
    assert length.acceptance < 0.7 and length.choose() == 0  # a prior of eight rounds at 0.95, then rejections
    for _ in range(300):  # at k = 0, one-draft probes, all accepted: acceptance comes back
        length.observe(1, 1) if length.choose() else None
    assert length.acceptance > 0.7 and length.choose() > 1


def test_acceptance_follows_a_draft_that_stops_matching():
    """Forty rounds of a draft the target agrees with, then one it never agrees with: within fifteen rounds the model
    stops drafting (a session-long average would keep drafting for forty and more; the benefit of the doubt, given
    to a session whose estimate dipped by chance, is not given to rounds in a row that kept nothing), and a later run
    of accepted probes brings drafting back."""
    length = CostModelLength(PassCosts(target_s=(1.0, 1.3, 1.6, 2.4, 3.2), draft_s=0.05), prior=0.5)
    for _ in range(40):
        length.observe(length.choose(), length.k)
    assert length.choose() == 2  # the best k of these costs at acceptance 1
    wasted = 0
    while length.choose():
        length.observe(length.k, 0)
        wasted += 1
    assert wasted <= 15 and length.reason == "none pays"
    while length.acceptance < 0.7:
        if length.choose():
            length.observe(1, 1)
    assert length.choose() > 1


def test_a_drafting_session_stops_only_once_its_rounds_show_drafting_loses():
    """An estimate a little under break-even stops no session that drafts (its last rounds may have been unlucky,
    and at k = 0 it would learn nothing more), but starts none that does not (probes aside); well under it, both
    decode."""
    costs = PassCosts(target_s=(1.0, 1.3, 1.6, 2.4, 3.2), draft_s=0.05)  # one draft pays from a = 0.35

    def session(accepted: float, drafting: bool) -> CostModelLength:
        length = CostModelLength(costs, prior=accepted, prior_rounds=30.0)  # thirty rounds' worth of `accepted`
        length.drafts = drafting
        return length

    assert session(0.33, drafting=True).current() == 1 and session(0.33, drafting=False).current() == 0
    assert session(0.1, drafting=True).current() == 0
    unlucky = session(0.33, drafting=True)
    for _ in range(4):  # a 0.67 ** 4 = 20 % chance: still the doubt
        unlucky.observe(1, 0)
    assert unlucky.current() == 1
    for _ in range(8):  # 0.67 ** 12 < 1 %: the draft stopped matching
        unlucky.observe(1, 0)
    assert unlucky.current() == 0


def test_a_new_session_drafts_where_the_servers_sessions_showed_drafting_may_pay():
    """A fresh session starts as a drafting one (the doubt its to keep) where the server's first-draft acceptance,
    one standard error up, pays; not where even that does not; and its drafts after the first start from the
    server's runs."""
    costs = PassCosts(target_s=(1.0, 1.3, 1.6, 2.4, 3.2), draft_s=0.05)  # one draft pays from a = 0.35

    def shown(every: int, run: bool = False) -> Tally:
        """Sixty rounds of 4 drafts, one in `every` keeping its first (and, with `run`, all four)."""
        tally = Tally()
        for i in range(60):
            tally.add(4, 0 if i % every else 1 + 3 * run)
        return tally

    near = CostModelLength(costs, tally=shown(3))  # a = 0.33 from about 45 rounds: 0.40 a standard error up
    assert near.drafts and near.current() == 1 and near.reason == "none"
    assert not CostModelLength(costs, tally=shown(10)).drafts  # a = 0.1: 0.14 a standard error up
    runs = CostModelLength(CHEAP, tally=shown(3, run=True))  # every kept first draft ran on to the fourth
    assert runs.positions()[0] == pytest.approx(runs.acceptance) and min(runs.positions()[1:]) > 0.99


def test_free_drafts_get_no_doubt_and_start_only_where_drafting_clearly_pays():
    """Where rounds at k = 0 keep teaching (unverified drafts, free to make), a session that drafts stops at the
    estimate, without the doubt, and one that does not starts only where drafting pays half a standard error down."""
    free = PassCosts(target_s=(1.0, 1.3, 1.6, 2.4, 3.2), draft_s=0.0)  # one draft pays from a = 0.3

    def session(accepted: float, drafting: bool) -> CostModelLength:
        length = CostModelLength(free, prior=accepted, prior_rounds=30.0)
        length.drafts = drafting
        return length

    assert session(0.28, drafting=True).current() == 0  # the doubt would have kept it drafting
    assert session(0.33, drafting=False).current() == 0  # pays at the estimate, not 0.5 standard errors down
    assert session(0.5, drafting=False).current() > 0


def test_draft_positions_after_the_first_follow_the_runs():
    """A draft whose first token is kept a third of the time, each next one nearly always once a run has begun (as
    n-gram lookup's): the first draft takes its own acceptance, the drafts after it (and the guess of the token after
    a round kept whole) the runs', and the long rounds that pay are chosen."""
    length = CostModelLength(PassCosts(target_s=(1.0, 1.4, 1.41, 1.42, 1.43, 1.44, 1.45, 1.46, 1.47), draft_s=0.001))
    for i in range(60):
        length.observe(8, 8 if i % 3 == 0 else 0)
    first, *later, guess = length.positions()
    assert first == length.acceptance == pytest.approx(1 / 3, abs=0.05) and min(*later, guess) > 0.95
    assert length.choose() == 8


def test_unverified_drafts_at_k0_teach_the_acceptance():
    """At k = 0 a cheap drafter's drafts are asked for and not verified: checked against the tokens the target then
    emits, each ends at its first miss or its last draft and teaches as a round would; a drafter that starts
    matching brings drafting back with no probe's verify."""
    free = PassCosts(target_s=CHEAP.target_s, draft_s=0.0)
    length = CostModelLength(free, prior=0.02, prior_rounds=50)
    assert length.choose() == 0 and length.shadow_k() == 4
    assert CostModelLength(DEAR, prior=0.02, prior_rounds=50).shadow_k() == 0  # a draft step as dear as a pass
    before = length.acceptance
    length.shadow([5, 6, 7], 3)
    length.emitted([5])
    length.emitted([6, 9])  # the third draft missed: two of three kept
    assert not length.shadows and length.acceptance > before
    assert (length.run_reached, length.run_kept) == (2, 1)  # of the drafts after the first: both reached, one kept
    while length.choose() == 0:
        length.shadow([1, 2, 3, 4], 4)
        length.emitted([1, 2, 3, 4])
    assert length.k and length.shadow_k() == 0  # drafting again: nothing left to shadow


def test_a_good_draft_comes_back_without_probes_when_drafting_is_cheap():
    prompt = torch.randint(0, 257, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    length = CostModelLength(PassCosts(target_s=CHEAP.target_s, draft_s=0.0), prior=0.02, prior_rounds=50)
    got = generate(TARGET, prompt, 40, ModelDrafter(TARGET), length)
    assert got.token_ids == generate(TARGET, prompt, 40).token_ids
    assert got.stats.drafts > 3 and got.stats.rounds < 30  # the target as its own draft: every shadow matched


def test_pipelined_rounds_hide_the_drafting_they_overlap():
    """Drafting as dear as a verify: serial rounds pay it every round, pipelined ones only where the round below
    missed, so at a high acceptance the pipelined loop takes longer rounds."""
    costs = PassCosts(target_s=(1.0, 1.2, 1.4, 1.6, 1.8), draft_s=0.5)
    assert round_s(costs, 0.9, 4, overlapped=True) < round_s(costs, 0.9, 4)
    assert round_s(costs, 0.0, 4, overlapped=True) == round_s(costs, 0.0, 4)  # every round misses: nothing hides
    assert round_s(costs, 0.9, 0, overlapped=True) == round_s(costs, 0.9, 0) == 1.0
    assert best_k(costs, 0.9, overlapped=True) == 3 > best_k(costs, 0.9) == 2


def test_probes_grow_rarer_while_rejected_and_dear():
    costs = PassCosts(target_s=(1.0, 1.05, 1.1, 1.15, 1.2), draft_s=0.01)
    length = CostModelLength(costs, prior=0.02, prior_rounds=50)  # a draft that does not match

    def next_probe() -> int:
        """Rounds until the next probe, the probe included."""
        n = 1
        while length.choose() == 0:
            n += 1
        return n

    assert next_probe() == PROBE_EVERY
    length.observe(1, 0, propose_s=0.01)  # rejected, cheap: the wait doubles
    assert next_probe() == 2 * PROBE_EVERY
    length.observe(1, 0, propose_s=1.5)  # rejected and dear (1.55 decode steps more than one): at most 1 % probing
    assert next_probe() == math.ceil(1.55 / PROBE_SHARE)
    length.observe(1, 0, propose_s=10.0)
    assert next_probe() == MAX_PROBE_EVERY
    length.observe(1, 1, propose_s=0.01)  # accepted: back to the shortest wait its cost allows (0.06 decode steps)
    assert length.wait == max(PROBE_EVERY, math.ceil((costs.target_s[1] - 1.0 + 0.01) / PROBE_SHARE))


@pytest.mark.parametrize("costs", [CHEAP, DEAR], ids=["cheap-verify", "dear-verify"])
def test_generation_equals_target_only_whatever_k_it_picks(costs):
    prompt = torch.randint(0, 257, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    want = generate(TARGET, prompt, 40).token_ids
    got = generate(TARGET, prompt, 40, ModelDrafter(DRAFT), CostModelLength(costs))
    assert got.token_ids == want
    if costs is DEAR:  # only the probes draft
        assert got.stats.drafted <= 40 // PROBE_EVERY + 1
    else:
        assert got.stats.drafted > 0


@pytest.mark.parametrize("draft", ["target", "noisy"])
def test_pipelined_loop_with_the_cost_model_equals_target_only_and_says_why(draft):
    """The pipelined loop takes each fresh round's k from the cost model and its speculated rounds' from its
    current choice; the output is target-only's, and every choice is on a span and in the metrics."""
    prompt = torch.randint(0, 257, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    want = generate(TARGET, prompt, 30).token_ids
    exporter, metrics = InMemorySpanExporter(), Metrics()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    session, stats = TargetSession(TARGET, prompt, max_chain=1), Stats()
    drafter = ModelDrafter(TARGET if draft == "target" else DRAFT)
    drafter.start(list(prompt))
    attach(drafter, session)
    length = CostModelLength(CHEAP, prior=0.9 if draft == "target" else 0.02, prior_rounds=20, overlapped=True)
    for _ in decode_pipelined(session, drafter, 30, length, set(), stats, provider.get_tracer("test"), metrics):
        pass
    assert session.generated == want
    chosen = [span.attributes for span in exporter.get_finished_spans() if attr.DRAFT_LENGTH_K in span.attributes]
    assert chosen and all(len(a[attr.DRAFT_LENGTH_TOKENS_PER_S]) == 5 for a in chosen)
    rounds = {(s.labels["k"], s.labels["reason"]): s.value for m in metrics.registry.collect()
              for s in m.samples if s.name == "deltaspec_draft_length_rounds_total"}
    if draft == "target":  # every guess holds: speculated rounds carry most of the drafts
        assert stats.speculations_kept > 0 and rounds.get(("4", "pays"), 0) >= 1
    else:
        assert stats.drafted <= 30 // PROBE_EVERY + 1 and rounds.get(("0", "none pays"), 0) > 10


@pytest.mark.parametrize("draft", ["target", "noisy"])
def test_adaptive_rounds_are_serial_while_nothing_is_drafted(draft):
    """The cost model's loop runs serial rounds while it drafts nothing and pipelined ones while it drafts, handing
    over at round ends: the target's tokens either way."""
    prompt = torch.randint(0, 257, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    session, stats = TargetSession(TARGET, prompt, max_chain=1), Stats()
    drafter = ModelDrafter(TARGET if draft == "target" else DRAFT)
    drafter.start(list(prompt))
    attach(drafter, session)
    length = CostModelLength(CHEAP, prior=0.9 if draft == "target" else 0.02, prior_rounds=20, overlapped=True)
    for _ in decode_adaptive(session, drafter, 30, length, set(), stats):
        pass
    assert session.generated == generate(TARGET, prompt, 30).token_ids
    pipelined = stats.speculations_kept + stats.speculations_missed
    assert pipelined > 0 if draft == "target" else pipelined == 0  # a draft never drafted for: serial throughout


def test_rates_worked_out_before_the_loop_is_known_are_not_kept():
    """A server asks whether a round would draft before it knows the loop will be pipelined: the serial rates that
    asking worked out must not decide the pipelined rounds (at eight sessions they said k = 0 where 7 or 8 pays)."""
    row = (9.0e-3, 10.4e-3, 11.5e-3, 12.5e-3, 13.6e-3, 14.6e-3, 15.6e-3, 16.7e-3, 17.7e-3)  # batch 8, as a server timed
    costs = PassCosts(row, 0.76e-3, batched=((8, row),), draft_fixed_s=4.19e-3)
    length = CostModelLength(costs, prior=0.95, prior_rounds=20, batch_size=lambda: 8, drafting=lambda: 8)
    assert length.current() == 0  # serial rounds: the draft's round trip is not hidden
    length.overlapped = True
    assert length.current() >= 6


class Flipping(CostModelLength):
    """A cost model that drafts 2 and nothing in turn, round after round (`current` on its own schedule)."""

    def __init__(self) -> None:
        super().__init__(CHEAP, overlapped=True)
        self.asked = 0

    def current(self) -> int:
        return 2 if self.asked % 2 == 0 else 0

    def choose(self) -> int:
        k, self.asked = self.current(), self.asked + 1
        self.k, self.reason, self.probing = k, "pays" if k else "none pays", False
        return k


def test_adaptive_rounds_handing_over_every_round_name_each_round_once():
    """Pipelined rounds begun again after serial ones are named apart from every earlier one: a name reused with other
    drafts (the target keeps the round before and the last dropped one for retries) was refused mid-generation
    (`round 'p0' was already verified with other input`)."""
    prompt = torch.randint(0, 257, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    session, stats = TargetSession(TARGET, prompt, max_chain=1), Stats()
    drafter = ModelDrafter(DRAFT)  # a draft that misses often: dropped rounds and speculations
    drafter.start(list(prompt))
    attach(drafter, session)
    for _ in decode_adaptive(session, drafter, 30, Flipping(), set(), stats):
        pass
    assert session.generated == generate(TARGET, prompt, 30).token_ids
    assert stats.drafted > 0


def test_pass_costs_measured_for_every_length():
    costs = PassCosts.measure(TARGET, DRAFT, k_max=3, repeats=2)
    assert costs.k_max == 3 and all(t > 0 for t in costs.target_s) and costs.draft_s > 0


def test_a_round_reads_the_costs_of_the_batch_it_joins():
    """A round's k drafts add k tokens to the pass its batch shares: costed from the measured batch (the smallest at
    least as large) at 1 + k / batch tokens a sequence, the others' tokens counted in what the pass yields."""
    costs = PassCosts(CHEAP.target_s, 0.01, batched=((1, CHEAP.target_s), (4, DEAR.target_s)))
    assert costs.at(1).target_s == CHEAP.target_s and costs.at(1).others == 0
    shared = costs.at(2)
    assert shared == costs.at(4) == costs.at(9) and shared.others == 3
    assert shared.target_s == pytest.approx((1.0, 1.25, 1.5, 1.75, 2.0))  # DEAR's row at T = 1 + k/4
    # every sequence drafting the same k in a pass whose time is a line in its tokens: the shared rule is the row's
    line = PassCosts((1.0, 1.5, 2.0, 2.5, 3.0), 0.0, batched=((4, (4.0, 6.0, 8.0, 10.0, 12.0)),))
    for a in (0.3, 0.5, 0.8):
        assert best_k(line.at(4), a) == best_k(PassCosts(line.batched[0][1], 0.0), a)
    batch = [1]
    length = CostModelLength(costs, prior=0.9, batch_size=lambda: batch[0])
    assert length.choose() == 4
    batch[0] = 3  # a pass of 3 costs what the measured pass of 4 did: a verify no longer pays
    assert length.choose() == 0
    assert CostModelLength(costs, prior=0.9, k_max=2).choose() == 2  # the request's cap
    assert CostModelLength(costs, prior=0.9, k_max=0).choose() == 0



def test_where_others_verify_a_round_pays_only_its_tokens():
    """The step up from a decode pass to a verify is paid once a pass: where another session of the batch drafts,
    this one's drafts cost their share of the verify line alone, so a draft too poor to pay for the step pays for
    its own tokens. Its own drafts of the last round do not count as another's."""
    row = (7.1, 9.3, 9.7, 10.1, 10.5, 10.9, 11.3, 11.7, 12.1)  # 8 sequences at T tokens each: a step, then a line
    costs = PassCosts(row, 0.0, batched=((8, row),))
    assert costs.at(8, verifying=True).target_s == pytest.approx([9.3 + 0.05 * k for k in range(9)])
    assert costs.at(8).target_s[1] == pytest.approx(7.1 + 2.2 / 8)  # alone, the first drafter bears the step
    others = [0]
    length = CostModelLength(costs, prior=0.1, batch_size=lambda: 8, drafting=lambda: others[0])
    assert length.choose() == 0 and not length.others_verify()
    others[0] = 1  # another session drafted in the last pass
    assert length.others_verify() and length.choose() > 0
    assert not length.others_verify()  # the one drafting session of the last pass may be this one
    others[0] = 2
    assert length.others_verify()


def test_drafting_cost_as_a_round_trip_plus_steps():
    assert draft_line({2: [0.012, 0.013, 0.012], 4: [0.014], 8: [0.018]}) == pytest.approx((0.010, 0.001))
    assert draft_line({4: [0.04]}) == pytest.approx((0.0, 0.01)) and draft_line({}) == (0.0, 0.0)
    # a round trip that a longer round amortises: k = 4 where the same cost spread per draft would pick less
    fixed = PassCosts(CHEAP.target_s, 0.001, draft_fixed_s=0.3)
    assert best_k(fixed, 0.8) == 4 and best_k(PassCosts(CHEAP.target_s, 0.301), 0.8) < 4
    assert PassCosts(CHEAP.target_s, 0.001, ((1, DEAR.target_s),), 0.3).at(1).draft_fixed_s == 0.3
    dear = CostModelLength(PassCosts(CHEAP.target_s, 1.0), prior=0.9)  # each draft as dear as a target pass
    assert dear.choose() == 0


def test_drafting_cost_timed_on_a_scratch_session():
    fixed, step = drafting_cost(TARGET, ModelDrafter(DRAFT), ks=(1, 6), repeats=3)  # far apart: a loaded
    # machine's spike in one round's time cannot turn the line flat
    assert fixed >= 0 and step > 0


def test_a_new_session_starts_from_what_the_servers_sessions_showed():
    tally = Tally()
    assert CostModelLength(CHEAP, tally=tally).acceptance == PRIOR  # nothing shown yet: the prior
    first = CostModelLength(CHEAP, tally=tally)
    for _ in range(30):
        first.observe(4, 0, propose_s=0.04)  # a draft that never matches
    later = CostModelLength(CHEAP, tally=tally)
    assert later.acceptance < 0.05 and later.choose() == 0
    while first.choose() == 0:  # a probe, rejected: a later session waits longer before its own first probe
        pass
    first.observe(1, 0, propose_s=0.04)
    assert CostModelLength(CHEAP, tally=tally).wait == tally.wait > PROBE_EVERY


def test_pass_costs_measured_at_each_batch():
    costs = PassCosts.measure(TARGET, None, k_max=2, repeats=1, batches=(1, 3))
    assert [size for size, _ in costs.batched] == [1, 3] and costs.draft_s == 0.0
    assert costs.target_s == costs.batched[0][1] and all(len(row) == 3 for _, row in costs.batched)


def test_served_with_the_cost_model_every_stream_equals_target_only(pair):
    prompts = [PROMPT, PROMPT[::-1], PROMPT[1:] * 2]
    want = [generate(load_model(pair[0]), p, 20).token_ids for p in prompts]
    with start(draft_service(pair[1])) as draft:
        peer = servicer.DraftPeer(draft.address)
        svc = servicer.service(lambda: (load_model(pair[0]), load_tokenizer(pair[0])), draft=peer,
                               draft_length="cost")
        with start(svc) as target:
            with ThreadPoolExecutor(3) as pool:
                got = list(pool.map(lambda p: generate_on_server(target.address, p, "", 20, 2)[0], prompts))
    assert [g.token_ids for g in got] == want
    assert all(g.stats.drafted <= 2 * g.stats.rounds for g in got)  # never more than the request's cap
    with pytest.raises(ValueError, match="draft_length"):
        servicer.TargetServicer(lambda: None, draft_length="dynamic")


def test_a_remote_draft_opened_late_proposes_what_one_opened_early_does(pair):
    """`open_early=False` (a loop whose cost model expects no drafts yet): `start` opens nothing on the draft service;
    the first proposal opens the session, from every token committed so far, and proposes what an early one does."""
    draft = DraftServicer(lambda: load_model(pair[1]))
    service = Service(NAME, lambda s: draft_service_pb2_grpc.add_DraftServiceServicer_to_server(draft, s), draft.load)
    target = load_model(pair[0])
    with start(service) as server:
        proposals = []
        for early in (True, False):
            remote = RemoteDrafter(draft_service_pb2_grpc.DraftServiceStub(channel(server.address)),
                                   SamplingParams(), target.config.vocab_size, open_early=early)
            session = TargetSession(target, PROMPT)
            remote.start(list(PROMPT))
            attach(remote, session)
            if not early:
                assert len(draft.sessions) == 0
            for i, k in enumerate((0, 0, 3, 0, 2)):  # rounds without drafts first: the session opens at the third
                proposal = remote.propose(k)
                proposals.append(proposal.tokens)
                rnd = session.verify(f"r{i}", proposal.tokens, session.version)
                session.commit(rnd.round_id, rnd.verdict.accepted)
                remote.advance(rnd.verdict.accepted, session.generated[-1])
            remote.close()
    assert proposals[:5] == proposals[5:] and proposals[2]
