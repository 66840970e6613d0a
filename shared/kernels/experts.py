"""Routed experts applied to the tokens that chose them, and the one place that picks how: one grouped matmul per
projection over every (token, expert) pair, or a loop over the distinct experts used (`apply_experts`). An expert is
down(act(w_in x)): `swiglu` for gated experts (w_in = [gate; up]), `relu_squared` for Nemotron-H's non-gated ones."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

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


def swiglu(h: Tensor, limit: float | None = None) -> Tensor:
    """silu(gate) * up of h = [gate; up] (Qwen's and Granite's experts); with a `limit` (Bailing's), silu(gate)
    clipped at it from above and up to [-limit, limit] first."""
    gate, up = h.chunk(2, dim=-1)
    if limit is None:
        return F.silu(gate) * up
    return F.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)


def relu_squared(h: Tensor) -> Tensor:
    """relu(h)^2, HF's `relu2` (Nemotron-H's experts and MLPs)."""
    return F.relu(h).square()


def apply_experts(w_in: Tensor, down_proj: Tensor, x: Tensor, weights: Tensor, chosen: Tensor,
                  grouped: bool | None = None, act: Callable[[Tensor], Tensor] = swiglu,
                  first: int | None = None) -> tuple[Tensor, Tensor | int]:
    """sum_j weights[t, j] * expert_{chosen[t, j]}(x[t]) for every token t, expert e being
    down_proj[e] act(w_in[e] x), each distinct expert applied once to all the tokens that chose it; the experts as HF
    keeps them: `w_in` its `gate_up_proj` (E, 2 I, H) (`swiglu`) or `up_proj` (E, I, H), `down_proj` (E, H, I).
    Each product with its weight is in their promoted dtype (float32 weights: HF's Nemotron-H), then cast to x's.
    Returns the sum (N, H) and what says how many distinct experts were read (`experts_read`).

    Two ways to apply the experts to their groups, the same arithmetic: one grouped matmul per projection over all
    the (token, slot) pairs (`torch._grouped_mm`, offsets per expert, empty groups for the experts no token chose):
    fixed shapes and no host sync, so a compiled graph or a CUDA graph holds it; or a loop over the distinct
    experts, which reads the group sizes on the host. `grouped` None: the grouped form where it is one kernel
    (`grouped_gemm_fast`), inside a compiled graph, and on a CPU for passes of several tokens with many (token,
    expert) pairs per expert (`CPU_GROUPED_PAIRS_PER_EXPERT`); the loop elsewhere. The loop over one token's
    experts (a decode step) needs no sort or groups (`_one_token`). Grouped, what is returned for the count is where
    each expert's group ends, counted only when asked (a count would be ops in every pass, and reading it a sync).

    `first`: expert parallelism (`deltaspec.shared.model.parallel`): `w_in` and `down_proj` hold the experts first..
    only, and the pairs routed to any other expert add nothing here (a token none of whose experts are here gets 0).
    Finding the pairs reads their count on the host."""
    flat, pair_weights = chosen.flatten(), weights.flatten()
    pair_tokens = None  # a pair's token: its index // k unless some pairs were left out
    if first is not None:
        flat = flat - first
        mine = ((flat >= 0) & (flat < w_in.shape[0])).nonzero().squeeze(1)
        if not mine.numel():
            return torch.zeros_like(x), 0
        flat, pair_weights, pair_tokens = flat[mine], pair_weights[mine], mine // chosen.shape[1]
    if grouped is None:
        many = CPU_GROUPED_PAIRS_PER_EXPERT * flat.numel() >= len(down_proj)
        grouped = (torch.compiler.is_compiling() or grouped_gemm_fast(x.device, x.dtype, *down_proj.shape[1:])
                   or (x.device.type == "cpu" and x.shape[0] > 1 and many))
    if not grouped and first is None and x.shape[0] == 1:
        return _one_token(w_in, down_proj, x, weights, chosen, act), chosen.shape[1]
    by_expert, order = flat.sort(stable=True)  # (token, slot) pairs grouped by expert, tokens in order within a group
    tokens = order // chosen.shape[1] if pair_tokens is None else pair_tokens[order]
    xs = x.index_select(0, tokens)
    if grouped:
        everyone = torch.arange(w_in.shape[0], device=x.device)
        ends = torch.searchsorted(by_expert, everyone, right=True).to(torch.int32)  # where each expert's group ends
        y = torch._grouped_mm(act(torch._grouped_mm(xs, w_in.transpose(1, 2), offs=ends)), down_proj.transpose(1, 2),
                              offs=ends)
        touched: Tensor | int = ends
    else:
        used, counts = torch.unique_consecutive(by_expert, return_counts=True)
        outs = [F.linear(act(F.linear(group, w_in[e])), down_proj[e])
                for e, group in zip(used.tolist(), xs.split(counts.tolist()))]
        y, touched = torch.cat(outs), len(outs)
    y = (y * pair_weights.index_select(0, order)[:, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y), touched


def _one_token(w_in: Tensor, down_proj: Tensor, x: Tensor, weights: Tensor, chosen: Tensor,
               act: Callable[[Tensor], Tensor]) -> Tensor:
    """`apply_experts` for one token `(1, H)`: its k experts, distinct, one after another in expert order, each
    product with its weight added as the other forms add them (bit for bit: the same matmuls, products and
    scatter-add), without their sort of pairs, groups or gathers. On the 2-core CPU, 8 experts of width 128 and
    hidden 256, top-2: 77 us a layer, the grouped form 108-110 (six alternated runs of 2,000 calls each)."""
    experts, order = chosen[0].sort()
    kept = weights[0].index_select(0, order)
    out = None
    for j, e in enumerate(experts.tolist()):
        y = (F.linear(act(F.linear(x, w_in[e])), down_proj[e]) * kept[j]).to(x.dtype).float()
        out = y if out is None else out.add_(y)
    return out.to(x.dtype)


def experts_read(touched: Tensor | int) -> int:
    """How many distinct experts a pass read, from what `apply_experts` returned for it: the count, or where each
    expert's group ends."""
    return touched if isinstance(touched, int) else int((touched.diff(prepend=touched.new_zeros(1)) > 0).sum())
