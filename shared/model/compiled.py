"""Compiled passes: a decode or verify pass of the fused path as `torch.compile` (Inductor) graphs.

Even fused, an eager step of these small models is mostly dispatch: the draft model's decode step is about
110 ATen calls for a few microseconds of arithmetic each. Inductor fuses the elementwise work into a few
generated loops, leaves the matmuls to ATen, and on the CPU calls it all from generated C++ (`cpp_wrapper`).

Nothing in the graph depends on where the pass sits: it is the one forward pass (`fused.forward`) over a
`StaticAccess`, where positions and log slots enter as index tensors (K/V and the GDN logs are written with
`index_copy_`), and attention reads the whole K/V buffer under a position
mask, and the token count is symbolic. So a new position, round or cache size never recompiles: a model
(or a layer kind) gets one graph for one token (the recurrent update) and one for 2 tokens up to the state's
log capacity (one chunk; a draft's states log more than a target's, so it has graphs of its own), each for a
pass from the head and one on top of a staging (the two read different GDN buffers: an attention layer kind
has just the first two). Passes longer than the logs (prefill) take the eager path. The fused path stays the truth:
`tests/test_compiled.py`
compares logits and every state buffer of both on random weights. A sparse MoE model compiles in bfloat16, its
experts as grouped matmuls (`kernels.experts.apply_experts`): fixed shapes whatever the routing.

A shallow model (the 2-layer embedded draft) runs each pass as one graph. A whole graph's compile time grows
with depth (Inductor's passes over all of it: the 12-layer target's had not finished after 15 minutes), so a
deeper model compiles one graph per layer kind instead, shared by every layer of that kind and called layer by
layer: a few more calls per pass, and a compile time that does not depend on depth.
"""
from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch
from torch import Tensor

from deltaspec.shared.model import fused
from deltaspec.shared.model.layers import DecoderLayer
from deltaspec.shared.state.access import RECURRENT_BUFFERS, StaticAccess
from deltaspec.shared.state.rollback import ModelState
from deltaspec.shared.state.spec import ATTENTION, CHAIN_LOG_CAPACITY, HOLDS, LOG_CAPACITY, RECURRENT, STATELESS

WHOLE_GRAPH_LAYERS = 4  # deeper stacks compile per layer kind (a whole 12-layer graph was not compiled after 15 min)
# A pass's most tokens, for every state: one range, whatever a state's log capacity (`fits` keeps each pass within
# its own), so every compile of a graph agrees on it. Ranges that differed per capacity made Inductor's on-disk FX
# graph cache hand a graph compiled for 2..36 tokens to a trace marked 2..51, which dynamo refuses.
MAX_PASS_TOKENS = CHAIN_LOG_CAPACITY

# Inductor warns, once per graph, that the chunk kernel's triangular solve (and a MoE block's `index_add`) has no C
# shim and runs through its proxy executor under the C++ wrapper. Expected (and no slower here than the Python
# wrapper): off the terminal.
_NO_SHIM = ("linalg_solve_triangular", "aten.index_add")
logging.getLogger("torch._inductor.ir").addFilter(
    lambda record: not any(op in record.getMessage() for op in _NO_SHIM))


def _static_layer(layer: DecoderLayer, f: fused.FusedLayer, x: Tensor, cos: Tensor, signed_sin: Tensor,
                  positions: Tensor, slots: Tensor, *buffers: Tensor) -> Tensor:
    """One layer of a static pass on its own buffers: a recurrent layer's `RECURRENT_BUFFERS`, an attention layer's
    K and V, or both in that order (a HYBRID layer), then the pass's embeddings where the mixer reads them. What a
    per-layer graph compiles (one copy per layer kind, so no graph ever sees another kind)."""
    held = HOLDS[layer.state or STATELESS]
    n = len(RECURRENT_BUFFERS) if RECURRENT in held else 0
    embeds = buffers[-1] if _reads_embeds(layer) else None
    kv = buffers[n:n + 2]
    access = StaticAccess(positions, slots, {name: (t,) for name, t in zip(RECURRENT_BUFFERS, buffers[:n])},
                          (kv,) if ATTENTION in held else (), embeds)  # type: ignore[arg-type]
    return fused.decoder_layer(layer, f, x, (cos, signed_sin), access, (0, 0) if len(held) == 2 else 0)


def _reads_embeds(layer: DecoderLayer) -> bool:
    return getattr(layer.mixer, "reads_embeds", False)


