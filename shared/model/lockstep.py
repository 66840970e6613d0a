"""A tensor-parallel group that serves as one model: rank 0 leads, the other ranks follow, rounds commit on all.

Rank 0 (`Leader`) runs the engine on its shard (`deltaspec.shared.model.parallel`) as a single process runs the whole
model. Each call that changes a session's state on its shard it broadcasts, `(op, session, args)`: a model pass
before making it (the followers' all-reduces pair with its own), a commit, revert, mark or new session once made
(none that rank 0 refuses is sent); every follower (`follow`) makes the same call on its own shard of that state.
The calls go out in one order under one lock, held over each pass too, so every rank runs the same passes in the
same order and keeps each round by the same closed form: what rank 0 applied, every rank applied. Only rank 0
samples and decides (every rank's logits are the same tensor).

A rank that dies or stops answering breaks the group: rank 0's next broadcast or all-reduce fails (or its watcher
sees a follower exit) and rank 0 exits, so callers see the target UNAVAILABLE and recover their sessions as after
any restart (no round is half applied: rank 0, which answers callers, is gone); a follower whose leader is gone
exits too. Rank 0 pings an idle group every `PING_S` so that a silent peer is noticed within the group's timeout.

A prefix cache on rank 0 (`deltaspec.shared.state.prefix_cache`) journals each change to its entries and each hit
it loads into a session (`Leader.journal`); the journal goes out with rank 0's next call, in order, ahead of it, and
each follower replays it on its shard of every entry (`deltaspec.shared.model.shard_cache`). A pass that takes a
prefill's block heads for the cache says where, so every rank takes its shard of them.

The MTP head (`deltaspec.shared.model.mtp_head`) is sharded as the trunk is: each new cache of it and each pass of
it on rank 0 goes out the same way (the pass's token ids, trunk hidden states and start position; a follower embeds
the ids itself), so every rank holds its shard of each sequence's head K/V and the head's all-reduces pair up. A
pass is the head cache's only change (its rows roll back by position), so the order of the calls keeps it alike.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from deltaspec.shared.model.batched import forward_batch
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.model.mtp_head import MTPCache, MTPHead
from deltaspec.shared.model.parallel import Rank
from deltaspec.shared.model.shard_cache import ShardCache
from deltaspec.shared.state.rollback import ModelState
from deltaspec.shared.state.spec import LOG_CAPACITY

MIRRORED = ("commit", "revert", "mark", "commit_marked", "drop_marked", "truncate")  # ModelState's changes
PING_S = 10.0
TIMEOUT_S = 60.0  # a collective (a pass's all-reduce, a call's broadcast) that waits longer breaks the group


def join(rank: int, world: int, rendezvous: str, timeout_s: float = TIMEOUT_S, wait_s: float | None = None) -> Rank:
    """Join the group of `world` ranks meeting at `rendezvous` (`tcp://HOST:PORT`, rank 0 listening; or
    `file://PATH`); gloo on CPUs, NCCL for CUDA tensors. Raises if the group is not complete within `wait_s` (at a
    tcp:// rendezvous; `timeout_s` otherwise); once formed, a collective that waits `timeout_s` fails."""
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if rendezvous.startswith("tcp://") and wait_s is not None:
        host, port = rendezvous.removeprefix("tcp://").rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world, is_master=rank == 0, timeout=timedelta(seconds=wait_s),
                              wait_for_workers=True)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world, timeout=timeout)
    return Rank(rank, world)


class Broken(RuntimeError):
    """The group lost a rank: its states can no longer be kept alike."""


def exit_group(error: BaseException) -> None:
    """What rank 0 does when its group breaks: say why and exit at once (its supervisor restarts the group)."""
    print(f"tensor parallel group broken, exiting: {error}", file=sys.stderr, flush=True)
    os._exit(70)


