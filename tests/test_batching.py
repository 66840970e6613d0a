"""Batched rounds are exact: several sequences in one forward pass give each what it would get alone.

On a random hybrid config of its own (3 GDN layers and 1 attention layer, GDN value heads twice
the key heads, d_k != d_v, one KV head, untied embeddings) saved in HF layout:
- `forward_batch` equals one `model(ids, state)` call per item, logits, hidden states and every
  tensor of every state, for ragged T (1 to a 100-token prefill), different history lengths, a
  round already staged, a chained (marked) round, KV buffers that grow inside the batch; then
  through different commits, a revert and a second pass (also hypothesis-driven).
- `BatchedModel` from threads: target sessions with mixed k and prompt lengths, joining and
  leaving mid-run, give each its own target-only greedy tokens and HF `generate()`'s; an item with
  ids outside the vocabulary, or whose state the memory budget refuses, fails alone and its session
  goes on; a long prompt is prefilled in pieces between the rounds of decoding sessions, with the
  unbatched prefill's result; sampling stays distribution-exact (the G-test of
  test_sampling_lossless) and draws seed for seed what the unbatched loop draws.
- Over loopback gRPC with batching on: client-driven rounds of several sessions verified in one
  batch, one reverted while its neighbours commit, retries idempotent, stale versions refused; many
  concurrent `Generate` and client-driven streams (with a batched draft peer, and target-only)
  equal target-only, or in-process speculation seed for seed when sampling.
Each `BatchedModel` test also checks that batches of more than one item really ran (`stats.largest`).
Outputs and states are compared per token (per layer, per position) to a relative 1e-4: see REL.
"""
from __future__ import annotations

import functools
import gc
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from deltaspec.v1 import target_service_pb2 as pb
from deltaspec.draft_service import servicer as draft_servicer
from deltaspec.shared.decoding.batcher import BatchConfig, BatchedModel
from deltaspec.shared.decoding.drafters import NoDrafter
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.pipelined import decode_pipelined
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import Stats, decode, generate
from deltaspec.shared.decoding.target import TargetSession
from deltaspec.shared.errors import ResourceExhausted
from deltaspec.shared.model import fused
from deltaspec.shared.model.batched import forward_batch
from deltaspec.shared.model.checkpoint import hf_config, random_model, save_checkpoint
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer
from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server
from deltaspec.shared.state.pool import StatePool, attach
from deltaspec.shared.state.rollback import ModelState
from deltaspec.target_service import servicer as target_servicer
from test_model_vs_hf import hf_model
from test_pipelined import Counting
from test_rpc_support import refused, start, target_stub
from test_sampling_lossless import ALPHA, DRAFT as SMALL_DRAFT, PROMPT as SMALL_PROMPT, T1, TARGET as SMALL_TARGET
from test_sampling_lossless import p_values

CFG = hf_config(vocab_size=113, hidden_size=48, intermediate_size=96, num_attention_heads=3, num_key_value_heads=1,
                head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                linear_value_head_dim=12, tie_word_embeddings=False, eos_token_id=None,
                layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
TARGET = random_model(CFG, seed=21).fuse()  # what load_model returns for the saved checkpoint
LAYERS = random_model(CFG, seed=21)  # the same weights on the layer path (the reference forward)
DRAFT = random_model(CFG, seed=21)
with torch.no_grad():  # the draft: the target with 3% noise, so rounds see full, partial and zero acceptance
    for p in DRAFT.parameters():
        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.03 * p.abs().mean())
