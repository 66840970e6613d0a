"""Tensor parallelism: one rank's shard of a `HybridLM`, as vLLM and SGLang cut Qwen's hybrids.

Each of N ranks holds a model of the same family whose config has 1/N of the heads and of the MLP columns
(`sharded_config`), so every pass, state, log and commit is the one the engine already has, sized to the shard:

- attention: q (with its gate), k and v heads column-parallel (rank r keeps heads r H/N..; K/V heads fewer than
  the ranks replicated, each rank keeping the one its query heads read), o_proj row-parallel;
- Gated DeltaNet: key and value heads column-parallel with their conv channels, `A_log`, `dt_bias`, z, b and a;
  out_proj row-parallel; each session's recurrent state, conv window and logs are the rank's heads' only;
- MLPs (and the shared expert): gate/up column-parallel, down row-parallel;
- routed experts: every expert's columns split the same way, so each rank holds every expert, routes every token
  with the same replicated router on the same hidden state, and the block ends in the one all-reduce as a dense MLP
  does: no all-to-all, and a rank's load does not depend on the routing. Or, with `expert_parallel`, the experts
  spread over the ranks whole (rank r keeps experts r E/N..(r+1) E/N - 1): every rank still routes every token with
  the replicated router, applies only its own experts (a token routed to none of them gets 0 here) and the block
  ends in the same all-reduce; the shared expert stays column/row-split;
- the embedding, the norms, the routers and the LM head replicated: logits need no gather, and the hidden state
  every rank routes and decides on is the same tensor;
- the MTP head (`mtp.*`): its decoder layer(s) split as a trunk layer is, by the same plans and all-reduces; its
  fusion projection `fc` and its norms replicated (`fc`'s output is the head's residual stream, which every rank
  needs whole: split, it would cost a collective of its own per draft step).

Where a row-parallel projection ends (a mixer's output, an MLP's) the rank's partial sums are added by one
all-reduce. The fused pass adds each part's output to the residual inside the part (`addmm`), so rank 0 hands it
the residual and the other ranks a zero: the all-reduce then yields residual + the whole output, on every rank. The
biases of row-parallel projections are kept by rank 0 only, for the same reason.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.fields import ConfigError
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.model.layers import DecoderLayer
from deltaspec.shared.model.mixers.attention import Attention
from deltaspec.shared.model.mixers.gdn import GatedDeltaNet
from deltaspec.shared.model.mlp import MLP, SparseMoE
from deltaspec.shared.model.moe import Experts
from deltaspec.shared.model.mtp_head import head_layers, layer_count

# the config fields cut by N (0: the model has no such part)
SHARDED_FIELDS = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
                  "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")

# how a parameter splits: (dim, block sizes each cut alike (None: one block), at most this many pieces (None: one a
# rank), ranks sharing a piece when fewer), or FIRST (rank 0 keeps it, the others hold zeros: a row-parallel
# projection's bias, added once by the all-reduce)
Split = tuple[int, tuple[int, ...] | None, int | None]
FIRST = "first"
COLUMN: Split = (0, None, None)  # a Linear's output rows
ROW: Split = (-1, None, None)  # a Linear's input columns


@dataclass
class Clock:
    """Seconds a rank spent in the group's collectives (its all-reduces; rank 0's broadcasts too): what its passes
    waited on the other ranks and the wire. Two clock reads a collective, nothing without a group."""

    seconds: float = 0.0


@dataclass(frozen=True)
class Rank:
    """Where a shard sits: its rank among `world` ranks and the process group they all-reduce in (None: the
    default group)."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = None
    clock: Clock = field(default_factory=Clock, compare=False)


@dataclass(frozen=True)
class Sharding:
    """How a shard was cut, kept on it (`HybridLM.sharding`) for the parts built from it later (the MTP head's
    layers, from the shard's config and its cut `mtp.*` tensors)."""

    at: Rank
    expert_parallel: bool = False

    def place(self, layers: Sequence[DecoderLayer]) -> None:
        """With `expert_parallel`, give each MoE block of `layers` (built from the shard's config) room for this
        rank's experts only, numbered from its first."""
        if not self.expert_parallel:
            return
        for layer in layers:
            if type(layer.mlp) is SparseMoE:
                whole = layer.mlp.experts
                held = whole.gate_up_proj.shape[0] // self.at.world
                layer.mlp.experts = Experts(held, whole.down_proj.shape[1], whole.down_proj.shape[2])
                layer.mlp.first_expert = self.at.rank * held

    def reduce(self, layers: Sequence[DecoderLayer], zero: Tensor) -> None:
        """All-reduce each mixer's and MLP's output of `layers`, on the layer path (a forward hook) and the fused one
        (the `fused` it hands the fused pass, added to the residual on rank 0 alone); `zero` in the weights' dtype."""
        for layer in layers:
            for module in (layer.mixer, layer.mlp):
                if module is not None:
                    module.register_forward_hook(lambda _m, _args, out: _all_reduce(out, self.at))
                    module.fused = _reduced(module.fused, self.at, zero)


