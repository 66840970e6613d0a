"""How a forward pass reaches the state it stages into: one small interface, three ways of addressing it.

The one forward pass (`deltaspec.shared.model.fused.forward`) computes every projection, gate and output itself and
leaves to a `StateAccess` only what depends on where the state lives: a recurrent layer's window and state before the
pass, running its mixer's recurrence (`Recurrence`) from them, and where the staging goes; an attention layer's K/V
writes and the causal read.

- `SequenceAccess`: one sequence's `ModelState`, by Python offsets (`RecurrentSlot`); the eager pass.
- `StaticAccess`: buffers and index tensors (positions, log slots) that do not depend on where the pass sits, so a
  compiled graph or a recorded CUDA graph serves every position and round.
- `BatchAccess`: several sequences' states gathered into a padded `(G, T)` batch per group and scattered back.

Each writes exactly what `RecurrentSlot.stage` writes; staging never happens anywhere else.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from deltaspec.shared.kernels import CHUNK_SIZE, VerifyLogs
from deltaspec.shared.state.rollback import AttnLayerState, ModelState, RecurrentSlot, verify_logs
from deltaspec.shared.state.steps import Start, Step

# A mixer's recurrence: (full = [conv window; x] `(..., K-1+T, C)`, its other per-token inputs `(..., T, ...)`,
# where it starts) -> its pass (`Step`)
Recurrence = Callable[[Tensor, tuple[Tensor, ...], Start], Step]


class StateAccess(Protocol):
    embeds: Tensor | None  # the pass's embeddings `(N, hidden)`, set by the pass for mixers that read them

    def recurrent(self, i: int, x: Tensor, inputs: tuple[Tensor, ...], core: Recurrence) -> Tensor:
        """Recurrent layer i (its index among the recurrent layers) on the pass's pre-conv inputs x `(N, C)` and its
        other per-token inputs `(N, ...)`: runs `core` from the layer's window and state, stages its tokens, and
        returns the recurrence's output `(N, H, Dv)`."""
        ...

    def attend(self, j: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
        """Attention layer j: writes k, v `(N, Hkv, D)` at the tokens' positions, attends causally with q
        `(N, H, D)` (to the last `window` positions only, a query's own included, where one is given);
        `(N, H, D)`."""
        ...


def causal_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """q `(B, T, H, D)` over keys and values `(B, Hkv, L, D)` under `mask` (`(T, L)` or `(B, 1, T, L)`, True where a
    query sees a key; None: every key). Returns `(B, T, H, D)`."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                          enable_gqa=q.shape[2] != k.shape[1]).transpose(1, 2)


def first_token(T: int, device: torch.device) -> Tensor:
    """`Start.first` of a pass whose first token is a sequence's first: `(T, 1)`, 1 in row 0."""
    first = torch.zeros(T, 1, device=device)
    first[0] = 1.0
    return first


def position_mask(query_at: Tensor, L: int, window: int | None = None) -> Tensor:
    """Each query at its position `query_at` (`(T,)`, or `(B, T)`) sees the keys at positions up to its own among
    0..L-1, and (`window`) none `window` or more before it: `(T, L)`, or `(B, 1, T, L)` (SDPA's CPU kernels round as
    the single-sequence form only with these)."""
    at = torch.arange(L, device=query_at.device)
    mask = at <= query_at[..., None]
    if window is not None:
        mask &= at > query_at[..., None] - window
    return mask[:, None] if mask.ndim == 3 else mask


def attend(st: AttnLayerState, q: Tensor, k: Tensor, v: Tensor, start: int, window: int | None = None) -> Tensor:
    """One sequence: write its k, v `(T, Hkv, D)` at positions start.. into the cache and attend causally with q
    `(T, H, D)`, to the last `window` positions where one is given; `(T, H, D)`. Keys no query of the pass sees are
    not read."""
    T = q.shape[0]
    end = start + T
    st.ensure_capacity(end)
    st.k[:, start:end] = k.transpose(0, 1)
    st.v[:, start:end] = v.transpose(0, 1)
    first = 0 if window is None else max(0, start + 1 - window)  # the first query's oldest key
    mask = None  # one query sees every key; query i of several sits at start + i
    if T > 1:
        mask = position_mask(torch.arange(start, end, device=q.device), end, window)[:, first:]
    return causal_attention(q[None], st.k[None, :, first:end], st.v[None, :, first:end], mask)[0]


class SequenceAccess:
    """One sequence's state, staged at its offsets; the eager pass."""

    def __init__(self, state: ModelState) -> None:
        self.state, self.offset, self.embeds = state, state.staged, None
        self.start = state.length + state.staged

    def recurrent(self, i: int, x: Tensor, inputs: tuple[Tensor, ...], core: Recurrence) -> Tensor:
        st = RecurrentSlot(self.state.recurrent, i, self.offset)
        full = torch.cat([st.conv_window(), x], dim=0)  # (K-1+T, C)
        first = first_token(x.shape[0], x.device) if self.start == 0 else None
        step = core(full, inputs, Start(st.initial_state(), out_state=st.state_out(),
                                        logs=lambda: st.verify_logs(x.shape[0]), first=first))
        st.stage(x, step.k, step.d, step.g, step.final, full, kernel_logged=step.logged)
        return step.out

    def attend(self, j: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
        return attend(self.state.attn[j], q, k, v, self.start, window)


RECURRENT_BUFFERS = ("conv_in", "state_in", "window", "spare", "x", "k", "delta", "g")  # a static recurrent layer's


@dataclass
class StaticAccess:
    """Buffers addressed by index tensors: tokens at `positions (T,)`, logged at `slots (T,)`; `buffers` maps each of
    `RECURRENT_BUFFERS` to the recurrent layers' buffers (a stacked tensor or a list of per-layer views), `kv` holds
    each attention
    layer's K/V buffers, read whole under a position mask. Nothing depends on where the pass sits."""

    positions: Tensor
    slots: Tensor
    buffers: dict[str, Sequence[Tensor]]
    kv: Sequence[tuple[Tensor, Tensor]]
    embeds: Tensor | None = None
    first: Tensor | None = None  # `Start.first`, made at the first recurrent layer that runs

    @staticmethod
    def recurrent_buffers(state: ModelState, per_layer: bool = False) -> dict:
        """The recurrent buffers a static pass on `state` reads and writes: the window and state before it (the head's,
        or the staging's when it stages on top of one) and where the staging goes. Stacked tensors, or per-layer
        views (made once)."""
        rec = state.recurrent
        buffers = rec.layers if per_layer else vars(rec)
        on_head = state.staged == 0
        return {"conv_in": buffers["conv" if on_head else "window"],
                "state_in": buffers["state" if on_head else "spare"],
                **{name: buffers[name] for name in RECURRENT_BUFFERS[2:]}}

    def recurrent(self, i: int, x: Tensor, inputs: tuple[Tensor, ...], core: Recurrence) -> Tensor:
        buf = {name: self.buffers[name][i] for name in RECURRENT_BUFFERS}
        full = torch.cat([buf["conv_in"], x], dim=0)
        if self.first is None:
            self.first = (self.positions == 0).to(torch.float32)[:, None]
        step = core(full, inputs, Start(buf["state_in"], static=True, first=self.first))
        buf["spare"].copy_(step.final)
        buf["window"].copy_(full[full.shape[0] - buf["window"].shape[0]:])  # none for K = 1
        buf["x"].index_copy_(0, self.slots, x)
        buf["k"].index_copy_(2, self.slots, step.k.permute(1, 2, 0))
        buf["delta"].index_copy_(1, self.slots, step.d.transpose(0, 1))
        buf["g"].index_copy_(buf["g"].ndim - 1, self.slots, step.g.movedim(0, -1))
        return step.out

    def attend(self, j: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
        k_cache, v_cache = self.kv[j]
        k_cache.index_copy_(1, self.positions, k.transpose(0, 1))
        v_cache.index_copy_(1, self.positions, v.transpose(0, 1))
        mask = position_mask(self.positions, k_cache.shape[1], window)
        return causal_attention(q[None], k_cache[None], v_cache[None], mask)[0]


@dataclass
class _Group:
    """Sequences whose recurrent core runs together, padded to `T` tokens each."""

    members: list[int]  # item indices
    lengths: list[int]
    T: int
    rows: slice | Tensor  # rows of the packed tokens in (member, t) order; padding repeats a member's last row
    valid: Tensor | None  # (G, T, 1) 1 for real tokens, 0 for padding; None when nothing is padded
    first: Tensor | None = None  # (G, T, 1) `Start.first`: 1 on a member's token at position 0; None when none is
    logs: VerifyLogs | None = None  # where the Triton kernel logs the members: made at the first layer that runs it

    def take(self, x: Tensor) -> Tensor:
        """Rows of the packed `x` for this group as `(G, T, ...)`."""
        rows = x[self.rows] if isinstance(self.rows, slice) else x.index_select(0, self.rows)
        return rows.view(len(self.members), self.T, *x.shape[1:])


class BatchAccess:
    """Several sequences' states, their tokens packed into one `(sum T_i, ...)` matrix.

    - Recurrent: the sequences' windows and states are gathered (`stack`) into a padded `(G, T_max)` group (every
      short sequence together; each one longer than a chunk alone) and run through one call of the mixer's
      recurrence. Padding sits after each sequence's last token, marked by `Start.valid`, where the recurrence adds
      nothing to the state (GDN: beta = 0 and g = 0) and touches no real output (causal). The staged state, window
      and logs go back to each sequence's own
      buffers in one `_foreach_copy_`; where the Triton kernel runs (CUDA) and the sequences are slots of one
      `StatePool`, it logs k, delta and g itself.
    - Attention: each sequence writes its K/V at its own positions in its own cache; the caches are gathered into
      one zero-padded batch and one masked attention call serves a group."""

    def __init__(self, states: Sequence[ModelState], lengths: list[int], device: torch.device) -> None:
        self.states, self.lengths, self.embeds = states, lengths, None
        self.starts = [st.length + st.staged for st in states]  # position of each sequence's first token
        self.offsets = [sum(lengths[:i]) for i in range(len(lengths))]  # each sequence's first packed row
        short = [i for i, T in enumerate(lengths) if T <= CHUNK_SIZE]
        self.groups = [self._group(short, device)] if short else []
        self.groups += [self._group([i], device) for i, T in enumerate(lengths) if T > CHUNK_SIZE]
        self.unpad = self._unpad(device)

    def _group(self, members: list[int], device: torch.device) -> _Group:
        lens = [self.lengths[i] for i in members]
        T = max(lens)
        first = None
        if any(self.starts[i] == 0 for i in members):
            first = torch.zeros(len(members), T, 1, device=device)
            first[:, 0, 0] = torch.tensor([float(self.starts[i] == 0) for i in members])
        contiguous = members == list(range(members[0], members[0] + len(members)))
        if min(lens) == T and contiguous:
            row = self.offsets[members[0]]
            return _Group(members, lens, T, slice(row, self.offsets[members[-1]] + T), None, first)
        rows = torch.tensor([self.offsets[i] + min(t, n - 1) for i, n in zip(members, lens) for t in range(T)],
                            device=device)
        valid = torch.tensor([[float(t < n)] for n in lens for t in range(T)], device=device).view(len(members), T, 1)
        return _Group(members, lens, T, rows, valid if min(lens) < T else None, first)

    def _unpad(self, device: torch.device) -> Tensor | None:
        """Packed row -> row of the groups' concatenated `(G T)` outputs; None when they coincide."""
        order = [i for g in self.groups for i in g.members]
        if order == list(range(len(self.lengths))) and all(g.valid is None for g in self.groups):
            return None
        flat, base = [0] * sum(self.lengths), 0
        for g in self.groups:
            for slot, (i, T) in enumerate(zip(g.members, g.lengths)):
                for t in range(T):
                    flat[self.offsets[i] + t] = base + slot * g.T + t
            base += len(g.members) * g.T
        return torch.tensor(flat, device=device)

    def _packed(self, outs: list[Tensor]) -> Tensor:
        """The groups' outputs, each `(G T, ...)`, back in the packed tokens' order (padding dropped)."""
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if self.unpad is None else out.index_select(0, self.unpad)

    def recurrent(self, i: int, x: Tensor, inputs: tuple[Tensor, ...], core: Recurrence) -> Tensor:
        outs = []
        for g in self.groups:
            slots = [RecurrentSlot(self.states[m].recurrent, i, self.states[m].staged) for m in g.members]
            outs.append(self._recurrent_group(g, slots, x, inputs, core))
        return self._packed(outs)

    @staticmethod
    def _recurrent_group(g: _Group, slots: list[RecurrentSlot], x: Tensor, inputs: tuple[Tensor, ...],
                         core: Recurrence) -> Tensor:
        """The recurrence for one group; stages each member into its own buffers; outputs `(G T, H, Dv)`."""
        xs = g.take(x)
        full = torch.cat([torch.stack([s.conv_window() for s in slots]), xs], dim=1)  # (G, K-1+T, C)
        initial = torch.stack([s.initial_state() for s in slots])  # (G, H, Dk, Dv)

        def logs() -> VerifyLogs | None:  # rows, offsets and counts are the same at every layer of the pass
            if g.logs is None:
                g.logs = verify_logs(slots, g.lengths)
            return None if g.logs is None else g.logs._replace(layer=slots[0].i)

        step = core(full, tuple(g.take(t) for t in inputs), Start(initial, valid=g.valid, logs=logs, first=g.first))
        _stage(g, slots, xs, full, step.k.permute(0, 2, 3, 1), step.d.transpose(1, 2), step.g.movedim(1, -1),
               step.final, step.logged)
        return step.out.reshape(-1, *step.out.shape[2:])

    def attend(self, j: int, q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
        outs = []
        for g in self.groups:
            members = [self.states[i].attn[j] for i in g.members]
            if len(g.members) == 1:  # a long prefill piece, or a group of one: the single-sequence form
                i = g.members[0]
                o, T = self.offsets[i], g.T
                outs.append(attend(members[0], q[o:o + T], k[o:o + T], v[o:o + T], self.starts[i], window))
            else:
                outs.append(self._attend_group(g, q, k, v, members, [self.starts[i] for i in g.members], window))
        return self._packed(outs)

    @staticmethod
    def _attend_group(g: _Group, q: Tensor, k: Tensor, v: Tensor, states: list[AttnLayerState],
                      starts: list[int], window: int | None = None) -> Tensor:
        """Masked attention for one group: each member writes its K/V at its positions, then all attend at once over
        their caches gathered into a zero-padded `(G, Hkv, L, D)` (a member's query t sees keys up to start + t)."""
        G, T, Hkv, D = len(g.members), g.T, k.shape[1], k.shape[2]
        ends = [start + n for start, n in zip(starts, g.lengths)]
        L = max(ends)
        new_k, new_v = (g.take(x).transpose(1, 2).unbind(0) for x in (k, v))  # G x (Hkv, T, D)
        cache_k, cache_v = (q.new_zeros(G, Hkv, L, D).unbind(0) for _ in range(2))
        dsts: list[Tensor] = []
        srcs: list[Tensor] = []
        for st, start, end, n, nk, nv in zip(states, starts, ends, g.lengths, new_k, new_v):
            dsts += (st.k[:, start:end], st.v[:, start:end])
            srcs += (nk, nv) if n == T else (nk[:, :n], nv[:, :n])
        torch._foreach_copy_(dsts, srcs)
        torch._foreach_copy_([c[:, :end] for c, end in zip(cache_k + cache_v, ends + ends)],
                             [st.k[:, :end] for st, end in zip(states, ends)]
                             + [st.v[:, :end] for st, end in zip(states, ends)])
        query_at = torch.tensor(starts, device=q.device)[:, None] + torch.arange(T, device=q.device)  # (G, T)
        out = causal_attention(g.take(q), torch.stack(cache_k), torch.stack(cache_v),
                               position_mask(query_at, L, window))
        return out.reshape(G * T, *out.shape[2:])


def _stage(g: _Group, slots: list[RecurrentSlot], xs: Tensor, full: Tensor, k_log: Tensor, delta_log: Tensor,
           g_log: Tensor, final: Tensor, kernel_logged: bool = False) -> None:
    """Each member's logs, window and state after its tokens, into its own buffers, in one foreach copy.

    Layouts as the logs keep them: xs `(G, T, C)`, k_log `(G, H, Dk, T)`, delta_log `(G, H, T, Dv)`, g_log
    `(G, H, [Dk,] T)`.
    `kernel_logged`: the kernel wrote k, delta and g into the logs (`verify_logs`); only x is copied.
    """
    width = full.shape[1] - g.T
    dsts: list[Tensor] = []
    srcs: list[Tensor] = []
    per_member = zip(slots, g.lengths, xs.unbind(0), k_log.unbind(0), delta_log.unbind(0), g_log.unbind(0),
                     full.unbind(0), final.unbind(0))
    for slot, n, x, k, delta, decay, window_and_x, state in per_member:
        logs = slot.log_targets(n)
        if logs:
            new = (x, k, delta, decay) if n == g.T else (x[:n], k[..., :n], delta[:, :n], decay[..., :n])
            dsts += logs[:1] if kernel_logged else logs
            srcs += new[:1] if kernel_logged else new
        dsts += (slot.states.layers["window"][slot.i], slot.state_out())
        srcs += (window_and_x[n:n + width], state)
    torch._foreach_copy_(dsts, srcs)