DRAFT.fuse()  # after the noise: fusing copies some weights (norms, decays)
# float32 rounding: packed matmuls of other shapes, a T = 1 step padded into the chunked form (measured up to 2e-5
# per token over random batches; a pass alone is not closer to a float64 run than the batched one)
REL = 1e-4
FAST = BatchConfig(max_batch=8, max_wait_ms=20.0, prefill_chunk=16)  # waits long enough that threads meet


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, CFG["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@functools.cache
def target_only(prompt: tuple[int, ...], n: int) -> list[int]:
    """Greedy target-only tokens, unbatched."""
    return generate(TARGET, list(prompt), n, None, 0).token_ids


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("batching")
    return save_checkpoint(TARGET, root / "target"), save_checkpoint(DRAFT, root / "draft")


@pytest.fixture(scope="module")
def hf_greedy(checkpoints) -> Callable[[list[int], int], list[int]]:
    hf = hf_model(checkpoints[0])

    def run(prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
    return run


def assert_batched(model: BatchedModel) -> None:
    """Some batch held more than one item."""
    assert model.stats.largest > 1, model.stats


def run_threads(fn: Callable, args: list) -> list:
    """`fn(arg)` for each arg, each in its own thread, all at once; results in order, the first error raised."""
    with ThreadPoolExecutor(len(args)) as pool:
        return [f.result() for f in [pool.submit(fn, a) for a in args]]


# ---- forward_batch against single calls ----


def assert_near(got: Tensor, want: Tensor) -> None:
    """Equal up to float32 rounding, row by row along the first axis (tokens, layers, positions)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    a, b = got.flatten(1).double(), want.flatten(1).double()
    err, scale = (a - b).norm(dim=1), b.norm(dim=1)
    assert bool((err <= REL * scale).all()), (err / scale.clamp_min(1e-30)).max().item()


def assert_same_state(got: ModelState, want: ModelState) -> None:
    """Lengths, flags and every tensor that holds the sequence (head, staging, logs, snapshot, K/V in use)."""
    assert (got.length, got.staged, got.marked, got.recurrent.logged) == (want.length, want.staged, want.marked,
                                                                      want.recurrent.logged)
    g, w = got.recurrent, want.recurrent
    pairs = [(g.conv, w.conv), (g.state, w.state)]
    if want.staged:
        pairs += [(g.window, w.window), (g.spare, w.spare)]
        if want.recurrent.logged:
            n = want.staged
            pairs += [(g.x[:, :n], w.x[:, :n]), (g.k[..., :n], w.k[..., :n]), (g.delta[:, :, :n], w.delta[:, :, :n]),
                      (g.g[:, :, :n], w.g[:, :, :n])]
    if want.marked:
        pairs += [(g.marked_window, w.marked_window), (g.marked_state, w.marked_state)]
    used = want.length + want.staged
    for a, b in zip(got.attn, want.attn, strict=True):  # by position
        pairs += [(a.k[:, :used].transpose(0, 1), b.k[:, :used].transpose(0, 1)),
                  (a.v[:, :used].transpose(0, 1), b.v[:, :used].transpose(0, 1))]
    for a, b in pairs:
        assert_near(a, b)


def assert_same_outputs(got: list[tuple[Tensor, Tensor]], want: list[tuple[Tensor, Tensor]]) -> None:
    assert len(got) == len(want)
    for (logits, hidden), (want_logits, want_hidden) in zip(got, want):
        assert logits.dtype == want_logits.dtype == torch.float32
        assert_near(logits, want_logits)
        assert_near(hidden, want_hidden)


@dataclass(frozen=True)
class Item:
    history: int  # tokens committed before the pass
    T: int  # tokens of the pass
    staged: int = 0  # tokens of a round staged before the pass (the pass starts that far into the staging)
    chained: bool = False  # those tokens are marked: the pass stages a chained round on them
    capacity: int = 256  # K/V buffer positions; less than history + staged + T makes them grow in the pass


def prepared(model: HybridLM, item: Item, seed: int, owner: HybridLM | BatchedModel | None = None
             ) -> tuple[Tensor, ModelState]:
    """The pass's ids and a state built by single calls as `item` says: same seed, same state, bit for bit.

    `owner` makes the state (a `BatchedModel` counts the sequences it serves)."""
    ids = torch.tensor(tokens(seed, item.history + item.staged + item.T))
    state = (owner or model).new_state(capacity=item.capacity)
    if item.history:
        model(ids[:item.history], state)
        state.commit(item.history)
    if item.staged:
        model(ids[item.history:item.history + item.staged], state)
        if item.chained:
            state.mark()
    return ids[item.history + item.staged:], state


ITEMS = [Item(0, 100), Item(6, 1), Item(40, 5), Item(3, 9, staged=4), Item(17, 3, staged=3, chained=True),
         Item(1, 3, capacity=4), Item(20, 70), Item(9, 9)]


def settle(states: list[ModelState]) -> None:
    """A different ending for each item of ITEMS: all of a long prefill, one, two, a part reaching into the
    earlier staging, the chained round's parent then one of its tokens, a revert, all of a second long one,
    everything."""
    states[0].commit(100)
    states[1].commit(1)
    states[2].commit(2)
    states[3].commit(7)
    states[4].commit_marked()
    states[4].commit(1)
    states[5].revert()
    states[6].commit(70)
    states[7].commit(9)


@pytest.mark.parametrize("model", [TARGET, LAYERS], ids=["fused", "layers"])
def test_forward_batch_equals_single_calls(model):
    batch = [prepared(model, item, seed) for seed, item in enumerate(ITEMS)]
    single = [prepared(model, item, seed) for seed, item in enumerate(ITEMS)]
    assert_same_outputs(forward_batch(model, batch), [model(ids, state) for ids, state in single])
    for (_, got), (_, want) in zip(batch, single):
        assert_same_state(got, want)
    settle([state for _, state in batch])
    settle([state for _, state in single])
    for (_, got), (_, want) in zip(batch, single):
        assert_same_state(got, want)
    # a second pass on the settled states (all lengths differ now), then everything committed
    more = [torch.tensor(tokens(100 + i, T)) for i, T in enumerate([1, 2, 3, 1, 4, 5, 2, 1])]
    got = forward_batch(model, [(ids, state) for ids, (_, state) in zip(more, batch)])
    assert_same_outputs(got, [model(ids, state) for ids, (_, state) in zip(more, single)])
    for (_, a), (_, b) in zip(batch, single):
        assert_same_state(a, b)
        a.commit(a.staged)
        b.commit(b.staged)
        assert_same_state(a, b)


passes = st.one_of(st.integers(1, 12), st.sampled_from([33, 64, 65, 90]))  # 64: the chunked kernel's chunk
item_specs = st.lists(st.tuples(st.integers(0, 40), passes, st.integers(0, 4), st.booleans(), st.integers(0, 16)),
                      min_size=2, max_size=5)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(specs=item_specs)
def test_forward_batch_random_batches(specs):
    """Random batches: history, T, a staged round (chained or not), how much each then commits (all of a
    staging too long to log)."""
    items = [Item(history, T, staged, chained and staged > 0) for history, T, staged, chained, _ in specs]
    batch = [prepared(TARGET, item, 1000 + seed) for seed, item in enumerate(items)]
    single = [prepared(TARGET, item, 1000 + seed) for seed, item in enumerate(items)]
    assert_same_outputs(forward_batch(TARGET, batch), [TARGET(ids, state) for ids, state in single])
    for (_, a), (_, b), item, (*_, keep) in zip(batch, single, items, specs):
        for s in (a, b):
            if item.chained:
                s.commit_marked()
            s.commit(min(keep, s.staged) if s.recurrent.logged else s.staged)
        assert_same_state(a, b)
    step = [torch.tensor(tokens(2000 + i, 1)) for i in range(len(items))]  # one decode step for all
    got = forward_batch(TARGET, [(ids, s) for ids, (_, s) in zip(step, batch)])
    assert_same_outputs(got, [TARGET(ids, s) for ids, (_, s) in zip(step, single)])
    for (_, a), (_, b) in zip(batch, single):
        assert_same_state(a, b)


# ---- BatchedModel from threads ----


def speculate(target, drafter_model, prompt: list[int], n: int, k: int, started: threading.Event | None = None,
              sampling: SamplingParams = SamplingParams(), loop=decode) -> tuple[list[int], Stats]:
    """An in-process loop on a TargetSession of `target` (`Counting`: it counts chained rounds); sets `started`
    once its first round is committed."""
    session = Counting(target, prompt, sampling)
    drafter = ModelDrafter(drafter_model, sampling)
    drafter.start(list(prompt))
    stats = Stats()
    for _ in loop(session, drafter, n, k, set(), stats):
        if started is not None:
            started.set()
    return session.generated, stats


# (prompt length, k, new tokens): different prompt lengths (one over the prefill chunk), zero-draft rounds
STREAMS = [(1, 0, 12), (5, 2, 20), (9, 4, 28), (23, 8, 16), (40, 2, 24), (70, 4, 14)]


@pytest.mark.parametrize("loop", [decode, decode_pipelined], ids=["serial", "pipelined"])
def test_threads_through_batched_model_equal_target_only_and_hf(hf_greedy, loop):
    """Six sessions, each started once the one before has committed a round (joining mid-run), finishing at
    different lengths (leaving mid-run); serial rounds, and pipelined ones (chained rounds staged on marked
    states, on the target and the draft, batched with plain ones)."""
    prompts = [tokens(50 + i, length) for i, (length, _, _) in enumerate(STREAMS)]
    started = [threading.Event() for _ in STREAMS]
    Counting.chained_rounds = 0
    with closing(BatchedModel(TARGET, FAST)) as target, closing(BatchedModel(DRAFT, FAST)) as draft:
        def stream(i: int) -> tuple[list[int], Stats]:
            if i:
                assert started[i - 1].wait(60)
            _, k, n = STREAMS[i]
            return speculate(target, draft, prompts[i], n, k, started[i], loop=loop)

        results = run_threads(stream, list(range(len(STREAMS))))
        assert_batched(target)
        assert_batched(draft)
    for prompt, (_, k, n), (out, stats) in zip(prompts, STREAMS, results):
        assert out == target_only(tuple(prompt), n) == hf_greedy(prompt, n)
        if k:
            assert stats.drafted > 0
    assert 0 < sum(s.accepted for _, s in results) < sum(s.drafted for _, s in results)
    assert (Counting.chained_rounds > 0) == (loop is decode_pipelined)


HOLD = 57  # tokens of the pass that holds the scheduler while other calls queue (one piece; no batch has as many)


def in_one_batch(model: BatchedModel, calls: list[tuple[Tensor, ModelState]], monkeypatch) -> list:
    """Each call from its own thread, made while the scheduler is held inside another pass, so that all of them
    queue and then run together; the results, or the errors raised, in order. Whether they did run together is
    for the caller to check (`stats.largest`): timing decides only whether the scenario happened.

    The batcher counts exactly these callers as active, so that the held pass is its own (queued, not run in a
    caller's thread) and no batch starts before every caller has queued, however slowly a loaded host wakes them."""
    real_layer, holding = fused.decoder_layer, threading.Barrier(len(calls) + 1, timeout=60)
    real_active = model._active

    def hold(layer, f, x, *rest):
        if x.shape[0] == HOLD and not holding.broken and holding.n_waiting == len(calls):
            holding.wait()  # every caller is about to call
            deadline = time.monotonic() + 30
            while len(model._queue) < len(calls) and time.monotonic() < deadline:  # and has queued its call (a
                time.sleep(0.001)  # fixed 50 ms was not always enough on a loaded host)
        return real_layer(layer, f, x, *rest)

    def call(i: int) -> tuple[Tensor, Tensor] | Exception:
        try:
            if i < 0:
                return model(torch.tensor(tokens(99, HOLD)), TARGET.new_state())
            holding.wait()
            return model(*calls[i])
        except Exception as e:  # noqa: BLE001 - the error is a result under test
            return e

    monkeypatch.setattr(fused, "decoder_layer", hold)
    monkeypatch.setattr(model, "_active", lambda: len(calls))
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call, i) for i in range(len(calls))]
        while holding.n_waiting < len(calls):
            time.sleep(0.001)
        call(-1)
        results = [f.result() for f in futures]
    monkeypatch.setattr(fused, "decoder_layer", real_layer)
    monkeypatch.setattr(model, "_active", real_active)
    return results


def test_failing_item_fails_alone(monkeypatch):
    """An item whose ids leave the vocabulary fails in its own caller when batched with others (and one with
    no ids at once): its own error, its state unchanged (the round it had staged included); the neighbours get
    what single calls give, and the failed session goes on, batched again, as if the call had never been made."""
    good = [Item(5, 3), Item(12, 1), Item(0, 7), Item(3, 2, staged=2)]
    failing = Item(4, 1, staged=2)  # a round staged already: the refusal must keep it
    singles = [prepared(TARGET, item, seed) for seed, item in enumerate(good)] + [prepared(TARGET, failing, 90)]
    want = [TARGET(ids, state) for ids, state in singles[:-1]]
    config = BatchConfig(max_batch=8, max_wait_ms=5.0)
    with closing(BatchedModel(TARGET, config)) as model:
        calls = [prepared(TARGET, item, seed, model) for seed, item in enumerate(good)]
        bad_state = prepared(TARGET, failing, 90, model)[1]
        calls.append((torch.tensor([1, CFG["vocab_size"], 2]), bad_state))
        results = in_one_batch(model, calls, monkeypatch)
        assert model.stats.largest >= len(calls), model.stats  # the failing item was batched with the others
        assert_same_outputs(results[:-1], want)
        assert isinstance(results[-1], ValueError) and "outside the vocabulary" in str(results[-1]), results[-1]
        for (_, got), (_, expected) in zip(calls, singles):
            assert_same_state(got, expected)
        with pytest.raises(ValueError, match="non-empty 1-D"):
            model(torch.tensor([], dtype=torch.long), bad_state)
        assert_same_state(bad_state, singles[-1][1])
        # one more step for everyone, the failed session included, batched again
        step = [(torch.tensor(tokens(95 + i, 1 + i % 2)), state) for i, (_, state) in enumerate(calls)]
        results = in_one_batch(model, step, monkeypatch)
        assert_same_outputs(results, [TARGET(ids, state) for (ids, _), (_, state) in zip(step, singles)])
        for (_, got), (_, expected) in zip(calls, singles):
            assert_same_state(got, expected)


def test_state_over_its_memory_budget_fails_alone(monkeypatch):
    """In a pooled model whose budget is all taken, a pass that would grow its sequence's K/V is refused
    (RESOURCE_EXHAUSTED) in its own caller, its state unchanged (its staged round kept), while its batch
    neighbours run; once another session ends, the same call goes through with the single call's result."""
    pooled = random_model(CFG, seed=21).fuse()  # TARGET's weights, with a pool of its own
    good = [Item(5, 3), Item(12, 1)]
    over = Item(248, 10, staged=2)  # 260 positions, paid for 256 with nothing left; a round staged already
    cfg = pooled.config
    attach(pooled, StatePool(cfg.state_spec, 3 * cfg.state_spec.bytes(pooled.dtype, 256)))
    singles = [prepared(TARGET, item, seed) for seed, item in enumerate(good)] + [prepared(TARGET, over, 7)]
    want = [TARGET(ids, state) for ids, state in singles]
    with closing(BatchedModel(pooled, BatchConfig(max_batch=8, max_wait_ms=5.0))) as model:
        calls = [prepared(pooled, item, seed, model) for seed, item in enumerate(good)]
        calls.append(prepared(pooled, over, 7, model))
        with pytest.raises(ResourceExhausted):
            model.new_state()
        results = in_one_batch(model, calls, monkeypatch)
        assert model.stats.largest >= len(calls), model.stats
        assert_same_outputs(results[:-1], want[:-1])
        assert isinstance(results[-1], ResourceExhausted) and results[-1].field == "state_memory", results[-1]
        untouched = prepared(TARGET, over, 7)[1]
        assert_same_state(calls[-1][1], untouched)
        del calls[0], results  # a session ends: its slot and K/V return (once the refusal's traceback is collected)
        gc.collect()
        assert_same_outputs([model(*calls[-1])], want[-1:])
        assert_same_state(calls[-1][1], singles[-1][1])


def test_long_input_failing_in_a_later_piece_changes_nothing():
    """A prompt run in pieces whose bad id sits in its second piece is refused whole, as one unbatched call
    refuses it: the first piece must not stay staged."""
    ids = torch.tensor([*tokens(96, 20), CFG["vocab_size"], *tokens(97, 10)])
    with closing(BatchedModel(TARGET, BatchConfig(max_batch=4, max_wait_ms=0.0, prefill_chunk=16))) as model:
        _, state = prepared(TARGET, Item(5, 1), 98, model)
        _, untouched = prepared(TARGET, Item(5, 1), 98)
        with pytest.raises((IndexError, ValueError)):
            TARGET(ids, untouched)  # unbatched: refused before anything is staged
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model(ids, state)
        assert_same_state(state, untouched)


def test_pass_failing_midway_gives_no_wrong_result(monkeypatch):
    """A batched pass that fails inside a layer (as an out-of-memory error would) after its first layers wrote
    their staging: every caller gets either an error or exactly its single-call result, never a result computed
    from what the failed pass left behind (an item with tokens already staged starts from those buffers)."""
    items = [Item(4, 3), Item(5, 2, staged=3), Item(9, 1, staged=2, chained=True)]
    singles = [prepared(TARGET, item, 60 + seed) for seed, item in enumerate(items)]
    want = [TARGET(ids, state) for ids, state in singles]
    real_layer, seen = fused.decoder_layer, []

    def fail_in_the_second_layer(layer, f, x, *rest):
        if x.shape[0] != HOLD:  # not the pass that holds the scheduler
            seen.append(x.shape[0])
            if len(seen) == 2:
                raise RuntimeError("injected: out of memory")
        return real_layer(layer, f, x, *rest)

    config = BatchConfig(max_batch=8, max_wait_ms=5.0)
    with closing(BatchedModel(TARGET, config)) as model:
        batch = [prepared(TARGET, item, 60 + seed, model) for seed, item in enumerate(items)]
        monkeypatch.setattr(fused, "decoder_layer", fail_in_the_second_layer)
        results = in_one_batch(model, batch, monkeypatch)
        assert model.stats.largest >= len(items) and seen[:2] == [sum(item.T for item in items)] * 2, model.stats
    for result, expected, (_, got), (_, single) in zip(results, want, batch, singles):
        if not isinstance(result, Exception):
            assert_same_outputs([result], [expected])
            assert_same_state(got, single)


def test_long_prefill_in_pieces_between_decoding_rounds():
    """A 150-token prompt is prefilled in 16-token pieces while two sessions decode: they commit rounds while
    the prompt is partly staged (not starved), and the prompt's logits, hidden states and state equal one
    unbatched prefill's."""
    long_ids = torch.tensor(tokens(70, 150))
    shorts = [tokens(71, 4), tokens(72, 11)]
    n = 60
    state = TARGET.new_state(capacity=300)
    seen: list[list[int]] = [[], []]  # the long state's staged count after each round of each short session
    with closing(BatchedModel(TARGET, FAST)) as model:
        running = [threading.Event(), threading.Event()]

        def short(i: int) -> list[int]:
            session = TargetSession(model, shorts[i])
            for _ in decode(session, NoDrafter(), n, 0, set(), Stats()):
                running[i].set()
                seen[i].append(state.staged)
            return session.generated

        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(short, i) for i in range(2)]
            assert all(e.wait(60) for e in running)
            logits, hidden = model(long_ids, state)
            outs = [f.result() for f in futures]
        assert_batched(model)
        assert model.config is TARGET.config and model.new_state().length == 0  # attributes reach the model
    for prompt, out, staged in zip(shorts, outs, seen):
        assert out == target_only(tuple(prompt), n)
        assert sum(0 < s < 150 for s in staged) >= 3, staged  # rounds committed between the prompt's pieces
    pieces = {s for staged in seen for s in staged if 0 < s < 150}
    assert len(pieces) >= 2 and all(s % FAST.prefill_chunk == 0 for s in pieces), pieces
    alone = TARGET.new_state(capacity=300)  # one unbatched call (its kernel chunks differ from the pieces)
    assert_same_outputs([(logits, hidden)], [TARGET(long_ids, alone)])
    assert_same_state(state, alone)
    state.commit(150)
    alone.commit(150)
    step = torch.tensor(tokens(73, 3))
    assert_same_outputs([TARGET(step, state)], [TARGET(step, alone)])


