"""The Triton closed-form commit against the sequential recurrence and against `RecurrentStates.prepare_commit` (under
TRITON_INTERPRET=1 on the CPU), for one sequence and for many slots with their own counts."""
from __future__ import annotations

import pytest
import torch

from deltaspec.shared.kernels.triton_commit import commit_states
from deltaspec.shared.model.checkpoint import hf_config, random_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def logs(S: int, L: int, H: int, Dk: int, Dv: int, C: int, seed: int, per_key: bool = False) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    recurrent = torch.randn(S, L, H, Dk, Dv, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(S, L, H, Dk, C, generator=gen), dim=3)
    delta = torch.randn(S, L, H, C, Dv, generator=gen)
    g = -torch.rand(S, L, H, *((Dk,) if per_key else ()), C, generator=gen) * 3
    return tuple(x.to(DEVICE) for x in (recurrent, k, delta, g))


def sequential(s0: torch.Tensor, k: torch.Tensor, delta: torch.Tensor, g: torch.Tensor, n: int) -> torch.Tensor:
    """S_t = D(g_t) S_{t-1} + k_t delta_t^T, token by token: the definition the closed form sums up (D a number per
    head, or a row scale per key channel where g has one more axis than k's heads)."""
    state = s0.clone()
    for t in range(n):
        decay = g[..., t, None].exp() if g.dim() == k.dim() else g[..., t, None, None].exp()
        state = state * decay + k[..., :, t, None] * delta[..., t, None, :]
    return state


@pytest.mark.parametrize("shape", [(3, 2, 3, 12, 20, 9), (2, 1, 1, 8, 8, 4), (4, 3, 2, 16, 24, 17)],
                         ids=lambda s: "S{}-L{}-H{}-Dk{}-Dv{}-C{}".format(*s))
def test_many_slots_each_with_its_count(shape):
    S, L, H, Dk, Dv, C = shape
    recurrent, k, delta, g = logs(*shape, seed=sum(shape))
    slots, counts = [S - 1, 0], [C, C // 2]
    before = recurrent.clone()
    out = torch.full_like(recurrent, 7.0)
    commit_states(recurrent, k, delta, g, out, slots, counts)
    for slot, n in zip(slots, counts):
        want = sequential(recurrent[slot], k[slot], delta[slot], g[slot], n)
        torch.testing.assert_close(out[slot], want, atol=1e-5, rtol=1e-5)
    untouched = [s for s in range(S) if s not in slots]
    assert (out[untouched] == 7.0).all() and torch.equal(recurrent, before)


@pytest.mark.parametrize("shape", [(3, 2, 3, 12, 20, 9), (2, 1, 2, 16, 8, 5)],
                         ids=lambda s: "S{}-L{}-H{}-Dk{}-Dv{}-C{}".format(*s))
def test_a_decay_per_key_channel(shape):
    """KDA's logs: g `(.., Dk, C)`, each key channel's row of the state decayed by its own sum, strong decays that
    would overflow exp(-G) included."""
    S, L, H, Dk, Dv, C = shape
    recurrent, k, delta, g = logs(*shape, seed=sum(shape), per_key=True)
    g[..., 0, :] *= 20  # a channel that forgets almost at once
    slots, counts = [0, S - 1], [C, 1]
    out = torch.full_like(recurrent, 7.0)
    commit_states(recurrent, k, delta, g, out, slots, counts)
    for slot, n in zip(slots, counts):
        torch.testing.assert_close(out[slot], sequential(recurrent[slot], k[slot], delta[slot], g[slot], n),
                                   atol=1e-5, rtol=1e-5)


def test_zero_tokens_keeps_the_state_and_in_place_works():
    recurrent, k, delta, g = logs(2, 2, 2, 8, 12, 5, seed=3)
    want = [sequential(recurrent[s], k[s], delta[s], g[s], n) for s, n in ((0, 0), (1, 3))]
    commit_states(recurrent, k, delta, g, recurrent, [0, 1], [0, 3])
    for s in range(2):
        torch.testing.assert_close(recurrent[s], want[s], atol=1e-5, rtol=1e-5)


def test_equals_prepare_commit_on_a_real_staging():
    """A model's verify pass logs 7 tokens; keeping any n of them gives the state `prepare_commit` computes."""
    model = random_model(hf_config(linear_key_head_dim=12, linear_value_head_dim=20), seed=4).to(DEVICE)
    state = model.new_state()
    model(torch.arange(5, device=DEVICE) % 97, state)
    state.commit(5)
    model(torch.arange(7, device=DEVICE) * 3 % 97, state)
    gdn = state.recurrent
    for n in range(8):
        gdn.mark(n, 7)  # the snapshot after n of the 7: prepare_commit's closed form (the staged state itself at 7)
        want = gdn.marked_state
        got = commit_states(gdn.state[None], gdn.k[None], gdn.delta[None], gdn.g[None],
                            torch.empty_like(gdn.state)[None], [0], [n])[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_refuses_what_it_cannot_commit():
    recurrent, k, delta, g = logs(1, 1, 1, 8, 8, 4, seed=5)
    with pytest.raises(ValueError, match=r"counts in 0..4"):
        commit_states(recurrent, k, delta, g, recurrent.clone(), [0], [5])
    with pytest.raises(ValueError, match=r"slots in 0..0"):
        commit_states(recurrent, k, delta, g, recurrent.clone(), [1], [2])
    with pytest.raises(ValueError, match="delta: expected a contiguous float32"):
        commit_states(recurrent, k, delta.transpose(-1, -2), g, recurrent.clone(), [0], [0])
