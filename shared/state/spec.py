"""What a model's state is made of, as its family declares it (`deltaspec.shared.model.families`).

A `StateSpec` lists the layers in order as recurrent or attention, the recurrent kind with its shapes, and the
attention K/V's shape. The state floor sizes, allocates and counts every buffer from it alone and imports nothing
of the model, so the engine never asks which family it serves: a new family declares its spec.

Every recurrent kind evolves as decay times state plus an outer product, `S_t = D(g_t) S_{t-1} + k_t d_t^T`, so one
closed-form commit serves them all (`rollback.closed_form`); a kind says only how its log decay g is laid out
(`DECAYS`): one number per head (GDN, Mamba2/SSD), one per head and key channel (KDA, Mamba1), or no state at all
beside the conv window (a short conv); a kind whose state is as small as one token's log (Mamba1, RecurrentGemma's
RG-LRU) logs the state after each token and commits by copying it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

RECURRENT, ATTENTION, STATELESS = "recurrent", "attention", "none"  # the layer kinds the state knows (an MLP alone)
HYBRID = "hybrid"  # a layer holding both: attention K/V and a recurrent state (Falcon-H1's parallel mixers)
HOLDS = {RECURRENT: (RECURRENT,), ATTENTION: (ATTENTION,), HYBRID: (RECURRENT, ATTENTION), STATELESS: ()}
# recurrent state kind -> how its log decay is laid out: per head, per head and key channel, or no state ("none");
# "snapshot": a kind whose state is no larger than what one token would log (Mamba1: a decay per channel and state
# entry) logs the state after each staged token instead (as d: the layer's whole state one head of 1 x Dv, so one
# token's states are contiguous in the logs), and a commit copies the one it keeps
DECAYS = {"gdn": "head", "ssd": "head", "kda": "key", "mamba": "snapshot", "rglru": "snapshot", "conv": "none",
          "lightning": "head"}
RECURRENT_KINDS = tuple(DECAYS)

LOG_CAPACITY = 36  # staged tokens logged: two chained rounds (a pipelined one on top) of k <= 16 drafts plus inputs
CHAIN_LOG_CAPACITY = 51  # a draft's: its open round and two speculations on top, 3 x (k + 1) for k <= 16 (a third
# fits for k <= 11; beyond, the draft refuses it or does not make it ahead)

Buffers = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype)


@dataclass(frozen=True)
class RecurrentSpec:
    """One recurrent layer's state: a short conv window of `conv_width - 1` rows of `conv_dim` channels before the
    mixer, and `heads` recurrent states of `key_dim x value_dim` (none for a short conv: `heads` 0), evolving by the
    algebra of `kind`."""

    kind: str
    conv_dim: int
    conv_width: int
    heads: int
    key_dim: int
    value_dim: int

    def __post_init__(self) -> None:
        if self.kind not in RECURRENT_KINDS:
            raise ValueError(f"unknown recurrent state kind {self.kind!r} (expected one of {RECURRENT_KINDS})")
        if (self.decay == "none") != (self.heads == 0):
            want = "0 (it holds only its conv window)" if self.decay == "none" else "at least 1"
            raise ValueError(f"a {self.kind!r} state's heads must be {want}, not {self.heads}")

    @property
    def decay(self) -> str:
        """How the log decay g is laid out: "head" `(H,)` per token, "key" `(H, Dk)`, or "none"."""
        return DECAYS[self.kind]

    def buffers(self, n_layers: int, dtype: torch.dtype, log_capacity: int = LOG_CAPACITY) -> Buffers:
        """Shape and dtype of every buffer one sequence's recurrent layers hold, stacked on a leading layer axis:
        committed and staged windows and states, the mark snapshot, and the logs of `log_capacity` staged tokens
        (pre-conv input x, key k, update d (GDN's delta-rule correction), log decay g), laid out so that the commit's
        matmul reads them as they are. The recurrent state is float32 whatever the weights."""
        H, Dk, Dv = self.heads, self.key_dim, self.value_dim
        window = ((n_layers, self.conv_width - 1, self.conv_dim), dtype)
        state = ((n_layers, H, Dk, Dv), torch.float32)
        return {"conv": window, "window": window, "marked_window": window,
                "state": state, "spare": state, "marked_state": state,
                "x": ((n_layers, log_capacity, self.conv_dim), dtype),
                "k": ((n_layers, H, Dk, log_capacity), torch.float32),
                "delta": ((n_layers, H, log_capacity, Dv), torch.float32),
                "g": ((n_layers, H, *((Dk,) if self.decay == "key" else ()), log_capacity), torch.float32)}


@dataclass(frozen=True)
class StateSpec:
    """A model's whole state: `layers` says, layer by layer, RECURRENT, ATTENTION, HYBRID (both) or STATELESS;
    `recurrent` is every recurrent layer's spec (None for a model without one); attention K/V holds
    `kv_heads x head_dim` per position. A HYBRID layer counts among the recurrent and among the attention layers, each
    state at its own index there (`HOLDS`)."""

    layers: tuple[str, ...]
    recurrent: RecurrentSpec | None
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        bad = [kind for kind in self.layers if kind not in HOLDS]
        if bad:
            raise ValueError(f"unknown layer kind {bad[0]!r} in a state spec (expected one of {tuple(HOLDS)})")
        if self.recurrent is None and self.n_recurrent:
            raise ValueError("a state spec with recurrent layers needs their RecurrentSpec")

    @property
    def n_recurrent(self) -> int:
        return sum(RECURRENT in HOLDS[kind] for kind in self.layers)

    @property
    def n_attention(self) -> int:
        return sum(ATTENTION in HOLDS[kind] for kind in self.layers)

    def recurrent_buffers(self, dtype: torch.dtype, log_capacity: int = LOG_CAPACITY) -> Buffers:
        return {} if self.recurrent is None else self.recurrent.buffers(self.n_recurrent, dtype, log_capacity)

    def recurrent_bytes(self, dtype: torch.dtype, log_capacity: int = LOG_CAPACITY) -> int:
        """Bytes of one sequence's recurrent state, logs and snapshot included: constant, whatever the context."""
        return sum(torch.Size(shape).numel() * kind.itemsize
                   for shape, kind in self.recurrent_buffers(dtype, log_capacity).values())

    def kv_bytes_per_position(self, dtype: torch.dtype) -> int:
        """Bytes of attention K/V one more position costs a sequence, all attention layers together."""
        return self.n_attention * 2 * self.kv_heads * self.head_dim * dtype.itemsize

    def bytes(self, dtype: torch.dtype, positions: int, log_capacity: int = LOG_CAPACITY) -> int:
        """Bytes of one sequence's whole state with K/V for `positions` positions: what a state pool charges."""
        return self.recurrent_bytes(dtype, log_capacity) + positions * self.kv_bytes_per_position(dtype)
