"""Versioned model state: the committed head, the staged round, and the one place rollback happens.

A forward pass never changes the committed head. It *stages* tokens on top of it: attention
layers write K/V past the committed length (never read unless committed), and the recurrent
layers log, per token, the pre-conv input x_t, key k_t, update delta_t and log decay g_t, and
keep the state after all staged tokens in one spare buffer.

`commit(n)` makes the first n staged tokens part of the head. For a recurrent layer (per head):

    S_n = exp(G_n) S_0 + sum_{t<n} exp(G_n - G_t) k_t delta_t^T,     G_t = g_0 + ... + g_t

with g a number per head (Gated DeltaNet, Mamba2) or per head and key channel (KDA, Mamba1:
then exp(.) scales rows), which is exact because the logged delta_t of an accepted prefix are
the ones a sequential run computes (GDN's depend on the state; Mamba2's are dt_t x_t). The conv
window becomes the last K-1 rows of [window; x_0 .. x_{n-1}], which holds
for any n, including n >= K-1 where the old window drops out. Attention is cut by position.

All recurrent layers of a sequence are stacked (`RecurrentStates`), so a commit is a handful of batched
operations whatever the depth: the new head is written into the spare buffers and then swapped
in, for every layer at once, after all arithmetic is done (no reader sees some layers moved and
others not). When n equals everything staged the spares already hold the result and commit is
a pointer swap. Logs are kept for up to `LOG_CAPACITY` staged tokens (a speculative round);
longer stagings (prefill) keep only the spare and the window, and commit all or nothing.

A pipelined round is staged on top of the round before it (`mark`, then more staging): the
snapshot after the first round's tokens is the one extra staging. `commit_marked` makes it the head
by a pointer swap and keeps the later round staged; `drop_marked` drops the later round only. The
same algebra gives the state after any logged prefix without a snapshot: `mark(n)` takes the mark
after the first n staged tokens and `truncate(n)` drops everything after them, so a draft can stage
rounds on top of rounds (`CHAIN_LOG_CAPACITY`) and still keep or drop each one exactly.

Where the Triton kernel runs a pass (CUDA), it writes k_t, delta_t and g_t into the logs itself
(`RecurrentSlot.verify_logs`; `verify_logs` for a batch of one `StatePool`'s slots, whose logs are rows of
the same buffers), and staging copies only x_t, the window and the state.

Cost per sequence: one extra state (the spare) plus O(T (conv_dim + H (Dk + Dv))) logged
numbers per recurrent layer and round; no forward pass is ever re-run.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from deltaspec.shared.kernels import VerifyLogs
from deltaspec.shared.state.spec import ATTENTION, HOLDS, LOG_CAPACITY, RECURRENT, RecurrentSpec, StateSpec


class Lease(Protocol):
    """What a sequence's state takes of a pool's slot (`deltaspec.shared.state.pool.Lease`): the slot's preallocated
    recurrent buffers, its logs as rows of the pool's, and K/V growth paid from the pool's budget."""

    buffers: dict[str, Tensor]
    rows: LogRows

    def grow(self, needed: int, preferred: int) -> int:
        """K/V positions granted for `needed` (at most `preferred`), or `ResourceExhausted` before anything changes."""
        ...


class CommitPlan(NamedTuple):
    """Views and buffers of a commit of n staged tokens: the logs' first n slots, and where the decays go."""

    g: Tensor  # log decays (L H, n), or (L H Dk, n) where a kind decays per key channel
    sums: Tensor  # (n, n+1) 0/1: g @ sums = [G_n, G_n - G_0, ..., G_n - G_{n-1}] (row s adds g_s to G_n, G_n - G_t<s)
    exps: Tensor  # (L H [Dk], n+1) buffer for their exponentials
    exp_total: Tensor  # views of it: exp(G_n) (L, H, 1 or Dk, 1) and exp(G_n - G_t) (L, H, 1 or Dk, n)
    decays: Tensor
    k: Tensor  # (L, H, Dk, n)
    scaled_k: Tensor  # buffer for k_t exp(G_n - G_t), (L, H, Dk, n), and its (L H, Dk, n) view
    scaled_k_flat: Tensor
    delta: Tensor  # (L H, n, Dv)
    x_tail: Tensor | None = None  # a commit's: the last K-1 (or fewer) kept pre-conv inputs, (L, <=K-1, C)


