"""Memory per session against context length, and sessions per GiB (`deltaspec bench --only sessions`).

A session's GDN state (committed state, spare, mark snapshot, conv windows, round logs) is the same
size at any context; its attention K/V grows by a fixed amount per token. The figures come from
the configs' state specs (`StateSpec.bytes`: what a `StatePool` charges),
for the embedded target and draft and for configs shaped as Qwen3.5-0.8B, Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B
(`benchmarks.shapes`; no weights needed: experts change the weights, not a session's state), and are
checked against the bytes a real pooled session holds. A draft's round logs hold `CHAIN_LOG_CAPACITY`
tokens (it speculates two rounds ahead), a target's `LOG_CAPACITY`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.shapes import QWEN3_NEXT_80B_A3B, QWEN35_08B, QWEN35_35B_A3B
from deltaspec.shared.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.state.pool import MIN_CONTEXT, StatePool
from deltaspec.shared.state.spec import CHAIN_LOG_CAPACITY, LOG_CAPACITY

CONTEXTS = (256, 1024, 4096, 16384, 32768, 131072)
GIB = 2**30


def models() -> dict[str, tuple[ModelConfig, torch.dtype, int]]:
    """Name: (config, dtype, log capacity of its sessions)."""
    return {"embedded target": (ModelConfig.from_file(DEFAULT_TARGET / "config.json"), torch.float32, LOG_CAPACITY),
            "embedded draft": (ModelConfig.from_file(DEFAULT_DRAFT / "config.json"), torch.float32,
                               CHAIN_LOG_CAPACITY),
            "Qwen3.5-0.8B shape": (ModelConfig.from_dict(QWEN35_08B), torch.bfloat16, LOG_CAPACITY),
            "Qwen3.5-35B-A3B shape": (ModelConfig.from_dict(QWEN35_35B_A3B), torch.bfloat16, LOG_CAPACITY),
            "Qwen3-Next-80B-A3B shape": (ModelConfig.from_dict(QWEN3_NEXT_80B_A3B), torch.bfloat16, LOG_CAPACITY)}


def measured_bytes(cfg: ModelConfig, dtype: torch.dtype, positions: int, log_capacity: int = LOG_CAPACITY) -> int:
    """Bytes one real pooled session holds at `positions` of K/V capacity: its slot's share of the pool and its K/V."""
    spec = cfg.state_spec
    pool = StatePool(spec, spec.bytes(dtype, positions, log_capacity), 1, dtype=dtype, log_capacity=log_capacity)
    state = pool.new_state(capacity=positions)
    slot = sum(t.nbytes for t in pool.tensors.values()) // pool.slots
    return slot + sum(t.nbytes for layer in state.attn for t in (layer.k, layer.v))


def rows() -> list[dict]:
    out = []
    for name, (cfg, dtype, log_capacity) in models().items():
        spec = cfg.state_spec
        gdn, per_token = spec.recurrent_bytes(dtype, log_capacity), spec.kv_bytes_per_position(dtype)
        out.append({"model": name, "dtype": str(dtype).removeprefix("torch."),
                    "measured_mib": measured_bytes(cfg, dtype, MIN_CONTEXT, log_capacity) / 2**20,  # = session_mib[256]
                    "gdn_layers": spec.n_recurrent, "attention_layers": spec.n_attention,
                    "gdn_mib": gdn / 2**20, "kv_kib_per_token": per_token / 2**10,
                    "session_mib": {n: spec.bytes(dtype, n, log_capacity) / 2**20 for n in CONTEXTS},
                    "sessions_per_gib": {n: GIB / spec.bytes(dtype, n, log_capacity) for n in CONTEXTS}})
    return out


def print_rows(result: list[dict]) -> None:
    contexts = "".join(f"{n:>9}" for n in CONTEXTS)
    print("\nMemory per session by context (GDN state constant, attention K/V per token; a pooled session measured "
          "at 256 positions holds exactly what the pool charges)")
    print(f"{'model':<24} {'dtype':<9} {'GDN MiB':>8} {'K/V KiB/token':>13} {'K/V = GDN at':>12} | MiB at{contexts}")
    for r in result:
        even = r["gdn_mib"] * 1024 / r["kv_kib_per_token"]
        print(f"{r['model']:<24} {r['dtype']:<9} {r['gdn_mib']:>8.2f} {r['kv_kib_per_token']:>13.2f} {even:>12.0f} | "
              f"{'':<6}" + "".join(f"{r['session_mib'][n]:>9.1f}" for n in CONTEXTS))
    print(f"{'sessions per GiB':<66} | at    {contexts}")
    for r in result:
        print(f"{r['model']:<66} | {'':<6}" + "".join(f"{r['sessions_per_gib'][n]:>9.1f}" for n in CONTEXTS))


def plot(result: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in result:
        line, = left.plot(CONTEXTS, [r["session_mib"][n] for n in CONTEXTS], marker="o", label=r["model"])
        left.axhline(r["gdn_mib"], color=line.get_color(), ls=":", lw=1)
        right.plot(CONTEXTS, [r["sessions_per_gib"][n] for n in CONTEXTS], marker="o", label=r["model"])
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.legend()
    left.set_ylabel("MiB per session")
    left.set_title("Memory per session (dotted: GDN state, constant)")
    right.set_ylabel("sessions per GiB")
    right.set_title("Sessions per GiB of state memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
