"""Compiled passes: a decode or verify pass of the fused path as `torch.compile` (Inductor) graphs.

Even fused, an eager step of these small models is mostly dispatch: the draft model's decode step is about
110 ATen calls for a few microseconds of arithmetic each. Inductor fuses the elementwise work into a few
generated loops, leaves the matmuls to ATen, and on the CPU calls it all from generated C++ (`cpp_wrapper`).

Nothing in the graph depends on where the pass sits: positions and log slots enter as index tensors (K/V
and the GDN logs are written with `index_copy_`), attention reads the whole K/V buffer under a position
mask, and the token count is symbolic. So a new position, round or cache size never recompiles: a model
(or a layer kind) gets one graph for one token (the recurrent update) and one for 2 tokens up to the state's
log capacity (one chunk; a draft's states log more than a target's, so it has graphs of its own), each for a
pass from the head and one on top of a staging (the two read different GDN buffers: an attention layer kind
has just the first two). Passes longer than the logs (prefill) take the eager path. The fused path stays the truth: `tests/test_compiled.py`
compares logits and every state buffer of both on random weights. A sparse MoE model compiles in bfloat16, its
experts as grouped matmuls (`moe.apply_experts`): fixed shapes whatever the routing.

A shallow model (the 2-layer embedded draft) runs each pass as one graph. A whole graph's compile time grows
with depth (Inductor's passes over all of it: the 12-layer target's had not finished after 15 minutes), so a
deeper model compiles one graph per layer kind instead, shared by every layer of that kind and called layer by
layer: a few more calls per pass, and a compile time that does not depend on depth.
"""
from __future__ import annotations

import logging
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from deltaspec.shared.kernels.chunk import one_chunk_gated_delta_rule
from deltaspec.shared.model import fused
from deltaspec.shared.state.rollback import CHAIN_LOG_CAPACITY, LOG_CAPACITY, ModelState

if TYPE_CHECKING:
    from deltaspec.shared.model.hybrid import HybridLM
    from deltaspec.shared.model.layers import DecoderLayer

WHOLE_GRAPH_LAYERS = 4  # deeper stacks compile per layer kind (a whole 12-layer graph was not compiled after 15 min)
# A pass's most tokens, for every state: one range, whatever a state's log capacity (`fits` keeps each pass within
# its own), so every compile of a graph agrees on it. Ranges that differed per capacity made Inductor's on-disk FX
# graph cache hand a graph compiled for 2..36 tokens to a trace marked 2..51, which dynamo refuses.
MAX_PASS_TOKENS = CHAIN_LOG_CAPACITY
_GDN_ARGS = ("conv_in", "state_in", "window", "spare", "x", "k", "delta", "g")  # a GDN layer's state arguments

# Inductor warns, once per graph, that the chunk kernel's triangular solve (and a MoE block's `index_add`) has no C
# shim and runs through its proxy executor under the C++ wrapper. Expected (and no slower here than the Python
# wrapper): off the terminal.
_NO_SHIM = ("linalg_solve_triangular", "aten.index_add")
logging.getLogger("torch._inductor.ir").addFilter(
    lambda record: not any(op in record.getMessage() for op in _NO_SHIM))


