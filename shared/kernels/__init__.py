"""The kernels, each beside the one place that picks among its forms: the gated delta rule here
(`gated_delta_rule`), the routed experts of a sparse MoE block in `experts` (`apply_experts`).

`naive` is the float32 reference loop; `recurrent_step` serves single-token decode on the CPU and in static passes
(compiled or CUDA-graph), the chunked form (`one_chunk_gated_delta_rule`) multi-token verify there and prefill in
chunks; `triton` serves decode and verify on CUDA. All return `(out, delta, final_state)` with the same layout
(see `naive`); the Triton kernel can also write a verify pass's logs itself (`VerifyLogs`).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from torch import Tensor

from deltaspec.shared.kernels.chunk import CHUNK_SIZE, chunk_gated_delta_rule, one_chunk_gated_delta_rule
from deltaspec.shared.kernels.naive import naive_recurrent_gated_delta_rule
from deltaspec.shared.kernels.recurrent import recurrent_gated_delta_rule, recurrent_step

Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
KERNEL_NAMES = ("auto", "naive", "chunk", "recurrent", "triton")
TRITON_MAX_TOKENS = 16  # beyond this the chunked form's matmuls win over a per-token loop
# a decay per key channel (KDA): a chunk's pair decays are (H, Dk, C, C), so short chunks; on the 2-core host, per
# 64 or 256 tokens, chunks of 8 beat 16 (by up to 1.4x at Dk 128), 64 (by 4-12x) and the per-token loop (1.2-1.6x)
KEY_CHUNK_SIZE = 8
_LOOPS: dict[str, Kernel] = {"naive": naive_recurrent_gated_delta_rule, "recurrent": recurrent_gated_delta_rule}


class VerifyLogs(NamedTuple):
    """Where a kernel logs the k, delta and g of a pass's tokens itself, in the layout the commit reads
    (`deltaspec.shared.state.rollback.RecurrentStates`), so that no copy moves them there after the pass.

    A row of the buffers is one (sequence, layer): a `StatePool`'s slots x layers, or one sequence's layers, so the
    sequences of a batch are logged by one launch. Sequence b's token t < counts[b] goes to log slot offsets[b] + t
    of row rows[b] + layer; its tokens after counts[b] (a batch's padding), and every other slot and row, are left
    as they are."""

    k: Tensor  # (R, H, Dk, C) float32, contiguous
    delta: Tensor  # (R, H, C, Dv)
    g: Tensor  # (R, H, C)
    members: Tensor  # (3, B) int32 on the kernel's device: rows, offsets, counts (the same for every layer of a pass)
    layer: int


def choose(name: str, num_tokens: int, on_cuda: bool, static: bool = False, chunk: int = CHUNK_SIZE) -> str:
    """The form a pass of `num_tokens` tokens takes for the kernel named `name` (one of `KERNEL_NAMES`):
    `step` (`recurrent_step`), `one_chunk`, `triton`, or a whole-sequence loop (`naive`, `chunk`, `recurrent`).

    `static`: a pass recorded as a graph (compiled or CUDA-graph), which takes the step or one chunk whatever the
    name. Otherwise `auto` is Triton on CUDA up to `TRITON_MAX_TOKENS` tokens, and on the CPU the step for one token
    and one chunk up to `chunk` tokens (`CHUNK_SIZE`, or `KEY_CHUNK_SIZE` for a decay per key channel); `recurrent`
    and `chunk` take their short forms on the CPU where those fit."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"unknown gated delta rule kernel {name!r} (expected one of {KERNEL_NAMES})")
    if static:
        return "step" if num_tokens == 1 else "one_chunk"
    if name == "triton" or (name == "auto" and on_cuda and num_tokens <= TRITON_MAX_TOKENS):
        return "triton"
    if not on_cuda and num_tokens == 1 and name in ("auto", "recurrent"):
        return "step"
    if not on_cuda and num_tokens <= chunk and name in ("auto", "chunk"):
        return "one_chunk"
    if name == "auto":
        return "recurrent" if num_tokens == 1 else "chunk"
    return name


def gated_delta_rule(name: str, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor,
                     out_state: Tensor | None = None, logs: Callable[[], VerifyLogs | None] | None = None,
                     static: bool = False) -> tuple[Tensor, Tensor, Tensor, bool]:
    """A pass through the form `choose` picks: q, k `(..., T, H, Dk)`, v `(..., T, H, Dv)`, g and beta
    `(..., T, H)` (g `(..., T, H, Dk)`: a decay per key channel, KDA's), float32, with an optional leading sequence
    axis (one for the state `(..., H, Dk, Dv)` too).

    Returns out and delta `(..., T, H, Dv)`, the final state, and whether the kernel logged k, delta and g itself
    (the Triton kernel does, where `logs()` says). `out_state`: where the one-token step may write the final state."""
    batched = q.ndim == 4
    T = q.shape[-3]
    per_key = g.dim() == k.dim()  # KDA's decay per key channel: the loops, the step and the chunks take it
    chunk = KEY_CHUNK_SIZE if per_key else CHUNK_SIZE
    form = choose(name, T, q.is_cuda and not per_key, static, chunk)  # the Triton kernel decays per head only
    if form == "triton" and per_key:
        raise ValueError("the Triton gated delta rule decays per head; a decay per key channel takes another form")
    if form == "step":
        out, delta, final = recurrent_step(q, k, v, g, beta, initial_state, out=out_state)
        return out, delta, final if out_state is None else out_state, False
    if form == "one_chunk":  # heads first, no batch axis needed, no casts or slices
        out, delta, final = one_chunk_gated_delta_rule(*(x.transpose(-3, -2) for x in (q, k, v)),
                                                       g.transpose(-3, -2) if per_key else g.transpose(-2, -1),
                                                       beta.transpose(-2, -1), initial_state)
        return out.transpose(-3, -2), delta.transpose(-3, -2), final, False
    args = (q, k, v, g, beta, initial_state) if batched else (q[None], k[None], v[None], g[None], beta[None],
                                                              initial_state[None])
    where = None
    if form == "triton":
        from deltaspec.shared.kernels.triton_recurrent import fused_recurrent_gated_delta_rule

        where = logs() if logs is not None else None
        out, delta, final = fused_recurrent_gated_delta_rule(*args, where)
    elif form == "chunk":
        out, delta, final = chunk_gated_delta_rule(*args, chunk_size=chunk)
    else:
        out, delta, final = _LOOPS[form](*args)
    if not batched:
        out, delta, final = out[0], delta[0], final[0]
    return out, delta, final, where is not None
