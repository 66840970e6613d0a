"""The scheduler: forward passes of concurrent sessions, gathered into batches on one thread.

`BatchedModel` stands in for the model wherever the engine calls `model(ids, state)`: target
sessions' verify and prefill passes, the draft's propose steps. Each call blocks its thread until
its pass has run in a batch (`deltaspec.shared.model.batched.forward_batch`), so sessions keep their own
locks, versions, verdicts and commits exactly as before: only the forward pass is shared.

Policy:
- A batch starts when `max_batch` calls wait, or when every active sequence (one that called in the
  last `ACTIVE_S`) has a call waiting (nobody else is about to join: a single session never waits,
  nor do sessions that went quiet), or `max_wait_ms` after its first call arrived, whichever comes
  first.
- A call of the only active sequence, with nothing queued, runs in the caller's own thread (a batch
  of one, under the same lock as the batches): a lone session pays no hand-off to the batching
  thread and back, which costs a scheduler wake-up each way per pass, milliseconds on a busy CPU.
- Calls are served first come, first served; a batch takes at most `max_batch` of them, so a call
  waits at most (calls ahead of it) / max_batch batches: no session starves.
- A long input (a prompt staged from the head) runs `prefill_chunk` tokens per batch and goes to the
  back of the queue between pieces, so decoding sessions keep making rounds while it prefills. Its
  ids are checked whole first: a bad one refuses the call before any piece is staged.
- A call that fails fails alone, and never hands back a result computed from a failed pass's
  leftovers. The batched pass checks its input before it stages anything; should it still fail
  midway (out of memory), each call's staging is put back where the pass found it (from the head:
  nothing to put back; from a pipelined round's mark: the snapshot) and the call runs alone; a call
  whose earlier staging cannot be put back gets the error, its staging dropped to the head.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from deltaspec.shared.decoding.session_table import Limits
from deltaspec.shared.errors import ResourceExhausted
from deltaspec.shared.model.batched import BatchRefused, forward_batch
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.state import prefix_cache
from deltaspec.shared.state.pool import StatePool, attach
from deltaspec.shared.state.rollback import ModelState
from deltaspec.shared.state.spec import LOG_CAPACITY
from deltaspec.shared.telemetry.metrics import Metrics


@dataclass(frozen=True)
class BatchConfig:
    max_batch: int = 8
    max_wait_ms: float = 2.0
    prefill_chunk: int = 64

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_wait_ms < 0 or self.prefill_chunk < 1:
            raise ValueError(f"batching needs max_batch >= 1, max_wait_ms >= 0 and prefill_chunk >= 1, got {self}")


@dataclass(eq=False)
class _Call:
    ids: Tensor
    state: ModelState
    staged: int  # the state's staged tokens when the call arrived
    queued_at: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    fed: int = 0  # tokens already run (prefill pieces)
    logits: list[Tensor] = field(default_factory=list)
    hidden: list[Tensor] = field(default_factory=list)
    error: BaseException | None = None

    def piece(self, chunk: int) -> Tensor:
        """The next tokens to run: a piece of a prompt staged from the head, else everything."""
        return self.ids[self.fed:self.fed + chunk] if not self.staged else self.ids


@dataclass
class BatchStats:
    batches: int = 0
    items: int = 0  # calls (or prefill pieces) run
    largest: int = 0


ACTIVE_S = 0.2  # a sequence that has not called for this long is not waited for
REFUSALS = (BatchRefused, ResourceExhausted)  # raised before a pass stages anything


def server_pool(model: HybridLM, limits: Limits, log_capacity: int = LOG_CAPACITY) -> StatePool:
    """The pool a server attaches: `limits.state_memory_bytes` for at most `limits.max_sessions` sessions, or
    (0) room for `max_sessions` sessions of `auto_context(max_prompt_tokens)` positions each."""
    budget, spec, dtype = limits.state_memory_bytes, model.config.state_spec, model.dtype
    if budget == 0:
        budget = limits.max_sessions * spec.bytes(dtype, auto_context(limits.max_prompt_tokens), log_capacity)
    return StatePool(spec, budget, limits.max_sessions, model.device, dtype, log_capacity)


def auto_context(max_prompt_tokens: int) -> int:
    """Positions per session the default budget pays for: a whole prompt and as many generated tokens, 4096 at least."""
    return max(4096, 2 * max_prompt_tokens)


def serving(model: HybridLM, limits: Limits, batching: BatchConfig | None, metrics: Metrics,
            log_capacity: int = LOG_CAPACITY, keep_hidden: bool = False) -> HybridLM:
    """A loaded model as a server runs it: its sessions' state in a pool within the memory budget, a prefix cache
    paid from the same budget (unless `limits.prefix_cache_block` is 0; `keep_hidden` for an MTP drafter), and
    (unless `batching` is None or max_batch 1) their forward passes batched. Both services load through this (the
    draft's states log `CHAIN_LOG_CAPACITY` tokens: it speculates rounds ahead)."""
    pool = server_pool(model, limits, log_capacity)
    attach(model, pool)
    metrics.watch_state_pool(pool)
    if limits.prefix_cache_block:
        metrics.watch_prefix_cache(prefix_cache.attach(model, limits.prefix_cache_block, keep_hidden,
                                                       state_every=limits.prefix_cache_state_every))
    if batching is None or batching.max_batch == 1:
        return model
    return BatchedModel(model, batching, metrics.batch)  # type: ignore[return-value]


def _restore(state: ModelState, staged: int) -> bool:
    """Put a state's staging back to `staged` tokens after a pass over it failed (its last layers may have
    overwritten the staged state); False when that cannot be done exactly: then all staging is dropped."""
    if staged and state.marked == staged:  # a pipelined round's parent: its snapshot is intact
        state.drop_marked()
        state.mark()
        return True
    state.revert()
    return not staged


class BatchedModel:
    """A `HybridLM` whose forward passes from many threads run in shared batches; everything else is the model's."""

    def __init__(self, model: HybridLM, config: BatchConfig = BatchConfig(),
                 observe: Callable[[int, int, float, float], None] | None = None) -> None:
        """`observe(size, tokens, wait_s, pass_s)` is told of every batch (e.g. `Metrics.batch`)."""
        self.inner, self.batching, self.observe = model, config, observe
        self.stats = BatchStats()
        self._queue: deque[_Call] = deque()
        self._cv = threading.Condition()
        self._stepping = threading.Lock()  # one pass at a time: the batching thread's, or a lone caller's
        self._last_call: weakref.WeakKeyDictionary[ModelState, float] = weakref.WeakKeyDictionary()
        self._closed = False
        self.drafting = 0  # calls in the last pass that carried more than one token (a verify's drafts, a prompt)
        self.active = 0  # sequences that called recently, as last counted (`_active`)
        self._thread = threading.Thread(target=self._run, name="deltaspec-batcher", daemon=True)
        self._thread.start()

    def __getattr__(self, name: str) -> Any:  # config, device, dtype, mtp, model, lm_head, ...
        return getattr(self.inner, name)

    def __call__(self, ids: Tensor, state: ModelState) -> tuple[Tensor, Tensor]:
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError("forward takes a non-empty 1-D tensor of token ids")
        vocab = self.inner.config.vocab_size
        if not state.staged and ids.numel() > self.batching.prefill_chunk \
                and (int(ids.min()) < 0 or int(ids.max()) >= vocab):  # run in pieces: refuse before the first
            raise ValueError(f"token ids outside the vocabulary [0, {vocab})")
        call = _Call(ids, state, state.staged)
        with self._cv:
            self._last_call[state] = call.queued_at
            if self._closed:
                raise RuntimeError("the batcher is closed")
            alone = not self._queue and self._active() <= 1  # nobody to share a pass with
            if not alone:
                self._queue.append(call)
                self._cv.notify()
        if alone:
            while not call.done.is_set():  # prefill pieces: other sessions' batches may run between them
                self._step([call])
        call.done.wait()
        if call.error is not None:
            raise call.error
        if len(call.logits) == 1:
            return call.logits[0], call.hidden[0]
        return torch.cat(call.logits), torch.cat(call.hidden)

    def batch_size(self) -> int:
        """Sequences the next pass is likely to carry: those active as last counted (every pass counts them), at
        most `max_batch` (what a draft length cost model reads every round, `deltaspec.shared.decoding.draft_length`:
        no lock and no count here, which at eight sessions cost a tenth of the rounds' time)."""
        return max(1, min(self.batching.max_batch, self.active))

    def drafting_calls(self) -> int:
        """Calls of the last pass that carried more than one token: where others verify drafts, the pass runs as a
        verify whatever one session adds (what a draft length cost model reads)."""
        return self.drafting

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    def _run(self) -> None:
        cfg = self.batching
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                deadline = time.monotonic() + cfg.max_wait_ms / 1e3
                while len(self._queue) < min(cfg.max_batch, self._active()) and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                batch = [self._queue.popleft() for _ in range(min(cfg.max_batch, len(self._queue)))]
            unfinished = self._step(batch)
            if unfinished:
                with self._cv:
                    for c in unfinished:
                        c.queued_at = time.monotonic()
                    self._queue.extend(unfinished)
            del batch, unfinished  # while waiting, finished calls must not keep their states (and pool slots) alive

    def _active(self) -> int:
        """Sequences that called recently: the ones worth waiting for."""
        since = time.monotonic() - ACTIVE_S
        self.active = sum(t > since for t in self._last_call.values())
        return self.active

    def _step(self, batch: list[_Call]) -> list[_Call]:
        """Run one pass for `batch`; returns the calls with input left (prefill pieces)."""
        with self._stepping:
            return self._step_locked(batch)

    def _step_locked(self, batch: list[_Call]) -> list[_Call]:
        chunk = self.batching.prefill_chunk
        started = time.monotonic()
        pieces = [(c.piece(chunk), c.state) for c in batch]
        before = [c.state.staged for c in batch]
        try:
            results = forward_batch(self.inner, pieces)
        except Exception as error:  # noqa: BLE001 - each call again alone, from where the pass found it
            results = []
            for c, piece, staged in zip(batch, pieces, before):
                try:
                    if not isinstance(error, REFUSALS) and not _restore(c.state, staged):
                        raise RuntimeError("a batched forward pass failed after overwriting the staging this call "
                                           f"ran on ({error}); that staging was dropped") from error
                    results += forward_batch(self.inner, [piece])
                except Exception as e:  # noqa: BLE001 - handed to the caller's thread
                    if not isinstance(e, REFUSALS) or c.fed:
                        _restore(c.state, c.staged)
                    c.error, c.fed = e, c.ids.numel()
                    results.append((torch.empty(0), torch.empty(0)))
        self.drafting = sum(ids.numel() > 1 for ids, _ in pieces)
        self.stats.batches += 1
        self.stats.items += len(batch)
        self.stats.largest = max(self.stats.largest, len(batch))
        if self.observe is not None:
            self.observe(len(batch), sum(ids.numel() for ids, _ in pieces), started - min(c.queued_at for c in batch),
                         time.monotonic() - started)
        unfinished = []
        for c, (logits, hidden) in zip(batch, results):
            if c.error is None:
                c.logits.append(logits)
                c.hidden.append(hidden)
                c.fed += logits.shape[0]
            if c.fed < c.ids.numel():
                unfinished.append(c)
            else:
                c.done.set()
        return unfinished
