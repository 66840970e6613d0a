"""Committed heads as a prefix cache: a new sequence resumes from the longest cached prefix of its prompt and
prefills only the rest.

A hybrid model's head after P tokens is every GDN layer's conv window and recurrent state (a fixed size, whatever
P) and the attention K/V of positions 0..P-1. The cache keeps it at every block boundary (`block` tokens; tens
of tokens work, the state being small), one entry per block, keyed by a hash chain over the token ids: an
entry's key hashes its parent's key and its own tokens, so a key names a whole prefix from position 0. An
entry holds its block's K/V, the GDN state at its end and, for an MTP drafter, the trunk's hidden states of its
positions. A prompt of any length that shares one whole block with a cached sequence hits.

Entries come from committed heads only: the block boundaries a prefill passes (taken by the pass itself,
`rollback.Capture`), and those a commit completes (the commit algebra over the kept tokens' logs, before the
swap). So no entry ever holds a rejected draft token, whatever the drafter, and a sequence caches the same
blocks with speculation on or off. An entry is never written once made: a hit copies it into the sequence's own
buffers, so a sequence never depends on an entry staying (eviction while it runs changes nothing).

Memory: entries are paid from the state pool's K/V budget (`StatePool.take`), and a session that needs room
evicts entries before it is refused (`StatePool.reclaim`). Eviction takes leaves only (an entry with cached
children is their only way in), lowest priority first, GreedyDual-Size-Frequency: priority = clock + hits x
block tokens / bytes, with the clock rising to each evicted priority, so an entry stays for being used often,
or lately, or for saving many tokens per byte.
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
from torch import Tensor

from deltaspec.shared.state.rollback import Capture, ModelState


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
    window: Tensor  # GDN conv windows after it (L, K-1, C)
    state: Tensor  # GDN states after it (L, H, Dk, Dv)
    kv: Tensor  # its positions' K/V (A, 2, H_kv, block, D)
    hidden: Tensor | None  # the trunk's last-layer states of its positions (block, hidden), for MTP
    nbytes: int
    children: int = 0
    hits: int = 0
    priority: float = 0.0
    alive: bool = True


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0  # lookups that found at least one block
    cached_tokens: int = 0  # positions served from the cache instead of prefilled
    prefilled_tokens: int = 0  # positions prefilled by sequences that looked up
    published: int = 0
    evictions: int = 0


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block after the prefix keyed `parent` (b"" at position 0)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCache:
    """Cached heads of one model's sequences, every `block` positions. Thread-safe."""

    def __init__(self, block: int, budget: Budget, keep_hidden: bool = False) -> None:
        if block < 1:
            raise ValueError(f"the prefix cache's block size must be at least 1 token, got {block}")
        self.block, self.budget, self.keep_hidden = block, budget, keep_hidden
        self.entries: dict[bytes, Entry] = {}
        self.leaves: set[Entry] = set()
        self._order: list[tuple[float, int, Entry]] = []  # leaves by priority, with stale items skipped on pop
        self._pushed = itertools.count()
        self.clock = 0.0
        self.bytes = 0
        self.stats = CacheStats()
        self.lock = threading.RLock()

    def lookup(self, ids: Sequence[int]) -> list[Entry]:
        """The longest chain of cached whole blocks that `ids` starts with (a hit when not empty)."""
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
            self.stats.lookups += 1
            self.stats.hits += bool(chain)
            self.stats.cached_tokens += len(chain) * self.block
        return chain

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
                freed += self._remove(victim)
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

    def _remove(self, entry: Entry) -> int:
        del self.entries[entry.key]
        self.leaves.discard(entry)
        entry.alive = False
        self.budget.give(entry.nbytes)
        self.bytes -= entry.nbytes
        self.stats.evictions += 1
        if entry.parent is not None:
            entry.parent.children -= 1
            if entry.parent.children == 0 and entry.parent.alive:
                self.leaves.add(entry.parent)
                self._push(entry.parent)
        return entry.nbytes

    def _add(self, parent: Entry | None, tokens: tuple[int, ...], window: Tensor, state: Tensor, kv: Tensor,
             hidden: Tensor | None) -> Entry | None:
        """A new entry under `parent` (alive, or None at position 0), paid from the budget (evicting others, never
        `parent`); the entry already cached under that key instead, if any; None when nothing can pay for it."""
        key = block_key(parent.key if parent else b"", tokens)
        with self.lock:
            if parent is not None and not parent.alive:
                return None
            known = self.entries.get(key)
            if known is not None:
                return known if known.tokens == tokens else None
            nbytes = sum(t.numel() * t.element_size() for t in (window, state, kv, *(() if hidden is None else (hidden,))))
            while not self.budget.take(nbytes):
                if not self.reclaim(nbytes, protect=parent):
                    return None
            entry = Entry(key, parent, tokens, (parent.end if parent else 0) + len(tokens), window, state, kv,
                          hidden, nbytes)
            self._touch(entry)
            self.entries[key] = entry
            self.leaves.add(entry)
            self._push(entry)
            if parent is not None:
                parent.children += 1
                self.leaves.discard(parent)
            self.bytes += nbytes
            self.stats.published += 1
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

    def __post_init__(self) -> None:
        self.tail = [] if self.cache.keep_hidden else None

    def prefill(self, model: Callable[[Tensor, ModelState], tuple[Tensor, Tensor]], ids: list[int]) -> Tensor | None:
        """Stage and commit `ids` after the head: from the longest cached prefix when the head is empty, caching
        the blocks the prefill completes. Returns the trunk's hidden states of these positions, or None when
        some came from a cache that keeps none."""
        cache, state = self.cache, self.state
        hidden: list[Tensor] | None = []
        if not state.length:
            chain = cache.lookup(ids)
            if chain:
                tip = chain[-1]
                state.load_head(tip.end, tip.window, tip.state, torch.cat([e.kv for e in chain], dim=3))
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
            ends = [end - base for end in self._ends(len(ids))]
            # a prefill the logs hold gives its heads as a commit does, after the pass (which may then be a compiled
            # one); a longer one has the pass take them (`Capture`)
            logged = len(ids) <= state.gdn.log_capacity
            state.gdn.capture = capture = Capture(state.gdn, ends) if ends and not logged else None
            try:
                _, h = model(torch.tensor(ids), state)
            finally:
                state.gdn.capture = None
            if hidden is not None:
                hidden.append(h)
            if capture is None:
                self.commit(ids, lambda: state.commit(state.staged), h)
            else:
                state.commit(state.staged)
                self._extend(ids, h)
                self._publish([(base + e, capture.windows[j], capture.states[j]) for j, e in enumerate(ends)])
        return None if hidden is None else torch.cat(hidden)

    def commit(self, ids: Sequence[int], commit: Callable[[], None], hidden: Tensor | None = None) -> None:
        """Run `commit()`, which keeps the first len(ids) staged tokens (`ids`), caching the blocks they complete:
        their heads come from the logs, before the commit swaps them in. `hidden`: the trunk's states of those
        positions (read only when the cache keeps hidden states)."""
        state = self.state
        heads = []
        for end in self._ends(len(ids)):
            window, gdn_state = torch.empty_like(state.gdn.conv), torch.empty_like(state.gdn.recurrent)
            state.gdn.state_after(end - state.length, state.staged, window, gdn_state)
            heads.append((end, window, gdn_state))
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

    def stop(self) -> None:
        self.stopped, self.tail = True, None

    def _extend(self, ids: Sequence[int], hidden: Tensor | None) -> None:
        self.ids += ids
        if self.tail is not None:
            if hidden is None:
                self.stop()
            else:
                self.tail.append(hidden)

    def _publish(self, heads: list[tuple[int, Tensor, Tensor]]) -> None:
        """Cache the blocks ending at `heads` (end, windows, states) in order, each under the one before."""
        block, state = self.cache.block, self.state
        for end, window, gdn_state in heads:
            start = end - block
            if self.stopped:
                return
            rows = None
            if self.tail is not None:  # the hidden states an MTP drafter resuming here reads
                rest = torch.cat(self.tail)
                rows, self.tail = rest[:block].clone(), [rest[block:]]
            kv = torch.stack([torch.stack([a.k[:, start:end], a.v[:, start:end]]) for a in state.attn])
            entry = self.cache._add(self.tip, tuple(self.ids[start:end]), window.clone(), gdn_state.clone(), kv, rows)
            if entry is None:
                self.stop()
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


def attach(model: object, block: int, keep_hidden: bool = False, max_bytes: int = 256 * 2**20) -> PrefixCache:
    """Give `model` a prefix cache that its sessions use (`TargetSession`, `ModelDrafter`): paid from the model's
    state pool when it has one (`deltaspec.shared.state.pool.attach` first), else within `max_bytes` of its own."""
    if getattr(model, "prefix_cache", None) is not None:
        raise ValueError("the model has a prefix cache already")
    pool = getattr(model, "state_pool", None)
    cache = PrefixCache(block, pool if pool is not None else ByteBudget(max_bytes), keep_hidden)
    if pool is not None:
        pool.reclaim = cache.reclaim
    model.prefix_cache = cache  # type: ignore[attr-defined]
    return cache
