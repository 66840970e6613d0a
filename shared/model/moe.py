"""Sparse mixture-of-experts MLP blocks (Qwen3-Next, Qwen3.5-MoE), with routing that reads only the experts used.

A pass routes all its tokens at once, whatever they are (one token of a decode step, the k+1 of a verify, the
packed tokens of many sessions in a batched pass): one router matmul over the packed tokens, the top-k per token,
the (token, expert) pairs sorted by expert, then each distinct expert chosen applied once to its group of tokens
and the weighted results added back to their tokens in expert order (as HF's `Experts.forward` adds them). No loop
over tokens and nothing computed for an expert no token chose: a verify of T tokens reads at most T x top-k experts
per layer (`SparseMoE.touched` in `deltaspec.shared.model.mlp`, counted by `kernels.experts.experts_read`, says how
many it did). How the experts meet their groups (one grouped matmul, or a loop over the experts used) is a kernel's
choice, made in `deltaspec.shared.kernels.experts`: the grouped form has fixed shapes, so compiled and captured passes cover MoE
models.

Routing is a discrete choice made per token from that token's hidden state by this one function in every pass
(layer, fused, batched; decode and verify), with HF's arithmetic (router logits in the model's dtype, softmax in
float32, top-k, renormalised per `norm_topk_prob`). Passes of different lengths agree on hidden states to float
rounding, not bit for bit (the delta rule runs as a recurrence for one token and in chunked form for several), so
they route identically except where two experts' probabilities sit within that rounding of the top-k boundary;
`tests/test_moe.py` builds routers whose boundary margin is small and checks every pass picks the same experts.
Nemotron-H and LFM2-MoE route with `route_groups` instead (sigmoid scores, a bias for the choice, group-limited
top-k; LFM2-MoE's one group), under the same discipline: one function, every pass.
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


class UngatedExperts(nn.Module):
    """Non-gated routed experts as HF's Nemotron-H keeps them: `up_proj` (E, I, H) and `down_proj` (E, H, I)."""

    def __init__(self, n: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(n, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, intermediate))


class GroupRouter(nn.Module):
    """HF's `NemotronHTopkRouter` tensors: `weight` (E, H) and the buffer `e_score_correction_bias` (E,), which
    `save_pretrained` writes. Both float32 whatever the model's dtype, as HF keeps them (`keep_float32`: the loader
    reads them so)."""

    keep_float32 = ("weight", "e_score_correction_bias")

    def __init__(self, n: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, hidden, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(n, dtype=torch.float32))

    def forward(self, x: Tensor) -> Tensor:
        """Router logits (N, E), float32 (HF's: input and weight in float32)."""
        return F.linear(x.float(), self.weight.float())


def route_groups(logits: Tensor, bias: Tensor | None, top_k: int, groups: int, top_groups: int, renormalise: bool,
                 scale: float, eps: float = 1e-20) -> tuple[Tensor, Tensor]:
    """Routing weights (N, k) in the logits' dtype and expert indices (N, k), as HF's `NemotronHTopkRouter` (float32
    logits) and, with one group, `Lfm2MoeTopKRouter` (eps 1e-6, bias optional) make them: sigmoid scores; the choice
    by scores + `bias` (float32: the sum is), among the experts of the `top_groups` of `groups` (contiguous) groups
    whose two best biased scores sum highest; the weights from the unbiased scores, renormalised (sum + eps) per
    `renormalise`, times `scale`. With every group kept the group step changes nothing and is skipped."""
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if top_groups < groups:
        by_group = choice.view(-1, groups, choice.shape[-1] // groups)  # (N, G, E / G)
        best = torch.topk(by_group.topk(2, dim=-1)[0].sum(dim=-1), top_groups, dim=-1, sorted=False)[1]
        kept = torch.zeros(by_group.shape[:2], dtype=torch.bool, device=logits.device).scatter_(1, best, True)
        choice = by_group.masked_fill(~kept[..., None], float("-inf")).flatten(1)
    experts = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    return weights * scale, experts


def route(logits: Tensor, top_k: int, renormalise: bool) -> tuple[Tensor, Tensor]:
    """Routing weights (N, k) in the logits' dtype and expert indices (N, k), HF's way."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts
