"""Gated delta rule kernels and the one place that picks among them.

`naive` is the float32 reference loop; `chunk` (UT form) serves prefill and multi-token verify
on the CPU; `recurrent` serves single-token decode on the CPU; `triton` serves decode and
verify on CUDA. All return `(out, delta, final_state)` with the same layout (see `naive`); the
Triton kernel can also write a verify pass's logs itself (`VerifyLogs`).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

from torch import Tensor

from deltaspec.shared.kernels.chunk import chunk_gated_delta_rule
from deltaspec.shared.kernels.naive import naive_recurrent_gated_delta_rule
from deltaspec.shared.kernels.recurrent import recurrent_gated_delta_rule

Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
KERNEL_NAMES = ("auto", "naive", "chunk", "recurrent", "triton")
TRITON_MAX_TOKENS = 16  # beyond this the chunked form's matmuls win over a per-token loop


class VerifyLogs(NamedTuple):
    """Where a kernel logs the k, delta and g of a pass's tokens itself, in the layout the commit reads
    (`deltaspec.shared.state.rollback.GDNStates`), so that no copy moves them there after the pass.

    A row of the buffers is one (sequence, layer): a `StatePool`'s slots x layers, or one sequence's layers, so the
    sequences of a batch are logged by one launch. Sequence b's token t < counts[b] goes to log slot offsets[b] + t
    of row rows[b] + layer; its tokens after counts[b] (a batch's padding), and every other slot and row, are left
    as they are."""

    k: Tensor  # (R, H, Dk, C) float32, contiguous
    delta: Tensor  # (R, H, C, Dv)
    g: Tensor  # (R, H, C)
    members: Tensor  # (3, B) int32 on the kernel's device: rows, offsets, counts (the same for every layer of a pass)
    layer: int


class LoggingKernel(Protocol):
    """A `Kernel` that can also log the pass itself."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor,
                 logs: VerifyLogs | None = None) -> tuple[Tensor, Tensor, Tensor]: ...


def triton_kernel(name: str, num_tokens: int, on_cuda: bool) -> LoggingKernel | None:
    """The Triton kernel where `pick_kernel` picks it (on CUDA up to `TRITON_MAX_TOKENS` tokens, or named), else None:
    the one kernel that logs a pass itself."""
    if name == "triton" or (name == "auto" and on_cuda and num_tokens <= TRITON_MAX_TOKENS):
        from deltaspec.shared.kernels.triton_recurrent import fused_recurrent_gated_delta_rule

        return fused_recurrent_gated_delta_rule
    return None


def pick_kernel(name: str, num_tokens: int, on_cuda: bool) -> Kernel:
    triton = triton_kernel(name, num_tokens, on_cuda)
    if triton is not None:
        return triton
    if name == "auto":
        name = "recurrent" if num_tokens == 1 else "chunk"
    kernels: dict[str, Kernel] = {
        "naive": naive_recurrent_gated_delta_rule,
        "chunk": chunk_gated_delta_rule,
        "recurrent": recurrent_gated_delta_rule,
    }
    if name not in kernels:
        raise ValueError(f"unknown gated delta rule kernel {name!r} (expected one of {KERNEL_NAMES})")
    return kernels[name]


def gated_delta_rule(name: str, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor,
                     logs: Callable[[], VerifyLogs | None]) -> tuple[Tensor, Tensor, Tensor, bool]:
    """One sequence's pass `(T, H, D)` through the kernel `pick_kernel` picks for `name`: out and delta `(T, H, Dv)`,
    the final state `(H, Dk, Dv)`, and whether the kernel logged k, delta and g itself (the Triton kernel does, where
    `logs()` says)."""
    T = q.shape[0]
    args = (q[None], k[None], v[None], g[None], beta[None], initial_state[None])
    triton = triton_kernel(name, T, q.is_cuda)
    where = logs() if triton is not None else None
    out, delta, final = triton(*args, where) if triton is not None else pick_kernel(name, T, q.is_cuda)(*args)
    return out[0], delta[0], final[0], where is not None
