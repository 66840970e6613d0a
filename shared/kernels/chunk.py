"""Chunked gated delta rule for prefill and multi-token verify.

Within a chunk of C tokens the corrections solve one unit-lower-triangular system
(the UT/WY form of the DeltaNet paper): with G the in-chunk cumulative log decay,

    (I + L) delta = beta * (v - exp(G) * (k S0)),   L[t, s] = beta_t exp(G_t - G_s) k_t.k_s  (s < t)
    o_t  = exp(G_t) q_t S0 + sum_{s<=t} exp(G_t - G_s) (q_t.k_s) delta_s
    S_C  = exp(G_C) S0 + sum_s exp(G_C - G_s) k_s delta_s^T

so a chunk costs a few small matmuls and one triangular solve instead of C dependent steps.
The solve reads only the strict lower triangle (`unitriangular`), so L needs no diagonal mask,
and exp(G_t - G_s) is zeroed above the diagonal by a -inf fill before the exp: few ops, since a
verify pass of a handful of tokens is dispatch-bound. Same contract as
`naive_recurrent_gated_delta_rule`.
"""
from __future__ import annotations

import torch
from torch import Tensor

CHUNK_SIZE = 64


def one_chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk in heads-first layout: float32 `(..., H, C, D)` q, k, v, `(..., H, C)` g and beta, `(..., H, Dk, Dv)`
    state; returns (out, delta, state after), heads first. The fused path calls it directly for a verify pass."""
    G = g.cumsum(-1)  # (B, H, C)
    exp_G = G.exp()[..., None]
    # exp(G_t - G_s) for s <= t, exactly 0 above the diagonal (where it may overflow to inf: tril_ selects, not multiplies)
    decay = (G[..., :, None] - G[..., None, :]).exp_().tril_()
    L = (k @ k.transpose(-1, -2)) * decay * beta[..., :, None]  # its diagonal is ignored by the unit solve
    rhs = beta[..., None] * (v - exp_G * (k @ state))  # (B, H, C, Dv)
    delta = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    out = exp_G * (q @ state) + ((q @ k.transpose(-1, -2)) * decay) @ delta
    last = G[..., -1:]
    state = last[..., None].exp() * state + (k * (last - G).exp()[..., None]).transpose(-1, -2) @ delta
    return out, delta, state


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor, chunk_size: int = CHUNK_SIZE
) -> tuple[Tensor, Tensor, Tensor]:
    # work in (B, H, T, D) float32
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))  # (B, H, T)
    state = initial_state.float()
    outs, deltas = [], []
    for start in range(0, q.shape[2], chunk_size):
        sl = slice(start, start + chunk_size)
        out, delta, state = one_chunk_gated_delta_rule(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl], state)
        outs.append(out)
        deltas.append(delta)
    out, delta = (xs[0] if len(xs) == 1 else torch.cat(xs, dim=2) for xs in (outs, deltas))
    return out.transpose(1, 2), delta.transpose(1, 2), state