def commit_plan(g: Tensor, k: Tensor, delta: Tensor, x_tail: Tensor | None = None) -> CommitPlan:
    """The views and buffers the closed form reads and writes for n logged tokens of L layers x H heads: g `(L H, n)`
    (or `(L H Dk, n)`, a decay per key channel), k `(L, H, Dk, n)`, delta `(L H, n, Dv)`; a commit's `x_tail` rides
    along for the window."""
    L, H, Dk, n = k.shape
    exps = g.new_empty(g.shape[0], n + 1)
    scaled = k.new_empty(L, H, Dk, n)
    per_head = g.shape[0] // (L * H) if H else 1  # 1, or Dk (no heads: a conv window alone, every operand empty)
    return CommitPlan(g=g, sums=torch.ones(n, n + 1, device=g.device).tril(), exps=exps,
                      exp_total=exps[:, :1].view(L, H, per_head, 1), decays=exps[:, 1:].view(L, H, per_head, n), k=k,
                      scaled_k=scaled, scaled_k_flat=scaled.view(L * H, Dk, n), delta=delta, x_tail=x_tail)


def closed_form(p: CommitPlan, state: Tensor, out: Tensor, out_flat: Tensor) -> None:
    """out <- exp(G_n) S_0 + sum_t exp(G_n - G_t) k_t delta_t^T per (layer, head), S_0 = `state` `(L, H, Dk, Dv)`,
    `out_flat` its `(L H, Dk, Dv)` view: every recurrent kind's commit, written once (a decay per key channel scales
    rows of S_0 and of each k_t; its Triton twin on CUDA: `kernels/triton_commit.py`).
    Five calls whatever the depth, every operand a view of the plan; `out` may be `state` itself."""
    # [exp(G_n), exp(G_n - G_0), ..., exp(G_n - G_{n-1})] per (layer, head): each a sum of the g after t, no
    # G_n - G_t cancellation
    torch.mm(p.g, p.sums, out=p.exps).exp_()
    # written in place (a state-sized temporary would cost an allocation and its page faults)
    torch.mul(state, p.exp_total, out=out)
    torch.mul(p.k, p.decays, out=p.scaled_k)
    out_flat.baddbmm_(p.scaled_k_flat, p.delta)


def layer_heads(state: Tensor) -> Tensor:
    """States `(L, H, Dk, Dv)` as the `(L H, Dk, Dv)` view the closed form writes (sizes spelled out: `view(-1, ...)`
    is ambiguous with zero heads)."""
    return state.view(state.shape[0] * state.shape[1], *state.shape[2:])


class LogRows(NamedTuple):
    """The k, delta and g logs of one or many sequences as rows of one (sequence, layer) axis, and the row of this
    sequence's first layer: the slots of a `StatePool` share one set, so a kernel logs a batch of them in one launch
    (`VerifyLogs`); a sequence of its own logs into its own buffers, from row 0."""

    k: Tensor  # (R, H, Dk, C)
    delta: Tensor  # (R, H, C, Dv)
    g: Tensor  # (R, H, C), or (R, H, Dk, C) where the kind decays per key channel
    first: int


