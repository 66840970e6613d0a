"""The Triton recurrent kernel against the naive float32 loop (under TRITON_INTERPRET=1 on CPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaspec.shared.kernels.naive import naive_recurrent_gated_delta_rule
from deltaspec.shared.kernels.triton_recurrent import fused_recurrent_gated_delta_rule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (B, T, H, Dk, Dv): awkward on purpose; Dv=20 spans three masked 8-wide value blocks.
SHAPES = [
    (1, 1, 1, 8, 8),
    (2, 1, 3, 12, 20),
    (1, 5, 3, 8, 20),
    (2, 5, 1, 12, 8),
    (1, 9, 1, 12, 20),
    (2, 9, 3, 8, 8),
]


def _inputs(B: int, T: int, H: int, Dk: int, Dv: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1234 + B * 1000 + T * 100 + H * 10 + Dk + Dv)
    q = F.normalize(torch.randn(B, T, H, Dk, generator=gen), dim=-1) * Dk**-0.5
    k = F.normalize(torch.randn(B, T, H, Dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, Dv, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 2
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, Dk, Dv, generator=gen)
    q, k, v, g, beta = (x.to(DEVICE, dtype) for x in (q, k, v, g, beta))
    return q, k, v, g, beta, state.to(DEVICE)


def _check(args: tuple[torch.Tensor, ...]) -> None:
    initial_state = args[-1]
    before = initial_state.clone()
    got = fused_recurrent_gated_delta_rule(*args)
    want = naive_recurrent_gated_delta_rule(*args)
    for name, a, b in zip(("out", "delta", "final_state"), got, want):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(initial_state, before), "initial_state was modified"
    assert got[2].data_ptr() != initial_state.data_ptr()


@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{b}-T{t}-H{h}-Dk{dk}-Dv{dv}" for b, t, h, dk, dv in SHAPES])
def test_matches_naive(shape: tuple[int, int, int, int, int]) -> None:
    _check(_inputs(*shape))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_inputs_match_naive(dtype: torch.dtype) -> None:
    _check(_inputs(2, 5, 3, 12, 20, dtype))


def test_non_contiguous_inputs() -> None:
    q, k, v, g, beta, state = _inputs(2, 5, 3, 12, 20)
    # Same values, transposed storage: [B, H, T, D] memory viewed as [B, T, H, D].
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (g, beta))
    state = state.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not q.is_contiguous() and not g.is_contiguous() and not state.is_contiguous()
    _check((q, k, v, g, beta, state))
