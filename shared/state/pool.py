"""State slots: the recurrent states of up to N sequences preallocated as a few large tensors, under one memory
budget that also pays for every sequence's attention K/V.

A sequence's recurrent state does not grow with its context: committed state, spare, mark snapshot, conv
windows and round logs (`RecurrentSpec.buffers`) are `StateSpec.recurrent_bytes` whatever its length.
Attention K/V grows by `StateSpec.kv_bytes_per_position` a token (`StateSpec.bytes`: a session's whole
state). So the pool preallocates its slots, one tensor per buffer with a leading slot axis, and leaves the
rest of the budget to K/V:

- admission (`new_state(capacity)`) takes a free slot and pays K/V for `capacity` positions (a target
  session asks for twice its prompt, at least 256), or raises `ResourceExhausted` naming the budget,
  the slots in use and what a session takes; nothing is allocated then;
- growth (`AttnLayerState.ensure_capacity`) pays for all the sequence's attention layers at once:
  doubling when the budget allows, else what is left, else `ResourceExhausted`. A forward reserves its
  positions before its first layer runs (`ModelState.ensure_positions`, a forward pre-hook set by
  `attach`), so a refused pass changes nothing and the session goes on once other sessions free memory;
- a prefix cache's entries (`deltaspec.shared.state.prefix_cache`) are paid from the K/V budget too
  (`take`, `give`), and admission or growth that finds no room has the cache evict entries (`reclaim`)
  before it refuses: cached prefixes never keep a session out;
- a slot and its K/V come back when the `ModelState` holding them is garbage (`weakref.finalize`):
  closing, expiring or finishing a session drops its last reference, and only then can no late call
  still write the slot. Admission that finds the pool full first collects reference cycles (at most
  once a second).
"""
from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable

import torch
from torch import nn

from deltaspec.shared.errors import ResourceExhausted
from deltaspec.shared.state.rollback import LogRows, ModelState
from deltaspec.shared.state.spec import LOG_CAPACITY, StateSpec

MIN_CONTEXT = 256  # the smallest K/V capacity a session asks for (TargetSession, ModelDrafter: max(256, 2 x prompt))
FIELD = "state_memory"  # what a refusal names (QuotaFailure subject)
COLLECT_INTERVAL_S = 1.0  # a full pool collects reference cycles at most this often (a flood of refusals costs no more)


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 / 10 else f"{n / 2**10:.1f} KiB"


class Lease:
    """One pooled sequence's slot, and the K/V capacity it has paid for (the same for all its attention layers).

    Holds no reference to the state, so the state's finalizer can return it."""

    def __init__(self, pool: StatePool, index: int, capacity: int) -> None:
        self.pool, self.index, self.capacity = pool, index, capacity
        self.buffers = {name: t[index] for name, t in pool.tensors.items()}
        self.rows = LogRows(*pool.log_rows, index * pool.tensors["k"].shape[1])

    def grow(self, needed: int, preferred: int) -> int:
        """The capacity an attention layer of this sequence grows to (>= needed), paid for every layer."""
        return self.pool.grow(self, needed, preferred)