class RecurrentStates:
    """The recurrent state of every recurrent layer of one sequence (its kind's, `RecurrentSpec`), stacked on a
    leading layer axis: conv windows, states, the mark snapshot and the logs of the staged tokens."""

    def __init__(self, spec: RecurrentSpec, n_layers: int, device: torch.device | str, dtype: torch.dtype,
                 slot: dict[str, Tensor] | None = None, log_capacity: int = LOG_CAPACITY,
                 rows: LogRows | None = None) -> None:
        """`slot`: preallocated buffers, one per name of `spec.buffers` (a `deltaspec.shared.state.pool.StatePool`
        slot), zeroed and used in place of fresh tensors, the mark snapshot's too (its logs' size wins over
        `log_capacity`);
        without one `mark` allocates that snapshot. `rows`: the slot's logs as rows of the pool's (`Lease.rows`)."""
        shapes = spec.buffers(n_layers, dtype, log_capacity)
        self.decay = spec.decay

        def buffer(name: str) -> Tensor:
            if slot is not None:
                return slot[name].zero_()
            shape, kind = shapes[name]
            with torch.inference_mode(False):  # normal tensors, wherever the state is made: commits write them
                return torch.zeros(shape, device=device, dtype=kind)

        self.conv = buffer("conv")  # committed window
        self.window = buffer("window")  # window after everything staged
        self.state = buffer("state")  # committed S
        self.spare = buffer("spare")  # S after everything staged
        self.x, self.k, self.delta, self.g = buffer("x"), buffer("k"), buffer("delta"), buffer("g")
        self.log_capacity = self.x.shape[1]
        self.logged = True  # the logs cover every staged token
        self.rows = LogRows(self.k, self.delta, self.g, 0) if rows is None else rows  # never swapped, as the logs
        self._members: dict[tuple[int, int], Tensor] = {}
        # views made once, since indexing costs a dispatch per index: per layer (every layer of every step), and
        # what a partial commit reads of a window or writes of a state (`_make_views`); they follow swaps
        self.layers: dict[str, list[Tensor]] = {}
        self.tails: dict[str, list[Tensor]] = {}
        self.flat: dict[str, Tensor] = {}
        for name in ("conv", "window", "state", "spare", "x", "k", "delta", "g"):
            self._make_views(name)
        if slot is not None:
            self.marked_window, self.marked_state = buffer("marked_window"), buffer("marked_state")
            self._make_views("marked_window")
            self._make_views("marked_state")
        self._log_views: dict[tuple[int, int, int], tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        self._prefixes: dict[int, CommitPlan] = {}
        self.block_heads: BlockHeads | None = None  # heads to take at chosen offsets while staging (a prefix cache's)

    def _make_views(self, name: str) -> None:
        """Buffer `name`'s per-layer views; for a window, what stays of it after n < K-1 new tokens (`tails[name][n]`);
        for a state, its `(L H, Dk, Dv)` view (`flat`)."""
        t = getattr(self, name)
        self.layers[name] = list(t.unbind(0))
        if name in ("conv", "window", "marked_window"):
            self.tails[name] = [t[:, n:] for n in range(t.shape[1])]
        elif name in ("state", "spare", "marked_state"):
            self.flat[name] = layer_heads(t)

    def log_views(self, i: int, start: int, end: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Layer i's log slots for staged tokens start..end-1: x `(T, C)`, k `(H, Dk, T)`, delta `(H, T, Dv)`, g
        `(H, [Dk,] T)`."""
        key = (i, start, end)
        if key not in self._log_views:
            self._log_views[key] = (self.x[i, start:end], self.k[i, :, :, start:end], self.delta[i, :, start:end],
                                    self.g[i, ..., start:end])
        return self._log_views[key]

    def members(self, offset: int, T: int) -> Tensor:
        """`VerifyLogs.members` of this sequence's pass of T tokens at staging offset `offset`, made once per
        (offset, T), then read by every layer of every pass like it (a host-to-device copy a layer would cost more)."""
        members = self._members.get((offset, T))
        if members is None:
            members = self._members[offset, T] = torch.tensor([[self.rows.first], [offset], [T]], dtype=torch.int32,
                                                              device=self.k.device)
        return members

    def _prefix(self, n: int) -> CommitPlan:
        """What committing n staged tokens reads and writes, made once per n (see `CommitPlan`)."""
        plan = self._prefixes.get(n)
        if plan is None:
            L, H, Dk, C = self.k.shape
            plan = self._prefixes[n] = commit_plan(self.g.flatten(0, -2)[:, :n], self.k[..., :n],
                                                   self.delta[:, :, :n].view(L * H, n, self.delta.shape[-1]),
                                                   self._x_tail(n))
        return plan

    def prepare_commit(self, n: int, staged: int, into: tuple[str, str] = ("window", "spare")) -> tuple[Tensor, Tensor]:
        """(window, recurrent) of the head after keeping n of `staged` tokens, written into the buffers named by
        `into` (the staging's by default; never the head's).

        Six calls whatever the depth: every operand and output is a view made once (per n, or per buffer)."""
        window, state = into
        return self.state_after(n, staged, getattr(self, window), getattr(self, state), self.flat[state])

    def state_after(self, n: int, staged: int, out_window: Tensor, out_state: Tensor,
                    out_flat: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The head's window and recurrent state after keeping n of `staged` logged tokens, written into `out_window`
        `(L, K-1, C)` and `out_state` `(L, H, Dk, Dv)` (a prefix cache's entry, or a buffer of this state)."""
        if not self.logged:
            raise ValueError(f"partial commit ({n} of {staged}) of a staging longer than {self.log_capacity} tokens")
        if self.decay == "snapshot":  # the logs hold the state after each staged token (as d): keep the n-th
            self._window_after(n, out_window, self._x_tail(n))
            out_state.copy_(self.delta[:, :, n - 1:n])
            return out_window, out_state
        if out_state.is_cuda and self.decay in ("head", "key"):  # one Triton launch for every (layer, head) tile
            # (`shared/kernels/triton_commit.py`):
            # it reads the logs as they are, so no per-n plan and none of its buffers
            from deltaspec.shared.kernels.triton_commit import commit_states

            self._window_after(n, out_window, self._x_tail(n))
            commit_states(self.state[None], self.k[None], self.delta[None], self.g[None], out_state[None], [0], [n])
            return out_window, out_state
        p = self._prefix(n)
        self._window_after(n, out_window, p.x_tail)
        closed_form(p, self.state, out_state,
                    layer_heads(out_state) if out_flat is None else out_flat)
        return out_window, out_state

    def _x_tail(self, n: int) -> Tensor:
        """The last K-1 (or fewer) of the first n logged pre-conv inputs, (L, <=K-1, C): a view."""
        return self.x[:, max(0, n - self.conv.shape[1]):n]

    def _window_after(self, n: int, out: Tensor, x_tail: Tensor) -> None:
        """The conv window after keeping n staged tokens: what stays of the head's, then their inputs."""
        if n >= self.conv.shape[1]:
            out.copy_(x_tail)
        else:
            torch.cat([self.tails["conv"][n], x_tail], dim=1, out=out)

    def commit(self, n: int, staged: int) -> None:
        """Keep the first n of `staged` tokens as the head. All of them: the staging's window and state are swapped
        in. Fewer: the closed form is written over the head's own state, read and written back in one pass, where
        writing the staging's buffer cost a pass more over memory the verify pass had just left (0.80-0.88x the
        commit's time on the CPU); the window goes into the staging's, swapped in."""
        if n < staged:
            self.state_after(n, staged, self.window, self.state, self.flat["state"])
        else:
            self._swap("state", "spare")
        self._swap("conv", "window")
        self.logged = True

    def mark(self, n: int, staged: int) -> None:
        """Snapshot the window and state after the first n of `staged` tokens (the one extra staging of a chained
        round): copied when n is everything staged, else computed from the logs."""
        if "marked_state" not in self.layers:
            with torch.inference_mode(False):
                self.marked_window, self.marked_state = torch.empty_like(self.conv), torch.empty_like(self.state)
            self._make_views("marked_window")
            self._make_views("marked_state")
        if n < staged:
            self.prepare_commit(n, staged, into=("marked_window", "marked_state"))
            return
        self.marked_window.copy_(self.window)
        self.marked_state.copy_(self.spare)

    def commit_marked(self, n: int, staged: int) -> None:
        """The snapshot becomes the head (n tokens in); the logs of the staged tokens after it move to the front."""
        self._swap("conv", "marked_window")
        self._swap("state", "marked_state")
        rest = staged - n
        if self.logged and rest:
            for log, axis in ((self.x, 1), (self.k, 3), (self.delta, 2), (self.g, self.g.ndim - 1)):
                log.narrow(axis, 0, rest).copy_(log.narrow(axis, n, rest).clone())

    def drop_marked(self) -> None:
        """Back to the snapshot: the tokens staged after it are dropped, those before stay staged."""
        self._swap("window", "marked_window")
        self._swap("spare", "marked_state")

    def marked_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.state))

    def _swap(self, a: str, b: str) -> None:
        ta, tb = getattr(self, a), getattr(self, b)
        setattr(self, a, tb)
        setattr(self, b, ta)
        for views in (self.layers, self.tails, self.flat):
            if a in views:
                views[a], views[b] = views[b], views[a]


