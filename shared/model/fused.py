"""The fused path: the same hybrid stack in far fewer ATen calls, for decode and verify.

At these model sizes a step costs per-op dispatch, not arithmetic, so this path cuts ops: each mixer runs its
input projections as one matmul (`mixer.fuse()`, `deltaspec.shared.model.mixers`), an MLP its gate/up (a sparse MoE
block its router, shared expert gate/up and shared expert gate), norms are single `rms_norm` calls with their
weights folded, residual adds ride on `addmm`. `fuse_stack` builds the concatenated weights once and re-points the
original parameters at slices of them (no extra memory; `state_dict` keys and values are unchanged).

This is the one forward pass (`forward`: one layer loop, one head). The eager, compiled, CUDA-graph and batched
passes differ only in the `deltaspec.shared.state.access.StateAccess` they hand it (how the state is addressed) and,
for compiled passes, in `run_layer`. The layer forwards in `deltaspec.shared.model.layers` stay the truth, its naive
twin: `tests/test_fused.py` checks this path against them on random weights.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.model.layers import DecoderLayer, HybridStack
from deltaspec.shared.state.access import StateAccess
from deltaspec.shared.state.rollback import ModelState
from deltaspec.shared.state.spec import ATTENTION, HOLDS, RECURRENT, STATELESS

if TYPE_CHECKING:
    from deltaspec.shared.model.config import ModelConfig

# a mixer's index among the layers of its state kind; a HYBRID layer's mixer's: (recurrent, attention)
Index = int | tuple[int, int]


class Model(Protocol):
    """What the passes (fused, compiled, captured) read of the model that runs them, `hybrid.HybridLM`: typed by
    shape here, so that they import nothing of it and it alone imports them."""

    config: ModelConfig
    model: HybridStack
    fused: FusedStack | None
    lm_head: nn.Linear
    compiled: Any  # its `compiled.CompiledPasses` while compile() is on

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def rope(self, start: int, end: int, like: Tensor) -> tuple[Tensor, Tensor, Tensor]: ...

    def logits(self, y: Tensor) -> Tensor: ...

    def new_state(self, capacity: int = ..., log_capacity: int = ...) -> ModelState: ...

    def __call__(self, ids: Tensor, state: ModelState) -> tuple[Tensor, Tensor]: ...


@dataclass
class FusedLayer:
    input_norm: Tensor | None  # (hidden,) the folded norm weights; None where the layer has no such part
    post_norm: Tensor | None
    mixer: Any  # the parts' own fused weights (`mixer.fuse()`, `mlp.fuse()`)
    mlp: Any
    run_mixer: Callable[..., Tensor] | None  # the parts' `fused`, looked up once (a step is dispatch-bound)
    run_mlp: Callable[..., Tensor] | None
    input_eps: float = 0.0
    post_eps: float = 0.0
    no_residual: Tensor | None = None  # a 0-dim zero: what a post-norm layer hands its parts for the residual
    normed_residual: tuple[float, float] | None = None  # (mixer's, MLP's alpha): the residual is the normed input


@dataclass
class FusedStack:
    layers: list[FusedLayer]
    final_norm: Tensor  # (hidden,) folded
    order: list[tuple[DecoderLayer, FusedLayer, Index]]  # each layer, its fused part, its index among its state kind


def fuse_stack(stack: HybridStack) -> FusedStack:
    layers = [fuse_layer(layer) for layer in stack.layers]
    counts = {RECURRENT: 0, ATTENTION: 0}  # each mixer addresses the index-th state of its kind
    order = []
    for layer, f in zip(stack.layers, layers):
        held = HOLDS[layer.state or STATELESS]  # a HYBRID layer's mixer addresses both: (recurrent, attention)
        index = tuple(counts[kind] for kind in held)
        order.append((layer, f, index[0] if len(index) == 1 else index or 0))
        for kind in held:
            counts[kind] += 1
    return FusedStack(layers, stack.norm.folded(), order)


def fuse_layer(layer: DecoderLayer) -> FusedLayer:
    mixer, mlp = layer.mixer, layer.mlp
    f = FusedLayer(input_norm=None, post_norm=None, mixer=None, mlp=None, run_mixer=None, run_mlp=None)
    if mixer is not None:
        if layer.prenorm:  # else the mixer norms its own input: it takes the residual stream as it is
            f.input_norm, f.input_eps = layer.input_layernorm.folded(), layer.input_layernorm.eps
        f.mixer, f.run_mixer = mixer.fuse(), mixer.fused
    if mlp is not None:
        f.post_norm, f.post_eps = layer.post_attention_layernorm.folded(), layer.post_attention_layernorm.eps
        f.mlp, f.run_mlp = mlp.fuse(), mlp.fused
    f.normed_residual = layer.normed_residual
    if layer.norm_after:  # its parts' outputs are normed before the residual add, so they add none themselves
        weight = layer.post_attention_layernorm.weight if mixer is None else layer.input_layernorm.weight
        f.no_residual = weight.new_zeros(()).detach()
    return f


def decoder_layer(layer: DecoderLayer, f: FusedLayer, x: Tensor, rope: tuple[Tensor, Tensor], access: StateAccess,
                  index: Index) -> Tensor:
    """`DecoderLayer.forward` in fewer ops: the mixer (the index-th of its kind) and the MLP, each on its pre-norm and
    added to the residual. `rope` is (cos, `rotary.rotary_signed` sin) at the tokens' positions."""
    if f.no_residual is not None:
        return _post_norm_layer(f, x, rope, access, index)
    if f.normed_residual is not None:
        return _normed_residual_layer(f, x, rope, access, index)
    if f.run_mixer is not None:
        h = x if f.input_norm is None else F.rms_norm(x, x.shape[-1:], f.input_norm, f.input_eps)
        x = f.run_mixer(f.mixer, h, x, rope, access, index)
    if f.run_mlp is not None:
        x = f.run_mlp(f.mlp, F.rms_norm(x, x.shape[-1:], f.post_norm, f.post_eps), x)
    return x


