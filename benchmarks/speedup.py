"""Speed-up figures: acceptance and speculative over target-only by drafter and k, and the
memory-bound regime the speed-up comes from (long generations against HF: `generation.py`). Every figure is a ratio of two runs made side by
side in one process (absolute times on a shared machine are noise)."""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.report import HELDOUT_LIST
from deltaspec.shared.decoding.drafters import Drafter
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.checkpoint import hf_config, random_model
from deltaspec.shared.model.hybrid import HybridLM



def heldout_prompts(count: int = 4, length: int = 96) -> list[list[int]]:
    """Prompts cut from standard-library files the embedded pair never trained on."""
    stdlib = Path(os.__file__).parent
    names = [line.strip() for line in HELDOUT_LIST.read_text().splitlines() if line.strip() and not line.startswith("#")]
    prompts = []
    for name in names:
        data = (stdlib / name).read_bytes() if (stdlib / name).exists() else b""
        if len(data) > 4 * length:
            mid = len(data) // 2
            prompts.append(list(data[mid : mid + length]))
        if len(prompts) == count:
            break
    return prompts


def acceptance_and_speedup(target: HybridLM, drafters: dict[str, Callable[[], Drafter]], ks: tuple[int, ...],
                           prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    """For each drafter and k: acceptance, mean accepted length, and tokens/s over target-only (same prompts)."""
    generate(target, prompts[0], 16)  # warm every path before timing
    for make in drafters.values():
        generate(target, prompts[0], 16, make(), max(ks))
    base_s, want = 0.0, []
    for prompt in prompts:
        g = generate(target, prompt, max_new_tokens)
        base_s += g.stats.seconds
        want.append(g.token_ids)
    rows = []
    for name, make in drafters.items():
        for k in ks:
            drafted = accepted = rounds = tokens = 0
            seconds, identical = 0.0, True
            for prompt, ref in zip(prompts, want):
                g = generate(target, prompt, max_new_tokens, make(), k)
                identical &= g.token_ids == ref
                drafted, accepted, rounds = drafted + g.stats.drafted, accepted + g.stats.accepted, rounds + g.stats.rounds
                tokens, seconds = tokens + len(g.token_ids), seconds + g.stats.seconds
            rows.append({"drafter": name, "k": k, "acceptance_rate": accepted / max(drafted, 1),
                         "mean_accepted_length": tokens / max(rounds, 1), "speedup": base_s / seconds,
                         "identical": identical})
    return rows


def memory_bound_ratio(k: int = 4, context: int = 64, repeats: int = 7, device: str = "cpu") -> dict:
    """Time to verify k+1 tokens over time to decode one, on a randomly initialised target of >= 100M parameters."""
    cfg = hf_config(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                    num_key_value_heads=4, head_dim=64, linear_num_key_heads=8, linear_num_value_heads=16,
                    linear_key_head_dim=64, linear_value_head_dim=64,
                    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3, tie_word_embeddings=False)
    model = random_model(cfg, seed=0).to(device).fuse()
    params = sum(p.numel() for p in model.parameters())
    state = model.new_state(capacity=context + 64)
    model(torch.arange(context, device=device), state)
    state.commit(state.staged)

    def timed(n: int) -> float:
        times = []
        for _ in range(repeats):
            if device != "cpu":
                torch.cuda.synchronize()
            started = time.perf_counter()
            model(torch.arange(n, device=device), state)
            state.commit(n)
            if device != "cpu":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
            state.length -= n  # measure from the same head each time
        return statistics.median(times)

    timed(1)  # warm-up
    one, many = timed(1), timed(k + 1)
    return {"params_m": params / 1e6, "k": k, "decode_1_ms": 1000 * one, "verify_k1_ms": 1000 * many,
            "ratio": many / one}