def test_batched_sampling_matches_target():
    """200 seeded sampled runs (k = 2, 3 tokens), eight at a time through batched target and draft: the
    first three tokens are distributed as the target draws them, and each run draws what it draws unbatched
    (draws are keyed by seed and position; batched logits differ from single ones by float rounding only)."""
    runs = 200
    config = BatchConfig(max_batch=8, max_wait_ms=5.0)
    with closing(BatchedModel(SMALL_TARGET, config)) as target, closing(BatchedModel(SMALL_DRAFT, config)) as draft:
        def run(seed: int) -> tuple[list[int], Stats]:
            s = SamplingParams(T1.temperature, T1.top_k, T1.top_p, seed)
            return speculate(target, draft, SMALL_PROMPT, 3, 2, sampling=s)

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(run, range(runs)))
        assert_batched(target)
        assert_batched(draft)
    drafted, accepted = sum(s.drafted for _, s in results), sum(s.accepted for _, s in results)
    assert 0 < accepted < drafted
    p = p_values(torch.tensor([out for out, _ in results]), T1)
    assert min(p) > ALPHA, p
    for seed in range(0, runs, 10):
        s = SamplingParams(T1.temperature, T1.top_k, T1.top_p, seed)
        assert results[seed][0] == speculate(SMALL_TARGET, SMALL_DRAFT, SMALL_PROMPT, 3, 2, sampling=s)[0], seed