class StatePool:
    """Slots for up to `max_slots` sequences of one model shape within `budget` bytes (recurrent slots + K/V); each
    slot's
    round logs hold `log_capacity` staged tokens."""

    def __init__(self, spec: StateSpec, budget: int, max_slots: int | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 log_capacity: int = LOG_CAPACITY) -> None:
        self.spec, self.device, self.dtype, self.budget, self.log_capacity = spec, device, dtype, budget, log_capacity
        self.recurrent_bytes = spec.recurrent_bytes(dtype, log_capacity)
        self.kv_per_position = spec.kv_bytes_per_position(dtype)
        session = self.recurrent_bytes + MIN_CONTEXT * self.kv_per_position
        self.slots = budget // session if max_slots is None else min(max_slots, budget // session)
        if self.slots < 1:
            raise ValueError(f"a state memory budget of {mib(budget)} holds no session: one takes {mib(session)} "
                             f"({mib(self.recurrent_bytes)} of recurrent state + K/V for {MIN_CONTEXT} positions)")
        self.kv_budget = budget - self.slots * self.recurrent_bytes
        self.kv_used = 0
        self.refusals = 0  # admissions and growths refused (a metric)
        shapes = spec.recurrent_buffers(dtype, log_capacity)
        with torch.inference_mode(False):  # normal tensors: a slot is zeroed outside inference mode
            self.tensors = {name: torch.empty(self.slots, *shape, device=device, dtype=kind)
                            for name, (shape, kind) in shapes.items()}
            # every slot's k, delta and g logs as rows of one (slot, layer) axis: one kernel launch logs many slots
            self.log_rows = tuple(self.tensors[name].flatten(0, 1) for name in ("k", "delta", "g"))
        self._free = list(range(self.slots - 1, -1, -1))  # popped from the end: lowest index first
        self._lock = threading.RLock()  # re-entrant: a finalizer may run inside, on a collection
        self._collected = -COLLECT_INTERVAL_S  # when a full pool last collected garbage
        # frees K/V budget held by a prefix cache, at least the bytes asked if it can; returns the bytes freed
        self.reclaim: Callable[[int], int] = lambda nbytes: 0

    @property
    def in_use(self) -> int:
        return self.slots - len(self._free)

    def session_bytes(self, positions: int) -> int:
        return self.spec.bytes(self.dtype, positions, self.log_capacity)

    def new_state(self, capacity: int = MIN_CONTEXT) -> ModelState:
        """A fresh sequence state in a free slot, K/V paid for `capacity` positions; `ResourceExhausted` if none."""
        lease = self._admit(capacity)
        try:
            state = ModelState(self.spec, self.device, self.dtype, capacity, lease)
        except BaseException:
            self._release(lease)
            raise
        weakref.finalize(state, self._release, lease).atexit = False
        return state

    def take(self, nbytes: int) -> bool:
        """Pay `nbytes` from the K/V budget (a prefix cache's entry); False, paying nothing, when they do not fit."""
        with self._lock:
            if self.kv_used + nbytes > self.kv_budget:
                return False
            self.kv_used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.kv_used -= nbytes

    def _make_room(self, cost: int) -> None:
        """Have the prefix cache free what `cost` more bytes of K/V need (outside the pool's lock: the cache calls
        `give`, and holds its own lock while it calls `take`)."""
        with self._lock:
            short = self.kv_used + cost - self.kv_budget
        if short > 0:
            self.reclaim(short)

    def _admit(self, capacity: int) -> Lease:
        cost = capacity * self.kv_per_position
        if self._free:
            self._make_room(cost)
        if not self._room(cost) and time.monotonic() - self._collected >= COLLECT_INTERVAL_S:
            self._collected = time.monotonic()
            gc.collect()  # states dropped inside reference cycles (an exception's traceback) return now
        with self._lock:
            if not self._room(cost):
                self.refusals += 1
                raise ResourceExhausted(
                    f"the state memory budget ({mib(self.budget)}) is taken: {self.in_use} of {self.slots} session "
                    f"slots in use, {mib(self.kv_used)} of {mib(self.kv_budget)} of attention K/V; a session takes "
                    f"{mib(self.recurrent_bytes)} of recurrent state + {self.kv_per_position} B of K/V per position "
                    f"({mib(self.session_bytes(capacity))} at the {capacity} positions asked)", FIELD)
            self.kv_used += cost
            return Lease(self, self._free.pop(), capacity)

    def _room(self, cost: int) -> bool:
        return bool(self._free) and self.kv_used + cost <= self.kv_budget

    def grow(self, lease: Lease, needed: int, preferred: int) -> int:
        self._make_room((needed - lease.capacity) * self.kv_per_position)
        with self._lock:
            if needed <= lease.capacity:  # another attention layer of the sequence has paid already
                return lease.capacity
            free = self.kv_budget - self.kv_used
            target = min(preferred, lease.capacity + free // self.kv_per_position)
            if target < needed:
                self.refusals += 1
                raise ResourceExhausted(
                    f"attention K/V for {needed} positions needs "
                    f"{mib((needed - lease.capacity) * self.kv_per_position)} more, and the state memory budget "
                    f"({mib(self.budget)}, {self.in_use} of {self.slots} session slots in use) has {mib(free)} of "
                    f"K/V left: retry when other sessions end", FIELD)
            self.kv_used += (target - lease.capacity) * self.kv_per_position
            lease.capacity = target
            return target

    def _release(self, lease: Lease) -> None:
        with self._lock:
            self.kv_used -= lease.capacity * self.kv_per_position
            self._free.append(lease.index)


def _reserve_positions(model: nn.Module, args: tuple, kwargs: dict) -> None:
    ids = args[0] if args else kwargs["ids"]
    state = args[1] if len(args) > 1 else kwargs["state"]
    state.ensure_positions(state.length + state.staged + ids.numel())


def attach(model: nn.Module, pool: StatePool) -> None:
    """From now on `model.new_state` takes slots from `pool`, and each forward reserves its positions first."""
    if model.state_pool is not None:
        raise ValueError("the model has a state pool already")
    model.state_pool = pool
    model.register_forward_pre_hook(_reserve_positions, with_kwargs=True)
