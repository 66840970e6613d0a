"""Recurrent gated delta rule: the one-token step, and a loop of it for short sequences.

`recurrent_step` is the delta rule's single step, written once: every pass that decodes one token (eager, compiled,
batched) takes it. Same contract as `naive_recurrent_gated_delta_rule`; on CUDA the Triton kernel in
`deltaspec.shared.kernels.triton_recurrent` replaces both (see `deltaspec.shared.kernels.gated_delta_rule`).
"""
from __future__ import annotations

import torch
from torch import Tensor


def recurrent_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                   out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One token per (sequence, head): S <- exp(g) S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q.

    q, k `(..., H, Dk)`, v `(..., H, Dv)`, g and beta `(..., H)` (g `(..., H, Dk)`: a decay per key channel)
    (any leading axes, a token axis of 1 included),
    state `(B..., H, Dk, Dv)` with as many (sequence, head) pairs; returns the output and delta shaped like v, and the
    state after, written into `out` (shaped like `state`) when given. A handful of batched matmuls over the pairs."""
    Dk, Dv = state.shape[-2:]
    flat = state.dim() == 3  # one sequence's (H, Dk, Dv): no reshapes (a decode step counts every call)
    s = (state if flat else state.reshape(-1, Dk, Dv)) * g.reshape(-1, Dk if g.dim() == k.dim() else 1, 1).exp()
    k = k.reshape(-1, 1, Dk)
    delta = (v.reshape(-1, 1, Dv) - torch.bmm(k, s)) * beta.reshape(-1, 1, 1)  # (B H, 1, Dv)
    s = torch.baddbmm(s, k.transpose(1, 2), delta, out=out if out is None or flat else out.view(-1, Dk, Dv))
    return (torch.bmm(q.reshape(-1, 1, Dk), s).view(v.shape), delta.view(v.shape),
            s if flat else s.view(state.shape))


def recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    state = initial_state.float()
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    outs, deltas = [], []
    for t in range(q.shape[1]):
        out, delta, state = recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(out)
        deltas.append(delta)
    return torch.stack(outs, 1), torch.stack(deltas, 1), state
