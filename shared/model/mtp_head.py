"""The target checkpoint's MTP head (`mtp.*`) as a module: its fusion projection over the embedding of x_{i+1} and
the trunk's post-norm hidden state h_i, its decoder layer(s) with their own K/V, its end norm. The wiring and its
references are in `deltaspec.shared.decoding.drafters.mtp`, which drafts with it.

On a tensor-parallel shard (`deltaspec.shared.model.parallel`) the head is the rank's shard, built from the shard's
config and its cut `mtp.*` tensors: its layers' heads and MLP columns (or experts) split as a trunk layer's, each
mixer's and MLP's output all-reduced, each cache the rank's K/V heads. Rank 0's passes and new caches are announced
to the followers (`deltaspec.shared.model.lockstep`) so that their all-reduces pair up.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.layers import DecoderLayer
from deltaspec.shared.model.loader import float32_names
from deltaspec.shared.model.norms import RMSNorm
from deltaspec.shared.model.rotary import rotary_cos_sin
from deltaspec.shared.state.rollback import AttnLayerState
from deltaspec.shared.state.spec import ATTENTION, RECURRENT

if TYPE_CHECKING:
    from deltaspec.shared.model.hybrid import HybridLM


def layer_kinds(cfg: ModelConfig, n_layers: int) -> tuple[str, ...]:
    """The head's layer kinds: the family's (`mtp_layer_types`), else Qwen's, `n_layers` full-attention layers."""
    return cfg.mtp_layer_types or ("full_attention",) * n_layers


def head_layers(cfg: ModelConfig, n_layers: int) -> list[DecoderLayer]:
    """The family's layers of those kinds, with the config's `mtp_overrides`; a MoE model's are sparse (their own
    MoE block and shared expert, in every published layout)."""
    layer_cfg = dataclasses.replace(cfg, **dict(cfg.mtp_overrides))
    return [DecoderLayer(layer_cfg, kind, cfg.num_experts > 0) for kind in layer_kinds(cfg, n_layers)]


def layer_count(mtp: dict[str, Tensor]) -> int:
    """How many decoder layers the `mtp.*` tensors hold."""
    return len({k.split(".")[2] for k in mtp if k.startswith("mtp.layers.")})


@dataclass(eq=False)
class MTPCache:
    """One sequence's K/V in the head: per layer, its `AttnLayerState` (None for an MLP alone). Rows are addressed
    by position and roll back by position (the drafter's committed length): a pass is its only change."""

    layers: list[AttnLayerState | None]


class MTPHead(nn.Module):
    """The `mtp.*` module; its state_dict keys are the checkpoint's keys (after the family's `convert`) without
    `mtp.`."""

    def __init__(self, target: HybridLM) -> None:
        super().__init__()
        cfg = target.config  # a shard's: its heads and columns
        weights = {k[len("mtp."):]: v for k, v in target.mtp.items()}
        n_layers = layer_count(target.mtp)
        if not weights or not n_layers:
            raise ValueError("the target checkpoint has no MTP head (no mtp.layers.* tensors)")
        D, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        self.cfg = cfg
        self.target = weakref.ref(target)  # its embedding, and its leader where it has one
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(D, eps, offset)
        self.pre_fc_norm_hidden = RMSNorm(D, eps, offset)
        self.layers = nn.ModuleList(head_layers(cfg, n_layers))
        if any(layer.state == RECURRENT for layer in self.layers):
            raise ValueError("an MTP head with recurrent layers is not supported: its cache rolls back by position")
        if target.sharding is not None:
            target.sharding.place(self.layers)
        self.norm = RMSNorm(D, eps, offset)
        missing, unexpected = self.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ValueError(f"mtp.* tensors do not match the MTP layout: missing {sorted(missing)[:3]}, "
                             f"unexpected {sorted(unexpected)[:3]}")
        float32 = float32_names(self)  # a router kept in float32, as the trunk's is
        for name, t in self.to(device=target.device).state_dict(keep_vars=True).items():
            t.data = t.data.to(torch.float32 if name in float32 else target.dtype)
        if target.sharding is not None:
            target.sharding.reduce(self.layers, self.fc.weight.new_zeros(()))
        self.eval()

    def new_cache(self, capacity: int = 256) -> MTPCache:
        """K/V for each attention layer of the head, shaped as the trunk's (a latent attention's latent as one
        head); None for its MLPs. On rank 0 of a group each follower makes its shard of it too."""
        spec = self.cfg.state_spec
        shape = (spec.kv_heads, capacity, spec.head_dim)
        p = self.fc.weight
        cache = MTPCache([AttnLayerState(p.new_zeros(shape), p.new_zeros(shape)) if layer.state == ATTENTION
                          else None for layer in self.layers])
        leader = self.target().leader
        if leader is not None:
            leader.new_mtp_cache(cache, capacity)
        return cache

    def forward(self, ids: Tensor, hidden: Tensor, cache: MTPCache, start: int) -> Tensor:
        """ids `(T,)` x_{i+1}, hidden `(T, D)` post-norm h_i; rows at positions start..start+T-1.

        Returns the post-`mtp.norm` states `(T, D)`; writes K/V at those positions. On rank 0 of a group the
        followers make the same pass on their shards."""
        leader = self.target().leader
        if leader is not None:
            return leader.mtp_pass(self, ids, hidden, cache, start)
        return self.run(ids, hidden, cache, start)

    @torch.inference_mode()
    def run(self, ids: Tensor, hidden: Tensor, cache: MTPCache, start: int) -> Tensor:
        """The pass on this process's head alone (a follower's, or inside rank 0's announced call)."""
        emb = self.target().model.embed(ids)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        positions = torch.arange(start, start + x.shape[0], device=x.device)
        rope = rotary_cos_sin(self.cfg.rotary_dim, self.cfg.rope_theta, positions, x.dtype)
        for layer, st in zip(self.layers, cache.layers):
            x = layer(x, st, start, rope)
        return self.norm(x)
