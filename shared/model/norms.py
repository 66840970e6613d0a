"""The norms the layers share, with HF's parameter names."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """RMSNorm applied as `(offset + w)`: Qwen's is zero-centred (`offset` 1, w stored from 0), the usual one plain
    (`offset` 0, w from 1)."""

    def __init__(self, dim: int, eps: float, offset: float = 1.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (self.offset + self.weight.float())).type_as(x)

    def folded(self) -> Tensor:
        """The weight as `F.rms_norm` takes it: `offset + w`, made once by the fused path."""
        return (self.offset + self.weight.detach().float()).to(self.weight.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of a mixer's output per head (plain weight), then gated by `act(z)`: silu (GDN's), or sigmoid (KDA's)."""

    def __init__(self, dim: int, eps: float, act: Callable[[Tensor], Tensor] = F.silu) -> None:
        super().__init__()
        self.eps, self.act = eps, act
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * self.act(gate.float())).to(x.dtype)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def concat(*linears: nn.Linear) -> Tensor:
    """One weight for several projections of the same input (the fused path's one matmul); each Linear's weight
    becomes a row slice of it, so no memory is added and `state_dict` is unchanged."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[row : row + n], requires_grad=lin.weight.requires_grad)
        row += n
    return weight
