"""The Triton verify kernel logging k, delta and g itself (under TRITON_INTERPRET=1 on the CPU): against the naive loop,
writing exactly its members' log slots; and wired into the layer, fused and batched passes (one sequence, its own or a
pool slot; a batch of pool slots with their own offsets and counts, padding, and one whose staging outgrows its logs),
which must stage and commit what the same passes with the naive kernel and copied logs do."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from deltaspec.shared.kernels import VerifyLogs
from deltaspec.shared.kernels.naive import naive_recurrent_gated_delta_rule
from deltaspec.shared.kernels.triton_recurrent import fused_recurrent_gated_delta_rule
from deltaspec.shared.state import access
from deltaspec.shared.model.batched import forward_batch
from deltaspec.shared.model.checkpoint import hf_config, random_model
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.state.pool import StatePool, attach
from deltaspec.shared.state.rollback import RecurrentSlot, ModelState

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {"atol": 1e-5, "rtol": 1e-5}

# (B, T, H, Dk, Dv, slots S, layers L, capacity C, layer, members as (slot, offset, count)): rows S x L, some unused;
# counts 0 and short of T (a batch's padding); Dv 20 and 13 end in a masked value block
CASES = [
    (1, 1, 1, 8, 8, 2, 1, 4, 0, [(1, 3, 1)]),
    (3, 5, 3, 12, 20, 4, 2, 9, 1, [(2, 4, 5), (0, 0, 3), (3, 2, 0)]),
    (4, 4, 2, 16, 13, 5, 3, 6, 2, [(4, 2, 4), (1, 0, 2), (0, 5, 1), (2, 0, 0)]),
]


def _inputs(B: int, T: int, H: int, Dk: int, Dv: int, gen: torch.Generator) -> tuple[Tensor, ...]:
    q = F.normalize(torch.randn(B, T, H, Dk, generator=gen), dim=-1) * Dk**-0.5
    k = F.normalize(torch.randn(B, T, H, Dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, Dv, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 2 - 0.01
    beta = torch.rand(B, T, H, generator=gen) * 0.9 + 0.05
    state = torch.randn(B, H, Dk, Dv, generator=gen)
    return tuple(x.to(DEVICE) for x in (q, k, v, g, beta, state))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-T{}-H{}-Dk{}-Dv{}-S{}-L{}-C{}".format(*c[:8]))
def test_logs_its_members_tokens_and_nothing_else(case):
    B, T, H, Dk, Dv, S, L, C, layer, members = case
    gen = torch.Generator().manual_seed(sum(case[:8]))
    q, k, v, g, beta, state = args = _inputs(B, T, H, Dk, Dv, gen)
    fill = [torch.randn(shape, generator=gen).to(DEVICE) for shape in ((S * L, H, Dk, C), (S * L, H, C, Dv),
                                                                        (S * L, H, C))]
    log_k, log_delta, log_g = (t.clone() for t in fill)
    where = torch.tensor([[s * L for s, _, _ in members], [o for _, o, _ in members], [n for _, _, n in members]],
                         dtype=torch.int32, device=DEVICE)
    out, delta, final = fused_recurrent_gated_delta_rule(*args, VerifyLogs(log_k, log_delta, log_g, where, layer))

    want = naive_recurrent_gated_delta_rule(*args)
    for name, got, expected in zip(("out", "delta", "final_state"), (out, delta, final), want):
        torch.testing.assert_close(got, expected, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    for got, plain in zip((out, delta, final), fused_recurrent_gated_delta_rule(*args)):
        assert torch.equal(got, plain), "logging changed the arithmetic"
    want_k, want_delta, want_g = (t.clone() for t in fill)  # the fill, with each member's logged tokens
    for b, (slot, offset, n) in enumerate(members):
        row, cols = slot * L + layer, slice(offset, offset + n)
        want_k[row, :, :, cols] = k[b, :n].permute(1, 2, 0)
        want_delta[row, :, cols] = delta[b, :n].transpose(0, 1)
        want_g[row, :, cols] = g[b, :n].t()
    for name, got, expected in (("k", log_k, want_k), ("delta", log_delta, want_delta), ("g", log_g, want_g)):
        assert torch.equal(got, expected), f"log {name}: {(got != expected).nonzero().tolist()[:8]}"


def test_refuses_logs_of_the_wrong_shape():
    args = _inputs(2, 3, 2, 8, 12, torch.Generator().manual_seed(0))
    k, delta, g = (torch.zeros(shape, device=DEVICE) for shape in ((4, 2, 8, 6), (4, 2, 6, 12), (4, 2, 6)))
    where = torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"logs.delta: expected a contiguous torch.float32 \(4, 2, 6, 12\)"):
        fused_recurrent_gated_delta_rule(*args, VerifyLogs(k, delta.transpose(-1, -2), g, where, 0))
    with pytest.raises(ValueError, match=r"logs.members: expected a contiguous torch.int32 \(3, 2\)"):
        fused_recurrent_gated_delta_rule(*args, VerifyLogs(k, delta, g, where[:, :1], 0))


# ---- wired into the passes: the Triton kernel logging, against the naive kernel and copied logs ----

CFG = hf_config(vocab_size=61, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                linear_value_head_dim=12, tie_word_embeddings=False, eos_token_id=None,
                layer_types=["linear_attention", "full_attention", "linear_attention"])
STATE_NAMES = ("conv", "window", "state", "spare", "x", "k", "delta", "g")


def tokens(seed: int, n: int) -> Tensor:
    return torch.randint(0, CFG["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def model_pair(fuse: bool, slots: int = 0, log_capacity: int = 8) -> list[tuple[HybridLM, str]]:
    """The same random model twice, the first forced to the Triton kernel, the second to the naive loop; with
    `slots`, each has a pool of its own, filled with the same random values (a slot is zeroed when taken)."""
    pair: list[tuple[HybridLM, str]] = []
    for kernel in ("triton", "naive"):
        model = random_model(CFG, seed=7).fuse(fuse).to(DEVICE)
        if slots:
            cfg, dtype = model.config, model.dtype
            budget = slots * cfg.state_spec.bytes(dtype, 256, log_capacity)
            pool = StatePool(cfg.state_spec, budget, slots, DEVICE, dtype, log_capacity)
            gen = torch.Generator().manual_seed(11)
            for t in pool.tensors.values():
                t.copy_(torch.randn(t.shape, generator=gen))
            attach(model, pool)
        pair.append((model, kernel))
    return pair


def prepare(model: HybridLM, history: int, staged: int, seed: int) -> ModelState:
    """A state with `history` tokens committed and `staged` more staged, by the default (CPU: chunked) kernel."""
    model.set_gdn_kernel("auto")
    state = model.new_state()
    ids = tokens(seed, history + staged).to(DEVICE)
    model(ids[:history], state)
    state.commit(history)
    if staged:
        model(ids[history:], state)
    return state


def buffers(model: HybridLM, state: ModelState) -> dict[str, Tensor]:
    """Every GDN buffer of the state: its pool's, all slots (so other slots' and rows' too), or its own."""
    pool = getattr(model, "state_pool", None)
    return dict(pool.tensors) if pool is not None else {name: getattr(state.recurrent, name) for name in STATE_NAMES}


