"""Committed heads as a prefix cache: a new sequence resumes from the longest cached prefix of its prompt and
prefills only the rest.

A hybrid model's head after P tokens is every recurrent layer's conv window and recurrent state (a fixed size, whatever
P) and the attention K/V of positions 0..P-1. The cache keeps it at every block boundary (`block` tokens; tens
of tokens work), one entry per block, keyed by a hash chain over the token ids: an entry's key hashes its
parent's key and its own tokens, so a key names a whole prefix from position 0. An entry holds its block's K/V,
the recurrent state at its end (see below) and, for an MTP drafter, the trunk's hidden states of its positions. A
prompt of any length that shares one whole block with a cached sequence hits.

recurrent states where they pay (`state_every`): K/V grows with the block, a recurrent state does not (61 MiB at the
Qwen3.5-35B-A3B shape, against 320 KiB of K/V for 16 tokens), so a big model can keep K/V at every block and a
state only every `state_every` blocks (the grid), at leaves (where a sequence's cached history ends: a resent
conversation or prompt resumes there) and at branch points (where cached sequences part: a shared system prompt's
end, once a second sequence has diverged there). A sequence resumes at the deepest block it matches that holds a
state, prefills from there, and hands the cache the state of the deepest block it matched when that one holds
none (the branch it is about to make); a block that gets its first child off the grid drops its state. So
`state_every` = 1 (the default) caches every head; a larger one trades the second sequence of a new branch
prefilling from the grid for memory: a 1,024-token prefix in blocks of 16 pays 64 blocks of K/V and 4 states at
`state_every` 16, not 64 states.

Entries come from committed heads only: the block boundaries a prefill passes (taken by the pass itself,
`rollback.BlockHeads`), and those a commit completes (the commit algebra over the kept tokens' logs, before the
swap). So no entry ever holds a rejected draft token, whatever the drafter, and a sequence caches the same
blocks with speculation on or off. An entry's tensors are never written once made (a block gains or drops its
recurrent state whole, under the lock, and a lookup takes the one it resumes from under it): a hit copies them into
the sequence's own buffers, so a sequence never depends on an entry staying (eviction while it runs changes
nothing). An evicted leaf takes the stateless blocks above it with it: nothing can resume from them.

Memory: entries are paid from the state pool's K/V budget (`StatePool.take`), and a session that needs room
evicts entries before it is refused (`StatePool.reclaim`). Eviction takes leaves only (an entry with cached
children is their only way in), lowest priority first, GreedyDual-Size-Frequency: priority = clock + hits x
block tokens / bytes, with the clock rising to each evicted priority, so an entry stays for being used often,
or lately, or for saving many tokens per byte.

Mirrors: a cache whose sessions' states have copies elsewhere (a tensor-parallel group's followers, each holding its
shard of every state) has a `journal`, called in order with every change to its entries and every read of a
session's state they are made from, so the copies can keep their shard of each entry alike
(`deltaspec.shared.model.shard_cache`).
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from deltaspec.shared.state.rollback import BlockHeads, ModelState


# journal(op, *args), in the order the cache made them (those of entries under its lock):
# ("heads", state, ends): the heads after `ends` (positions) read from `state`'s logs, before its commit;
# ("put", key, state, start, end, with a recurrent state): a new entry, its K/V `state`'s of
# positions start..end-1 and its recurrent state (if any) the head after `end` read from the state;
# ("keep", key, state, end): a cached entry given the head after `end` read from `state`; ("drop", key): an entry's
# recurrent state dropped; ("evict", key); ("clear",); ("load", state, keys): a hit on the chain `keys` loaded into
# `state` (fresh)
Journal = Callable[..., None]


class Budget(Protocol):
    """Where entries' bytes come from: a `StatePool` (shared with its sessions) or a `ByteBudget`."""

    def take(self, nbytes: int) -> bool: ...

    def give(self, nbytes: int) -> None: ...