def static_pass(model: fused.Model, x: Tensor, cos: Tensor, signed_sin: Tensor, positions: Tensor, slots: Tensor,
                gdn: dict[str, Tensor], kv: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """`HybridLM.forward` on the fused path from the embeddings, every state write in the pass: tokens at
    `positions`, logged at `slots`, on the buffers `StaticAccess.recurrent_buffers` names and the K/V buffers `kv`.
    What a
    whole-model graph compiles, and what `deltaspec.shared.model.captured` records."""
    return fused.forward(model, x, (cos, signed_sin), StaticAccess(positions, slots, gdn, kv))


class CompiledPasses:
    """The compiled passes of one model, and the bookkeeping around them that `HybridLM.forward` would do.

    Up to `WHOLE_GRAPH_LAYERS` layers the pass is one graph (`static_pass`); deeper stacks compile one graph per layer
    kind (`_static_layer`), called layer by layer by the one pass: compile time no longer grows with depth."""

    def __init__(self, device: torch.device, n_layers: int) -> None:
        options: dict = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        if device.type == "cpu":
            _require_cpp_compiler()
            options["cpp_wrapper"] = True  # the kernels called from generated C++: no Python per kernel
        self.per_layer = n_layers > WHOLE_GRAPH_LAYERS
        self.options = options
        self.layer_graphs: dict[str, Callable[..., Tensor]] = {}  # per layer kind, made at its first layer
        if not self.per_layer:
            self.fn: Callable[..., tuple[Tensor, Tensor]] = _compile(static_pass, options)

    @staticmethod
    def fits(state: ModelState, T: int) -> bool:
        """Whether a pass of T tokens is one the graphs cover: its recurrent steps land in the logs, and no prefix
        cache takes heads inside it (`BlockHeads`: eager passes only)."""
        rec = state.recurrent
        return rec.logged and state.staged + T <= rec.log_capacity and rec.block_heads is None

    def __call__(self, model: fused.Model, x: Tensor, state: ModelState,
                 rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        T, start = x.shape[0], state.length + state.staged
        state.ensure_positions(start + T)
        positions = torch.arange(start, start + T, device=x.device)
        return self.run(model, x, rope, positions, positions - state.length,
                        StaticAccess.recurrent_buffers(state, self.per_layer),
                        [(layer.k, layer.v) for layer in state.attn])

    def run(self, model: fused.Model, x: Tensor, rope: tuple[Tensor, Tensor], positions: Tensor, slots: Tensor,
            gdn: dict, kv: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """The compiled pass over given buffers (`static_pass`'s arguments; `gdn` per layer when `per_layer`)."""
        # the rope rows as tensors of their own: as views of the table at the pass's position, dynamo specialises
        # graphs on a storage offset of 0 or 1, and the first pass past them recompiles (a server's first request)
        rope = tuple(t.clone() for t in rope)
        if x.shape[0] > 1:  # one graph for every verify length
            for t in (x, *rope, positions, slots):
                torch._dynamo.mark_dynamic(t, 0, min=2, max=MAX_PASS_TOKENS)
        for k_cache, v_cache in kv:  # and for every K/V capacity
            torch._dynamo.maybe_mark_dynamic(k_cache, 1)
            torch._dynamo.maybe_mark_dynamic(v_cache, 1)
        if self.per_layer:
            return fused.forward(model, x, rope, StaticAccess(positions, slots, gdn, kv), self._layer)
        return self.fn(model, x, *rope, positions, slots, gdn, kv)

    def _layer(self, layer: DecoderLayer, f: fused.FusedLayer, x: Tensor, rope: tuple[Tensor, Tensor],
               access: StaticAccess, index: fused.Index) -> Tensor:
        """`fused.decoder_layer` as its kind's graph, on the layer's own buffers; its input's token count symbolic
        from 2 tokens on (each layer's `x` is a new tensor)."""
        if x.shape[0] > 1:
            torch._dynamo.mark_dynamic(x, 0, min=2, max=MAX_PASS_TOKENS)
        held = dict(zip(HOLDS[layer.state or STATELESS], index if isinstance(index, tuple) else (index,)))
        buffers = ([access.buffers[name][held[RECURRENT]] for name in RECURRENT_BUFFERS] if RECURRENT in held else [])
        buffers += access.kv[held[ATTENTION]] if ATTENTION in held else ()
        if _reads_embeds(layer):
            buffers.append(access.embeds)
            if x.shape[0] > 1:
                torch._dynamo.mark_dynamic(access.embeds, 0, min=2, max=MAX_PASS_TOKENS)
        graph = self.layer_graphs.get(layer.kind)
        if graph is None:
            graph = self.layer_graphs[layer.kind] = _compile(_static_layer, self.options)
        return graph(layer, f, x, *rope, access.positions, access.slots, *buffers)

    @staticmethod
    def warm_up(model: fused.Model, log_capacity: int = LOG_CAPACITY) -> None:
        """Compile every graph now (a server does this before it serves): one and several tokens, from the head
        and on top of a staging, for states whose logs hold `log_capacity` tokens."""
        state = model.new_state(log_capacity=log_capacity)
        ids = torch.arange(6, device=model.device) % model.config.vocab_size
        for first, second in ((1, 1), (3, 2)):
            model(ids[:first], state)
            model(ids[:second], state)
            state.revert()


def _require_cpp_compiler() -> None:
    """Inductor builds CPU kernels with a C++ compiler: refuse up front, and say so, where there is none."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        raise ValueError("compiled passes on a CPU need a C++ compiler (g++ on the PATH, or one named by $CXX) and "
                         "none was found: install one, or run without --compile") from None


def _compile(fn: Callable, options: dict) -> Callable:
    # A code object of its own: dynamo keeps graphs per code object, so this model's graphs are the only ones it
    # looks up, and their guards can skip the module's attributes (the model's structure does not change).
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
    return torch.compile(own, fullgraph=True, options=options)
