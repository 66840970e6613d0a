"""Every gated delta rule path against the naive float32 loop, on fresh random inputs and awkward sizes."""
import pytest
import torch

from deltaspec.shared.kernels.chunk import chunk_gated_delta_rule
from deltaspec.shared.kernels.naive import naive_recurrent_gated_delta_rule
from deltaspec.shared.kernels.recurrent import recurrent_gated_delta_rule


def random_inputs(B, T, H, Dk, Dv, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, Dk, generator=gen), dim=-1) * Dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, Dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, Dv, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 3
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, Dk, Dv, generator=gen)
    return q, k, v, g, beta, state


def rel_rms(a, b):
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


SHAPES = [(1, 1, 1, 8, 8), (2, 63, 3, 12, 20), (1, 75, 4, 16, 10), (1, 9, 2, 60, 100), (2, 130, 2, 8, 8)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-T{}-H{}-Dk{}-Dv{}".format(*s))
@pytest.mark.parametrize("path", ["chunk64", "chunk16", "recurrent"])
def test_paths_match_naive(shape, path):
    inputs = random_inputs(*shape, seed=sum(shape))
    before = inputs[-1].clone()
    ref = naive_recurrent_gated_delta_rule(*inputs)
    if path == "recurrent":
        got = recurrent_gated_delta_rule(*inputs)
    else:
        got = chunk_gated_delta_rule(*inputs, chunk_size=int(path[5:]))
    for name, a, b in zip(("out", "delta", "state"), got, ref):
        assert rel_rms(a, b) < 1e-5, name
    assert torch.equal(inputs[-1], before), "the initial state must not be modified"


def test_naive_matches_hf_reference():
    """An outside reference: HF transformers' own torch recurrence (it normalises q and k itself)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    B, T, H, Dk, Dv = 1, 17, 2, 12, 20
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(B, T, H, Dk, generator=gen), torch.randn(B, T, H, Dk, generator=gen)
    v, g, beta = torch.randn(B, T, H, Dv, generator=gen), -torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, Dk, Dv, generator=gen)
    ref_out, ref_state = torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    from deltaspec.shared.model.norms import l2norm

    out, _, final = naive_recurrent_gated_delta_rule(l2norm(q) * Dk**-0.5, l2norm(k), v, g, beta, state)
    assert rel_rms(out, ref_out) < 1e-5 and rel_rms(final, ref_state) < 1e-5


def test_closed_form_prefix_state_matches_trajectory():
    """S after any prefix a is exp(G_a) S0 + sum_t exp(G_a - G_t) k_t delta_t^T (the algebra rollback rests on)."""
    q, k, v, g, beta, state = random_inputs(1, 9, 3, 10, 14, seed=3)
    _, delta, _ = chunk_gated_delta_rule(q, k, v, g, beta, state)
    for a in range(9):
        _, _, want = naive_recurrent_gated_delta_rule(q[:, : a + 1], k[:, : a + 1], v[:, : a + 1],
                                                      g[:, : a + 1], beta[:, : a + 1], state)
        G = g[0, : a + 1].cumsum(0)  # (a+1, H)
        got = G[-1].exp()[:, None, None] * state[0] + torch.einsum(
            "th,thk,thv->hkv", (G[-1] - G).exp(), k[0, : a + 1], delta[0, : a + 1])
        assert (got - want[0]).abs().max() < 1e-5