# ---- over loopback gRPC ----


def batching_servers(checkpoints: tuple[Path, Path], config: BatchConfig, draft_peer: bool = True):
    """Draft and target services with batching on; the target's servicer (to read its model's stats)."""
    target_dir, draft_dir = checkpoints
    draft = draft_servicer.service(lambda: load_model(draft_dir), batching=config)
    d = start(draft)
    peer = target_servicer.DraftPeer(d.address, 10.0) if draft_peer else None
    target = target_servicer.service(lambda: (load_model(target_dir), load_tokenizer(target_dir)), draft=peer,
                                     batching=config)
    return d, start(target), target.load.__self__, draft.load.__self__


def test_client_driven_rounds_batched_over_grpc(checkpoints):
    """Three sessions verify each round at the same time (one batch): session 0 reverts every other round while
    the others commit; every Verify and Commit is sent twice (the retry returns the same answer), a stale base
    version is refused. Each session's tokens stay target-only's."""
    rounds, ks = 6, (2, 3, 4)
    prompts = [tokens(80 + i, length) for i, length in enumerate((3, 11, 26))]
    refs = [target_only(tuple(p), 32) for p in prompts]
    d, t, servicer, _ = batching_servers(checkpoints, BatchConfig(max_batch=4, max_wait_ms=50.0), draft_peer=False)
    with d, t:
        stub = target_stub(t.address)
        sids = [stub.CreateSession(pb.CreateSessionRequest(prompt_ids=p)).session_id for p in prompts]
        barrier = threading.Barrier(len(sids), timeout=60)

        def drive(s: int) -> list[int]:
            sid, ref, k, version, generated = sids[s], refs[s], ks[s], 0, []
            for r in range(rounds):
                drafts = ref[len(generated):len(generated) + k]
                if r % (k + 1) < k:  # a wrong draft at a different place each round (none at times)
                    drafts[r % (k + 1)] = (drafts[r % (k + 1)] + 1) % CFG["vocab_size"]
                verify = pb.VerifyRequest(session_id=sid, round_id=f"r{r}", base_version=version, draft_tokens=drafts)
                barrier.wait()
                answer = stub.Verify(verify)
                assert stub.Verify(verify) == answer  # a retry: the same answer, nothing staged twice
                barrier.wait()  # everyone verified: now one reverts while its neighbours commit
                if s == 0 and r % 2 == 0:
                    assert stub.Revert(pb.RevertRequest(session_id=sid, round_id=f"r{r}")).head_version == version
                    refused(lambda: stub.Verify(verify), grpc.StatusCode.FAILED_PRECONDITION, "round_id")
                    continue
                commit = pb.CommitRequest(session_id=sid, round_id=f"r{r}", accepted=answer.accepted)
                done = stub.Commit(commit)
                assert stub.Commit(commit) == done and done.head_version == version + 1
                assert list(done.committed_tokens) == ref[len(generated):len(generated) + answer.accepted + 1]
                generated += done.committed_tokens
                version = done.head_version
                stale = pb.VerifyRequest(session_id=sid, round_id=f"stale{r}", base_version=version - 1,
                                         draft_tokens=ref[len(generated):len(generated) + 1])
                refused(lambda: stub.Verify(stale), grpc.StatusCode.FAILED_PRECONDITION, "base_version")
            return generated

        results = run_threads(drive, list(range(len(sids))))
        for sid, ref, out in zip(sids, refs, results):
            seen = stub.GetSession(pb.GetSessionRequest(session_id=sid))
            assert list(seen.generated_ids) == out == ref[:len(out)] and not seen.HasField("pending_round")
        assert len(results[0]) >= rounds // 2 and all(len(out) >= rounds for out in results[1:])
        assert_batched(servicer.model)


