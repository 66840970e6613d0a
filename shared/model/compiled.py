"""Compiled passes: a decode or verify pass of the fused path as one `torch.compile` (Inductor) graph.

Even fused, an eager step of these small models is mostly dispatch: the draft model's decode step is about
110 ATen calls for a few microseconds of arithmetic each. Inductor fuses the elementwise work into a few
generated loops, leaves the matmuls to ATen, and on the CPU calls it all from generated C++ (`cpp_wrapper`).

Nothing in the graph depends on where the pass sits: positions and log slots enter as index tensors (K/V
and the GDN logs are written with `index_copy_`), attention reads the whole K/V buffer under a position
mask, and the token count is symbolic. So a new position, round or cache size never recompiles; a model
gets one graph for one token (the recurrent update) and one for 2..`LOG_CAPACITY` tokens (one chunk),
each for a pass from the head and one on top of a staging (the two read different buffers). Passes
longer than the logs (prefill) take the eager path. The fused path stays the truth: `tests/test_compiled.py`
compares logits and every state buffer of both on random weights.

Compiling takes time with depth (Inductor's passes over the whole graph): about a minute for the 2-layer
embedded draft on a CPU, and the 12-layer target had not finished after 15 minutes; so the command line
compiles draft models only.
"""
from __future__ import annotations

import types
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from shared.kernels.chunk import one_chunk_gated_delta_rule
from shared.model import fused
from shared.state.rollback import LOG_CAPACITY, ModelState

if TYPE_CHECKING:
    from shared.model.hybrid import HybridLM


def _pass(model: HybridLM, x: Tensor, cos: Tensor, signed_sin: Tensor, positions: Tensor, slots: Tensor,
          conv_in: Tensor, state_in: Tensor, window: Tensor, spare: Tensor, logs: tuple[Tensor, Tensor, Tensor, Tensor],
          kv: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """`HybridLM.forward` on the fused path from the embeddings `x (T, hidden)`, with every state write in the graph.

    conv_in, state_in: the stacked GDN window and state before the pass (the head's, or the staging's when the pass
    goes on top of one); window, spare: where the staging's go; logs: `GDNStates` x, k, delta, g; kv: each attention
    layer's K/V buffers; positions (T,) and slots (T,): where the tokens go in K/V and in the logs."""
    T = x.shape[0]
    log_x, log_k, log_delta, log_g = logs
    rope = (cos, signed_sin)
    i = j = 0
    for layer, f in zip(model.model.layers, model.fused.layers):
        h = F.rms_norm(x, x.shape[-1:], f.input_norm, layer.input_layernorm.eps)
        if layer.kind == "linear_attention":
            m, fm = layer.linear_attn, f.mixer
            mixed, z, b, a = fused.gdn_inputs(fm, h)
            full = torch.cat([conv_in[i], mixed], dim=0)
            q, k, v, beta, g = fused.gdn_gates(m, fm, full, b, a)
            if T == 1:
                out, delta, final = fused.recurrent_step(q, k, v, beta, g, state_in[i])
                delta = delta.transpose(0, 1)
            else:
                out, delta, final = one_chunk_gated_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                               g.t(), beta.t(), state_in[i])
                out = out.transpose(0, 1)
            spare[i].copy_(final)
            window[i].copy_(full[-window.shape[1]:])
            log_x[i].index_copy_(0, slots, mixed)
            log_k[i].index_copy_(2, slots, k.permute(1, 2, 0))
            log_delta[i].index_copy_(1, slots, delta)
            log_g[i].index_copy_(1, slots, g.t())
            x = fused.gdn_output(m, fm, out, z, x)
            i += 1
        else:
            m, fa = layer.self_attn, f.mixer
            q_gate, q, k, v = fused.attention_inputs(m, fa, h, rope)
            k_cache, v_cache = kv[j]
            k_cache.index_copy_(1, positions, k.transpose(0, 1))
            v_cache.index_copy_(1, positions, v.transpose(0, 1))
            mask = torch.arange(k_cache.shape[1], device=x.device)[None, :] <= positions[:, None]  # (T, capacity)
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_cache[None], v_cache[None], attn_mask=mask,
                                                 enable_gqa=m.n_heads != m.n_kv)[0].transpose(0, 1)
            x = fused.attention_output(fa, out, q_gate, x)
            j += 1
        x = fused.mlp(layer, f, x)
    normed = F.rms_norm(x, x.shape[-1:], model.fused.final_norm, model.model.norm.eps)
    return model.lm_head(normed).float(), x


class CompiledPasses:
    """The compiled `_pass` of one model, and the bookkeeping around it that `HybridLM.forward` would do."""

    def __init__(self, device: torch.device) -> None:
        # A code object of its own: dynamo keeps graphs per code object, so this model's graphs are the only ones it
        # looks up, and their guards can skip the module's attributes (the model's structure does not change).
        own = types.FunctionType(_pass.__code__.replace(), _pass.__globals__, _pass.__name__)
        options: dict = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        if device.type == "cpu":
            options["cpp_wrapper"] = True  # the kernels called from generated C++: no Python per kernel
        self.fn: Callable[..., tuple[Tensor, Tensor]] = torch.compile(own, fullgraph=True, options=options)

    @staticmethod
    def fits(state: ModelState, T: int) -> bool:
        """Whether a pass of T tokens is one the graphs cover: its GDN steps land in the logs."""
        return state.gdn.logged and state.staged + T <= LOG_CAPACITY

    def __call__(self, model: HybridLM, x: Tensor, state: ModelState, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        T, start, gdn = x.shape[0], state.length + state.staged, state.gdn
        state.ensure_positions(start + T)
        positions = torch.arange(start, start + T, device=x.device)
        slots = positions - state.length
        on_head = state.staged == 0
        if T > 1:  # one graph for every verify length
            for t in (x, *rope, positions, slots):
                torch._dynamo.mark_dynamic(t, 0, min=2, max=LOG_CAPACITY)
        for layer in state.attn:  # and for every K/V capacity
            torch._dynamo.maybe_mark_dynamic(layer.k, 1)
            torch._dynamo.maybe_mark_dynamic(layer.v, 1)
        return self.fn(model, x, *rope, positions, slots, gdn.conv if on_head else gdn.window,
                       gdn.recurrent if on_head else gdn.spare, gdn.window, gdn.spare, (gdn.x, gdn.k, gdn.delta, gdn.g),
                       [(layer.k, layer.v) for layer in state.attn])

    @staticmethod
    def warm_up(model: HybridLM) -> None:
        """Compile every graph now (a server does this before it serves): one and several tokens, from the head
        and on top of a staging."""
        state = model.new_state()
        ids = torch.arange(6, device=model.device) % model.config.vocab_size
        for first, second in ((1, 1), (3, 2)):
            model(ids[:first], state)
            model(ids[:second], state)
            state.revert()
