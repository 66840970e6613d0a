"""Zamba2's hybrid layer: a transformer block whose weights several layers share runs on [stream; embeddings], its
output goes through the layer's own `linear` into the input of the layer's Mamba2 mixer (normed with it), whose output
alone is added to the residual:

    t = linear(block_c(x, e)),   x <- x + mamba(norm(x + t))
    block_c(x, e) = mlp_c(norm_ff(attention_c(norm_in([x; e]))))     (no residual inside the block)

where block c is the (c mod num_mem_blocks)-th shared block and `attention_c`, `mlp_c` add hybrid layer c's own
LoRA adapters (HF's `*_adapter_list[c]`, identities at the other layers' slots) to their projections.

The layer holds two states (`HYBRID`): its K/V (each hybrid layer its own, though the block is shared) and its Mamba2
state. The shared block is one module, registered in the first layer that uses it (where HF's checkpoint holds its
tensors) and referenced, unregistered, by the others: one parameter object, loaded once. The family hands the blocks
out after the layers are built (`SharedBlockMixer.attach`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.model.mixers.attention import Attention, FusedAttention
from deltaspec.shared.model.mixers.mamba2 import Mamba2Mixer
from deltaspec.shared.model.mlp import MLP, FusedMLP
from deltaspec.shared.model.norms import RMSNorm
from deltaspec.shared.state.access import StateAccess
from deltaspec.shared.state.rollback import AttnLayerState, RecurrentSlot
from deltaspec.shared.state.spec import HYBRID

ADAPTED = ("linear_q_adapter_list", "linear_k_adapter_list", "linear_v_adapter_list")  # HF's, on the attention


def _adapters(mine: list[bool], width_in: int, rank: int, width_out: int) -> nn.ModuleList:
    """HF's adapter list: at each hybrid layer's slot a rank-`rank` LoRA pair where the layer uses this block, an
    identity (no tensors) elsewhere."""
    return nn.ModuleList(nn.Sequential(nn.Linear(width_in, rank, bias=False), nn.Linear(rank, width_out, bias=False))
                         if m else nn.Identity() for m in mine)


@dataclass
class FusedBlock:
    attention: FusedAttention
    mlp: FusedMLP
    in_norm: Tensor  # (2 hidden,) folded
    ff_norm: Tensor  # (hidden,) folded
    zero: Tensor  # a 0-dim zero: the residual the block's parts add to (the block has none)


class SharedBlock(nn.Module):
    """HF's `Zamba2AttentionDecoderLayer`: `self_attn` (the shared `Attention` on 2 x hidden inputs), `feed_forward`
    (the shared `MLP`), `input_layernorm` (over 2 x hidden), `pre_ff_layernorm`; block `block` of `n_blocks`, with
    adapters for the hybrid layers that use it among `n_layers` (attention ones only with `attention_adapters`)."""

    def __init__(self, cfg: Any, block: int, n_blocks: int, n_layers: int, attention_adapters: bool, rank: int,
                 act: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, input_size=2 * hidden)
        self.feed_forward = MLP(hidden, cfg.intermediate_size, cfg.mlp_bias, act=act)
        self.input_layernorm = RMSNorm(2 * hidden, eps, cfg.norm_offset)
        self.pre_ff_layernorm = RMSNorm(hidden, eps, cfg.norm_offset)
        mine = [c % n_blocks == block for c in range(n_layers)]
        self.attention_adapters = attention_adapters
        if attention_adapters:  # registered on the attention, where HF's names put them
            for name in ADAPTED:
                self.self_attn.add_module(name, _adapters(mine, 2 * hidden, rank, 2 * hidden))
        self.feed_forward.add_module("gate_up_proj_adapter_list",
                                     _adapters(mine, hidden, rank, 2 * cfg.intermediate_size))

    def forward(self, x: Tensor, embeds: Tensor, st: AttnLayerState, start: int, rope: tuple[Tensor, Tensor],
                c: int) -> Tensor:
        """The reference, for hybrid layer c: x and embeds `(T, hidden)` -> the block's output `(T, hidden)`."""
        u = self.input_layernorm(torch.cat([x, embeds], dim=-1))
        delta = (torch.cat([getattr(self.self_attn, name)[c](u) for name in ADAPTED], dim=-1)
                 if self.attention_adapters else None)
        m = self.pre_ff_layernorm(self.self_attn(u, st, start, rope, delta))
        return self.feed_forward(m, self.feed_forward.gate_up_proj_adapter_list[c](m))

    def fuse(self) -> FusedBlock:
        """Made once, whichever layer asks first: every layer that shares the block shares its fused weights."""
        if "_fused" not in self.__dict__:
            self.__dict__["_fused"] = FusedBlock(self.self_attn.fuse(), self.feed_forward.fuse(),
                                                 self.input_layernorm.folded(), self.pre_ff_layernorm.folded(),
                                                 self.pre_ff_layernorm.weight.new_zeros(()).detach())
        return self.__dict__["_fused"]

    def adapters(self, c: int) -> tuple[Tensor | None, Tensor | None, Tensor, Tensor]:
        """Hybrid layer c's adapters as the fast path runs them: the attention's three down projections as one
        `(3 r, 2 hidden)` and their up projections block-diagonal `(q + k + v, 3 r)` (None without them), then the
        MLP's down `(r, hidden)` and up `(2 intermediate, r)`."""
        down = up = None
        if self.attention_adapters:
            pairs = [getattr(self.self_attn, name)[c] for name in ADAPTED]
            down = torch.cat([p[0].weight.detach() for p in pairs])
            up = torch.block_diag(*(p[1].weight.detach() for p in pairs))
        mlp = self.feed_forward.gate_up_proj_adapter_list[c]
        return down, up, mlp[0].weight.detach(), mlp[1].weight.detach()

    def fused(self, f: FusedBlock, adapters: tuple[Tensor | None, Tensor | None, Tensor, Tensor], x: Tensor,
              embeds: Tensor, rope: tuple[Tensor, Tensor], access: StateAccess, j: int) -> Tensor:
        attn_down, attn_up, mlp_down, mlp_up = adapters
        u = torch.cat([x, embeds], dim=-1)
        u = F.rms_norm(u, u.shape[-1:], f.in_norm, self.input_layernorm.eps)
        delta = None if attn_down is None else F.linear(F.linear(u, attn_down), attn_up)
        a = self.self_attn.fused(f.attention, u, f.zero, rope, access, j, delta)
        m = F.rms_norm(a, a.shape[-1:], f.ff_norm, self.pre_ff_layernorm.eps)
        return self.feed_forward.fused(f.mlp, m, f.zero, F.linear(F.linear(m, mlp_down), mlp_up))


