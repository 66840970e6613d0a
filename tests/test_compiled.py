"""Compiled passes (`deltaspec.shared.model.compiled`) against the fused path they compile.

Random weights and ids, the awkward sizes of `test_fused` (value heads != key heads, d_k != d_v, attention
first, partial rotary, untied) and a second, differently shaped model compiled in the same process (each
must run its own graphs). The target has 5 layers (compiled per layer kind), the draft 2 (one whole-model
graph), so both ways of compiling are checked. Every forward of a session (one-token decode,
verify of 2..9 tokens from the head and on top of a staging, a pipelined round after `mark`) must give the
same logits, hidden states, staged logs and, after partial, full, zero and marked commits, the same head; in
bf16, the same logits to bf16 rounding.
Compiling takes a while (up to four graphs a model or layer kind), so the models are compiled once for the
module.
"""
import copy

import pytest
import torch

from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.checkpoint import hf_config, hf_moe_config, random_model, save_checkpoint
from deltaspec.shared.state.spec import CHAIN_LOG_CAPACITY, LOG_CAPACITY
from test_fused import AWKWARD, assert_same_head, close
from support import Served, both_loops


TARGET = hf_config(**{**AWKWARD, "layer_types": ["full_attention", "linear_attention", "linear_attention",
                                                 "full_attention", "linear_attention"]})
DRAFT = hf_config(vocab_size=AWKWARD["vocab_size"], layer_types=["linear_attention", "full_attention"])


# Dynamo's caches are per process: the module runs on one xdist worker, in file order, as it does serially (all
# but the bf16 test, which compiles models of its own).
pytestmark = pytest.mark.xdist_group("compiled")


@pytest.fixture(scope="module")
def models():
    target, draft = random_model(TARGET, seed=11).fuse(), random_model(DRAFT, seed=12).fuse()
    pairs = {"target": (target, copy.deepcopy(target).compile()), "draft": (draft, copy.deepcopy(draft).compile())}
    assert [pair[1].compiled.per_layer for pair in pairs.values()] == [True, False]  # both ways of compiling
    return pairs


def assert_same_staging(state, ref) -> None:
    for name in ("window", "spare"):
        assert close(getattr(state.recurrent, name), getattr(ref.recurrent, name)), name
    n = state.staged
    if not state.recurrent.logged:
        return
    for name, axis in (("x", 1), ("k", 3), ("delta", 2), ("g", 2)):
        assert close(getattr(state.recurrent, name).narrow(axis, 0, n), getattr(ref.recurrent, name).narrow(axis, 0, n)), name


@pytest.mark.parametrize("which", ["target", "draft"])
def test_every_pass_and_commit_matches_the_fused_path(models, which):
    eager, compiled = models[which]
    gen = torch.Generator().manual_seed(5)
    # small K/V buffers, which grow; the draft's logs as a drafter's (the graphs the speculative test runs)
    logs = CHAIN_LOG_CAPACITY if which == "draft" else LOG_CAPACITY
    ref, state = (m.new_state(capacity=8, log_capacity=logs) for m in (eager, compiled))
    # (tokens, then a pass on top or None, what to keep): the first pass does not fit the logs (eager); the rest runs
    # compiled
    plan = [(logs + 4, None, logs + 4), (1, None, 1), (1, 1, 2), (5, None, 2), (1, None, 0), (9, None, 9), (3, 2, 4),
            (2, 3, None), (1, 1, 1), (6, None, 6), (4, 1, 3)]
    run_plan(plan, (eager, ref), (compiled, state), gen)
    assert compiled.compiled is not None


def run_plan(plan: list[tuple[int, int | None, int | None]], reference: tuple, fast: tuple, gen: torch.Generator,
             before_pass=lambda n: None) -> None:
    """Each (tokens, then a pass on top or None, what to keep, None: revert) on both (model, state) pairs: every
    forward's logits and hidden states, every staging and every head the same. `before_pass(n)` sees each pass first."""
    (eager, ref), (model, state) = reference, fast
    for T, more, keep in plan:
        for n in (T, more):
            if n:
                ids = torch.randint(0, eager.config.vocab_size, (n,), generator=gen)
                before_pass(n)
                want, got = eager(ids, ref), model(ids, state)
                assert close(got[0], want[0]) and close(got[1], want[1]), f"forward of {n} tokens"
                assert_same_staging(state, ref)
        if keep is None:
            ref.revert(), state.revert()
        else:
            ref.commit(keep), state.commit(keep)
        assert_same_head(state, ref)


def test_a_pipelined_round_matches(models):
    """`mark`, a chained pass on top, then `commit_marked` or `drop_marked`, as the pipelined loops do."""
    eager, compiled = models["target"]
    gen = torch.Generator().manual_seed(9)
    ref, state = eager.new_state(), compiled.new_state()
    prompt = torch.randint(0, eager.config.vocab_size, (30,), generator=gen)
    for model, st in ((eager, ref), (compiled, state)):
        model(prompt, st), st.commit(30)
    for finish in ("commit_marked", "drop_marked", "commit_marked"):
        ids, chained = (torch.randint(0, eager.config.vocab_size, (n,), generator=gen) for n in (5, 5))
        for model, st in ((eager, ref), (compiled, state)):
            model(ids, st), st.mark()
        want, got = eager(chained, ref), compiled(chained, state)
        assert close(got[0], want[0])
        getattr(ref, finish)(), getattr(state, finish)()
        assert_same_staging(state, ref)
        ref.commit(ref.staged), state.commit(state.staged)
        assert_same_head(state, ref)