class BlockHeads:
    """The head's recurrent windows and states after chosen staged offsets, taken by the passes that stage past them: a
    prefix cache's block boundaries inside a prefill, whose tokens are too many for the logs the commit algebra reads.

    Each layer's pass hands over what it stages (its tokens' pre-conv inputs, keys, corrections and log decays, and
    the state before and after); a boundary inside the pass is the commit algebra applied to the tokens since the
    last one, `S_e = exp(G) S_s + sum_t exp(G - G_t) k_t delta_t^T`, and one at the pass's end is the pass's own
    state. Heads only: nothing staged is kept unless the caller commits at least up to each offset."""

    def __init__(self, rec: RecurrentStates, ends: list[int]) -> None:
        self.ends = ends  # staged offsets, increasing
        self.snapshot = rec.decay == "snapshot"  # delta is the state after each token
        self.windows = rec.conv.new_empty(len(ends), *rec.conv.shape)  # (E, L, K-1, C)
        self.states = rec.state.new_empty(len(ends), *rec.state.shape)  # (E, L, H, Dk, Dv)

    def take(self, i: int, offset: int, window_and_x: Tensor, k: Tensor, delta: Tensor, g: Tensor, before: Tensor,
             after: Tensor) -> None:
        """Layer i staged tokens offset..offset+T-1: `window_and_x` `(K-1+T, C)`, k `(T, H, Dk)`, delta `(T, H, Dv)`,
        g `(T, H, [Dk])`; `before` and `after` its state around them `(H, Dk, Dv)`."""
        width = self.windows.shape[2]
        T = window_and_x.shape[0] - width
        state, start = before, 0
        for j, end in enumerate(self.ends):
            n = end - offset
            if not 0 < n <= T:
                continue
            self.windows[j, i] = window_and_x[n:n + width]
            if n == T:
                self.states[j, i] = after
                continue
            if self.snapshot:
                self.states[j, i] = delta[n - 1][:, None]
                continue
            # the tokens since the last boundary, laid out as the logs hold them
            plan = commit_plan(g[start:n].flatten(1).t(), k[start:n].permute(1, 2, 0)[None],
                               delta[start:n].transpose(0, 1))
            closed_form(plan, state[None], self.states[j, i][None], self.states[j, i])
            state, start = self.states[j, i], n


