"""Chunked gated delta rule for prefill and multi-token verify.

Within a chunk of C tokens the corrections solve one unit-lower-triangular system
(the UT/WY form of the DeltaNet paper): with G the in-chunk cumulative log decay,

    (I + L) delta = beta * (v - exp(G) * (k S0)),   L[t, s] = beta_t exp(G_t - G_s) k_t.k_s  (s < t)
    o_t  = exp(G_t) q_t S0 + sum_{s<=t} exp(G_t - G_s) (q_t.k_s) delta_s
    S_C  = exp(G_C) S0 + sum_s exp(G_C - G_s) k_s delta_s^T

so a chunk costs a few small matmuls and one triangular solve instead of C dependent steps. Where the decay is
per key channel (KDA: g `(..., T, H, Dk)`), exp(G) scales k's and q's channels and the pairs' decays are
`decay_scan.pair_decays`' `(Dk, C, C)` ones.
The solve reads only the strict lower triangle (`unitriangular`), so L needs no diagonal mask,
and exp(G_t - G_s) is zeroed above the diagonal by a -inf fill before the exp: few ops, since a
verify pass of a handful of tokens is dispatch-bound. Same contract as
`naive_recurrent_gated_delta_rule`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from deltaspec.shared.kernels.decay_scan import decayed_scores, pair_decays

CHUNK_SIZE = 64


def one_chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk in heads-first layout: float32 `(..., H, C, D)` q, k, v, `(..., H, C)` beta, g `(..., H, C)` (a
    decay per head) or `(..., H, C, Dk)` (per key channel: KDA), `(..., H, Dk, Dv)` state; returns (out, delta,
    state after), heads first. The fused path calls it directly for a verify pass."""
    G = (g if g.dim() == k.dim() else g[..., None]).cumsum(-2)  # (..., H, C, Dk|1)
    decay = pair_decays(G)  # exp(G_t - G_s) for s <= t, per head or per key channel
    exp_G = G.exp()
    # the solve ignores L's diagonal (unit)
    L = decayed_scores(k, k, decay) * beta[..., :, None]
    rhs = beta[..., None] * (v - _read(k, exp_G, state))  # (B, H, C, Dv)
    delta = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    out = _read(q, exp_G, state) + decayed_scores(q, k, decay) @ delta
    last = G[..., -1:, :]  # (..., H, 1, Dk|1)
    state = last.transpose(-1, -2).exp() * state + (k * (last - G).exp()).transpose(-1, -2) @ delta
    return out, delta, state


def _read(x: Tensor, exp_G: Tensor, state: Tensor) -> Tensor:
    """x_t read from the decayed state, exp(G_t) x_t S0: the decay after the matmul where it is one number per row."""
    return exp_G * (x @ state) if exp_G.shape[-1] == 1 else (x * exp_G) @ state


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor, chunk_size: int = CHUNK_SIZE
) -> tuple[Tensor, Tensor, Tensor]:
    # work in (B, H, T, D) float32
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))  # (B, H, T[, Dk])
    state = initial_state.float()
    outs, deltas = [], []
    for start in range(0, q.shape[2], chunk_size):
        sl = slice(start, start + chunk_size)
        out, delta, state = one_chunk_gated_delta_rule(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl], state)
        outs.append(out)
        deltas.append(delta)
    out, delta = (xs[0] if len(xs) == 1 else torch.cat(xs, dim=2) for xs in (outs, deltas))
    return out.transpose(1, 2), delta.transpose(1, 2), state
