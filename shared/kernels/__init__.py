"""Gated delta rule kernels and the one place that picks among them.

`naive` is the float32 reference loop; `chunk` (UT form) serves prefill and multi-token verify
on the CPU; `recurrent` serves single-token decode on the CPU; `triton` serves decode and
verify on CUDA. All return `(out, delta, final_state)` with the same layout (see `naive`).
"""
from __future__ import annotations

from typing import Callable

from torch import Tensor

from deltaspec.shared.kernels.chunk import chunk_gated_delta_rule
from deltaspec.shared.kernels.naive import naive_recurrent_gated_delta_rule
from deltaspec.shared.kernels.recurrent import recurrent_gated_delta_rule

Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
KERNEL_NAMES = ("auto", "naive", "chunk", "recurrent", "triton")
TRITON_MAX_TOKENS = 16  # beyond this the chunked form's matmuls win over a per-token loop


def pick_kernel(name: str, num_tokens: int, on_cuda: bool) -> Kernel:
    if name == "auto":
        if on_cuda and num_tokens <= TRITON_MAX_TOKENS:
            name = "triton"
        else:
            name = "recurrent" if num_tokens == 1 else "chunk"
    if name == "triton":
        from deltaspec.shared.kernels.triton_recurrent import fused_recurrent_gated_delta_rule

        return fused_recurrent_gated_delta_rule
    kernels: dict[str, Kernel] = {
        "naive": naive_recurrent_gated_delta_rule,
        "chunk": chunk_gated_delta_rule,
        "recurrent": recurrent_gated_delta_rule,
    }
    if name not in kernels:
        raise ValueError(f"unknown gated delta rule kernel {name!r} (expected one of {KERNEL_NAMES})")
    return kernels[name]
