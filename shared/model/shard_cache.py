"""A tensor-parallel follower's shard of rank 0's prefix cache: every entry's K/V of this rank's K/V heads and its
heads' recurrent states and conv windows, kept by replaying the cache's journal
(`deltaspec.shared.state.prefix_cache`) that rank 0 sends with its calls (`deltaspec.shared.model.lockstep`).

Rank 0's cache decides everything (lookups, budget, eviction); a follower only mirrors what it decided, in the same
order, on its shard of the same sessions' states: an entry is made from the same positions of the same session, a
hit loads the same chain into the same fresh session. So a session resumed from the cache holds on every rank the
shard of the head rank 0 resumed it from, and the ranks' passes stay each other's parts of one pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from deltaspec.shared.state.rollback import BlockHeads, ModelState

Head = tuple[Tensor, Tensor]  # a head's conv windows and recurrent states


@dataclass
class ShardEntry:
    end: int  # positions covered from 0
    kv: Tensor
    window: Tensor | None = None
    state: Tensor | None = None


class ShardCache:
    """One follower's shard of every entry of rank 0's prefix cache, keyed as rank 0 keys them."""

    def __init__(self) -> None:
        self.entries: dict[bytes, ShardEntry] = {}
        self._heads: dict[int, dict[int, Head]] = {}  # per session: heads read for the entries its commit makes

    def replay(self, op: str, args: tuple[Any, ...], states: dict[int, ModelState]) -> None:
        """Make on this shard the change rank 0's cache journaled (sessions named by their ids)."""
        if op == "heads":
            sid, ends = args
            st = states[sid]
            rec = st.recurrent
            for end in ends:
                window, state = torch.empty_like(rec.conv), torch.empty_like(rec.state)
                rec.state_after(end - st.length, st.staged, window, state)
                self._heads.setdefault(sid, {})[end] = (window, state)
        elif op == "put":
            key, sid, start, end, with_state = args
            entry = self.entries[key] = ShardEntry(end, states[sid].kv(start, end))
            if with_state:
                entry.window, entry.state = self._head(sid, end)
        elif op == "keep":
            key, sid, end = args
            self.entries[key].window, self.entries[key].state = self._head(sid, end)
        elif op == "drop":
            entry = self.entries[args[0]]
            entry.window = entry.state = None
        elif op == "evict":
            del self.entries[args[0]]
        elif op == "clear":
            self.entries.clear()
        elif op == "load":
            sid, keys = args
            chain = [self.entries[k] for k in keys]
            states[sid].load_head(chain[-1].end, chain[-1].window, chain[-1].state,
                                  torch.cat([e.kv for e in chain], dim=3))
        else:
            raise ValueError(f"unknown prefix cache change {op!r}")

    def before_pass(self, sid: int, state: ModelState, ends: list[int] | None) -> None:
        """A pass of session `sid` follows: heads read before it are stale; `ends`: staged offsets whose heads the
        pass takes (rank 0's prefill takes them there)."""
        self._heads.pop(sid, None)
        if ends:
            state.recurrent.block_heads = BlockHeads(state.recurrent, ends)

    def after_pass(self, sid: int, state: ModelState) -> None:
        heads, state.recurrent.block_heads = state.recurrent.block_heads, None
        if heads is not None:
            self._heads[sid] = {state.length + e: (heads.windows[j], heads.states[j])
                                for j, e in enumerate(heads.ends)}

    def forget(self, sid: int) -> None:
        """Session `sid` is gone."""
        self._heads.pop(sid, None)

    def _head(self, sid: int, end: int) -> Head:
        window, state = self._heads[sid][end]
        return window.clone(), state.clone()
