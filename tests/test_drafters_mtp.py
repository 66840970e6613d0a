"""MTP self-speculation with random MTP weights in HF layout, saved to and loaded from a checkpoint.

- greedy output identical to target-only, for accept counts spanning 0..k (a steering wrapper
  runs the head every round, then proposes the truth up to a chosen count, so every count occurs);
- the head's incremental KV cache (rows rolled back by position after every round) gives, at each
  round, the same next-token distribution as a from-scratch computation over the committed tokens.
"""
import pytest
import torch

from deltaspec.shared.decoding.drafters import Proposal, make_drafter
from deltaspec.shared.decoding.drafters.mtp import MTPDrafter, MTPHead, random_mtp_weights
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.decoding.target import TargetSession
from deltaspec.shared.model.checkpoint import hf_config, random_model, save_checkpoint
from deltaspec.shared.model.loader import load_model

PROMPT = [40, 41, 42, 43, 10, 11, 40, 41]
N = 40


@pytest.fixture(scope="module", params=[1, 2], ids=["mtp1layer", "mtp2layers"])
def target(request, tmp_path_factory):
    model = random_model(hf_config(mtp_num_hidden_layers=request.param), seed=11)
    model.mtp = random_mtp_weights(model.config, request.param, seed=5)
    return load_model(save_checkpoint(model, tmp_path_factory.mktemp("mtp")))


def reference_next(target, tokens: list[int]) -> torch.Tensor:
    """From scratch: trunk over x_0..x_{m-1}, head over rows (h_i post-norm, x_{i+1}); probs for x_{m+1}."""
    head = MTPHead(target)
    _, hidden = target(torch.tensor(tokens[:-1]), target.new_state())
    with torch.inference_mode():
        y = head(target.model.embed_tokens(torch.tensor(tokens[1:])), target.model.norm(hidden),
                 head.new_cache(), 0)
        return target.lm_head(y[-1]).float().softmax(-1)


class Steered:
    """Runs the MTP drafter, then makes round r keep exactly r mod (k+1) drafts: the truth up to there,
    a wrong token after (unless `check` only watches: then the head's own tokens go through)."""

    def __init__(self, inner, truth, check=None):
        self.inner, self.truth, self.check = inner, truth, check
        self.accept_counts: list[int] = []

    def start(self, prompt_ids):
        self.inner.start(prompt_ids)
        self.pos = 0

    def attach_session(self, session):
        self.inner.attach_session(session)
        self.session = session

    def propose(self, k):
        p = self.inner.propose(k)
        if self.check:
            if p.tokens:
                self.check(self.session.tokens, p)
            return Proposal(p.tokens)
        a = len(self.accept_counts) % (k + 1)
        truth = self.truth[self.pos:self.pos + k]
        return Proposal([t if i < a else (t + 1) % 257 for i, t in enumerate(truth)])

    def advance(self, accepted, next_token):
        self.inner.advance(accepted, next_token)
        self.accept_counts.append(accepted)
        self.pos += accepted + 1


@pytest.mark.parametrize("k", [1, 2, 4, 7], ids=lambda k: f"k{k}")
def test_mtp_greedy_equals_target_only_all_accept_counts(target, k):
    want = generate(target, PROMPT, N).token_ids
    assert generate(target, PROMPT, N, make_drafter("mtp", target), k).token_ids == want
    steered = Steered(MTPDrafter(target), want)
    assert generate(target, PROMPT, N, steered, k).token_ids == want
    assert set(steered.accept_counts) == set(range(k + 1))


def test_mtp_incremental_cache_equals_from_scratch(target):
    want = generate(target, PROMPT, N).token_ids
    checked = []

    def check(tokens, proposal):
        ref = reference_next(target, list(tokens))
        torch.testing.assert_close(proposal.probs[0], ref, rtol=1e-4, atol=1e-5)
        checked.append(len(tokens))

    drafter = Steered(MTPDrafter(target, SamplingParams(temperature=1.0)), want, check=check)
    assert generate(target, PROMPT, N, drafter, 3).token_ids == want
    assert len(checked) >= 5


def test_mtp_single_token_prompt_and_zero_k(target):
    want = generate(target, [7], 12).token_ids
    assert generate(target, [7], 12, make_drafter("mtp", target), 3).token_ids == want
    assert generate(target, PROMPT, 12, make_drafter("mtp", target), 0).token_ids == generate(target, PROMPT, 12).token_ids


def test_mtp_needs_weights_and_a_session():
    plain = random_model(hf_config(), seed=1)
    with pytest.raises(ValueError, match="no MTP head"):
        make_drafter("mtp", plain)
    plain.mtp = random_mtp_weights(plain.config, 1, seed=0)
    drafter = MTPDrafter(plain)
    drafter.start(PROMPT)
    with pytest.raises(RuntimeError, match="target session"):
        drafter.propose(2)
    session = TargetSession(plain, PROMPT)
    drafter.attach_session(session)
    assert len(drafter.propose(2).tokens) == 2
