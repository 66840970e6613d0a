"""Versioned model state: the committed head, the staged round, and the one place rollback happens.

A forward pass never changes the committed head. It *stages* tokens on top of it: attention
layers write K/V past the committed length (never read unless committed), and each Gated
DeltaNet layer logs, per token, its pre-conv input x_t, key k_t, delta-rule correction delta_t
and log decay g_t, and keeps the state after all staged tokens in one spare buffer.

`commit(n)` makes the first n staged tokens part of the head. For a GDN layer (per head):

    S_n = exp(G_n) S_0 + sum_{t<n} exp(G_n - G_t) k_t delta_t^T,     G_t = g_0 + ... + g_t

which is exact because the logged delta_t of an accepted prefix are the ones a sequential run
computes. The result is written into the spare buffer and then swapped in, for every layer at
once, after all arithmetic is done, so no reader sees some layers moved and others not. When
n equals everything staged the spare already holds S_n and commit is a pointer swap. The conv
window becomes the last K-1 columns of [window | x_0 .. x_{n-1}], which holds for any n,
including n >= K-1 where the old window drops out entirely. Attention is cut by position.

Cost per round and GDN layer: one extra state (the spare) plus O(T (conv_dim + H (Dk + Dv)))
logged numbers; no forward pass is ever re-run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from shared.model.config import ModelConfig


@dataclass
class GDNLayerState:
    """Committed conv window `(conv_dim, K-1)` and recurrent state `(H, Dk, Dv)` float32, plus the staging log."""

    conv: Tensor
    recurrent: Tensor
    spare: Tensor
    x_log: list[Tensor] = field(default_factory=list)  # (T, conv_dim) pre-conv inputs
    k_log: list[Tensor] = field(default_factory=list)  # (T, H, Dk) normalised keys, repeated to value heads
    delta_log: list[Tensor] = field(default_factory=list)  # (T, H, Dv)
    g_log: list[Tensor] = field(default_factory=list)  # (T, H) log decays
    spare_valid: bool = False  # spare holds the state after everything staged

    def staged_conv_window(self) -> Tensor:
        """The K-1 pre-conv inputs preceding the next token to stage, as `(K-1, conv_dim)`."""
        width = self.conv.shape[1]
        history = torch.cat([self.conv.t(), *self.x_log], dim=0)
        return history[history.shape[0] - width :]

    def staged_state(self) -> Tensor:
        return self.spare if self.spare_valid else self.recurrent

    def stage(self, x: Tensor, k: Tensor, delta: Tensor, g: Tensor, final_state: Tensor) -> None:
        self.x_log.append(x)
        self.k_log.append(k)
        self.delta_log.append(delta)
        self.g_log.append(g)
        self.spare.copy_(final_state)
        self.spare_valid = True

    def prepare_commit(self, n: int, staged: int) -> tuple[Tensor, Tensor]:
        """New (conv, recurrent) after keeping the first n of `staged` tokens; touches only the spare."""
        x = torch.cat(self.x_log, dim=0)[:n]
        width = self.conv.shape[1]
        conv = torch.cat([self.conv, x.t().to(self.conv.dtype)], dim=1)[:, -width:].contiguous()
        if n == staged:
            return conv, self.spare
        k = torch.cat(self.k_log, dim=0)[:n]  # (n, H, Dk)
        delta = torch.cat(self.delta_log, dim=0)[:n]  # (n, H, Dv)
        G = torch.cat(self.g_log, dim=0)[:n].cumsum(0)  # (n, H)
        weighted_k = k * (G[-1] - G).exp()[..., None]
        # spare <- exp(G_n) S_0 + sum_t exp(G_n - G_t) k_t delta_t^T, batched over heads
        torch.baddbmm(
            self.recurrent * G[-1].exp()[:, None, None],
            weighted_k.permute(1, 2, 0),
            delta.permute(1, 0, 2),
            out=self.spare,
        )
        return conv, self.spare

    def apply(self, conv: Tensor, recurrent: Tensor) -> None:
        if recurrent is self.spare:
            self.spare, self.recurrent = self.recurrent, self.spare
        self.conv = conv
        self.clear()

    def clear(self) -> None:
        self.x_log.clear()
        self.k_log.clear()
        self.delta_log.clear()
        self.g_log.clear()
        self.spare_valid = False

    def nbytes_staged(self) -> int:
        logs = (*self.x_log, *self.k_log, *self.delta_log, *self.g_log)
        return sum(t.numel() * t.element_size() for t in logs)


@dataclass
class AttnLayerState:
    """K/V buffers `(H_kv, capacity, D)` addressed by position; only positions < committed length are the head."""

    k: Tensor
    v: Tensor

    def ensure_capacity(self, needed: int) -> None:
        capacity = self.k.shape[1]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = old.new_empty(old.shape[0], new_capacity, old.shape[2])
            grown[:, :capacity] = old
            setattr(self, name, grown)


class ModelState:
    """One sequence's state for a whole hybrid stack: the committed head and at most one staged round."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 capacity: int = 256) -> None:
        self.length = 0  # tokens in the committed head
        self.staged = 0  # tokens staged on top of it
        self.layers: list[GDNLayerState | AttnLayerState] = []
        for kind in config.layer_types:
            if kind == "linear_attention":
                shape = (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
                self.layers.append(GDNLayerState(
                    conv=torch.zeros(config.conv_dim, config.linear_conv_kernel_dim - 1, device=device, dtype=dtype),
                    recurrent=torch.zeros(shape, device=device, dtype=torch.float32),
                    spare=torch.zeros(shape, device=device, dtype=torch.float32),
                ))
            else:
                shape = (config.num_key_value_heads, capacity, config.head_dim)
                self.layers.append(AttnLayerState(
                    k=torch.zeros(shape, device=device, dtype=dtype), v=torch.zeros(shape, device=device, dtype=dtype)
                ))

    def commit(self, n: int) -> None:
        """Keep the first n staged tokens, drop the rest. All layers move together or none does."""
        if not 0 <= n <= self.staged:
            raise ValueError(f"commit of {n} tokens, but {self.staged} are staged")
        if n == 0:
            self.revert()
            return
        gdn = [layer for layer in self.layers if isinstance(layer, GDNLayerState)]
        prepared = [layer.prepare_commit(n, self.staged) for layer in gdn]
        for layer, (conv, recurrent) in zip(gdn, prepared):
            layer.apply(conv, recurrent)
        self.length += n
        self.staged = 0

    def revert(self) -> None:
        """Drop everything staged; the head is untouched by construction."""
        for layer in self.layers:
            if isinstance(layer, GDNLayerState):
                layer.clear()
        self.staged = 0

    def staged_bytes(self) -> int:
        return sum(layer.nbytes_staged() for layer in self.layers if isinstance(layer, GDNLayerState))

    def clone(self) -> ModelState:
        """A deep copy of the head (used by the checkpoint strategies in the benchmark and by tests)."""
        if self.staged:
            raise ValueError("clone with a staged round")
        twin = object.__new__(ModelState)
        twin.length, twin.staged = self.length, 0
        twin.layers = [
            GDNLayerState(conv=l.conv.clone(), recurrent=l.recurrent.clone(), spare=l.spare.clone())
            if isinstance(l, GDNLayerState) else AttnLayerState(k=l.k.clone(), v=l.v.clone())
            for l in self.layers
        ]
        return twin