def test_speculative_decoding_with_compiled_models_equals_target_only(models):
    """On the graphs the tests above made (both models' states log as they do here), sessions from position 0 on
    compile nothing more: a graph holds for every position (a rope row at the table's start once made its own)."""
    target, compiled_target = models["target"]
    draft, compiled_draft = models["draft"]
    prompt = torch.randint(0, target.config.vocab_size, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    want = generate(target, prompt, 40).token_ids
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert generate(compiled_target, prompt, 40).token_ids == want
        assert generate(compiled_target, prompt, 40, ModelDrafter(compiled_draft), 4).token_ids == want
        assert generate(target, prompt, 40, ModelDrafter(compiled_draft), 8).token_ids == want


def test_compiled_services_serve_target_only_tokens(models, tmp_path):
    """`serve-target --compile` as a real process (its graphs compile at start-up), both loops over gRPC. Its draft
    runs eager: a compiled draft's rounds are `test_speculative_decoding_with_compiled_models_equals_target_only`'s,
    and `serve-draft --compile` compiles the same way at start-up (the suite's time: a second process compiling)."""
    target, draft = models["target"][0], models["draft"][0]
    with Served("serve-draft", save_checkpoint(draft, tmp_path / "draft")) as drafted, \
            Served("serve-target", save_checkpoint(target, tmp_path / "target"), "--draft-addr", drafted.address,
                   "--compile") as served:
        prompt = torch.randint(0, target.config.vocab_size, (9,), generator=torch.Generator().manual_seed(4)).tolist()
        want = generate(target, prompt, 32).token_ids
        assert both_loops(served, drafted, prompt, 32, 4) == (want, want)


def test_compile_needs_the_fused_path_and_bfloat16_experts():
    model = random_model(hf_config(), seed=1).fuse(False)
    with pytest.raises(ValueError, match="fused path"):
        model.compile()
    assert model.fuse().compile().fuse(False).compiled is None
    with pytest.raises(ValueError, match="MoE model need bfloat16"):
        random_model(hf_moe_config("qwen3_next"), seed=1).fuse().compile()


@pytest.mark.xdist_group("compiled-bf16")  # models and graphs of its own: free to run beside the module's other tests
def test_bfloat16_compiled_passes_match_the_fused_path():
    """bf16 weights, both ways of compiling: logits agree with the fused path to bf16 rounding through decode, verify
    from the head and on a staging, and commits; the state stays float32; speculative output equals target-only.
    The target alone is compiled (the float32 tests compile both models of the pair: the draft's graphs are the same
    code at other sizes), its draft eager."""
    eager = random_model(TARGET, seed=21).to(torch.bfloat16).fuse()
    compiled = copy.deepcopy(eager).compile()
    gen = torch.Generator().manual_seed(6)
    ref, state = eager.new_state(), compiled.new_state()
    for T, keep in ((20, 20), (1, 1), (5, 2), (3, None), (4, 4)):
        ids = torch.randint(0, eager.config.vocab_size, (T,), generator=gen)
        want, got = eager(ids, ref)[0], compiled(ids, state)[0]
        assert (got - want).norm() / want.norm() < 3e-2, f"forward of {T} tokens"
        if T == 3:  # a pass on top of a staging, then drop both
            want, got = eager(ids[:2], ref)[0], compiled(ids[:2], state)[0]
            assert (got - want).norm() / want.norm() < 3e-2, "forward on a staging"
            ref.revert(), state.revert()
        else:
            ref.commit(keep), state.commit(keep)
    assert state.recurrent.state.dtype == torch.float32
    draft = random_model(DRAFT, seed=22).to(torch.bfloat16).fuse()
    prompt = torch.randint(0, compiled.config.vocab_size, (10,), generator=gen).tolist()
    assert generate(compiled, prompt, 32, ModelDrafter(draft), 4).token_ids == generate(compiled, prompt, 32).token_ids


@pytest.mark.xdist_group("compiled-moe")  # a graph of its own: free to run beside the module's other tests
def test_a_bfloat16_moe_target_compiles_its_experts_as_grouped_matmuls():
    """A sparse MoE target (Qwen3-Next, one GDN and one attention layer: one whole-model graph) with its experts as
    `torch._grouped_mm` in the graph (fixed shapes, no host sync): logits agree with the fused path, which loops over
    the experts, to bf16 rounding through decode, verify and commits; speculative output equals target-only. Every
    token takes every expert here: in bf16 two passes that round differently route differently at near-ties (a
    random 16-expert top-4 model's eager bf16 logits differ from its float32 ones by up to 29 %), and the grouped
    form against the loop is checked exactly in `test_moe.py`, empty groups included."""
    config = hf_moe_config("qwen3_next", num_experts=4, num_experts_per_tok=4, vocab_size=AWKWARD["vocab_size"],
                           layer_types=["linear_attention", "full_attention"])
    eager = random_model(config, seed=23).to(torch.bfloat16).fuse()
    compiled = copy.deepcopy(eager).compile()
    gen = torch.Generator().manual_seed(7)
    ref, state = eager.new_state(), compiled.new_state()
    for T, keep in ((20, 20), (1, 1), (5, 2), (3, None), (4, 4)):
        ids = torch.randint(0, config["vocab_size"], (T,), generator=gen)
        want, got = eager(ids, ref)[0], compiled(ids, state)[0]
        assert (got - want).norm() / want.norm() < 5e-2, f"forward of {T} tokens"
        ref.revert() if keep is None else ref.commit(keep)
        state.revert() if keep is None else state.commit(keep)
    draft = random_model(DRAFT, seed=24).to(torch.bfloat16).fuse()
    prompt = torch.randint(0, config["vocab_size"], (10,), generator=gen).tolist()
    assert generate(compiled, prompt, 24, ModelDrafter(draft), 4).token_ids == generate(compiled, prompt, 24).token_ids
