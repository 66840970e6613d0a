"""`deltaspec bench`: measurements side by side in one run, reported as ratios (absolute times here are noise)."""
from __future__ import annotations

import argparse
import json

import torch
from tqdm import tqdm

from shared.bench.rollback import STRATEGIES, compare
from shared.defaults import DEFAULT_TARGET
from shared.model.checkpoint import hf_config, random_model
from shared.model.loader import load_model

PROMPT = list(b"import os\nimport sys\n\ndef main(argv):\n    ")


def bench_models() -> dict[str, object]:
    wide = hf_config(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                     linear_value_head_dim=64, layer_types=["linear_attention"] * 3 + ["full_attention"] * 1)
    return {"embedded target": load_model(DEFAULT_TARGET), "random 512-wide": random_model(wide, seed=0)}


def rollback_table(rounds: int, ks: tuple[int, ...] = (2, 4, 8)) -> list[dict]:
    rows = []
    models = bench_models()
    with tqdm(total=len(models) * len(ks), desc="rollback strategies") as bar:
        for model_name, model in models.items():
            for k in ks:
                costs = compare(model, PROMPT, k, rounds)
                base = costs["closed_form"].round_s
                for name, cost in costs.items():
                    rows.append({"model": model_name, "k": k, "strategy": name,
                                 "round_ms": 1000 * cost.round_s, "round_vs_ours": cost.round_s / base,
                                 "rollback_share": cost.rollback_share,
                                 "staged_kib_per_round": cost.bytes_per_round / 1024})
                bar.update()
    return rows


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    rows = rollback_table(args.rounds)
    if args.json:
        print(json.dumps({"rollback": rows}))
        return 0
    print(f"\nRollback strategies ({args.rounds} rounds each, accept counts uniform in 0..k, same rounds for all)")
    print(f"{'model':<18} {'k':>2} {'strategy':<18} {'round ms':>9} {'x ours':>7} {'rollback %':>10} {'staged KiB':>10}")
    for r in rows:
        print(f"{r['model']:<18} {r['k']:>2} {r['strategy']:<18} {r['round_ms']:>9.2f} {r['round_vs_ours']:>7.2f} "
              f"{100 * r['rollback_share']:>10.2f} {r['staged_kib_per_round']:>10.1f}")
    return 0


__all__ = ["main", "STRATEGIES"]