def _gdn_layer(layer: DecoderLayer, f: fused.FusedLayer, x: Tensor, conv_in: Tensor, state_in: Tensor,
               window: Tensor, spare: Tensor, log_x: Tensor, log_k: Tensor, log_delta: Tensor, log_g: Tensor,
               slots: Tensor) -> Tensor:
    """One Gated DeltaNet layer and its MLP, writing this layer's window, state and logs (`GDNSlot.stage`'s writes).

    conv_in, state_in: the window and state before the pass (the head's, or the staging's on top of one); window,
    spare: where the staging's go; slots (T,): the tokens' log slots."""
    T = x.shape[0]
    h = F.rms_norm(x, x.shape[-1:], f.input_norm, layer.input_layernorm.eps)
    m, fm = layer.linear_attn, f.mixer
    mixed, z, b, a = fused.gdn_inputs(fm, h)
    full = torch.cat([conv_in, mixed], dim=0)
    q, k, v, beta, g = fused.gdn_gates(m, fm, full, b, a)
    if T == 1:
        out, delta, final = fused.recurrent_step(q, k, v, beta, g, state_in)
        delta = delta.transpose(0, 1)
    else:
        out, delta, final = one_chunk_gated_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                       g.t(), beta.t(), state_in)
        out = out.transpose(0, 1)
    spare.copy_(final)
    window.copy_(full[-window.shape[0]:])
    log_x.index_copy_(0, slots, mixed)
    log_k.index_copy_(2, slots, k.permute(1, 2, 0))
    log_delta.index_copy_(1, slots, delta)
    log_g.index_copy_(1, slots, g.t())
    return fused.mlp(layer, f, fused.gdn_output(m, fm, out, z, x))


def _attention_layer(layer: DecoderLayer, f: fused.FusedLayer, x: Tensor, k_cache: Tensor, v_cache: Tensor,
                     positions: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """One attention layer and its MLP: K/V written at `positions (T,)`, the whole buffer read under a position mask."""
    h = F.rms_norm(x, x.shape[-1:], f.input_norm, layer.input_layernorm.eps)
    m, fa = layer.self_attn, f.mixer
    q_gate, q, k, v = fused.attention_inputs(m, fa, h, (cos, signed_sin))
    k_cache.index_copy_(1, positions, k.transpose(0, 1))
    v_cache.index_copy_(1, positions, v.transpose(0, 1))
    mask = torch.arange(k_cache.shape[1], device=x.device)[None, :] <= positions[:, None]  # (T, capacity)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_cache[None], v_cache[None], attn_mask=mask,
                                         enable_gqa=m.n_heads != m.n_kv)[0].transpose(0, 1)
    return fused.mlp(layer, f, fused.attention_output(fa, out, q_gate, x))


def _layers(model: HybridLM, x: Tensor, cos: Tensor, signed_sin: Tensor, positions: Tensor, slots: Tensor,
            gdn: dict[str, Sequence[Tensor]], kv: list[tuple[Tensor, Tensor]],
            gdn_layer: Callable[..., Tensor] = _gdn_layer,
            attention_layer: Callable[..., Tensor] = _attention_layer) -> Tensor:
    """Every layer on the embeddings `x (T, hidden)`. gdn: per-layer sequences (a stacked tensor or a list of its
    views) under conv_in, state_in, window, spare, x, k, delta, g; kv: each attention layer's K/V buffers."""
    i = j = 0
    for layer, f in zip(model.model.layers, model.fused.layers):
        if layer.kind == "linear_attention":
            x = gdn_layer(layer, f, x, *(gdn[name][i] for name in _GDN_ARGS), slots)
            i += 1
        else:
            x = attention_layer(layer, f, x, *kv[j], positions, cos, signed_sin)
            j += 1
    return x


def _head(model: HybridLM, x: Tensor) -> tuple[Tensor, Tensor]:
    normed = F.rms_norm(x, x.shape[-1:], model.fused.final_norm, model.model.norm.eps)
    return model.lm_head(normed).float(), x


