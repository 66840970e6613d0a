"""Tensor parallelism (`deltaspec bench --only tensor_parallel`): per pass, time in collectives against time in
compute, and the bytes each rank sends, at 1, 2 and 4 ranks on this CPU (gloo), and the same rows computed for the
real Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B shapes on NCCL (Qwen3.5-122B-A10B's config is not in
`benchmarks.shapes`).

Measured: a random Qwen3.5 of 8 layers (hidden 512) sharded over N gloo ranks on this host, a decode pass (T = 1)
and a verify pass (T = 5, a round at k = 4), each reverted, alternated `REPEATS` times; rank 0's wall time per pass
and the time inside its all-reduces (which includes waiting for the slowest rank), medians. Bytes a rank sends per
pass: 2 all-reduces a layer of T x hidden float32 values, each sending 2 (N - 1) / N of its size (a ring).

Computed: the same count at the published shapes in bfloat16, at an assumed NCCL all-reduce bus bandwidth of
`BUS_GB_S` and a per-all-reduce latency of `LATENCY_US` (one H100 node, NVLink): at a round's few tokens the
latency term dominates.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import report
from benchmarks.shapes import QUARTERS, QWEN3_NEXT_80B_A3B, QWEN35_35B_A3B
from deltaspec.shared.model.checkpoint import hf_config, random_model
from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.fields import ConfigError
from deltaspec.shared.model.lockstep import join
from deltaspec.shared.model.parallel import Rank, shard, sharded_config

MODEL = hf_config(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, linear_num_key_heads=8, linear_num_value_heads=16,
                  linear_key_head_dim=64, linear_value_head_dim=64, layer_types=QUARTERS * 2)
WORLDS, TOKENS = (1, 2, 4), (1, 5)
REPEATS, QUICK_REPEATS = 30, 8
BUS_GB_S, LATENCY_US = 360.0, 10.0  # NCCL all-reduce on one H100 node (NVLink 4), assumed
SHAPES = {"Qwen3-Next-80B-A3B": QWEN3_NEXT_80B_A3B, "Qwen3.5-35B-A3B": QWEN35_35B_A3B}


def ring_bytes(tokens: int, hidden: int, layers: int, world: int, itemsize: int) -> float:
    """Bytes one rank sends in a pass: 2 all-reduces a layer of tokens x hidden values, 2 (N - 1) / N each."""
    return 2 * layers * tokens * hidden * itemsize * 2 * (world - 1) / world


def _rank(rank: int, world: int, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        join(rank, world, f"file://{out}/rendezvous", timeout_s=120)
    at = Rank(rank, world)
    model = shard(random_model(MODEL, seed=1), at)  # its all-reduces timed on `at.clock`
    state = model.new_state()
    model(torch.arange(32), state)
    state.commit(32)
    rows: dict[int, list[tuple[float, float]]] = {t: [] for t in TOKENS}
    for i in range(repeats + 2):  # two warm-up rounds
        for T in TOKENS:
            spent = at.clock.seconds
            started = time.perf_counter()
            model(torch.arange(T) + 7, state)
            wall = time.perf_counter() - started
            state.revert()
            if i >= 2:
                rows[T].append((wall, at.clock.seconds - spent))
    if rank == 0:
        torch.save(rows, Path(out) / "rows.pt")
    if world > 1:
        dist.barrier()  # no rank tears the group down while another still runs (gloo aborts the one left)
        dist.destroy_process_group()


def measured(repeats: int) -> list[dict]:
    result = []
    for world in WORLDS:
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_rank, args=(world, repeats, out), nprocs=world)
            rows = torch.load(Path(out) / "rows.pt")
        for T, times in rows.items():
            wall = statistics.median(w for w, _ in times)
            coll = statistics.median(c for _, c in times)
            result.append({"world": world, "tokens": T, "pass_ms": 1e3 * wall, "collective_ms": 1e3 * coll,
                           "compute_ms": 1e3 * (wall - coll),
                           "sent_bytes": ring_bytes(T, MODEL["hidden_size"], len(MODEL["layer_types"]), world, 4)})
    return result


def computed() -> list[dict]:
    rows = []
    for name, shape in SHAPES.items():
        cfg = ModelConfig.from_dict(shape)
        for world in (2, 4, 8):
            try:
                sharded_config(cfg, world)
            except ConfigError as refused:
                rows.append({"model": name, "world": world, "refused": str(refused)})
                continue
            for T in TOKENS:
                sent = ring_bytes(T, cfg.hidden_size, cfg.num_hidden_layers, world, 2)
                count = 2 * cfg.num_hidden_layers
                rows.append({"model": name, "world": world, "tokens": T, "all_reduces": count, "sent_bytes": sent,
                             "collective_ms": 1e3 * (count * LATENCY_US * 1e-6 + sent / (BUS_GB_S * 1e9))})
    return rows


def tensor_parallel(quick: bool) -> dict:
    return {"header": report.header("deltaspec bench --only tensor_parallel", time.time()),
            "repeats": QUICK_REPEATS if quick else REPEATS, "measured": measured(QUICK_REPEATS if quick else REPEATS),
            "computed": computed()}


def print_rows(result: dict) -> None:
    print(f"\n{result['header']}")
    print(f"Tensor parallel passes on this CPU (gloo, random Qwen3.5, 8 layers, hidden 512, float32; rank 0, medians "
          f"of {result['repeats']}; collective = inside the all-reduces, waiting for the slowest rank included)")
    print(f"{'ranks':>5} {'T':>3} {'pass ms':>8} {'compute ms':>10} {'collective ms':>13} {'share':>6} "
          f"{'KiB sent/rank':>13}")
    for r in result["measured"]:
        print(f"{r['world']:>5} {r['tokens']:>3} {r['pass_ms']:>8.2f} {r['compute_ms']:>10.2f} "
              f"{r['collective_ms']:>13.2f} {r['collective_ms'] / r['pass_ms']:>6.0%} {r['sent_bytes'] / 1024:>13.1f}")
    print(f"\nComputed for NCCL at the published shapes (bfloat16; assumed all-reduce bus bandwidth {BUS_GB_S:.0f} GB/s "
          f"and {LATENCY_US:.0f} us per all-reduce, one H100 node)")
    print(f"{'model':>20} {'ranks':>5} {'T':>3} {'all-reduces':>11} {'KiB sent/rank':>13} {'collective ms':>13}")
    for r in result["computed"]:
        if "refused" in r:
            print(f"{r['model']:>20} {r['world']:>5}   refused: {r['refused']}")
            continue
        print(f"{r['model']:>20} {r['world']:>5} {r['tokens']:>3} {r['all_reduces']:>11} "
              f"{r['sent_bytes'] / 1024:>13.1f} {r['collective_ms']:>13.3f}")
