"""The gated short convolution of Liquid's LFM2 (`Lfm2ShortConv`), with HF's parameter names.

in_proj splits each token into B, C and x; a depthwise causal conv of width K runs over B * x, and C gates its
output before out_proj: y_t = out_proj(C_t * sum_j w_j (B x)_{t-K+1+j}), no activation. The only state is the conv
window (the last K-1 rows of B * x), kind `conv`: nothing decays and nothing is written, so a `Step` carries empty
k, d, g and state (zero heads) and the state floor commits the window alone, as the last K-1 rows of
[window; (B x)_1 .. (B x)_a]. A batch's padding tokens need no care here: the state access keeps each sequence's
window from its own rows only, and the conv is causal.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.kernels.conv import causal_conv
from deltaspec.shared.state.access import StateAccess
from deltaspec.shared.state.rollback import RecurrentSlot
from deltaspec.shared.state.spec import RECURRENT
from deltaspec.shared.state.steps import Start, Step


class ShortConv(nn.Module):
    state = RECURRENT
    compiles = True  # its fast path traces into a graph whose token count is symbolic

    def __init__(self, hidden_size: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel, groups=hidden_size, bias=bias)
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    def forward(self, h: Tensor, st: RecurrentSlot, start: int = 0, rope: object = None) -> Tensor:
        """The reference on one sequence's slot, h `(T, hidden)`: plain `F.conv1d` over [window; B x]; stages the
        tokens' B x (its window) and nothing else."""
        Bx, C = inputs(self, h)
        full = torch.cat([st.conv_window().to(h.dtype), Bx])  # (K-1+T, hidden)
        conv = F.conv1d(full.t()[None], self.conv.weight, self.conv.bias, groups=self.hidden_size)[0].t()  # (T, hidden)
        k, d, g = no_logs(full, Bx.shape[0])
        st.stage(Bx, k, d, g, st.initial_state(), full)
        return self.out_proj(C * conv)

    def fuse(self) -> ShortConv:
        return self  # its input projection is one matmul already

    def fused(self, f: ShortConv, h: Tensor, residual: Tensor, rope: object, access: StateAccess, i: int) -> Tensor:
        """Recurrent layer i on the normed input h `(N, hidden)`, added to the residual."""
        Bx, C = inputs(self, h)
        conv = access.recurrent(i, Bx, (), functools.partial(recurrence, self))
        return residual + self.out_proj(C * conv)


def inputs(m: ShortConv, h: Tensor) -> tuple[Tensor, Tensor]:
    """h `(..., T, hidden)` -> (B x `(..., T, hidden)`, what the conv reads and its window keeps; C, the gate)."""
    B, C, x = m.in_proj(h).chunk(3, dim=-1)
    return B * x, C


def no_logs(like: Tensor, T: int) -> tuple[Tensor, Tensor, Tensor]:
    """What the state floor logs of T tokens of a conv-only state: k, d `(..., T, 0, 0)` and g `(..., T, 0)`."""
    lead = (*like.shape[:-2], T)
    return (like.new_empty(*lead, 0, 0, dtype=torch.float32), like.new_empty(*lead, 0, 0, dtype=torch.float32),
            like.new_empty(*lead, 0, dtype=torch.float32))


def recurrence(m: ShortConv, full: Tensor, extras: tuple[Tensor, ...], start: Start) -> Step:
    """full = [conv window; B x] `(..., K-1+T, hidden)` -> the conv at the T tokens `(..., T, hidden)` as the `Step`'s
    output (`causal_conv`); the state (none: zero heads) passes as it is."""
    conv = causal_conv(full, m.conv.weight[:, 0], m.conv.bias)
    return Step(conv, *no_logs(full, conv.shape[-2]), start.initial)