def test_concurrent_generate_streams_over_grpc(checkpoints):
    """Ten streams at once through batched servers: server-side loops with the draft peer and target-only
    (k = 0) and client-driven loops, greedy ones equal to target-only, sampled ones (one of each loop) to
    unbatched in-process speculation with the same seed."""
    # (prompt length, k, new tokens, seed or None for greedy); the first six on the server, the rest client-driven
    streams = [(4, 0, 20, None), (7, 2, 24, None), (15, 4, 16, None), (2, 0, 28, None), (30, 6, 20, None),
               (9, 3, 24, 5), (6, 4, 20, None), (13, 2, 16, None), (5, 0, 12, None), (8, 3, 20, 6)]
    on_server = 6
    prompts = [tokens(90 + i, length) for i, (length, *_) in enumerate(streams)]
    d, t, target, draft = batching_servers(checkpoints, BatchConfig(max_batch=8, max_wait_ms=10.0))
    with d, t:
        def run(i: int) -> list[int]:
            _, k, n, seed = streams[i]
            sampling = SamplingParams() if seed is None else SamplingParams(0.9, 0, 0.95, seed)
            if i < on_server:
                return generate_on_server(t.address, prompts[i], "", n, k, sampling)[0].token_ids
            return generate_client_driven(t.address, d.address if k else None, prompts[i], "", n, k, sampling,
                                          draft_timeout_s=10.0)[0].token_ids

        results = run_threads(run, list(range(len(prompts))))
        assert_batched(target.model)
        assert_batched(draft.model)
    for prompt, (_, k, n, seed), out in zip(prompts, streams, results):
        if seed is None:
            assert out == target_only(tuple(prompt), n)
        else:
            sampling = SamplingParams(0.9, 0, 0.95, seed)
            assert out == generate(TARGET, prompt, n, ModelDrafter(DRAFT, sampling), k, sampling).token_ids