def static_pass(model: HybridLM, x: Tensor, cos: Tensor, signed_sin: Tensor, positions: Tensor, slots: Tensor,
                gdn: dict[str, Tensor], kv: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """`HybridLM.forward` on the fused path from the embeddings, every state write in the pass: tokens at
    `positions`, logged at `slots`, on the buffers `gdn_arguments` names and the K/V buffers `kv`. What a whole-model
    graph compiles, and what `deltaspec.shared.model.captured` records."""
    return _head(model, _layers(model, x, cos, signed_sin, positions, slots, gdn, kv))


def gdn_arguments(state: ModelState, per_layer: bool = False) -> dict:
    """The GDN buffers a static pass on `state` reads and writes, by `_GDN_ARGS` name: the window and state before
    it (the head's, or the staging's when it stages on top of one) and where the staging goes. Stacked tensors for a
    whole-model pass (indexed in it), per-layer views (made once) for a pass called layer by layer."""
    gdn = state.gdn
    buffers = gdn.layers if per_layer else vars(gdn)
    on_head = state.staged == 0
    return {"conv_in": buffers["conv" if on_head else "window"],
            "state_in": buffers["recurrent" if on_head else "spare"], **{name: buffers[name] for name in _GDN_ARGS[2:]}}


class CompiledPasses:
    """The compiled passes of one model, and the bookkeeping around them that `HybridLM.forward` would do.

    Up to `WHOLE_GRAPH_LAYERS` layers the pass is one graph (`static_pass`); deeper stacks compile one graph per layer kind
    (`_gdn_layer`, `_attention_layer`), called layer by layer: compile time no longer grows with depth."""

    def __init__(self, device: torch.device, n_layers: int) -> None:
        options: dict = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        if device.type == "cpu":
            _require_cpp_compiler()
            options["cpp_wrapper"] = True  # the kernels called from generated C++: no Python per kernel
        self.per_layer = n_layers > WHOLE_GRAPH_LAYERS
        if self.per_layer:
            self.gdn_layer, self.attention_layer = (_token_count_dynamic(_compile(fn, options))
                                                    for fn in (_gdn_layer, _attention_layer))
        else:
            self.fn: Callable[..., tuple[Tensor, Tensor]] = _compile(static_pass, options)

    @staticmethod
    def fits(state: ModelState, T: int) -> bool:
        """Whether a pass of T tokens is one the graphs cover: its GDN steps land in the logs, and no prefix cache
        takes heads inside it (`Capture`: eager passes only)."""
        return state.gdn.logged and state.staged + T <= state.gdn.log_capacity and state.gdn.capture is None

    def __call__(self, model: HybridLM, x: Tensor, state: ModelState, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        T, start = x.shape[0], state.length + state.staged
        state.ensure_positions(start + T)
        positions = torch.arange(start, start + T, device=x.device)
        return self.run(model, x, rope, positions, positions - state.length, gdn_arguments(state, self.per_layer),
                        [(layer.k, layer.v) for layer in state.attn])

    def run(self, model: HybridLM, x: Tensor, rope: tuple[Tensor, Tensor], positions: Tensor, slots: Tensor,
            gdn: dict, kv: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """The compiled pass over given buffers (`static_pass`'s arguments; `gdn` per layer when `per_layer`)."""
        if x.shape[0] > 1:  # one graph for every verify length
            for t in (x, *rope, positions, slots):
                torch._dynamo.mark_dynamic(t, 0, min=2, max=MAX_PASS_TOKENS)
        for k_cache, v_cache in kv:  # and for every K/V capacity
            torch._dynamo.maybe_mark_dynamic(k_cache, 1)
            torch._dynamo.maybe_mark_dynamic(v_cache, 1)
        if self.per_layer:
            return _head(model, _layers(model, x, *rope, positions, slots, gdn, kv, self.gdn_layer,
                                        self.attention_layer))
        return self.fn(model, x, *rope, positions, slots, gdn, kv)

    @staticmethod
    def warm_up(model: HybridLM, log_capacity: int = LOG_CAPACITY) -> None:
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


def _token_count_dynamic(layer_fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """A compiled layer whose input `x`'s token count is symbolic from 2 tokens on (each layer's `x` is a new tensor)."""
    def call(layer: DecoderLayer, f: fused.FusedLayer, x: Tensor, *rest: Tensor) -> Tensor:
        if x.shape[0] > 1:
            torch._dynamo.mark_dynamic(x, 0, min=2, max=MAX_PASS_TOKENS)
        return layer_fn(layer, f, x, *rest)
    return call
