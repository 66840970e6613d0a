"""What a recurrent mixer and the state access hand each other in one pass (`access.StateAccess.recurrent`).

The access reads where the state lives (`Start`); the mixer's recurrence computes its tokens and says what the
state floor logs of them (`Step`): the same (k, d, g) for every kind, since every kind commits by the one closed
form `S_n = D(G_n) S_0 + sum_t D(G_n - G_t) k_t d_t^T` (`rollback.closed_form`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from deltaspec.shared.kernels import VerifyLogs


class Step(NamedTuple):
    """A recurrence's pass over T tokens (any leading batch axis on all): `out (..., T, H, Dv)` its output before
    the mixer's gate and projection (a short conv's `(..., T, C)`: the access hands it back as it is); what is
    logged per token, `k (..., T, H, Dk)`, `d (..., T, H, Dv)` and the log decay `g (..., T, H)` (or
    `(..., T, H, Dk)`, a decay per key channel); the state after them `final (..., H, Dk, Dv)`; `logged`: the kernel
    wrote k, d and g into the logs itself (`Start.logs`)."""

    out: Tensor
    k: Tensor
    d: Tensor
    g: Tensor
    final: Tensor
    logged: bool = False


@dataclass
class Start:
    """Where a recurrence starts: the state before the pass `initial (..., H, Dk, Dv)` float32; `valid (..., T, 1)`
    (None: all real) 0 on a batch's padding tokens, which must leave the state as it is (no update, log decay 0);
    `out_state` where a one-token step may write the final state; `logs` where a kernel may log k, d, g itself;
    `static` a pass recorded as a graph (shape-static forms only); `first (..., T, 1)` 1 on a sequence's first token
    (position 0), where a kind treats it apart (RecurrentGemma's RG-LRU), None when the pass holds none."""

    initial: Tensor
    valid: Tensor | None = None
    out_state: Tensor | None = None
    logs: Callable[[], VerifyLogs | None] | None = None
    static: bool = False
    first: Tensor | None = None
