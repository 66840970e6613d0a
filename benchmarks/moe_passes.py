"""Sparse MoE targets on this machine (`deltaspec bench --only moe`): what a verify costs when each token picks
its own experts, and whether speculation still pays.

For a small random target of each family (32 experts, top-4, a shared expert, 4 layers), in one run:
- ms per pass of T = 1 (decode) and T = k+1 (verify, k = 1..8) tokens per session, batched over 1, 4 and 8
  sessions, with the distinct experts the pass read per sparse layer (`SparseMoE.touched`): a verify routes all its
  tokens at once and reads each chosen expert once, so its cost follows the distinct experts, not T x top-k;
- the acceptance at which speculation breaks even at each k: tokens a round yields at per-token acceptance a,
  (1 - a^(k+1)) / (1 - a), against the round's cost in decode steps, verify(k+1) / decode + k x draft step / decode
  (a dense 2-layer draft, measured at the same batch), and with a draft that costs nothing (n-gram lookup: the
  verify's own share);
- rounds with a real draft model and accept counts drawn at a = 0.7 (round cost is measured here, not acceptance:
  `benchmarks.rounds`, which the GPU section shares), at k = 4 and at the k the cost model picks from
  this run's pass costs (`deltaspec.shared.decoding.draft_length`; 0 is decoding alone), against target-only
  decoding, batched 1, 4 and 8;
- our target-only against HF `generate()` on the same checkpoint, one sequence;
- decode and verify(5) at the published proportions (`shapes.scaled` of Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B:
  widths / 8, 4 layers, every weight's share of a decode's reads kept, 256 experts top-8 and 512 top-10): the toy
  above has experts as wide as its hidden size, these the published quarter, and as many experts as published, so
  the distinct experts a verify reads grow as on the real models; and there, verify(5) at 4 and 8 sessions with the
  experts as grouped matmuls (what a CPU picks for such passes, `kernels.experts.CPU_GROUPED_PAIRS_PER_EXPERT`) against the
  loop over the experts used, the two forms alternated pass by pass.
Passes are timed alternately (every T in turn, repeated), medians with their spread.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.rounds import (PREFIX, Stopwatch, draft_model, drawn_rounds, pass_times, sessions,
                               target_only, timed_pass, tokens_per_s)
from benchmarks.shapes import QWEN3_NEXT_80B_A3B, QWEN35_35B_A3B, scaled
from deltaspec.shared.decoding.draft_length import PassCosts, best_k
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.kernels import experts as expert_kernels
from deltaspec.shared.model.checkpoint import hf_moe_config, random_model, save_checkpoint
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.model.loader import load_model

FAMILIES = {"Qwen3.5-MoE": "qwen3_5_moe_text", "Qwen3-Next": "qwen3_next"}
PUBLISHED = {"Qwen3.5-MoE": ("Qwen3.5-35B-A3B", QWEN35_35B_A3B),
             "Qwen3-Next": ("Qwen3-Next-80B-A3B", QWEN3_NEXT_80B_A3B)}
KS = tuple(range(1, 9))
BATCHES = (1, 4, 8)
ALPHA = 0.7


def moe_config(model_type: str) -> dict:
    return hf_moe_config(model_type, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=64, linear_value_head_dim=64, num_experts=32, num_experts_per_tok=4,
                         moe_intermediate_size=256, shared_expert_intermediate_size=256,
                         eos_token_id=None)  # no end of sequence: both sides generate every token asked for


def pass_costs(model: HybridLM, draft: HybridLM, repeats: int, ks: tuple[int, ...] = KS) -> list[dict]:
    """Per batch: decode and verify(k+1) ms and distinct experts per sparse layer, the draft's step ms."""
    gen, watch = torch.Generator().manual_seed(0), Stopwatch("cpu")
    rows = []
    for batch in BATCHES:
        lengths = (1, *(k + 1 for k in ks))
        times = pass_times(model, draft, sessions(model, batch, gen), sessions(draft, batch, gen), lengths, repeats,
                           gen, watch)
        decode = times.median(1)
        draft_ms = 1000 * statistics.median(times.draft_seconds)
        for T in lengths:
            ms = [1000 * t for t in times.seconds[T]]
            rows.append({"batch": batch, "tokens": T, "ms": statistics.median(ms), "ms_min": min(ms),
                         "ms_max": max(ms), "vs_decode": times.median(T) / decode,
                         "experts": statistics.mean(times.experts[T]), "draft_step_ms": draft_ms,
                         "break_even": None if T == 1 else break_even(T - 1, times.median(T) / decode,
                                                                      draft_ms / (1000 * decode)),
                         "break_even_free": None if T == 1 else break_even(T - 1, times.median(T) / decode, 0.0)})
    return rows


