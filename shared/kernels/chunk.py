"""Chunked gated delta rule for prefill and multi-token verify.

Within a chunk of C tokens the corrections solve one unit-lower-triangular system
(the UT/WY form of the DeltaNet paper): with G the in-chunk cumulative log decay,

    (I + L) delta = beta * (v - exp(G) * (k S0)),   L[t, s] = beta_t exp(G_t - G_s) k_t.k_s  (s < t)
    o_t  = exp(G_t) q_t S0 + sum_{s<=t} exp(G_t - G_s) (q_t.k_s) delta_s
    S_C  = exp(G_C) S0 + sum_s exp(G_C - G_s) k_s delta_s^T

so a chunk costs a few small matmuls and one triangular solve instead of C dependent steps.
Same contract as `naive_recurrent_gated_delta_rule`.
"""
from __future__ import annotations

import torch
from torch import Tensor


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor, chunk_size: int = 64
) -> tuple[Tensor, Tensor, Tensor]:
    # work in (B, H, T, D) float32
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))  # (B, H, T)
    state = initial_state.float()
    T = q.shape[2]
    out = torch.empty_like(v)
    delta = torch.empty_like(v)
    for start in range(0, T, chunk_size):
        sl = slice(start, min(start + chunk_size, T))
        qc, kc, vc, bc = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]
        G = g[:, :, sl].cumsum(-1)  # (B, H, C)
        C = G.shape[-1]
        decay = (G[..., :, None] - G[..., None, :]).tril().exp().tril()  # (B, H, C, C), exp(G_t - G_s) for s <= t
        strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
        L = (bc[..., :, None] * decay * (kc @ kc.transpose(-1, -2))).masked_fill(~strict, 0.0)
        rhs = bc[..., None] * (vc - G.exp()[..., None] * (kc @ state))  # (B, H, C, Dv)
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        dc = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
        scores = (qc @ kc.transpose(-1, -2)) * decay  # decay is already zero above the diagonal
        out[:, :, sl] = G.exp()[..., None] * (qc @ state) + scores @ dc
        delta[:, :, sl] = dc
        state = G[..., -1:, None].exp() * state + (kc * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2) @ dc
    return out.transpose(1, 2), delta.transpose(1, 2), state
