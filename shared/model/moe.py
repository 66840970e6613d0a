"""Sparse mixture-of-experts MLP blocks (Qwen3-Next, Qwen3.5-MoE), with routing that reads only the experts used.

A pass routes all its tokens at once, whatever they are (one token of a decode step, the k+1 of a verify, the
packed tokens of many sessions in a batched pass): one router matmul over the packed tokens, the top-k per token,
the (token, expert) pairs sorted by expert, then each distinct expert chosen applied once to its group of tokens
and the weighted results added back to their tokens in expert order (as HF's `Experts.forward` adds them). No loop
over tokens and nothing computed for an expert no token chose: a verify of T tokens reads at most T x top-k experts
per layer (`SparseMoE.touched` in `deltaspec.shared.model.layers` says how many it did).

Routing is a discrete choice made per token from that token's hidden state by this one function in every pass
(layer, fused, batched; decode and verify), with HF's arithmetic (router logits in the model's dtype, softmax in
float32, top-k, renormalised per `norm_topk_prob`). Passes of different lengths agree on hidden states to float
rounding, not bit for bit (the delta rule runs as a recurrence for one token and in chunked form for several), so
they route identically except where two experts' probabilities sit within that rounding of the top-k boundary;
`tests/test_moe.py` builds routers whose boundary margin is small and checks every pass picks the same experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Experts(nn.Module):
    """The routed experts as HF keeps them: `gate_up_proj` (E, 2 I, H) and `down_proj` (E, H, I)."""

    def __init__(self, n: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, intermediate))


def route(logits: Tensor, top_k: int, renormalise: bool) -> tuple[Tensor, Tensor]:
    """Routing weights (N, k) in the logits' dtype and expert indices (N, k), HF's way."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def apply_experts(experts: Experts, x: Tensor, weights: Tensor, chosen: Tensor) -> tuple[Tensor, int]:
    """sum_j weights[t, j] * expert_{chosen[t, j]}(x[t]) for every token t, each distinct expert applied once to
    all the tokens that chose it. Returns the sum (N, H) and how many distinct experts were read."""
    flat = chosen.flatten()
    order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens in order within a group
    used, counts = torch.unique_consecutive(flat[order], return_counts=True)
    tokens = order // chosen.shape[1]
    groups = x.index_select(0, tokens).split(counts.tolist())
    outs = []
    for e, group in zip(used.tolist(), groups):
        gate, up = F.linear(group, experts.gate_up_proj[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, experts.down_proj[e]))
    y = torch.cat(outs) * weights.flatten().index_select(0, order)[:, None]
    return torch.zeros_like(x).index_add_(0, tokens, y), len(outs)