@dataclass
class RecurrentSlot:
    """Layer i's view of `RecurrentStates` during one forward pass that starts `offset` tokens into the staging."""

    states: RecurrentStates
    i: int
    offset: int

    def conv_window(self) -> Tensor:
        """The K-1 pre-conv inputs before this pass's first token, `(K-1, conv_dim)`."""
        return self.states.layers["window" if self.offset else "conv"][self.i]

    def initial_state(self) -> Tensor:
        return self.states.layers["spare" if self.offset else "state"][self.i]

    def state_out(self) -> Tensor:
        """Where the state after this pass goes, `(H, Dk, Dv)`: a kernel may write it here directly."""
        return self.states.layers["spare"][self.i]

    def log_targets(self, T: int) -> tuple[Tensor, ...]:
        """Where this pass's T tokens are logged: x `(T, C)`, k `(H, Dk, T)`, delta `(H, T, Dv)`, g `(H, [Dk,] T)`; none
        (and the staging no longer logged) when they do not fit."""
        s, end = self.states, self.offset + T
        if s.logged and end <= s.log_capacity:
            return s.log_views(self.i, self.offset, end)
        s.logged = False
        return ()

    def verify_logs(self, T: int) -> VerifyLogs | None:
        """Where a kernel logs k, delta and g of this pass's T tokens itself (`log_targets`'s slots); None (and the
        staging no longer logged) when they do not fit."""
        if not self.log_targets(T):
            return None
        rows = self.states.rows
        return VerifyLogs(rows.k, rows.delta, rows.g, self.states.members(self.offset, T), self.i)

    def stage(self, x: Tensor, k: Tensor, delta: Tensor, g: Tensor, final_state: Tensor,
              window_and_x: Tensor | None = None, kernel_logged: bool = False) -> None:
        """Log this pass's T tokens and keep the window and state after them.

        `final_state`: the state after the pass (nothing is copied when it is `state_out()` itself, where a kernel
        wrote it). `window_and_x`: `[conv_window(); x]` when the caller has it (saves a concatenation).
        `kernel_logged`: the kernel wrote k, delta and g into the logs (`verify_logs`); only x is copied.
        """
        s = self.states
        logs = self.log_targets(x.shape[0])
        if logs:
            log_x, log_k, log_delta, log_g = logs
            log_x.copy_(x)
            if not kernel_logged:
                log_delta.copy_(delta.transpose(0, 1))
                if s.decay != "snapshot":  # a snapshot kind's k and g are zeros nothing reads (its commit copies d)
                    log_k.copy_(k.permute(1, 2, 0))
                    log_g.copy_(g.movedim(0, -1))
        if window_and_x is None:
            window_and_x = torch.cat([self.conv_window(), x.to(s.window.dtype)], dim=0)
        if s.block_heads is not None:  # before the state after this pass overwrites the one before it
            s.block_heads.take(self.i, self.offset, window_and_x, k, delta, g, self.initial_state(), final_state)
        s.layers["window"][self.i].copy_(window_and_x[window_and_x.shape[0] - s.conv.shape[1]:])  # none for K = 1
        if final_state is not self.state_out():
            self.state_out().copy_(final_state)


