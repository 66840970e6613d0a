"""Recurrent gated delta rule for one-token decode (and short sequences): a vectorised step loop.

Same contract as `naive_recurrent_gated_delta_rule`; on CUDA the Triton kernel in
`deltaspec.shared.kernels.triton_recurrent` replaces it (see `gated_delta_rule`).
"""
from __future__ import annotations

import torch
from torch import Tensor


def recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    state = initial_state.float()
    q, k, v = q.float(), k.float(), v.float()
    decay = g.float().exp()
    beta = beta.float()
    outs, deltas = [], []
    for t in range(q.shape[1]):
        state = state * decay[:, t, :, None, None]
        d = beta[:, t, :, None] * (v[:, t] - (k[:, t].unsqueeze(-2) @ state).squeeze(-2))  # (B, H, Dv)
        state = state + k[:, t].unsqueeze(-1) * d.unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-2) @ state).squeeze(-2))
        deltas.append(d)
    return torch.stack(outs, 1), torch.stack(deltas, 1), state