def sharded_config(cfg: ModelConfig, world: int, expert_parallel: bool = False) -> ModelConfig:
    """`cfg` with the heads and MLP columns of one of `world` ranks; a ConfigError names a dimension N does not
    divide. K/V heads fewer than the ranks are replicated, as vLLM does (Qwen3-Next-80B has 2 for 16 query heads):
    each rank keeps the one its query heads read, so N must then be a multiple of them. `expert_parallel`: the
    routed experts' columns stay whole (N must divide `num_experts` instead, which stays the router's count)."""
    if world < 1:
        raise ConfigError(f"tensor parallel size must be at least 1, got {world}")
    if expert_parallel and not cfg.num_experts:
        raise ConfigError(f"expert parallelism needs routed experts, and {cfg.family} has none (num_experts is 0)")
    if expert_parallel and cfg.num_experts % world:
        raise ConfigError(f"expert parallel size {world} does not divide num_experts ({cfg.num_experts})")
    cut = {}
    for name in SHARDED_FIELDS:
        if expert_parallel and name == "moe_intermediate_size":
            continue
        size = getattr(cfg, name)
        if name == "num_key_value_heads" and size and world % size == 0:
            cut[name] = max(1, size // world)
            continue
        if size % world:
            raise ConfigError(f"tensor parallel size {world} does not divide {name} ({size})")
        cut[name] = size // world
    return dataclasses.replace(cfg, **cut)


def _mlp(m: MLP, prefix: str = "") -> dict[str, Split | str]:
    splits: dict[str, Split | str] = {f"{prefix}gate_proj.weight": COLUMN, f"{prefix}up_proj.weight": COLUMN,
                                      f"{prefix}down_proj.weight": ROW}
    if m.down_proj.bias is not None:
        splits |= {f"{prefix}gate_proj.bias": COLUMN, f"{prefix}up_proj.bias": COLUMN, f"{prefix}down_proj.bias": FIRST}
    return splits


def _splits(m: nn.Module, expert_parallel: bool) -> dict[str, Split | str] | None:
    """How each of a mixer's or MLP's parameters splits (those not named are replicated); None where it is not
    sharded yet."""
    if type(m) is GatedDeltaNet:
        qkv = (0, (m.n_k * m.d_k, m.n_k * m.d_k, m.n_v * m.d_v), None)
        return {"in_proj_qkv.weight": qkv, "conv1d.weight": qkv, "in_proj_z.weight": COLUMN,
                "in_proj_b.weight": COLUMN, "in_proj_a.weight": COLUMN, "dt_bias": COLUMN, "A_log": COLUMN,
                "out_proj.weight": ROW}
    if type(m) is Attention and (m.q_norm is None or m.norm_per_head):  # a norm over all heads would need them all
        kv: Split = (0, None, m.n_kv)  # K/V heads, replicated over the ranks when fewer
        return {"q_proj.weight": COLUMN, "q_proj.bias": COLUMN, "k_proj.weight": kv, "k_proj.bias": kv,
                "v_proj.weight": kv, "v_proj.bias": kv, "o_proj.weight": ROW, "o_proj.bias": FIRST}
    if type(m) is MLP:
        return _mlp(m)
    if type(m) is SparseMoE:
        inter = m.experts.down_proj.shape[-1]
        shared = {} if m.shared_expert is None else _mlp(m.shared_expert, "shared_expert.")
        if expert_parallel:  # whole experts, E/N a rank
            return {"experts.gate_up_proj": COLUMN, "experts.down_proj": COLUMN, **shared}
        return {"experts.gate_up_proj": (1, (inter, inter), None), "experts.down_proj": ROW, **shared}
    return None


def _take(t: Tensor, split: Split | str, at: Rank) -> Tensor:
    """Rank `at`'s part of parameter t."""
    if split == FIRST:
        return t.clone() if at.rank == 0 else torch.zeros_like(t)
    dim, blocks, most = split
    pieces = at.world if most is None else min(at.world, most)
    piece = at.rank * pieces // at.world
    parts = t.split(blocks, dim) if blocks else (t,)
    return torch.cat([p.chunk(pieces, dim)[piece] for p in parts], dim).clone()


def _layer_splits(layers: Sequence[DecoderLayer], prefix: str, what: str, family: str,
                  expert_parallel: bool) -> dict[str, Split | str]:
    """How each parameter of `layers` (named `prefix`i.) splits; a ConfigError names a part not sharded yet."""
    splits: dict[str, Split | str] = {}
    for i, layer in enumerate(layers):
        for name, part in ((layer.mixer_name, layer.mixer), ("mlp", layer.mlp)):
            if part is None:
                continue
            plan = _splits(part, expert_parallel)
            if plan is None:
                raise ConfigError(f"tensor parallel: {what} {i}'s {type(part).__name__} ({family}) is not sharded "
                                  "yet")
            splits |= {f"{prefix}{i}.{name}.{p}": s for p, s in plan.items()}
    return splits


def shard_tensors(model: HybridLM, at: Rank, expert_parallel: bool = False) -> dict[str, Tensor]:
    """Rank `at`'s part of every tensor of `model`'s state_dict (HF's names)."""
    splits = _layer_splits(model.model.layers, "model.layers.", "layer", model.config.family, expert_parallel)
    return _cut(model.state_dict(), splits, at)


def shard_mtp_tensors(model: HybridLM, at: Rank, expert_parallel: bool = False) -> dict[str, Tensor]:
    """Rank `at`'s part of `model`'s `mtp.*` tensors (in their checkpoint dtypes): the head's layers split as the
    trunk's, the rest (fusion projection, norms) replicated."""
    if not model.mtp:
        return {}
    with torch.device("meta"):
        layers = head_layers(model.config, layer_count(model.mtp))
    return _cut(model.mtp, _layer_splits(layers, "mtp.layers.", "MTP layer", model.config.family, expert_parallel), at)


def _cut(tensors: dict[str, Tensor], splits: dict[str, Split | str], at: Rank) -> dict[str, Tensor]:
    """Rank `at`'s part of each of `tensors`: those `splits` names cut, the others replicated."""
    return {k: _take(v, splits[k], at) if k in splits else v.clone() for k, v in tensors.items()}


def shard(model: HybridLM, at: Rank, expert_parallel: bool = False) -> HybridLM:
    """Rank `at`'s shard of `model`, fused; its layer path (`fuse(False)`) is all-reduced too. Its `mtp` holds the
    rank's part of the MTP head's tensors, from which `MTPHead` builds the rank's shard of the head (`sharding`).
    `expert_parallel`: routed experts spread over the ranks whole instead of cut by columns."""
    if at.world == 1:
        return model.fuse()
    cfg = sharded_config(model.config, at.world, expert_parallel)
    tensors = shard_tensors(model, at, expert_parallel)
    sharding = Sharding(at, expert_parallel)
    with torch.device("meta"):
        part = HybridLM(cfg)
        sharding.place(part.model.layers)
    part.load_state_dict(tensors, strict=True, assign=True)
    if part.config.tie_word_embeddings:
        part.lm_head.weight = part.model.embed_tokens.weight
    part.mtp, part.sharding = shard_mtp_tensors(model, at, expert_parallel), sharding
    part.eval()
    sharding.reduce(part.model.layers, part.lm_head.weight.new_zeros(()))
    part.fuse()
    return part


def _all_reduce(out: Tensor, at: Rank) -> Tensor:
    started = time.perf_counter()
    dist.all_reduce(out, group=at.group)
    at.clock.seconds += time.perf_counter() - started
    return out


def _reduced(run: Callable[..., Tensor], at: Rank, zero: Tensor) -> Callable[..., Tensor]:
    """A fused part's `fused` whose output, added to the residual on rank 0 alone, is summed over the ranks."""
    def run_shard(f: object, h: Tensor, residual: Tensor, *rest: object) -> Tensor:
        return _all_reduce(run(f, h, residual if at.rank == 0 else zero, *rest), at)
    return run_shard