@dataclass
class FusedHybrid:
    block: FusedBlock
    adapters: tuple[Tensor | None, Tensor | None, Tensor, Tensor]
    linear_t: Tensor  # linear.weight.t(), a view
    mamba_norm: Tensor  # (hidden,) folded
    mamba: Any  # the Mamba2 mixer's own `fuse()`


class SharedBlockMixer(nn.Module):
    """One hybrid layer: its `linear` and `mamba_decoder` (`mamba`, `input_layernorm`) as HF names them, and the
    shared block (`shared_transformer`, registered where this layer owns it). It norms its own input
    (`prenorm` False) and reads the pass's embeddings (`reads_embeds`)."""

    state = HYBRID
    prenorm = False
    reads_embeds = True
    compiles = True  # its fast path traces into a graph whose token count is symbolic

    def __init__(self, hidden: int, eps: float, mamba: Mamba2Mixer) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden, bias=False)
        self.mamba_decoder = nn.Module()
        self.mamba_decoder.mamba = mamba
        self.mamba_decoder.input_layernorm = RMSNorm(hidden, eps, 0.0)
        self.index = -1  # this layer's place among the hybrid layers (its adapters' slot): set by `attach`

    def attach(self, block: SharedBlock, index: int, owner: bool) -> None:
        """Use `block` as hybrid layer `index`; `owner`: its tensors are this layer's (the first layer using it)."""
        self.__dict__["block"] = block  # a plain reference: registered once, in the owner
        self.index = index
        if owner:
            self.shared_transformer = block

    @property
    def shared(self) -> SharedBlock:
        return self.__dict__["block"]

    def forward(self, x: Tensor, st: tuple[RecurrentSlot, AttnLayerState], start: int, rope: tuple[Tensor, Tensor],
                embeds: Tensor) -> Tensor:
        """The reference: what the layer adds to the residual stream x `(T, hidden)`."""
        t = self.linear(self.shared(x, embeds, st[1], start, rope, self.index))
        decoder = self.mamba_decoder
        return decoder.mamba(decoder.input_layernorm(x + t), st[0], start, rope)

    def fuse(self) -> FusedHybrid:
        decoder = self.mamba_decoder
        return FusedHybrid(self.shared.fuse(), self.shared.adapters(self.index), self.linear.weight.detach().t(),
                           decoder.input_layernorm.folded(), decoder.mamba.fuse())

    def fused(self, f: FusedHybrid, h: Tensor, residual: Tensor, rope: tuple[Tensor, Tensor], access: StateAccess,
              index: tuple[int, int]) -> Tensor:
        """The layer on the residual stream itself (h is it: no norm before), added to it; `index`: (recurrent,
        attention)."""
        t = self.shared.fused(f.block, f.adapters, residual, access.embeds, rope, access, index[1])
        x = torch.addmm(residual, t, f.linear_t)
        decoder = self.mamba_decoder
        normed = F.rms_norm(x, x.shape[-1:], f.mamba_norm, decoder.input_layernorm.eps)
        return decoder.mamba.fused(f.mamba, normed, residual, rope, access, index[0])