def grouped_vs_loop(model: HybridLM, repeats: int) -> list[dict]:
    """verify(5) ms at 4 and 8 sessions, the experts as grouped matmuls (the CPU's choice for these passes) and as
    the loop over the experts used (forced by setting the CPU's threshold out of reach), alternated pass by pass."""
    gen, watch = torch.Generator().manual_seed(1), Stopwatch("cpu")
    rows = []
    for batch in (4, 8):
        states = sessions(model, batch, gen)
        times: dict[str, list[float]] = {"grouped": [], "loop": []}
        rule = expert_kernels.CPU_GROUPED_PAIRS_PER_EXPERT
        try:
            for r in range(2 * repeats + 1):
                for form in ("grouped", "loop") if r % 2 else ("loop", "grouped"):
                    expert_kernels.CPU_GROUPED_PAIRS_PER_EXPERT = rule if form == "grouped" else 0
                    seconds = timed_pass(model, states, 5, gen, watch)
                    if r:
                        times[form].append(seconds)
        finally:
            expert_kernels.CPU_GROUPED_PAIRS_PER_EXPERT = rule
        grouped, loop = (statistics.median(times[f]) for f in ("grouped", "loop"))
        rows.append({"batch": batch, "grouped_ms": 1000 * grouped, "loop_ms": 1000 * loop,
                     "saving": 1 - grouped / loop})
    return rows


def break_even(k: int, verify_vs_decode: float, draft_vs_decode: float) -> float | None:
    """Per-token acceptance at which a round of k drafts yields as many tokens per decode step's time as decoding."""
    cost = verify_vs_decode + k * draft_vs_decode
    if cost >= k + 1:
        return None  # not even full acceptance pays
    lo, hi = 0.0, 1.0
    for _ in range(50):
        a = (lo + hi) / 2
        tokens = k + 1 if a == 1 else (1 - a ** (k + 1)) / (1 - a)
        lo, hi = (lo, a) if tokens >= cost else (a, hi)
    return hi


def _tok_s(model: HybridLM, draft: HybridLM, batch: int, k: int, new_tokens: int, seed: int) -> float:
    """Tokens/s of fresh sessions: rounds at accepts drawn at `ALPHA` (k > 0) or target-only decoding (k = 0)."""
    gen, watch = torch.Generator().manual_seed(seed), Stopwatch("cpu")
    states = sessions(model, batch, gen)
    if not k:
        return tokens_per_s(target_only(model, states, new_tokens, gen, watch))
    return tokens_per_s(drawn_rounds(model, draft, states, sessions(draft, batch, gen), k, ALPHA, new_tokens, gen,
                                     watch))


def speculation_rows(model: HybridLM, draft: HybridLM, passes: list[dict], repeats: int,
                     new_tokens: int) -> list[dict]:
    """At each batch: k = 4, and the k the cost model (`deltaspec.shared.decoding.draft_length`) picks from this
    run's pass costs at acceptance `ALPHA` (0: decoding alone)."""
    rows = []
    for batch in BATCHES:
        at = {p["tokens"]: p for p in passes if p["batch"] == batch}
        costs = PassCosts(tuple(at[T]["ms"] / 1000 for T in sorted(at)), at[1]["draft_step_ms"] / 1000)
        for policy, k in (("fixed", 4), ("cost model", best_k(costs, ALPHA))):
            spec, plain = [], []
            for r in range(repeats + 1):
                spec.append(_tok_s(model, draft, batch, k, new_tokens, seed=r if k else 100 + r))
                plain.append(_tok_s(model, draft, batch, 0, new_tokens, seed=r))
            ratios = [s / p for s, p in zip(spec[1:], plain[1:])]
            rows.append({"batch": batch, "policy": policy, "k": k, "alpha": ALPHA,
                         "spec_tok_s": statistics.median(spec[1:]), "target_only_tok_s": statistics.median(plain[1:]),
                         "speedup": statistics.median(ratios), "speedup_min": min(ratios),
                         "speedup_max": max(ratios)})
    return rows


def versus_hf(directory: Path, model: HybridLM, repeats: int, new_tokens: int) -> dict:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = torch.randint(0, model.config.vocab_size, (PREFIX,), generator=torch.Generator().manual_seed(3)).tolist()
    ours, theirs = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        got = generate(model, prompt, new_tokens).token_ids
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0, PREFIX:].tolist()
        theirs.append(time.perf_counter() - start)
    ratios = [t / o for o, t in zip(ours[1:], theirs[1:])]
    return {"ours_tok_s": new_tokens / statistics.median(ours[1:]),
            "hf_tok_s": new_tokens / statistics.median(theirs[1:]),
            "ours_vs_hf": statistics.median(ratios), "ours_vs_hf_min": min(ratios), "ours_vs_hf_max": max(ratios),
            "same_tokens": got == want}


