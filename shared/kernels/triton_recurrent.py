"""Triton recurrent gated delta rule for the decode and verify steps on CUDA.

Same contract as `naive_recurrent_gated_delta_rule`; each program keeps its tile of the state
in registers across all T tokens of a verify pass instead of round-tripping it through memory.
Given `VerifyLogs` it also logs each token's k, delta and g straight into the log buffers the
commit reads (one sequence's, or a `StatePool`'s slots for a batch), so no copy moves them there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deltaspec.shared.kernels import VerifyLogs

MAX_DK = 256


@triton.jit
def _fused_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, out_ptr, delta_ptr, ht_ptr,
    log_k_ptr, log_delta_ptr, log_g_ptr, members_ptr, layer, C,
    T, B,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LOG: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H

    offs_k = tl.arange(0, BLOCK_K)
    offs_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    mask_kv = mask_k[:, None] & mask_v[None, :]

    state_offs = i_bh * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    state = tl.load(h0_ptr + state_offs, mask=mask_kv, other=0.0)
    if LOG:  # this sequence's (layer, head) row of the logs, its first log slot and how many tokens it logs
        log_row = (tl.load(members_ptr + i_b).to(tl.int64) + layer) * H + i_h
        log_offset = tl.load(members_ptr + B + i_b)
        log_count = tl.load(members_ptr + 2 * B + i_b)

    for t in range(T):
        row = (i_b * T + t) * H + i_h  # index of (b, t, h) in the flattened [B, T, H] layout
        q = tl.load(q_ptr + row * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * DV + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row).to(tl.float32)
        beta = tl.load(beta_ptr + row).to(tl.float32)

        state = state * tl.exp(g)
        delta = beta * (v - tl.sum(state * k[:, None], axis=0))
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)

        tl.store(out_ptr + row * DV + offs_v, out, mask=mask_v)
        tl.store(delta_ptr + row * DV + offs_v, delta, mask=mask_v)
        if LOG:  # logs as the commit reads them: k (.., Dk, C), delta (.., C, Dv), g (.., C); padding logs nothing
            if t < log_count:
                slot = log_offset + t
                tl.store(log_delta_ptr + (log_row * C + slot) * DV + offs_v, delta, mask=mask_v)
                if i_v == 0:  # k and g are the same for every value block: one program logs them
                    tl.store(log_k_ptr + (log_row * DK + offs_k) * C + slot, k, mask=mask_k)
                    tl.store(log_g_ptr + log_row * C + slot, g)

    tl.store(ht_ptr + state_offs, state, mask=mask_kv)


def fused_recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor, logs: VerifyLogs | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (out, delta, final_state), all float32 and new; `initial_state` is left untouched.

    `logs`: also write each sequence's first `counts[b]` tokens' k, delta and g into its log row (see `VerifyLogs`),
    and nothing else of the log buffers. Shapes are checked here; rows, offsets and counts, on the device, are not
    (reading them back would cost a sync): the caller keeps them inside the buffers."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    if Dk > MAX_DK:
        raise ValueError(f"key head dim {Dk} exceeds {MAX_DK}: the [Dk, BLOCK_V] state tile would not fit in registers")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    initial_state = initial_state.float().contiguous()

    out = torch.empty(B, T, H, Dv, dtype=torch.float32, device=v.device)
    delta = torch.empty_like(out)
    final_state = torch.empty_like(initial_state)
    if logs is not None:
        _check_logs(logs, B, H, Dk, Dv, out.device)
    log_k, log_delta, log_g, members, layer = (out, out, out, out, 0) if logs is None else logs  # unread without logs

    block_k = triton.next_power_of_2(Dk)
    block_v = min(triton.next_power_of_2(Dv), 8)
    grid = (triton.cdiv(Dv, block_v), B * H)
    _fused_recurrent_kernel[grid](
        q, k, v, g, beta, initial_state, out, delta, final_state,
        log_k, log_delta, log_g, members, layer, log_g.shape[-1],
        T, B, H=H, DK=Dk, DV=Dv, BLOCK_K=block_k, BLOCK_V=block_v, LOG=logs is not None, num_warps=1,
    )
    return out, delta, final_state


def _check_logs(logs: VerifyLogs, B: int, H: int, Dk: int, Dv: int, device: torch.device) -> None:
    R, C = logs.g.shape[0], logs.g.shape[-1]
    expected = (("k", (R, H, Dk, C), torch.float32), ("delta", (R, H, C, Dv), torch.float32),
                ("g", (R, H, C), torch.float32), ("members", (3, B), torch.int32))
    for name, shape, dtype in expected:
        t = getattr(logs, name)
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != device:
            raise ValueError(f"logs.{name}: expected a contiguous {dtype} {shape} on {device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