def _post_norm_layer(f: FusedLayer, x: Tensor, rope: tuple[Tensor, Tensor], access: StateAccess,
                     index: Index) -> Tensor:
    """A `norm_after` layer: the mixer and the MLP on the residual stream itself, each output normed, then added."""
    if f.run_mixer is not None:
        y = f.run_mixer(f.mixer, x, f.no_residual, rope, access, index)
        x = x + F.rms_norm(y, y.shape[-1:], f.input_norm, f.input_eps)
    if f.run_mlp is not None:
        y = f.run_mlp(f.mlp, x, f.no_residual)
        x = x + F.rms_norm(y, y.shape[-1:], f.post_norm, f.post_eps)
    return x


def _normed_residual_layer(f: FusedLayer, x: Tensor, rope: tuple[Tensor, Tensor], access: StateAccess,
                           index: Index) -> Tensor:
    """A `normed_residual` layer (MiniMax's): each part on its normed input, added to that input times its alpha."""
    alphas = f.normed_residual
    if f.run_mixer is not None:
        h = F.rms_norm(x, x.shape[-1:], f.input_norm, f.input_eps)
        x = f.run_mixer(f.mixer, h, h if alphas[0] == 1.0 else h * alphas[0], rope, access, index)
    if f.run_mlp is not None:
        h = F.rms_norm(x, x.shape[-1:], f.post_norm, f.post_eps)
        x = f.run_mlp(f.mlp, h, h if alphas[1] == 1.0 else h * alphas[1])
    return x


LayerFn = Callable[[DecoderLayer, FusedLayer, Tensor, tuple[Tensor, Tensor], StateAccess, Index], Tensor]


def forward(model: Model, x: Tensor, rope: tuple[Tensor, Tensor], access: StateAccess,
            run_layer: LayerFn | None = None) -> tuple[Tensor, Tensor]:
    """The one forward pass, from the embeddings `x (N, hidden)`: every layer through `run_layer` (a compiled
    layer, or `decoder_layer`), then the head. Returns float32 logits `(N, vocab)` and the last layer's hidden states
    before the final norm. Where the state lives is the access's business alone."""
    run_layer = run_layer or decoder_layer
    access.embeds = x  # what a mixer that reads the embeddings finds there (Zamba2's shared block)
    for layer, f, index in model.fused.order:
        x = run_layer(layer, f, x, rope, access, index)
    return head(model, x), x


def head(model: Model, x: Tensor) -> Tensor:
    """The final norm and the LM head: float32 logits."""
    return model.logits(F.rms_norm(x, x.shape[-1:], model.fused.final_norm, model.model.norm.eps))
