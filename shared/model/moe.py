"""Sparse mixture-of-experts MLP blocks (Qwen3-Next, Qwen3.5-MoE), with routing that reads only the experts used.

A pass routes all its tokens at once, whatever they are (one token of a decode step, the k+1 of a verify, the
packed tokens of many sessions in a batched pass): one router matmul over the packed tokens, the top-k per token,
the (token, expert) pairs sorted by expert, then each distinct expert chosen applied once to its group of tokens
and the weighted results added back to their tokens in expert order (as HF's `Experts.forward` adds them). No loop
over tokens and nothing computed for an expert no token chose: a verify of T tokens reads at most T x top-k experts
per layer (`SparseMoE.touched` in `deltaspec.shared.model.layers` says how many it did). Where a grouped matmul
is one kernel (bfloat16 on an sm90/sm100 GPU), in compiled graphs, and on a CPU for passes with many tokens per
expert, the groups go through `torch._grouped_mm` with fixed shapes instead of a loop, so compiled and captured
passes cover MoE models.

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


# On a CPU PyTorch's grouped matmul loops over the groups in C++, empty ones included (about 1 us each): cheaper than
# our loop over the experts used once a pass has at least a quarter as many (token, expert) pairs as there are
# experts (measured on the 2-core host for 32 to 512 experts, top-4 to top-10: a verify of 5 tokens over 32 experts
# 0.75 ms a layer instead of 1.30; one token over 256, 0.68 ms instead of 0.22; experts in cache).
CPU_GROUPED_PAIRS_PER_EXPERT = 4


def grouped_gemm_fast(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """Whether `torch._grouped_mm` runs its grouped kernel for experts of these sizes here: bfloat16 on an sm90 or
    sm100 GPU, rows a multiple of 16 bytes. Elsewhere it falls back to one matmul per group after copying the
    offsets to the host (or refuses the sizes)."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hidden % 8 == 0 and intermediate % 8 == 0
            and torch.cuda.get_device_capability(device) in ((9, 0), (10, 0)))


def apply_experts(experts: Experts, x: Tensor, weights: Tensor, chosen: Tensor,
                  grouped: bool | None = None) -> tuple[Tensor, Tensor | int]:
    """sum_j weights[t, j] * expert_{chosen[t, j]}(x[t]) for every token t, each distinct expert applied once to
    all the tokens that chose it. Returns the sum (N, H) and how many distinct experts were read.

    Two ways to apply the experts to their groups, the same arithmetic: one grouped matmul per projection over all
    the (token, slot) pairs (`torch._grouped_mm`, offsets per expert, empty groups for the experts no token chose):
    fixed shapes and no host sync, so a compiled graph or a CUDA graph holds it; or a loop over the distinct
    experts, which reads the group sizes on the host. `grouped` None: the grouped form where it is one kernel
    (`grouped_gemm_fast`), inside a compiled graph, and on a CPU for passes with many (token, expert) pairs per
    expert (`CPU_GROUPED_PAIRS_PER_EXPERT`); the loop elsewhere. Grouped, the count is a 0-d tensor (reading it
    would sync)."""
    flat = chosen.flatten()
    by_expert, order = flat.sort(stable=True)  # (token, slot) pairs grouped by expert, tokens in order within a group
    tokens = order // chosen.shape[1]
    xs = x.index_select(0, tokens)
    if grouped is None:
        many = CPU_GROUPED_PAIRS_PER_EXPERT * flat.numel() >= len(experts.down_proj)
        grouped = (torch.compiler.is_compiling() or grouped_gemm_fast(x.device, x.dtype, *experts.down_proj.shape[1:])
                   or (x.device.type == "cpu" and many))
    if grouped:
        everyone = torch.arange(experts.gate_up_proj.shape[0], device=x.device)
        ends = torch.searchsorted(by_expert, everyone, right=True).to(torch.int32)  # where each expert's group ends
        gate, up = torch._grouped_mm(xs, experts.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, experts.down_proj.transpose(1, 2), offs=ends)
        touched: Tensor | int = (ends.diff(prepend=ends.new_zeros(1)) > 0).sum()
    else:
        used, counts = torch.unique_consecutive(by_expert, return_counts=True)
        outs = []
        for e, group in zip(used.tolist(), xs.split(counts.tolist())):
            gate, up = F.linear(group, experts.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, experts.down_proj[e]))
        y, touched = torch.cat(outs), len(outs)
    y = y * weights.flatten().index_select(0, order)[:, None]
    return torch.zeros_like(x).index_add_(0, tokens, y), touched
