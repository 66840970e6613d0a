"""Sparse mixture-of-experts MLP blocks (Qwen3-Next, Qwen3.5-MoE), with routing that reads only the experts used.

A pass routes all its tokens at once, whatever they are (one token of a decode step, the k+1 of a verify, the
packed tokens of many sessions in a batched pass): one router matmul over the packed tokens, the top-k per token,
the (token, expert) pairs sorted by expert, then each distinct expert chosen applied once to its group of tokens
and the weighted results added back to their tokens in expert order (as HF's `Experts.forward` adds them). No loop
over tokens and nothing computed for an expert no token chose: a verify of T tokens reads at most T x top-k experts
per layer (`SparseMoE.touched` in `deltaspec.shared.model.mlp` says how many it did). How the experts meet
their groups (one grouped matmul, or a loop over the experts used) is a kernel's choice, made in
`deltaspec.shared.kernels.experts`: the grouped form has fixed shapes, so compiled and captured passes cover MoE
models.

Routing is a discrete choice made per token from that token's hidden state by this one function in every pass
(layer, fused, batched; decode and verify), with HF's arithmetic (router logits in the model's dtype, softmax in
float32, top-k, renormalised per `norm_topk_prob`). Passes of different lengths agree on hidden states to float
rounding, not bit for bit (the delta rule runs as a recurrence for one token and in chunked form for several), so
they route identically except where two experts' probabilities sit within that rounding of the top-k boundary;
`tests/test_moe.py` builds routers whose boundary margin is small and checks every pass picks the same experts.
"""
from __future__ import annotations

import torch
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