@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_in_process_drafters_inside_batched_generate(drafter, tmp_path):
    """`serve-target --draft mtp|ngram`: five Generate streams at once, each drafting in the target's process
    (the MTP head reads the batched verify passes' hidden states), every one equal to target-only."""
    from deltaspec.shared.decoding.drafters.mtp import random_mtp_weights

    model = random_model(CFG, seed=21)  # TARGET's weights, plus an MTP head
    model.mtp = random_mtp_weights(model.config, 1, seed=5)
    directory = save_checkpoint(model, tmp_path / "target")
    service = target_servicer.service(lambda: (load_model(directory), load_tokenizer(directory)),
                                      local_draft=drafter, batching=BatchConfig(max_batch=8, max_wait_ms=10.0))
    streams = [(5, 3, 24), (12, 4, 20), (3, 2, 28), (20, 4, 16), (8, 0, 20)]  # (prompt length, k, new tokens)
    prompts = [tokens(70 + i, length) for i, (length, _, _) in enumerate(streams)]
    with start(service) as t:
        results = run_threads(lambda i: generate_on_server(t.address, prompts[i], "", streams[i][2],
                                                           streams[i][1])[0].token_ids, list(range(len(streams))))
        assert_batched(service.load.__self__.model)
    for prompt, (_, _, n), out in zip(prompts, streams, results):
        assert out == target_only(tuple(prompt), n)