class ByteBudget:
    """A budget of the cache's own, for a model without a state pool (an in-process run)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, nbytes: int) -> bool:
        if self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.used -= nbytes


@dataclass(eq=False)
class Entry:
    """One block: the head after its last token, and what its own positions add."""

    key: bytes
    parent: Entry | None
    tokens: tuple[int, ...]  # compared on lookup: a hash collision cannot serve another prefix
    end: int  # positions covered from 0
    window: Tensor | None  # conv windows after it (L, K-1, C); None where no state is kept
    state: Tensor | None  # recurrent states after it (L, H, Dk, Dv); a sequence resumes only where there is one
    kv: Tensor  # its positions' K/V (A, 2, H_kv, block, D)
    hidden: Tensor | None  # the trunk's last-layer states of its positions (block, hidden), for MTP
    nbytes: int
    children: int = 0
    hits: int = 0
    priority: float = 0.0
    alive: bool = True


@dataclass
class Hit:
    """What a lookup found: the matched blocks up to the deepest holding a recurrent state (where a sequence resumes),
    that block's windows and states as the lookup read them (a block off the grid drops its own once it gets a
    child), and the end of the deepest matched block when it holds no state (0 otherwise): the branch point the
    sequence's prefill passes."""

    chain: list[Entry]
    window: Tensor | None = None
    state: Tensor | None = None
    branch: int = 0


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0  # lookups that found at least one block
    cached_tokens: int = 0  # positions served from the cache instead of prefilled
    prefilled_tokens: int = 0  # positions prefilled by sequences that looked up
    published: int = 0
    evictions: int = 0


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block after the prefix keyed `parent` (b"" at position 0)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCache:
    """Cached heads of one model's sequences: K/V every `block` positions, recurrent states every `state_every` blocks
    and
    at leaves and branch points. Thread-safe."""

    def __init__(self, block: int, budget: Budget, keep_hidden: bool = False, state_every: int = 1) -> None:
        if block < 1:
            raise ValueError(f"the prefix cache's block size must be at least 1 token, got {block}")
        if state_every < 1:
            raise ValueError(f"the prefix cache keeps a recurrent state every 1 or more blocks, not {state_every}")
        self.block, self.budget, self.keep_hidden, self.state_every = block, budget, keep_hidden, state_every
        self.entries: dict[bytes, Entry] = {}
        self.leaves: set[Entry] = set()
        self._order: list[tuple[float, int, Entry]] = []  # leaves by priority, with stale items skipped on pop
        self._pushed = itertools.count()
        self.clock = 0.0
        self.bytes = 0
        self.stats = CacheStats()
        self.lock = threading.RLock()
        self.journal: Journal | None = None

    def on_grid(self, end: int) -> bool:
        """Whether the block ending at `end` keeps its recurrent state whatever its place in the tree."""
        return end % (self.block * self.state_every) == 0

    def lookup(self, ids: Sequence[int]) -> Hit:
        """The longest chain of cached whole blocks that `ids` starts with, cut after its deepest block holding a
        recurrent state (a hit when not empty)."""
        chain: list[Entry] = []
        key = b""
        with self.lock:
            for start in range(0, len(ids) - self.block + 1, self.block):
                block = tuple(ids[start:start + self.block])
                key = block_key(key, block)
                entry = self.entries.get(key)
                if entry is None or entry.tokens != block:
                    break
                chain.append(entry)
            for entry in chain:
                self._touch(entry)
            branch = chain[-1].end if chain and chain[-1].state is None else 0
            while chain and chain[-1].state is None:
                chain.pop()
            self.stats.lookups += 1
            self.stats.hits += bool(chain)
            self.stats.cached_tokens += len(chain) * self.block
            if not chain:
                return Hit(chain, branch=branch)
            return Hit(chain, chain[-1].window, chain[-1].state, branch)

    def resume(self, state: ModelState, ids: Sequence[int]) -> Hit:
        """`lookup(ids)`, its hit (if any) loaded into the fresh `state`."""
        with self.lock:
            hit = self.lookup(ids)
            if hit.chain and self.journal is not None:
                self.journal("load", state, [e.key for e in hit.chain])
        if hit.chain:
            state.load_head(hit.chain[-1].end, hit.window, hit.state, torch.cat([e.kv for e in hit.chain], dim=3))
        return hit

    def states(self) -> int:
        """Cached blocks holding a recurrent state."""
        with self.lock:
            return sum(entry.state is not None for entry in self.entries.values())

    def roots(self) -> dict[str, int]:
        """Each cached first block's key (hex) and the most positions cached below it: what a router needs to send
        a prompt to the replica holding its prefix."""
        with self.lock:
            deepest: dict[str, int] = {}
            for entry in self.entries.values():
                root = entry
                while root.parent is not None:
                    root = root.parent
                name = root.key.hex()
                deepest[name] = max(deepest.get(name, 0), entry.end)
            return deepest

    def reclaim(self, nbytes: int, protect: Entry | None = None) -> int:
        """Evict entries until `nbytes` are freed or none is left to evict; returns the bytes freed."""
        freed = 0
        with self.lock:
            spared = None
            while freed < nbytes and self._order:
                priority, _, victim = heapq.heappop(self._order)
                if victim not in self.leaves or priority != victim.priority:
                    continue  # evicted, no longer a leaf, or touched since (pushed again with its new priority)
                if victim is protect:
                    spared = victim
                    continue
                self.clock = priority
                freed += self._remove(victim, protect)
            if spared is not None:
                self._push(spared)
        return freed

    def clear(self) -> None:
        with self.lock:
            for entry in list(self.entries.values()):
                self.budget.give(entry.nbytes)
                entry.alive = False
            self.entries.clear()
            self.leaves.clear()
            self._order.clear()
            self.bytes = 0
            if self.journal is not None:
                self.journal("clear")

    def _touch(self, entry: Entry) -> None:
        entry.hits += 1
        entry.priority = self.clock + entry.hits * self.block / entry.nbytes * 2**20  # tokens saved per MiB
        if entry in self.leaves:
            self._push(entry)

    def _push(self, entry: Entry) -> None:
        heapq.heappush(self._order, (entry.priority, next(self._pushed), entry))
        if len(self._order) > 4 * len(self.leaves) + 64:  # mostly stale items: rebuild from the leaves
            self._order = [(e.priority, next(self._pushed), e) for e in self.leaves]
            heapq.heapify(self._order)

    def _remove(self, entry: Entry, protect: Entry | None = None) -> int:
        del self.entries[entry.key]
        self.leaves.discard(entry)
        entry.alive = False
        self.budget.give(entry.nbytes)
        self.bytes -= entry.nbytes
        self.stats.evictions += 1
        if self.journal is not None:
            self.journal("evict", entry.key)
        freed = entry.nbytes
        parent = entry.parent
        if parent is not None:
            parent.children -= 1
            if parent.children == 0 and parent.alive:
                if parent.state is None and parent is not protect:  # nothing can resume from it or below it
                    freed += self._remove(parent, protect)
                else:
                    self.leaves.add(parent)
                    self._push(parent)
        return freed

    def prune(self, entry: Entry) -> None:
        """Drop `entry` if it is a leaf without a state (a sequence stopped caching right after it)."""
        with self.lock:
            if entry.alive and entry.state is None and not entry.children:
                self._remove(entry)

    def _keep_state(self, entry: Entry, window: Tensor, state: Tensor, source: ModelState) -> None:
        """Give a block that has none its recurrent state (read from `source`), if the budget pays for it."""
        nbytes = _nbytes(window, state)
        if self.budget.take(nbytes):
            entry.window, entry.state = window, state
            entry.nbytes += nbytes
            self.bytes += nbytes
            if self.journal is not None:
                self.journal("keep", entry.key, source, entry.end)

    def _drop_state(self, entry: Entry) -> None:
        if entry.state is None:
            return
        nbytes = _nbytes(entry.window, entry.state)
        entry.window = entry.state = None
        entry.nbytes -= nbytes
        self.bytes -= nbytes
        self.budget.give(nbytes)
        if self.journal is not None:
            self.journal("drop", entry.key)

    def _add(self, parent: Entry | None, tokens: tuple[int, ...], window: Tensor | None, state: Tensor | None,
             source: ModelState, hidden: Tensor | None) -> Entry | None:
        """A new entry under `parent` (alive, or None at position 0), paid from the budget (evicting others, never
        `parent`), its K/V `source`'s of its positions, with the recurrent state given (None: K/V only); the entry
        already cached under that key instead, if any, given the state when it holds none; None when nothing can pay
        for it."""
        key = block_key(parent.key if parent else b"", tokens)
        with self.lock:
            if parent is not None and not parent.alive:
                return None
            known = self.entries.get(key)
            if known is not None:
                if known.tokens != tokens:
                    return None
                if known.state is None and state is not None:
                    self._keep_state(known, window, state, source)
                return known
            start = parent.end if parent else 0
            kv = source.kv(start, start + len(tokens))
            nbytes = _nbytes(kv, *(() if state is None else (window, state)), *(() if hidden is None else (hidden,)))
            while not self.budget.take(nbytes):
                if not self.reclaim(nbytes, protect=parent):
                    return None
            entry = Entry(key, parent, tokens, start + len(tokens), window, state, kv, hidden, nbytes)
            self._touch(entry)
            self.entries[key] = entry
            self.leaves.add(entry)
            self._push(entry)
            if parent is not None:
                parent.children += 1
                self.leaves.discard(parent)
                if parent.children == 1 and not self.on_grid(parent.end):
                    self._drop_state(parent)  # neither a leaf nor a branch point any more
            self.bytes += nbytes
            self.stats.published += 1
            if self.journal is not None:
                self.journal("put", key, source, start, entry.end, state is not None)
        return entry


