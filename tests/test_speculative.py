"""Greedy speculative output equals target-only output for any acceptance pattern."""
import random

import pytest
import torch

from deltaspec.shared.decoding.drafters import Proposal
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.checkpoint import hf_config, random_model

TARGET = random_model(hf_config(), seed=11)
PROMPT = [40, 41, 42, 43, 10, 11]
N = 40
WANT = generate(TARGET, PROMPT, N).token_ids


class OracleDrafter:
    """Knows the target's greedy continuation and proposes each token right with probability `p_right`."""

    def __init__(self, p_right: float, seed: int) -> None:
        self.p_right, self.rng = p_right, random.Random(seed)

    def start(self, prompt_ids):
        self.pos = 0

    def propose(self, k):
        tokens = [WANT[i] if self.rng.random() < self.p_right else (WANT[i] + 7) % 257
                  for i in range(self.pos, min(self.pos + k, len(WANT)))]
        return Proposal(tokens)

    def advance(self, accepted, next_token):
        self.pos += accepted + 1


@pytest.mark.parametrize("k", range(1, 9), ids=lambda k: f"k{k}")
@pytest.mark.parametrize("p_right", [0.0, 0.7, 1.0], ids=["accept0", "accept07", "accept1"])
def test_greedy_speculation_equals_target_only(k, p_right):
    result = generate(TARGET, PROMPT, N, OracleDrafter(p_right, seed=k), k)
    assert result.token_ids == WANT
    rate = result.stats.as_dict(N)["acceptance_rate"]
    if p_right == 1.0:
        assert rate == 1.0
    if p_right == 0.0:
        assert rate == 0.0


@pytest.mark.parametrize("k", [1, 4, 8], ids=lambda k: f"k{k}")
def test_model_drafter_any_acceptance(k):
    weak = random_model(hf_config(hidden_size=32, intermediate_size=64,
                                  layer_types=["linear_attention", "full_attention"]), seed=3)
    assert generate(TARGET, PROMPT, N, ModelDrafter(weak), k).token_ids == WANT
    assert generate(TARGET, PROMPT, N, ModelDrafter(TARGET), k).token_ids == WANT



def test_zero_draft_rounds_run_no_draft_pass_and_the_backlog_drafts_as_a_fresh_start():
    """A cost model at k = 0 must cost what plain decoding costs: the draft model stays idle through zero-draft
    rounds (not one forward pass), and its next proposal equals a drafter started on the whole history."""
    draft = random_model(hf_config(hidden_size=32, intermediate_size=64,
                                   layer_types=["linear_attention", "full_attention"]), seed=5)
    drafter, passes = ModelDrafter(draft), []
    handle = draft.register_forward_hook(lambda *_: passes.append(1))
    drafter.start(PROMPT)
    history = list(PROMPT)
    for token in WANT[:6]:  # six rounds without drafts, each emitting the target's token
        assert drafter.propose(0).tokens == []
        drafter.advance(0, token)
        history.append(token)
    assert passes == []
    fresh = ModelDrafter(draft)
    fresh.start(history)
    handle.remove()
    assert drafter.propose(4).tokens == fresh.propose(4).tokens


class Recorder:
    """Wraps a drafter and keeps each proposal with the committed history it was made after."""

    def __init__(self, drafter: ModelDrafter) -> None:
        self.drafter, self.rounds = drafter, []

    def start(self, prompt_ids):
        self.history = list(prompt_ids)
        self.drafter.start(prompt_ids)

    def propose(self, k):
        proposal = self.drafter.propose(k)
        self.rounds.append((list(self.history), proposal.tokens, k))
        return proposal

    def advance(self, accepted, next_token):
        self.history += self.rounds[-1][1][:accepted] + [next_token]
        self.drafter.advance(accepted, next_token)


@pytest.mark.parametrize("stop_below", [0.04, 0.05, 1.0], ids=lambda t: f"stop{t}")
def test_dynamic_draft_length_is_exact_and_stops_where_the_draft_is_unsure(stop_below):
    """Each proposal ends at the first token the draft gives less than `stop_below` (its top probability, from a
    fresh forward over the history: the reference), or at k; the output stays target-only's."""
    weak = random_model(hf_config(hidden_size=32, intermediate_size=64,
                                  layer_types=["linear_attention", "full_attention"]), seed=3)
    recorder = Recorder(ModelDrafter(weak, stop_below=stop_below))
    assert generate(TARGET, PROMPT, N, recorder, 8).token_ids == WANT
    lengths = set()
    for history, tokens, k in recorder.rounds:
        if not k:  # the last token of the run: nothing to draft
            assert tokens == []
            continue
        logits, _ = weak(torch.tensor(history + tokens[:-1]), weak.new_state())
        top, best = logits[len(history) - 1:].softmax(-1).max(-1)
        assert tokens == best.tolist()
        sure = (top >= stop_below).tolist()
        assert all(sure[:-1]) and (len(tokens) == k or not sure[-1])
        lengths.add(len(tokens))
    assert lengths == {1} if stop_below == 1.0 else len(lengths) > 2  # the quantiles chosen stop at varied lengths
    with pytest.raises(ValueError, match="stop_below"):
        ModelDrafter(weak, stop_below=1.5)

def test_exact_length_and_eos_stop():
    eos = WANT[5]
    model = random_model(hf_config(eos_token_id=eos), seed=11)
    for drafter in (None, ModelDrafter(model)):
        out = generate(model, PROMPT, N, drafter, 4).token_ids
        assert out == WANT[: WANT.index(eos) + 1]
    for n in (1, 2, 7):
        assert generate(TARGET, PROMPT, n, ModelDrafter(TARGET), 4).token_ids == WANT[:n]


def test_single_token_prompt():
    want = generate(TARGET, [7], 10).token_ids
    assert generate(TARGET, [7], 10, ModelDrafter(TARGET), 3).token_ids == want
    assert len(want) == 10 and torch.tensor(want).max() < 257


def test_sampled_session_recreated_from_history_continues_identically():
    """Draws are keyed by position: a session rebuilt from the committed history (a target restart)
    continues with exactly the tokens the lost session would have produced."""
    from deltaspec.shared.decoding.sampling import SamplingParams
    from deltaspec.shared.decoding.speculative import Stats, decode
    from deltaspec.shared.decoding.target import TargetSession

    sampling = SamplingParams(temperature=1.0, top_k=50, seed=7)
    draft = random_model(hf_config(hidden_size=32, intermediate_size=64,
                                   layer_types=["linear_attention", "full_attention"]), seed=3)

    def run(prompt, n):
        session, drafter = TargetSession(TARGET, prompt, sampling), ModelDrafter(draft, sampling)
        drafter.start(prompt)
        return session, decode(session, drafter, n, 4, set(), Stats())

    _, rounds = run(PROMPT, N)
    uninterrupted = [t for chunk in rounds for t in chunk]
    session, rounds = run(PROMPT, N)
    for _ in range(5):  # the target "dies" after five rounds
        next(rounds)
    done = session.generated
    _, resumed = run(PROMPT + done, N - len(done))
    assert done + [t for chunk in resumed for t in chunk] == uninterrupted