def moe(quick: bool = False) -> dict:
    repeats, new_tokens = (3, 24) if quick else (7, 64)
    draft = draft_model()
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model_type in FAMILIES.items():
            directory = save_checkpoint(random_model(moe_config(model_type), seed=2), Path(tmp) / model_type)
            model = load_model(directory)
            passes = pass_costs(model, draft, repeats)
            result[name] = {"passes": passes,
                            "speculation": speculation_rows(model, draft, passes, repeats, new_tokens),
                            "hf": versus_hf(directory, model, repeats, new_tokens)}
            published, shape = PUBLISHED[name]
            big = random_model(scaled(shape), seed=2).eval().fuse()
            result[name]["published"] = {"model": published, "vocab_size": big.config.vocab_size,
                                         "experts": big.config.num_experts, "top_k": big.config.num_experts_per_tok,
                                         "passes": pass_costs(big, draft, repeats, ks=(4,)),
                                         "grouped_vs_loop": grouped_vs_loop(big, repeats)}
    return result


def print_rows(result: dict) -> None:
    print("\nSparse MoE targets (32 experts, top-4, 4 layers, hidden 256; random weights; medians)")
    for name, r in result.items():
        hf = r["hf"]
        print(f"\n{name}: target-only {hf['ours_tok_s']:.1f} tok/s, HF generate() {hf['hf_tok_s']:.1f} tok/s "
              f"({hf['ours_vs_hf']:.2f}x, {hf['ours_vs_hf_min']:.2f}-{hf['ours_vs_hf_max']:.2f}; "
              f"same tokens: {hf['same_tokens']})")
        _print_passes(r["passes"])
        print("draft step (dense 2-layer) per batch: "
              + ", ".join(f"{p['batch']}: {p['draft_step_ms']:.2f} ms" for p in r["passes"] if p["tokens"] == 1))
        for s in r["speculation"]:
            print(f"{s['policy']:>10} k = {s['k']}, accepts drawn at {s['alpha']}, batch {s['batch']}: "
                  f"{s['spec_tok_s']:.0f} tok/s against {s['target_only_tok_s']:.0f} target-only, {s['speedup']:.2f}x "
                  f"({s['speedup_min']:.2f}-{s['speedup_max']:.2f})")
        big = r["published"]
        print(f"at {big['model']}'s proportions (widths / 8, 4 layers, {big['experts']} experts top-{big['top_k']}, "
              f"vocabulary {big['vocab_size']}):")
        _print_passes(big["passes"])
        print("verify(5), experts as grouped matmuls against the loop, alternated: " + ", ".join(
            f"batch {g['batch']}: {g['grouped_ms']:.2f} against {g['loop_ms']:.2f} ms ({100 * g['saving']:.0f} % less)"
            for g in big["grouped_vs_loop"]))


def _print_passes(passes: list[dict]) -> None:
    print(f"{'batch':>5} {'tokens':>6} {'ms/pass':>8} {'min-max':>13} {'x decode':>8} {'experts/layer':>13} "
          f"{'break-even a':>12} {'free draft':>10}")

    def even(p: dict, key: str) -> str:
        return "-" if p["tokens"] == 1 else "never" if p[key] is None else f"{p[key]:.2f}"

    for p in passes:
        print(f"{p['batch']:>5} {p['tokens']:>6} {p['ms']:>8.2f} {p['ms_min']:>6.2f}-{p['ms_max']:<6.2f} "
              f"{p['vs_decode']:>8.2f} {p['experts']:>13.1f} {even(p, 'break_even'):>12} "
              f"{even(p, 'break_even_free'):>10}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result), figsize=(5.5 * len(result), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], result.items()):
        for batch in BATCHES:
            rows = [p for p in r["passes"] if p["batch"] == batch]
            line, = ax.plot([p["tokens"] for p in rows], [p["vs_decode"] for p in rows], marker="o",
                            label=f"{batch} session(s): pass / decode")
            ax.plot([p["tokens"] for p in rows], [p["experts"] / rows[0]["experts"] for p in rows], ls=":",
                    color=line.get_color(), label=f"{batch}: distinct experts / decode's")
        ax.set_xlabel("tokens per session in the pass (k + 1)")
        ax.set_ylabel("relative to a decode step")
        ax.set_title(f"{name}: verify cost and experts read")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