def assert_same(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture
def kernel_logged(monkeypatch) -> list[bool]:
    """Whether the Triton kernel got logs to write: at each layer of a single-sequence pass, once a pass for a batch's
    group."""
    seen: list[bool] = []

    def spy(wrapped):
        def run(*args, **kwargs):
            logs = wrapped(*args, **kwargs)
            seen.append(logs is not None)
            return logs
        return run
    monkeypatch.setattr(RecurrentSlot, "verify_logs", spy(RecurrentSlot.verify_logs))
    monkeypatch.setattr(access, "verify_logs", spy(access.verify_logs))
    return seen


@pytest.mark.parametrize("pooled", [False, True], ids=["own", "pool-slot"])
@pytest.mark.parametrize("fuse", [False, True], ids=["layers", "fused"])
def test_one_sequence_stages_and_commits_as_with_copied_logs(fuse, pooled, kernel_logged):
    """A round at offset 0, a chained one on top (offset 3), then a partial commit into both."""
    states = []
    for model, kernel in model_pair(fuse, slots=3 if pooled else 0):
        first = model.new_state() if pooled else None  # the sequence takes the pool's second slot: rows L.. of it
        state = prepare(model, 6, 0, seed=1)
        model.set_gdn_kernel(kernel)
        outputs = [model(tokens(seed, T).to(DEVICE), state) for seed, T in ((2, 3), (3, 4))]
        staged = {name: t.clone() for name, t in buffers(model, state).items()}
        state.commit(5)
        states.append((outputs, staged, buffers(model, state), state, first))
    (got_out, got_staged, got_head, got, _), (want_out, want_staged, want_head, want, _) = states
    assert kernel_logged == [True] * 4  # 2 GDN layers x 2 passes
    for (logits, hidden), (want_logits, want_hidden) in zip(got_out, want_out):
        torch.testing.assert_close(logits, want_logits, **TOL)
        torch.testing.assert_close(hidden, want_hidden, **TOL)
    assert_same(got_staged, want_staged)
    assert_same(got_head, want_head)
    assert (got.length, got.staged, got.recurrent.logged) == (want.length, want.staged, want.recurrent.logged) == (11, 0, True)


def test_batch_of_pool_slots_stages_and_commits_as_with_copied_logs(kernel_logged):
    """Four slots of one pool (logs of 8 tokens, one slot unused) in one pass, made in another order than the batch's:
    offsets 0, 2, 6, 0 and 4, 2, 3, 1 tokens (padding to 4); the third outgrows its logs (6 + 3 > 8) and logs
    nothing. Then partial commits reading the kernel's logs, and full ones."""
    # (history, staged before the pass, tokens of the pass, commit after it), in batch order
    items = [(5, 0, 4, 3), (3, 2, 2, 3), (4, 6, 3, 9), (2, 0, 1, 1)]
    made_in = [2, 0, 3, 1]
    runs = []
    for model, kernel in model_pair(fuse=True, slots=5):
        states: list[ModelState | None] = [None] * len(items)
        for i in made_in:
            history, staged, _, _ = items[i]
            states[i] = prepare(model, history, staged, seed=10 + i)
        model.set_gdn_kernel(kernel)
        batch = [(tokens(20 + i, T).to(DEVICE), st) for i, ((_, _, T, _), st) in enumerate(zip(items, states))]
        outputs = forward_batch(model, batch)
        staged_buffers = {name: t.clone() for name, t in buffers(model, states[0]).items()}
        flags = [st.recurrent.logged for st in states]
        for (_, _, _, n), st in zip(items, states):
            st.commit(n)
        runs.append((outputs, staged_buffers, flags, buffers(model, states[0]), states))
    (got_out, got_staged, got_flags, got_head, got), (want_out, want_staged, want_flags, want_head, want) = runs
    assert kernel_logged == [True]  # one group: made at its first GDN layer, used at both
    assert got_flags == want_flags == [True, True, False, True]
    for (logits, hidden), (want_logits, want_hidden) in zip(got_out, want_out):
        torch.testing.assert_close(logits, want_logits, **TOL)
        torch.testing.assert_close(hidden, want_hidden, **TOL)
    assert_same(got_staged, want_staged)
    assert_same(got_head, want_head)
    assert [st.length for st in got] == [st.length for st in want] == [8, 6, 13, 3]