def verify_logs(slots: Sequence[RecurrentSlot], counts: Sequence[int]) -> VerifyLogs | None:
    """Where a kernel logs a batch's pass at one layer itself: the first `counts[b]` tokens of `slots[b]` at its own
    offset, none for a sequence whose staging no longer fits its logs (marked so, as `log_targets` does). None when
    the sequences' logs are not rows of the same buffers (not slots of one `StatePool`): each copies its own then."""
    rows = slots[0].states.rows
    if any(s.states.rows.k is not rows.k for s in slots):
        return None
    fits = [n if s.log_targets(n) else 0 for s, n in zip(slots, counts)]
    members = torch.tensor([[s.states.rows.first for s in slots], [s.offset for s in slots], fits], dtype=torch.int32,
                           device=rows.k.device)
    return VerifyLogs(rows.k, rows.delta, rows.g, members, slots[0].i)


@dataclass
class AttnLayerState:
    """K/V buffers `(H_kv, capacity, D)` addressed by position; only positions < committed length are the head.

    `lease`: a pooled sequence's; its growth is paid from the pool's memory budget or refused (`ResourceExhausted`)
    before anything changes.
    """

    k: Tensor
    v: Tensor
    lease: Lease | None = None

    def ensure_capacity(self, needed: int) -> None:
        capacity = self.k.shape[1]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity)
        if self.lease is not None:
            new_capacity = self.lease.grow(needed, new_capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            with torch.inference_mode(False):  # like every state buffer (a compiled pass's graph expects it)
                grown = old.new_zeros(old.shape[0], new_capacity, old.shape[2])  # finite: compiled passes read it all
                grown[:, :capacity] = old
            setattr(self, name, grown)


LayerView = RecurrentSlot | AttnLayerState | tuple[RecurrentSlot, AttnLayerState] | None  # `layer_views`' entries


class ModelState:
    """One sequence's state for a whole hybrid stack: the committed head and at most one staged round."""

    def __init__(self, spec: StateSpec, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 capacity: int = 256, lease: Lease | None = None, log_capacity: int = LOG_CAPACITY) -> None:
        """`spec`: what the state holds, as the model's family declares it (`ModelConfig.state_spec`). `lease`: a
        slot of a `deltaspec.shared.state.pool.StatePool` (recurrent buffers, K/V paid for `capacity` positions; its
        logs' size is the pool's); `log_capacity`: staged tokens a partial commit can keep (`CHAIN_LOG_CAPACITY` for a
        draft that speculates rounds ahead)."""
        self.length = 0  # tokens in the committed head
        self.staged = 0  # tokens staged on top of it
        self.marked = 0  # with `mark`: staged tokens the snapshot covers (a chained round stages after them)
        # seconds rank 0 of a tensor-parallel group spent in collectives on this state's passes (a batch's whole) and
        # changes (`deltaspec.shared.model.lockstep.Leader` adds them); 0 in one process
        self.collective_s = 0.0
        if spec.recurrent is None:
            raise ValueError("ModelState holds a hybrid model's state: the spec declares no recurrent layers")
        self.spec = spec
        self.recurrent = RecurrentStates(spec.recurrent, spec.n_recurrent, device, dtype,
                             lease.buffers if lease is not None else None, log_capacity,
                             lease.rows if lease is not None else None)
        shape = (spec.kv_heads, capacity, spec.head_dim)
        with torch.inference_mode(False):
            self.attn = [AttnLayerState(torch.zeros(shape, device=device, dtype=dtype),
                                        torch.zeros(shape, device=device, dtype=dtype), lease)
                         for _ in range(spec.n_attention)]

    def load_head(self, length: int, window: Tensor, state: Tensor, kv: Tensor) -> None:
        """Make a fresh state's head the one after `length` tokens: recurrent windows `(L, K-1, C)` and states
        `(L, H, Dk, Dv)`, attention K/V of positions 0..length-1 `(A, 2, H_kv, length, D)` (a prefix cache's)."""
        if self.length or self.staged:
            raise ValueError("load_head needs a fresh state")
        self.ensure_positions(length)
        self.recurrent.conv.copy_(window)
        self.recurrent.state.copy_(state)
        for layer, (k, v) in zip(self.attn, kv):
            layer.k[:, :length] = k
            layer.v[:, :length] = v
        self.length = length

    def kv(self, start: int, end: int) -> Tensor:
        """Every attention layer's K/V of positions start..end-1 `(A, 2, H_kv, end - start, D)`, as `load_head` takes
        it; A = 0 for a model without attention layers (pure Mamba2), whose prefix cache entries hold none."""
        if not self.attn:
            window = self.recurrent.conv
            return window.new_empty(0, 2, self.spec.kv_heads, end - start, self.spec.head_dim)
        return torch.stack([torch.stack([a.k[:, start:end], a.v[:, start:end]]) for a in self.attn])

    def load_from(self, source: ModelState, n: int) -> None:
        """Make a fresh state's head `source`'s after its first n staged tokens, computed as `source.commit(n)`
        would compute it, so a sequence continued here equals one continued there bit for bit (a draft's branch:
        `ModelDrafter.stage_branches`). `source` is unchanged."""
        if self.length or self.staged:
            raise ValueError("load_from needs a fresh state")
        if not 0 < n <= source.staged:
            raise ValueError(f"load_from after {n} tokens, but {source.staged} are staged")
        rec, end = source.recurrent, source.length + n
        if n == source.marked:  # what a commit after `drop_marked` keeps: the snapshot
            self.recurrent.conv.copy_(rec.marked_window)
            self.recurrent.state.copy_(rec.marked_state)
        elif n == source.staged and not source.marked:  # what a full commit swaps in: the pass's own final state
            self.recurrent.conv.copy_(rec.window)
            self.recurrent.state.copy_(rec.spare)
        else:
            rec.state_after(n, source.staged, self.recurrent.conv, self.recurrent.state)
        self.ensure_positions(end)
        for mine, theirs in zip(self.attn, source.attn):
            mine.k[:, :end] = theirs.k[:, :end]
            mine.v[:, :end] = theirs.v[:, :end]
        self.length = end

    def ensure_positions(self, needed: int) -> None:
        """Grow every attention layer's K/V to `needed` positions before a forward stages anything: a pooled
        state's growth is paid in full by the first layer, or refused (`ResourceExhausted`) with the state unchanged."""
        for layer in self.attn:
            layer.ensure_capacity(needed)

    def layer_views(self) -> list[LayerView]:
        """Per-layer state for one forward pass, in layer order: a recurrent layer's slot, an attention layer's K/V,
        both (slot, K/V) for a HYBRID layer, None for a layer without state."""
        rec, attn = iter(range(len(self.recurrent.conv))), iter(self.attn)
        views = {RECURRENT: lambda: RecurrentSlot(self.recurrent, next(rec), self.staged),
                 ATTENTION: lambda: next(attn)}
        out: list[LayerView] = []
        for kind in self.spec.layers:
            held = tuple(views[k]() for k in HOLDS[kind])
            out.append(held[0] if len(held) == 1 else held or None)
        return out

    def commit(self, n: int) -> None:
        """Keep the first n staged tokens, drop the rest. All layers move together or none does."""
        if not 0 <= n <= self.staged:
            raise ValueError(f"commit of {n} tokens, but {self.staged} are staged")
        if n == 0:
            self.revert()
            return
        self.recurrent.commit(n, self.staged)
        self.length += n
        self.staged = self.marked = 0

    def revert(self) -> None:
        """Drop everything staged; the head is untouched by construction."""
        self.staged = self.marked = 0
        self.recurrent.logged = True

    def mark(self, n: int | None = None) -> None:
        """Remember the state after the first n staged tokens (default: all); a chained round then stages on top of
        them. n < staged computes it from the logs (the tokens after n stay staged)."""
        n = self.staged if n is None else n
        if not 0 < n <= self.staged:
            raise ValueError(f"mark after {n} tokens, but {self.staged} are staged")
        self.recurrent.mark(n, self.staged)
        self.marked = n

    def truncate(self, n: int) -> None:
        """Drop the staged tokens after the first n, keeping those (and a mark within them) staged."""
        if not 0 <= n <= self.staged:
            raise ValueError(f"truncate to {n} tokens, but {self.staged} are staged")
        if n == self.staged:
            return
        if n == 0:
            self.revert()
            return
        if n == self.marked:
            self.drop_marked()
            return
        self.recurrent.prepare_commit(n, self.staged)
        self.staged = n
        if self.marked > n:
            self.marked = 0

    def commit_marked(self) -> None:
        """Keep the tokens staged before `mark` (a pointer swap); the tokens staged after it stay staged."""
        if not self.marked:
            raise ValueError("no mark to commit")
        self.recurrent.commit_marked(self.marked, self.staged)
        self.length += self.marked
        self.staged -= self.marked
        self.marked = 0

    def drop_marked(self) -> None:
        """Drop the tokens staged after `mark`; those before it stay staged."""
        if not self.marked:
            raise ValueError("no mark to drop")
        self.recurrent.drop_marked()
        self.staged, self.marked = self.marked, 0

    def staged_bytes(self) -> int:
        """Bytes logged for the staged tokens (the spare state is allocated once and not counted)."""
        if not self.recurrent.logged:
            return 0
        rec = self.recurrent
        per_token = sum(t.numel() * t.element_size() for t in (rec.x, rec.k, rec.delta, rec.g))
        return per_token // rec.log_capacity * self.staged + (rec.marked_bytes() if self.marked else 0)
