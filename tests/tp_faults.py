"""`deltaspec` whose tensor-parallel ranks die on purpose, at a chosen point of a round: run as
`python tests/tp_faults.py serve-target ... --tensor-parallel N` with `DELTASPEC_TEST_DIE_AT=[leader-]OP:N`.

A rank exits at once (as a killed process does: no clean-up, its sockets closed by the kernel) at rank 0's N-th
call OP: each follower right after it received the call, before making it (`pass`, a pass or a batched pass:
while rank 0 waits in that pass's all-reduce; `commit`: once rank 0 has kept a round its followers have not); with
`leader-`, rank 0 right after it sent the call (`leader-pass`: the followers wait in an all-reduce rank 0 never
joins). `reduce:N`: each follower at its N-th all-reduce, inside a pass between two layers (rank 0 waits in that
all-reduce, its shard's earlier layers done). A spawned rank runs this file again as its main module, so the hook
reaches every rank.
"""
from __future__ import annotations

import os
import sys

import torch.distributed as dist

OPS = {"pass": ("pass", "batch"), "commit": ("commit",)}


def die_at(ops: tuple[str, ...], n: int, sender: bool) -> None:
    """The n-th call of `ops` ends this rank: once sent if `sender` (rank 0), else once received (a follower)."""
    broadcast, seen = dist.broadcast_object_list, [0]

    def broadcast_object_list(objects: list, src: int = 0, group=None, device=None) -> None:
        broadcast(objects, src=src, group=group, device=device)
        if (dist.get_rank(group) == src) == sender and objects[0][0] in ops:
            seen[0] += 1
            if seen[0] == n:
                os._exit(9)

    dist.broadcast_object_list = broadcast_object_list


def die_in_all_reduce(n: int) -> None:
    """A follower's n-th all-reduce ends it, before it adds its part."""
    all_reduce, seen = dist.all_reduce, [0]

    def counted(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if dist.get_rank(group) != 0:
            seen[0] += 1
            if seen[0] == n:
                os._exit(9)
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counted


if spec := os.environ.get("DELTASPEC_TEST_DIE_AT"):
    op, count = spec.split(":")
    if op == "reduce":
        die_in_all_reduce(int(count))
    else:
        die_at(OPS[op.removeprefix("leader-")], int(count), op.startswith("leader-"))

if __name__ == "__main__":
    from deltaspec.shared.cli import main

    sys.exit(main())
