"""One forward pass over several sequences: the rounds of many sessions at the price of about one.

At these sizes a pass costs per-op dispatch, so a batch shares every op it can. The sequences'
tokens are packed into one `(sum T_i, hidden)` matrix: embeddings, norms, every projection and
the MLP run once for all of them, in the one forward pass (`fused.forward`). What is per sequence
stays per sequence, and is the state access's business (`deltaspec.shared.state.access.BatchAccess`):
GDN windows and states gathered into padded groups and staged back, K/V written per sequence and
attended under one mask. The result for each sequence, and what it leaves staged, is what
`HybridLM.forward` gives it alone; `tests/test_batching.py` checks that on random models.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from deltaspec.shared.model import fused
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.state.access import BatchAccess
from deltaspec.shared.state.rollback import ModelState


class BatchRefused(ValueError):
    """A batch refused before anything was staged: every state is as it was."""


@torch.inference_mode()
def forward_batch(model: HybridLM, items: Sequence[tuple[Tensor, ModelState]]) -> list[tuple[Tensor, Tensor]]:
    """`[model(ids, state) for ids, state in items]` in one pass; every state distinct.

    Everything is checked before anything is staged: a refused batch (`BatchRefused`, or a K/V budget's
    `ResourceExhausted`) changes no state. On rank 0 of a tensor-parallel group the model's `leader`
    (`deltaspec.shared.model.lockstep`) announces the batch to the other ranks and runs it here.
    """
    if len({id(st) for _, st in items}) != len(items):
        raise BatchRefused("a batch names the same sequence state twice")
    for ids, _ in items:
        if ids.ndim != 1 or ids.numel() == 0:
            raise BatchRefused("forward takes a non-empty 1-D tensor of token ids")
    cfg, device = model.config, model.device
    ids = torch.cat([ids for ids, _ in items]).to(device)
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise BatchRefused(f"token ids outside the vocabulary [0, {cfg.vocab_size})")
    if model.leader is not None and not model.leader.nested:  # rank 0 of a tensor-parallel group: every rank runs it
        return model.leader.forward_batch(items)
    if model.fused is None or len(items) == 1 or any(st.recurrent.block_heads is not None for _, st in items):
        return [model(ids, st) for ids, st in items]  # a prefix cache's heads are taken by the per-sequence pass
    lengths = [t.numel() for t, _ in items]
    starts = [st.length + st.staged for _, st in items]
    for (_, st), start, T in zip(items, starts, lengths):
        st.ensure_positions(start + T)
    access = BatchAccess([st for _, st in items], lengths, device)
    positions = torch.tensor([p for s, T in zip(starts, lengths) for p in range(s, s + T)], device=device)
    x = model.model.embed(ids)
    cos, _, signed_sin = model.rope(0, max(s + T for s, T in zip(starts, lengths)), x)
    logits, x = fused.forward(model, x, (cos[positions], signed_sin[positions]), access)
    for (_, st), T in zip(items, lengths):
        st.staged += T
    return list(zip(logits.split(lengths), x.split(lengths)))
