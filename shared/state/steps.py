"""What a recurrent mixer's pass takes from the state floor and gives back, whatever its kind.

A mixer computes; the engine's state access decides where its window and state live. So the access hands the mixer
a `Start` (the state before the pass, which tokens are real, whether the pass is recorded as a graph) and takes back
a `Step`: the output, and the (k, d, g) of every token, which is all a closed-form commit of any accepted prefix
needs (`S_a = exp(G_a) S_0 + sum_t exp(G_a - G_t) k_t d_t^T`, see `deltaspec.shared.state.rollback`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from torch import Tensor


class Step(NamedTuple):
    """One pass of a recurrent mixer over T tokens, with an optional leading batch axis on every tensor."""

    out: Tensor  # (..., T, H, Dv): the mixer's per-head output, before its output projection
    k: Tensor  # (..., T, H, Dk): the key written at each token
    d: Tensor  # (..., T, H, Dv): the value written at each token (Mamba2: dt * x; GDN: the delta-rule correction)
    g: Tensor  # (..., T, H) or (..., T, H, Dk): the log decay at each token
    final: Tensor  # (..., H, Dk, Dv) float32: the state after the last token
    logged: bool = False  # whether the kernel already wrote k, d, g into the commit's logs itself


@dataclass
class Start:
    """The state a pass starts from, and how it may treat it."""

    initial: Tensor  # (..., H, Dk, Dv) float32
    valid: Tensor | None = None  # (..., T, 1), 0 on a batch's padding tokens: they must leave the state unchanged
    out_state: Tensor | None = None  # where a one-token step may write the final state
    logs: Callable[[], Any] | None = None  # where a kernel may write the logs itself (GDN's Triton kernel)
    static: bool = False  # a pass recorded as a graph: only shape-static ops
