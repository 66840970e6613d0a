"""The no-rollback study's strategy does what it claims, and only where it is asked for.

Exact sessions leave zero recurrent-state error and never diverge; the stale strategy (attention
rolled back, GDN not) is exact on full acceptance and drifts as soon as a draft is rejected.
"""
from pathlib import Path

from benchmarks.no_rollback import random_setup, stale_run
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.decoding.target import TargetSession

SETUP = random_setup(n_prompts=2, length=12, seed=3)
N = 24


def test_exact_session_is_the_control():
    for prompt in SETUP.prompts:
        want = generate(SETUP.model, prompt, N).token_ids
        run = stale_run(SETUP.model, prompt, want, SETUP.drafters["model"](), 4, session_cls=TargetSession)
        assert run.diverged_at is None and run.partial_rounds > 0
        assert max(run.errors) < 1e-5 and all(run.agree)


def test_stale_gdn_drifts_after_a_rejection():
    prompt = SETUP.prompts[0]
    want = generate(SETUP.model, prompt, N).token_ids
    run = stale_run(SETUP.model, prompt, want, SETUP.drafters["model"](), 4)
    assert run.partial_rounds > 0
    assert max(run.errors) > 1e-2
    assert run.diverged_at is not None


def test_stale_gdn_is_exact_when_everything_is_accepted():
    model, prompt = SETUP.model, SETUP.prompts[1]
    want = generate(model, prompt, N).token_ids
    run = stale_run(model, prompt, want, ModelDrafter(model), 4)  # the target drafting for itself
    assert run.partial_rounds == 0 and run.diverged_at is None
    assert max(run.errors) < 1e-5


def test_generate_and_services_never_reach_the_stale_strategy():
    root = Path(__file__).resolve().parents[1]
    sources = [*root.glob("shared/**/*.py"), *root.glob("target_service/*.py"), *root.glob("draft_service/*.py")]
    users = {p.relative_to(root).as_posix() for p in sources
             if any(name in p.read_text() for name in ("StaleSession", "StaleGDNState", "no_rollback"))}
    assert not users  # benchmarks/no_rollback.py, outside the package, reachable only as `deltaspec study`
    assert type(TargetSession(SETUP.model, [1, 2, 3]).state).__name__ == "ModelState"
