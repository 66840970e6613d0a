"""Two token mixers side by side on the same normed input, their outputs added to the residual together: Falcon-H1's
layers, a Mamba2 mixer beside an attention, each with its own multipliers (`Mamba2Mixer`'s and `Attention`'s).

Such a layer holds two states (`HYBRID`, `deltaspec.shared.state.spec`): the reference gets its recurrent slot and
its K/V as a pair (`ModelState.layer_views`), the fast path its index among the recurrent layers and among the
attention layers (`fused.fuse_stack`), so each part addresses its own state through the same `StateAccess` as it
would in a layer of its own. Nothing is new to the state floor: rollback is each part's.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from deltaspec.shared.state.access import StateAccess
from deltaspec.shared.state.rollback import AttnLayerState, RecurrentSlot
from deltaspec.shared.state.spec import HYBRID


class ParallelMixer(nn.Module):
    """`recurrent` and `attention`, registered under `names` (HF's module names for them)."""

    state = HYBRID

    def __init__(self, recurrent: nn.Module, attention: nn.Module, names: tuple[str, str] = ("mamba", "self_attn")):
        super().__init__()
        self.names = names
        self.add_module(names[0], recurrent)
        self.add_module(names[1], attention)

    @property
    def parts(self) -> tuple[Any, Any]:
        return getattr(self, self.names[0]), getattr(self, self.names[1])

    @property
    def compiles(self) -> bool:
        return all(part.compiles for part in self.parts)

    def forward(self, h: Tensor, st: tuple[RecurrentSlot, AttnLayerState], start: int,
                rope: tuple[Tensor, Tensor]) -> Tensor:
        """The reference: both parts' outputs on one sequence's T tokens `(T, hidden)`, summed."""
        recurrent, attention = self.parts
        return recurrent(h, st[0], start, rope) + attention(h, st[1], start, rope)

    def fuse(self) -> tuple[Any, Any]:
        return tuple(part.fuse() for part in self.parts)  # type: ignore[return-value]

    def fused(self, f: tuple[Any, Any], h: Tensor, residual: Tensor, rope: tuple[Tensor, Tensor],
              access: StateAccess, index: tuple[int, int]) -> Tensor:
        """Both parts on the normed input h, each added to the residual in turn; `index`: (recurrent, attention)."""
        recurrent, attention = self.parts
        x = recurrent.fused(f[0], h, residual, rope, access, index[0])
        return attention.fused(f[1], h, x, rope, access, index[1])
