"""Triton closed-form commit: a recurrent state after keeping n staged tokens, for one sequence or many, in one launch.

    S_n = exp(G_n) S_0 + sum_{t<n} exp(G_n - G_t) k_t delta_t^T,   G_t = g_0 + ... + g_t

with a decay per head (GDN, Mamba2/SSD, lightning: g a number per token) or per head and key channel (KDA: g a
vector over the key channels per token, exp(G) scaling the state's rows),

from the logs a verify pass wrote (`deltaspec.shared.state.rollback.RecurrentStates`: k `(.., Dk, C)`, delta
`(.., C, Dv)`,
g `(.., C)` or `(.., Dk, C)` per layer and head), where the torch form is three calls and a batched matmul per
sequence. Each program
holds one (Dk, BLOCK_V) tile of one (sequence, layer x head) state in registers and walks the n logged tokens
backwards, so each decay exp(G_n - G_t) is the running sum of the g after t (no G_n - G_t cancellation), as the torch
form's `g @ sums` computes it. Many sequences are slots of stacked buffers (a `StatePool`'s), each with its own n.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_DK = 256


@triton.jit
def _commit_kernel(s0_ptr, k_ptr, delta_ptr, g_ptr, out_ptr, slot_ptr, n_ptr, C, LH,
                   DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                   PER_KEY: tl.constexpr):
    i_v = tl.program_id(0)
    i_lh = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2)
    slot = tl.load(slot_ptr + i_s).to(tl.int64)
    n = tl.load(n_ptr + i_s)
    row = slot * LH + i_lh  # (slot, layer x head) in the stacked buffers

    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    mask_kv = mask_k[:, None] & mask_v[None, :]

    acc = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    after = tl.zeros((BLOCK_K,), dtype=tl.float32)  # sum of the g of the tokens after t: log of exp(G_n - G_t)
    for i in range(n):
        t = n - 1 - i
        k = tl.load(k_ptr + row * DK * C + offs_k * C + t, mask=mask_k, other=0.0)
        d = tl.load(delta_ptr + row * C * DV + t * DV + offs_v, mask=mask_v, other=0.0)
        acc += (tl.exp(after) * k)[:, None] * d[None, :]
        if PER_KEY:  # one decay per key channel: a row of the state each
            after += tl.load(g_ptr + row * DK * C + offs_k * C + t, mask=mask_k, other=0.0)
        else:
            after += tl.load(g_ptr + row * C + t)
    state_offs = row * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    s0 = tl.load(s0_ptr + state_offs, mask=mask_kv, other=0.0)
    tl.store(out_ptr + state_offs, tl.exp(after)[:, None] * s0 + acc, mask=mask_kv)


def commit_states(recurrent: Tensor, k: Tensor, delta: Tensor, g: Tensor, out: Tensor, slots: Sequence[int],
                  counts: Sequence[int]) -> Tensor:
    """Writes into `out[s]` the state of slot s after its first `counts[i]` logged tokens, for each s = `slots[i]`.

    Buffers stacked over slots, float32, contiguous: recurrent and out `(S, L, H, Dk, Dv)`, k `(S, L, H, Dk, C)`,
    delta `(S, L, H, C, Dv)`, g `(S, L, H, C)`, or `(S, L, H, Dk, C)` for a decay per key channel. Slots and counts are host integers, checked on the host (no device
    sync on a commit's path). out may be recurrent (each program reads the tile it writes); other slots of out are
    left as they are. Returns out."""
    S, L, H, Dk, Dv = recurrent.shape
    C = g.shape[-1]
    per_key = g.dim() == 5
    if Dk > MAX_DK:
        raise ValueError(f"key head dim {Dk} exceeds {MAX_DK}: the [Dk, BLOCK_V] state tile would not fit in registers")
    for name, t, shape in (("k", k, (S, L, H, Dk, C)), ("delta", delta, (S, L, H, C, Dv)), ("g", g, (S, L, H, *((Dk,) if per_key else ()), C)),
                           ("out", out, recurrent.shape)):
        if tuple(t.shape) != tuple(shape) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous float32 {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")
    if len(slots) != len(counts) or any(not 0 <= n <= C for n in counts) or any(not 0 <= s < S for s in slots):
        raise ValueError(f"slots {list(slots)} and counts {list(counts)}: one count per slot, slots in 0..{S - 1}, "
                         f"counts in 0..{C} (the logs' capacity)")
    slots_t, counts_t = torch.tensor([list(slots), list(counts)], dtype=torch.int32, device=out.device)
    block_v = min(triton.next_power_of_2(Dv), 8)
    grid = (triton.cdiv(Dv, block_v), L * H, len(slots))
    _commit_kernel[grid](recurrent, k, delta, g, out, slots_t, counts_t, C, L * H, DK=Dk, DV=Dv,
                         BLOCK_K=triton.next_power_of_2(Dk), BLOCK_V=block_v, PER_KEY=per_key, num_warps=1)
    return out
