"""The depthwise causal conv every recurrent mixer runs over its window and its new inputs (GDN, Mamba1, short conv).

One multiply and sum over the unfolded windows (cheaper than a convolution call at these sizes, over any batch
axes); inside a compiled graph a sum of shifted rows instead, since unfold's shape checks would split a symbolic
token count into ranges.
"""
from __future__ import annotations

import torch
from torch import Tensor


def causal_conv(full: Tensor, taps: Tensor, bias: Tensor | None = None) -> Tensor:
    """full = [window; x] `(..., K-1+T, C)`, taps `(C, K)` -> the conv at the T tokens `(..., T, C)`, no
    activation: token t sees rows t..t+K-1 of `full`."""
    K = taps.shape[1]
    if torch.compiler.is_compiling():
        T = full.shape[-2] - K + 1
        out = sum(full[..., j:j + T, :] * taps[:, j] for j in range(K))
    else:
        out = (full.unfold(-2, K, 1) * taps).sum(-1)  # windows (..., T, C, K)
    return out if bias is None else out + bias