class Leader:
    """Rank 0's side: `model`'s forward and new_state, and every state's `MIRRORED` methods, broadcast each call
    before making it. Every state the engine uses must come from `model.new_state`."""

    def __init__(self, model: HybridLM, at: Rank, on_broken: Callable[[BaseException], None] = exit_group) -> None:
        self.model, self.at, self.on_broken = model, at, on_broken
        self._lock = threading.RLock()
        self._inside = threading.local()  # calls a mirrored call makes are the followers' own business
        self._freed: collections.deque[int] = collections.deque()  # states gone on rank 0: sent with the next call
        self._journal: collections.deque[tuple[str, tuple[Any, ...]]] = collections.deque()  # the prefix cache's
        self._ids = itertools.count()
        self._sid: weakref.WeakKeyDictionary[ModelState | MTPCache, int] = weakref.WeakKeyDictionary()
        self._forward, self._new_state = model.forward, model.new_state
        model.forward, model.new_state = self.forward, self.new_state  # what the engine's calls reach
        model.leader = self  # and `batched.forward_batch`'s
        self._stopped = threading.Event()
        threading.Thread(target=self._ping, name="deltaspec-tp-ping", daemon=True).start()

    def new_state(self, capacity: int = 256, log_capacity: int = LOG_CAPACITY) -> ModelState:
        with self._lock:
            state = self._new_state(capacity, log_capacity)
            sid = self._register(state, "new", capacity, state.recurrent.log_capacity)
        ref = weakref.ref(state)  # the state's own methods, not a cycle through it
        for name in MIRRORED:
            setattr(state, name, functools.partial(self._mirrored, sid, ref, name))
        return state

    def new_mtp_cache(self, cache: MTPCache, capacity: int) -> None:
        """An MTP head's new cache (`MTPHead.new_cache`): each follower makes its shard of it."""
        with self._lock:
            self._register(cache, "mtp_new", capacity)

    def mtp_pass(self, head: MTPHead, ids: Tensor, hidden: Tensor, cache: MTPCache, start: int) -> Tensor:
        """The MTP head's pass (`MTPHead.forward`), on every rank."""
        if self.nested:
            return head.run(ids, hidden, cache, start)
        return self._announced("mtp", self._sid[cache], (ids.cpu(), hidden.cpu(), start),
                               lambda: head.run(ids, hidden, cache, start), [])

    def forward(self, ids: Tensor, state: ModelState) -> tuple[Tensor, Tensor]:
        """The pass, on every rank. Input the followers would refuse alike is refused here before it is sent."""
        vocab = self.model.config.vocab_size
        if ids.ndim != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"forward takes a non-empty 1-D tensor of token ids in [0, {vocab})")
        if self.nested:  # a batch of one, already announced
            return self._forward(ids, state)
        return self._announced("pass", -1, self._items([(ids, state)]), lambda: self._forward(ids, state), [state])

    def forward_batch(self, items: Sequence[tuple[Tensor, ModelState]]) -> list[tuple[Tensor, Tensor]]:
        """`batched.forward_batch` on every rank. Positions are reserved first: a K/V budget refuses here, before
        anything is sent (the followers' states are outside any budget)."""
        for ids, st in items:
            st.ensure_positions(st.length + st.staged + ids.numel())
        return self._announced("batch", -1, self._items(items), lambda: forward_batch(self.model, items),
                               [st for _, st in items])

    def journal(self, op: str, *args: Any) -> None:
        """A prefix cache's change (its `journal`), sent ahead of the next call: what it reads from a session comes
        before that session's next call, a hit's load before its first pass."""
        self._journal.append((op, tuple(self._sid[a] if isinstance(a, ModelState) else a for a in args)))

    @property
    def nested(self) -> bool:
        """Whether this thread is inside a call already announced (its inner calls are the followers' own)."""
        return getattr(self._inside, "depth", 0) > 0

    def _items(self, items: Sequence[tuple[Tensor, ModelState]]) -> tuple[Any, ...]:
        """A trunk pass's arguments as sent: each session's id, its token ids, where the pass takes block heads."""
        return ([(self._sid[st], ids.cpu(), None if st.recurrent.block_heads is None
                  else st.recurrent.block_heads.ends) for ids, st in items],)

    def _register(self, made: ModelState | MTPCache, op: str, *args: Any) -> int:
        """Announce a state (or MTP cache) rank 0 made, under the lock; it is dropped on the followers once gone."""
        sid = next(self._ids)
        self._send(op, sid, *args)
        self._sid[made] = sid
        weakref.finalize(made, self._freed.append, sid).atexit = False
        return sid

    def _announced(self, op: str, sid: int, args: tuple[Any, ...], run: Callable[[], Any],
                   states: Sequence[ModelState]) -> Any:
        """Send the pass, then run it; its collective time goes to `states` (a batch's whole to each)."""
        with self._lock:
            started = self.at.clock.seconds
            self._send(op, sid, *args)
            try:
                with self._nested():
                    out = run()
            except Exception as error:  # noqa: BLE001 - the followers may have run it: the shards are no longer alike
                self.on_broken(error)
                raise Broken(f"a pass failed on rank 0 after it was sent: {error}") from error
            spent = self.at.clock.seconds - started  # a batch's, whole, for each of its sessions: each waited on it
            for st in states:
                st.collective_s += spent
            return out

    def stop(self) -> None:
        """Tell the followers to exit (the group is done)."""
        with self._lock:
            self._stopped.set()
            self._send("stop", -1)

    def watch(self, processes: Sequence[Any]) -> None:
        """Break the group as soon as one of the follower `processes` (multiprocessing's) exits unasked."""
        def run() -> None:
            wait([p.sentinel for p in processes])
            if not self._stopped.is_set():
                codes = [p.exitcode for p in processes if not p.is_alive()]
                self.on_broken(Broken(f"a follower rank exited (code {codes[0] if codes else '?'})"))
        threading.Thread(target=run, name="deltaspec-tp-watch", daemon=True).start()

    def _mirrored(self, sid: int, ref: weakref.ref[ModelState], name: str, *args: Any) -> Any:
        state = ref()
        method = getattr(ModelState, name)
        if self.nested:
            return method(state, *args)
        with self._lock:  # made first (no collective in it): one rank 0 refuses is never sent
            with self._nested():
                result = method(state, *args)
            started = self.at.clock.seconds
            self._send(name, sid, *args)
            state.collective_s += self.at.clock.seconds - started
            return result

    @contextlib.contextmanager
    def _nested(self) -> Iterator[None]:
        self._inside.depth = getattr(self._inside, "depth", 0) + 1
        try:
            yield
        finally:
            self._inside.depth -= 1

    def _send(self, op: str, sid: int, *args: Any) -> None:
        # the states gone first, the journal after: whatever the journal says of a state gone was journaled before it
        # went, so it goes out with that state's end or ahead of it (a follower replays the journal before it frees)
        journal, freed = [], []
        while self._freed:
            freed.append(self._freed.popleft())
        while self._journal:
            journal.append(self._journal.popleft())
        started = time.perf_counter()
        try:
            dist.broadcast_object_list([(op, sid, args, journal, freed)], src=0, group=self.at.group,
                                       device=torch.device("cpu"))
            self.at.clock.seconds += time.perf_counter() - started
        except Exception as error:  # noqa: BLE001 - a rank is gone or silent
            self.on_broken(error)
            raise Broken(f"a follower did not take {op}: {error}") from error

    def _ping(self) -> None:
        while not self._stopped.wait(PING_S):
            with self._lock:
                if not self._stopped.is_set():
                    self._send("ping", -1)