@dataclass
class Cursor:
    """One sequence's place in a prefix cache: the ids its committed head holds, and the entry of its last
    cached block (`tip`). Blocks are cached in order, each under the one before, so a sequence whose block could
    not be cached (no room) or whose tip was evicted caches nothing more."""

    cache: PrefixCache
    state: ModelState
    ids: list[int] = field(default_factory=list)
    tip: Entry | None = None
    cached_tokens: int = 0  # positions this sequence took from the cache
    stopped: bool = False
    tail: list[Tensor] | None = None  # with hidden states kept: the trunk's, of the positions after the tip
    branch: int = 0  # the end of a block its lookup matched that holds no state: the prefill takes it for the cache

    def __post_init__(self) -> None:
        self.tail = [] if self.cache.keep_hidden else None

    def prefill(self, model: Callable[[Tensor, ModelState], tuple[Tensor, Tensor]], ids: list[int]) -> Tensor | None:
        """Stage and commit `ids` after the head: from the longest cached prefix when the head is empty, caching
        the blocks the prefill completes. Returns the trunk's hidden states of these positions, or None when
        some came from a cache that keeps none."""
        cache, state = self.cache, self.state
        hidden: list[Tensor] | None = []
        if not state.length:
            hit = cache.resume(state, ids)
            chain, self.branch = hit.chain, hit.branch
            if chain:
                tip = chain[-1]
                self.ids, self.tip, self.cached_tokens = list(ids[:tip.end]), tip, tip.end
                if not cache.keep_hidden:
                    hidden = None
                else:
                    hidden += [e.hidden for e in chain]  # type: ignore[misc]
                ids = ids[tip.end:]
            with cache.lock:
                cache.stats.prefilled_tokens += len(ids)
        if ids:
            base = state.length
            ends = self._ends(len(ids))
            kept = self._kept(ends)
            # a prefill the logs hold gives its heads as a commit does, after the pass (which may then be a compiled
            # one); a longer one has the pass take them (`BlockHeads`)
            logged = len(ids) <= state.recurrent.log_capacity
            heads = BlockHeads(state.recurrent, [e - base for e in kept]) if kept and not logged else None
            state.recurrent.block_heads = heads
            try:
                _, h = model(torch.tensor(ids), state)
            finally:
                state.recurrent.block_heads = None
            if hidden is not None:
                hidden.append(h)
            if heads is None:
                self.commit(ids, lambda: state.commit(state.staged), h)
            else:
                state.commit(state.staged)
                self._extend(ids, h)
                taken = {e: (heads.windows[j], heads.states[j]) for j, e in enumerate(kept)}
                self._publish([(e, *taken.get(e, (None, None))) for e in ends])
        return None if hidden is None else torch.cat(hidden)

    def commit(self, ids: Sequence[int], commit: Callable[[], None], hidden: Tensor | None = None) -> None:
        """Run `commit()`, which keeps the first len(ids) staged tokens (`ids`), caching the blocks they complete:
        their heads come from the logs, before the commit swaps them in. `hidden`: the trunk's states of those
        positions (read only when the cache keeps hidden states)."""
        state = self.state
        heads: list[tuple[int, Tensor | None, Tensor | None]] = []
        ends = self._ends(len(ids))
        kept = self._kept(ends)
        for end in ends:
            if end not in kept:
                heads.append((end, None, None))
                continue
            window, gdn_state = torch.empty_like(state.recurrent.conv), torch.empty_like(state.recurrent.state)
            state.recurrent.state_after(end - state.length, state.staged, window, gdn_state)
            heads.append((end, window, gdn_state))
        if kept and self.cache.journal is not None:
            self.cache.journal("heads", state, kept)
        commit()
        self._extend(ids, hidden)
        self._publish(heads)

    def completes_block(self, n: int) -> bool:
        """Whether committing n more positions would cache a block."""
        return bool(self._ends(n))

    def _ends(self, n: int) -> range:
        """Ends of the blocks to cache among the head's next n positions: those after the tip, unless this
        sequence stopped caching (a block it could not cache, or its tip evicted)."""
        first = (self.tip.end if self.tip is not None else 0) + self.cache.block
        if self.tip is not None and not self.tip.alive or first <= len(self.ids):
            self.stop()
        return range(0) if self.stopped else range(first, len(self.ids) + n + 1, self.cache.block)

    def _kept(self, ends: range) -> list[int]:
        """Which of the blocks ending at `ends` get a recurrent state: those on the cache's grid, the last (the
        sequence's
        new tip), and the matched block without one where this sequence branches off."""
        return [e for e in ends if self.cache.on_grid(e) or e == ends[-1] or e == self.branch]

    def stop(self) -> None:
        self.stopped, self.tail = True, None

    def _extend(self, ids: Sequence[int], hidden: Tensor | None) -> None:
        self.ids += ids
        if self.tail is not None:
            if hidden is None:
                self.stop()
            else:
                self.tail.append(hidden)

    def _publish(self, heads: list[tuple[int, Tensor | None, Tensor | None]]) -> None:
        """Cache the blocks ending at `heads` (end, windows and states or None) in order, each under the one
        before."""
        block, state = self.cache.block, self.state
        for end, window, gdn_state in heads:
            start = end - block
            if self.stopped:
                return
            rows = None
            if self.tail is not None:  # the hidden states an MTP drafter resuming here reads
                rest = torch.cat(self.tail)
                rows, self.tail = rest[:block].clone(), [rest[block:]]
            entry = self.cache._add(self.tip, tuple(self.ids[start:end]), None if window is None else window.clone(),
                                    None if gdn_state is None else gdn_state.clone(), state, rows)
            if entry is None:
                self.stop()
                if self.tip is not None:
                    self.cache.prune(self.tip)
                return
            self.tip = entry


