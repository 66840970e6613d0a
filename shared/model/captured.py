"""Captured passes: a sequence's decode and verify passes replayed as CUDA graphs.

On a GPU a step of these models costs kernel launches, not arithmetic: eager, each of a pass's hundreds of kernels
is launched from Python (the embedded 12-layer target took 10.4 ms a step on an H200,
`benchmarks/results/gpu_check.txt`). A CUDA graph records a pass once and replays all of its kernels with one launch,
but over the memory it recorded: the same input, state and output addresses every time. Two things make a
sequence's passes fit that:
- the pass recorded is the static form `compiled.py` compiles (`static_pass`: K/V and GDN logs written at index
  tensors, attention over the whole K/V buffer under a position mask), so nothing recorded depends on where the pass
  sits. What changes between passes (the tokens, the first position, the first log slot) is copied into static
  inputs before a replay, and the outputs are copied out after it;
- a graph is kept per token count and per set of state buffers the pass reads and writes, by address: a full
  accept swaps a state's committed and staged buffers, so a sequence alternates between a few sets, and a new
  sequence whose buffers sit where an earlier one's did (a state pool's slots never move; the allocator reuses freed K/V) replays
  the graphs recorded for them. Beyond `max_graphs` the least recently used graph is dropped.
A pass the graphs do not cover runs eagerly: more than `max_tokens` tokens (prefill), a staging past the logs, a
prefix cache taking heads inside the pass, K/V that must grow first. A sparse MoE model's experts are recorded as
grouped matmuls (`kernels.experts.apply_experts`), which need no host sync only in bfloat16 on an sm90/sm100 GPU:
elsewhere on a GPU such a model is refused. With `compile()` on as well, the compiled pass is what is recorded.

Eager stays the truth: on CUDA `tests/test_cuda.py` compares captured passes with eager ones; on the CPU, where there
are no graphs, the same static buffers are filled and the same pass is run directly (`tests/test_captured.py`).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from deltaspec.shared.model.compiled import static_pass
from deltaspec.shared.kernels.experts import grouped_gemm_fast
from deltaspec.shared.state.access import StaticAccess
from deltaspec.shared.state.rollback import ModelState

if TYPE_CHECKING:
    from deltaspec.shared.model.fused import Model

MAX_CAPTURED_TOKENS = 17  # a decode step up to a verify of 16 drafts (`MAX_DRAFT_TOKENS`)
MAX_GRAPHS = 96  # graphs kept per model: a few sequences' worth of token counts x buffer sets


class _Recorded:
    """One pass of T tokens over one set of state buffers: its static inputs and, once recorded, its graph."""

    def __init__(self, model: Model, state: ModelState, T: int) -> None:
        device = model.device
        self.ids = torch.zeros(T, dtype=torch.long, device=device)
        self.first = torch.zeros((), dtype=torch.long, device=device)  # position of the first token
        self.offset = torch.zeros((), dtype=torch.long, device=device)  # its log slot: tokens staged before it
        self.steps = torch.arange(T, device=device)
        capacity = state.attn[0].k.shape[1] if state.attn else state.length + state.staged + T
        self.table = model.rope(0, capacity, model.lm_head.weight)  # cos, sin, signed sin, to the K/V's end
        self.model = model
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[Tensor, Tensor] | None = None

    def fill(self, ids: Tensor, first: int, offset: int) -> None:
        self.ids.copy_(ids)
        self.first.fill_(first)
        self.offset.fill_(offset)

    def run(self, state: ModelState) -> tuple[Tensor, Tensor]:
        """The pass on the static inputs and `state`'s buffers: what a graph records, and what runs in its place on
        the CPU. Nothing here keeps the state's buffers: a graph holds their addresses only, so they can be freed,
        and another state allocated where they were replays it."""
        model, compiled = self.model, self.model.compiled
        positions = self.first + self.steps
        x = model.model.embed(self.ids)
        rope = (self.table[0].index_select(0, positions), self.table[2].index_select(0, positions))
        slots = self.offset + self.steps
        kv = [(layer.k, layer.v) for layer in state.attn]
        if compiled is not None:
            gdn = StaticAccess.recurrent_buffers(state, compiled.per_layer)
            return compiled.run(model, x, rope, positions, slots, gdn, kv)
        return static_pass(model, x, *rope, positions, slots, StaticAccess.recurrent_buffers(state), kv)

    def record(self, state: ModelState, pool: tuple[int, int]) -> tuple[Tensor, Tensor]:
        """Run the pass once for real (it is this call's pass, and the warm-up a capture needs), then record it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            result = self.run(state)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):  # records; runs nothing
            self.out = self.run(state)
        return result

    def replay(self) -> tuple[Tensor, Tensor]:
        assert self.graph is not None and self.out is not None
        self.graph.replay()
        return self.out[0].clone(), self.out[1].clone()  # the next replay writes the same outputs


def covers_experts(model: Model) -> bool:
    """Whether captured passes take the model's experts: a dense model has none; a sparse MoE model's are recorded as
    grouped matmuls, which a CUDA graph holds only where they are one kernel (off a GPU nothing is recorded)."""
    cfg = model.config
    return (not cfg.num_experts or model.device.type != "cuda"
            or grouped_gemm_fast(model.device, model.dtype, cfg.moe_latent_size or cfg.hidden_size,
                                 cfg.moe_intermediate_size))


class CapturedPasses:
    """The captured passes of one model (`HybridLM.capture`); thread-safe."""

    def __init__(self, model: Model, max_tokens: int = MAX_CAPTURED_TOKENS, max_graphs: int = MAX_GRAPHS) -> None:
        if model.fused is None:
            raise ValueError("capture() needs the fused path: call fuse() first")
        if not covers_experts(model):
            raise ValueError("captured passes of a sparse MoE model need bfloat16 weights on an sm90 or sm100 GPU, "
                             "where its experts run as one grouped matmul with no host sync: run it without --capture")
        if max_tokens < 1:
            raise ValueError(f"captured passes need max_tokens >= 1, got {max_tokens}")
        self.max_tokens, self.max_graphs = max_tokens, max_graphs
        self.on_cuda = model.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.on_cuda else None  # one memory pool for all graphs
        self.passes: OrderedDict[tuple, _Recorded] = OrderedDict()
        self.recorded = 0  # passes recorded so far (a new one per token count and buffer set)
        self.lock = threading.Lock()

    def fits(self, state: ModelState, T: int) -> bool:
        """Whether the graphs cover a pass of T tokens on `state` (else it runs eagerly)."""
        end = state.length + state.staged + T
        return (T <= self.max_tokens and state.recurrent.logged and state.staged + T <= state.recurrent.log_capacity
                and state.recurrent.block_heads is None and all(end <= layer.k.shape[1] for layer in state.attn))

    @staticmethod
    def key(state: ModelState, T: int) -> tuple:
        """What a recorded pass is valid for: its token count, where it logs, and every buffer it reads or writes."""
        gdn = StaticAccess.recurrent_buffers(state)
        return (T, state.recurrent.log_capacity, *(t.data_ptr() for t in gdn.values()),
                *((layer.k.data_ptr(), layer.v.data_ptr(), layer.k.shape[1]) for layer in state.attn))

    def __call__(self, model: Model, ids: Tensor, state: ModelState) -> tuple[Tensor, Tensor]:
        """Stage `ids` on `state` (which `fits`): logits and last hidden states, as `HybridLM.forward` returns them;
        the caller counts the staged tokens."""
        T = ids.numel()
        key = self.key(state, T)
        with self.lock:
            recorded = self.passes.get(key)
            fresh = recorded is None
            if fresh:
                recorded = self.passes[key] = _Recorded(model, state, T)
                if len(self.passes) > self.max_graphs:
                    self.passes.popitem(last=False)
            else:
                self.passes.move_to_end(key)
            recorded.fill(ids, state.length + state.staged, state.staged)
            self.recorded += fresh
            if not self.on_cuda:
                return recorded.run(state)
            if fresh:
                return recorded.record(state, self.pool)
            return recorded.replay()