@dataclass
class Followed:
    """What a follower holds: its shard of each live session's state and MTP cache (by rank 0's ids), of rank 0's
    prefix cache, and of the MTP head (once rank 0 drafted with it)."""

    states: dict[int, ModelState | MTPCache] = field(default_factory=dict)
    prefix_cache: ShardCache = field(default_factory=ShardCache)
    mtp_head: MTPHead | None = None


def follow(model: HybridLM, at: Rank) -> Followed:
    """A follower's loop: make every call rank 0 sends, on this rank's shard, until it says stop; returns what it
    held then. Raises when the leader is gone or silent past the group's timeout."""
    held = Followed()
    states, cache = held.states, held.prefix_cache
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=at.group, device=torch.device("cpu"))
        op, sid, args, journal, freed = box[0]
        for change, change_args in journal:
            cache.replay(change, change_args, states)
        for gone in freed:
            states.pop(gone, None)
            cache.forget(gone)
        if op == "stop":
            return held
        if op == "new":
            capacity, log_capacity = args
            states[sid] = ModelState(model.config.state_spec, device=model.device, dtype=model.dtype,
                                     capacity=capacity, log_capacity=log_capacity)
        elif op in ("pass", "batch"):
            for i, _, heads in args[0]:
                cache.before_pass(i, states[i], heads)
            items = [(ids.to(model.device), states[i]) for i, ids, _ in args[0]]
            if op == "pass":
                model(*items[0])
            else:
                forward_batch(model, items)
            for i, _, _ in args[0]:
                cache.after_pass(i, states[i])
        elif op == "mtp_new":
            held.mtp_head = held.mtp_head or MTPHead(model)
            states[sid] = held.mtp_head.new_cache(*args)
        elif op == "mtp":
            ids, hidden, start = args
            held.mtp_head.run(ids.to(model.device), hidden.to(model.device), states[sid], start)
        elif op != "ping":  # a change rank 0 made: one that fails here breaks the group (this rank exits)
            getattr(states[sid], op)(*args)