@pytest.mark.parametrize("kernel", ["naive", "triton"])
def test_forward_batch_through_the_general_kernel_path(kernel):
    """The path CUDA takes (`pick_kernel` on the padded `(B, T, H, D)` group: Triton, here under the interpreter)
    and the naive loop give what single calls with the default CPU kernels give."""
    model = random_model(CFG, seed=21).fuse()
    model.set_gdn_kernel(kernel)
    specs = [(10, 0, 1), (30, 0, 5), (7, 3, 5), (12, 2, 9)]  # (history, staged, T)

    def state_of(owner: HybridLM, history: int, staged: int, seed: int) -> ModelState:
        state = owner.new_state()
        owner(torch.tensor(tokens(seed, history)), state)
        state.commit(state.staged)
        if staged:
            owner(torch.tensor(tokens(seed + 1, staged)), state)
        return state

    ids = [torch.tensor(tokens(40 + n, T)) for n, (_, _, T) in enumerate(specs)]
    got = forward_batch(model, [(i, state_of(model, h, s, 10 * n)) for n, ((h, s, _), i) in enumerate(zip(specs, ids))])
    want = [TARGET(i, state_of(TARGET, h, s, 10 * n)) for n, ((h, s, _), i) in enumerate(zip(specs, ids))]
    assert_same_outputs(got, want)