def commit_head(cursor: Cursor | None, ids: Sequence[int], commit: Callable[[], None],
                hidden: Tensor | None = None) -> None:
    """`commit()` keeps the staged `ids` of a sequence; with a prefix cache (its `cursor`), the blocks they complete
    are cached (`Cursor.commit`)."""
    if cursor is None:
        commit()
    else:
        cursor.commit(ids, commit, hidden)


def attach(model: nn.Module, block: int, keep_hidden: bool = False, max_bytes: int = 256 * 2**20,
           state_every: int = 1) -> PrefixCache:
    """Give `model` a prefix cache that its sessions use (`TargetSession`, `ModelDrafter`): paid from the model's
    state pool when it has one (`deltaspec.shared.state.pool.attach` first), else within `max_bytes` of its own."""
    if model.prefix_cache is not None:
        raise ValueError("the model has a prefix cache already")
    pool = model.state_pool
    cache = PrefixCache(block, pool if pool is not None else ByteBudget(max_bytes), keep_hidden, state_every)
    if pool is not None:
        pool.reclaim = cache.reclaim
    leader = getattr(model, "leader", None)  # rank 0 of a tensor-parallel group: its followers replay the journal
    if leader is not None:
        cache.journal = leader.journal
    model.prefix_cache = cache
    return cache
