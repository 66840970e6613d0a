"""Naive gated delta rule: a float32 token-by-token loop, the source of truth for every fast path.

Layout everywhere: q, k `[B, T, H, Dk]`, v `[B, T, H, Dv]`, g and beta `[B, T, H]` (g `[B, T, H, Dk]` where
the decay is per key channel, KDA's: row i of S decays by exp(g[i])),
state `[B, H, Dk, Dv]`. q and k are already L2-normalised and q already carries the
1/sqrt(Dk) scale; key heads are already repeated to the value heads.

Besides the output and the final state every variant returns `delta [B, T, H, Dv]`, the
delta-rule correction written at each step. Together with k and g it is all that is
needed to rebuild the state after any prefix (see `deltaspec.shared.state.rollback`).
"""
from __future__ import annotations

import torch
from torch import Tensor


def naive_recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """One step per token: S <- exp(g) S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = initial_state.float().clone()  # (B, H, Dk, Dv)
    out = torch.empty_like(v)
    delta = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * (g[:, t, ..., None] if g.dim() == k.dim() else g[:, t, :, None, None]).exp()
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta[:, t] = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, :, None] * delta[:, t, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out, delta, state
