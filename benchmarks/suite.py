"""`deltaspec bench`: every figure measured side by side in one run, reported as ratios.

Sections: the cost of one step (ATen calls and time, layer path vs fused path); acceptance and
speed-up by drafter and k; long generations (96 to 1024 tokens: speculative, our target-only and
HF transformers' generate(), alternated, with each round's phases); the gRPC path over in-process;
draft distributions on the wire, dense and sparse, at Qwen3.5's vocabulary (`benchmarks.wire`);
tracing overhead; rollback strategies; the memory-bound regime (verify k+1 over decode 1);
pipelined vs serial rounds over gRPC with 0, 1 and 5 ms of network delay, and what a round costs in CPU time
and draft passes (`benchmarks.pipeline`); load
(1 to 32 concurrent sessions over loopback gRPC, `benchmarks.load`); memory per session against
context and sessions per GiB (`benchmarks.session_memory`, computed from the configs); sparse MoE
targets of both families (verify cost against the distinct experts read, break-even acceptance, rounds at drawn
accepts, against HF generate(): `benchmarks.moe_passes`); the prefix cache (time to first token and prefilled
tokens with it on and off, speculation on and off, and memory per cached prefix: `benchmarks.prefix`);
compiled passes (steps fused vs compiled, and the long generations again with both models compiled); and, only
where CUDA is present, the GPU: Qwen3.5 shapes at their real sizes with random bf16 weights (passes against the
floor the copy bandwidth sets, HF generate() on the same weights, up to 256 sessions at once with and without
speculation: `benchmarks.gpu`), the load table with both servers on CUDA, and eager against captured and compiled
generations (`generation.fast_paths`). `--only` runs some sections; `--only aiperf` (never in a full run: it needs
AIPerf installed apart, `benchmarks.openai_aiperf`) runs NVIDIA's load generator against the OpenAI front beside the
bench's own client. Plots go to docs/figures/ (where the
documentation pages show them); a full run's tables also go to benchmarks/results/bench.txt (all sections) and
benchmarks/results/load.txt (the load section, whenever it runs in full; prefix_cache.txt likewise).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json

import torch
from tqdm import tqdm

from benchmarks import (cost_model, families, generation, gpu, load, moe_passes as moe, openai_aiperf, openai_front,
                        pipeline, prefix, report, session_memory, steps as step_costs, tensor_parallel, wire)
from benchmarks.report import FIGURES, RESULTS
from benchmarks.rollback_cost import compare
from benchmarks.speedup import acceptance_and_speedup, heldout_prompts, memory_bound_ratio
from benchmarks.telemetry_overhead import tracing_overhead
from deltaspec.shared.decoding.drafters import make_drafter
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from deltaspec.shared.model.checkpoint import hf_config, random_model
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.state.spec import CHAIN_LOG_CAPACITY

PROMPT = list(b"import os\nimport sys\n\ndef main(argv):\n    ")
SECTIONS = ("steps", "acceptance", "generations", "grpc", "wire", "tracing", "rollback", "memory", "pipeline", "load",
            "sessions", "moe", "cost_model", "prefix", "compiled", "gpu", "openai", "families", "tensor_parallel",
            "aiperf")
ON_REQUEST = ("aiperf",)  # sections a run without --only skips


def rollback_rows(rounds: int, ks: tuple[int, ...]) -> list[dict]:
    wide = hf_config(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                     linear_value_head_dim=64, layer_types=["linear_attention"] * 3 + ["full_attention"])
    models = {"embedded target": load_model(DEFAULT_TARGET), "random 512-wide": random_model(wide, seed=0)}
    rows = []
    for model_name, model in models.items():
        for k in ks:
            costs = compare(model, PROMPT, k, rounds)
            base = costs["closed_form"].round_s
            rows += [{"model": model_name, "k": k, "strategy": name, "round_ms": 1000 * cost.round_s,
                      "round_vs_ours": cost.round_s / base, "rollback_share": cost.rollback_share,
                      "staged_kib_per_round": cost.bytes_per_round / 1024} for name, cost in costs.items()]
    return rows


def run(args: argparse.Namespace) -> dict:
    quick = args.quick
    target, draft = load_model(DEFAULT_TARGET), load_model(DEFAULT_DRAFT)
    drafters = {"draft model": lambda: ModelDrafter(draft), "mtp": lambda: make_drafter("mtp", target),
                "ngram": lambda: make_drafter("ngram", target)}
    prompts = heldout_prompts(2 if quick else 3)
    ks = (2, 4) if quick else (1, 2, 4, 8)
    new_tokens = 48 if quick else 96
    lengths = args.lengths or ((96, 384) if quick else (96, 384, 1024))
    long_prompts = heldout_prompts(args.prompts or (2 if quick else 5))
    steps = [s for s in SECTIONS if s in (args.only or set(SECTIONS) - set(ON_REQUEST))
             and (s != "gpu" or torch.cuda.is_available())]
    result: dict = {}
    repeats = 1 if quick else 2
    long = sum(section in steps for section in ("generations", "compiled"))  # a tick per generation, not per section
    with tqdm(total=len(steps) + long * (len(lengths) * len(long_prompts) * repeats - 1), desc="bench") as bar:
        if "steps" in steps:
            result["steps"] = step_costs.step_costs({"embedded target": target, "embedded draft": draft},
                                                    blocks=3 if quick else 7)
            bar.update()
        if "acceptance" in steps:
            result["acceptance"] = acceptance_and_speedup(target, drafters, ks, prompts, new_tokens)
            bar.update()
        if "generations" in steps:
            result["generations"] = generation.long_generations(target, DEFAULT_TARGET, draft, long_prompts, lengths,
                                                                repeats, bar.update)
        if "grpc" in steps:
            from benchmarks.rpc_overhead import measure

            result["grpc"] = measure(max_new_tokens=new_tokens, repeats=2 if quick else 3)
            bar.update()
        if "wire" in steps:
            result["wire"] = wire.draft_probs_wire(repeats=3 if quick else 7)
            bar.update()
        if "tracing" in steps:
            result["tracing"] = tracing_overhead(target, ModelDrafter(draft), prompts[0], new_tokens,
                                                 repeats=3 if quick else 7)
            bar.update()
        if "rollback" in steps:
            result["rollback"] = rollback_rows(10 if quick else args.rounds, (4,) if quick else (2, 4, 8))
            bar.update()
        if "memory" in steps:
            result["memory_bound"] = memory_bound_ratio(repeats=3 if quick else 7)
            bar.update()
        if "pipeline" in steps:
            result["pipeline"] = pipeline.placements(heldout_prompts(2 if quick else 6, 96),
                                                     max_new_tokens=64 if quick else 96, repeats=1 if quick else 2)
            bar.update()
        if "load" in steps:
            result["load"] = load.load(DEFAULT_TARGET, DEFAULT_DRAFT, quick)
            bar.update()
        if "sessions" in steps:
            result["sessions"] = session_memory.rows()
            bar.update()
        if "moe" in steps:
            result["moe"] = moe.moe(quick)
            bar.update()
        if "cost_model" in steps:
            result["cost_model"] = cost_model.cost_model(quick)
            bar.update()
        if "prefix" in steps:
            command = " ".join(["deltaspec bench", *(["--quick"] if quick else []),
                                *([f"--only {','.join(args.only)}"] if args.only else [])])
            result["prefix"] = prefix.prefix(quick, command)
            bar.update()
        if "compiled" in steps:  # both models' passes compiled: speculative and target-only alike
            result["compiled"] = {"steps": step_costs.step_costs({"embedded target": target, "embedded draft": draft},
                                                                 blocks=3 if quick else 7, paths=("fused", "compiled"))}
            result["compiled"]["generations"] = generation.long_generations(
                copy.deepcopy(target).compile(warm_up=True), DEFAULT_TARGET,
                copy.deepcopy(draft).compile(warm_up=True, log_capacity=CHAIN_LOG_CAPACITY),
                long_prompts, lengths, repeats, bar.update)
        if "gpu" in steps:  # the real shapes first, their memory freed before the servers start
            result["gpu"] = gpu.gpu("cuda", plan=gpu.QUICK if quick else gpu.FULL)
            result["gpu"]["load"] = load.load(DEFAULT_TARGET, DEFAULT_DRAFT, quick, device="cuda")
            result["gpu"]["compiled"] = generation.fast_paths(
                load_model(DEFAULT_TARGET, device="cuda"), load_model(DEFAULT_DRAFT, device="cuda"), long_prompts[:2],
                256, 1 if quick else 2, paths=("captured", "compiled"))
            bar.update()
        if "openai" in steps:
            result["openai"] = openai_front.openai_front(DEFAULT_TARGET, DEFAULT_DRAFT, quick)
            bar.update()
        if "families" in steps:
            result["families"] = families.families(quick)
            bar.update()
        if "tensor_parallel" in steps:
            result["tensor_parallel"] = tensor_parallel.tensor_parallel(quick)
            bar.update()
        if "aiperf" in steps:
            result["aiperf"] = openai_aiperf.aiperf_rows(DEFAULT_TARGET, DEFAULT_DRAFT, quick)
            bar.update()
    return result


PRINTERS = {"pipeline": pipeline.print_rows, "load": load.print_rows, "sessions": session_memory.print_rows,
            "moe": moe.print_rows, "cost_model": cost_model.print_rows, "prefix": prefix.print_rows,
            "openai": openai_front.print_rows, "families": families.print_rows,
            "tensor_parallel": tensor_parallel.print_rows,
            "aiperf": openai_aiperf.print_rows}  # sections that print their own rows


def print_tables(result: dict) -> None:
    if "steps" in result:
        step_costs.print_rows(result["steps"])
    if "acceptance" in result:
        print("\nAcceptance and speed-up (held-out text, greedy, warmed; speed-up = tokens/s over target-only)")
        print(f"{'drafter':<14} {'k':>2} {'accept':>7} {'mean len':>9} {'speed-up':>9} identical")
        for r in result["acceptance"]:
            print(f"{r['drafter']:<14} {r['k']:>2} {r['acceptance_rate']:>7.2f} {r['mean_accepted_length']:>9.2f} "
                  f"{r['speedup']:>9.2f} {r['identical']}")
    if "generations" in result:
        generation.print_rows(result["generations"])
    if "compiled" in result:
        step_costs.print_rows(result["compiled"]["steps"])
        generation.print_rows(result["compiled"]["generations"], "both models' passes compiled")
    if "grpc" in result:
        g = result["grpc"]["ratio_to_in_process"]
        print(f"\ngRPC loopback over in-process tokens/s: server loop {g['server_loop']:.2f}, "
              f"client-driven {g['client_driven']:.2f}")
    if "wire" in result:
        wire.print_rows(result["wire"])
    if "tracing" in result:
        t = result["tracing"]
        print(f"Tracing off vs compiled out: {t['off_tokens_per_s']:.1f} vs {t['compiled_out_tokens_per_s']:.1f} "
              f"tok/s (cost {100 * t['off_cost']:.1f} %, from the loop's added time per round "
              f"{100 * t['off_cost_from_added_time']:.2f} %)")
    if "rollback" in result:
        print("\nRollback strategies (medians; rollback share = commit/revert/copies/replay over round time)")
        print(f"{'model':<18} {'k':>2} {'strategy':<18} {'round ms':>9} {'x ours':>7} {'rollback %':>10} "
              f"{'staged KiB':>10}")
        for r in result["rollback"]:
            print(f"{r['model']:<18} {r['k']:>2} {r['strategy']:<18} {r['round_ms']:>9.2f} "
                  f"{r['round_vs_ours']:>7.2f} {100 * r['rollback_share']:>10.2f} {r['staged_kib_per_round']:>10.1f}")
    if "memory_bound" in result:
        m = result["memory_bound"]
        print(f"\nMemory-bound regime ({m['params_m']:.0f}M-parameter random target): verify {m['k'] + 1} tokens "
              f"{m['verify_k1_ms']:.1f} ms / decode 1 {m['decode_1_ms']:.1f} ms = {m['ratio']:.2f}")
    for section, print_rows in PRINTERS.items():
        if section in result:
            print_rows(result[section])
    if "gpu" in result:
        gpu.print_rows(result["gpu"])
        print("\nGPU: load (both servers --device cuda)", end="")
        load.print_rows(result["gpu"]["load"])
        generation.print_fast_paths(result["gpu"]["compiled"])


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    for name in sorted({r["drafter"] for r in result["acceptance"]}):
        rows = [r for r in result["acceptance"] if r["drafter"] == name]
        left.plot([r["k"] for r in rows], [r["acceptance_rate"] for r in rows], marker="o", label=f"{name}: acceptance")
        left.plot([r["k"] for r in rows], [r["speedup"] for r in rows], marker="s", ls="--", label=f"{name}: speed-up")
    left.set_xlabel("draft tokens k")
    left.set_title("Acceptance and speed-up over target-only")
    left.legend()
    rows = result["generations"]
    lengths = [r["length"] for r in rows]
    for name, label in (("speculative", "speculative"), ("dynamic", f"speculative, {generation.SPECULATIVE['dynamic']}"),
                        ("target_only", "our target-only"), ("hf", "HF generate()")):
        stats = [r["tokens_per_s"][name] for r in rows]
        medians = [s["median"] for s in stats]
        middle.errorbar(lengths, medians, yerr=[[m - s["min"] for m, s in zip(medians, stats)],
                                                [s["max"] - m for m, s in zip(medians, stats)]],
                        marker="o", capsize=3, label=label)
    middle.set_xscale("log")
    middle.set_xticks(lengths, [str(n) for n in lengths])
    middle.set_xlabel("new tokens (greedy, held-out prompts)")
    middle.set_ylabel("tokens/s (median, min-max)")
    middle.set_title("Long generations, one CPU thread")
    middle.legend()
    wide = [r for r in result["rollback"] if r["model"] == "random 512-wide"]
    for strategy in ("closed_form", "snapshots", "checkpoint_replay"):
        rows = [r for r in wide if r["strategy"] == strategy]
        right.plot([r["k"] for r in rows], [r["staged_kib_per_round"] for r in rows], marker="o", label=strategy)
    right.set_xlabel("draft tokens k")
    right.set_ylabel("KiB staged per round")
    right.set_title("Rollback memory per round (512-wide model)")
    right.legend()
    fig.tight_layout()
    FIGURES.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURES / "bench.png", dpi=110)


def main(args: argparse.Namespace) -> int:
    unknown = set(args.only or ()) - set(SECTIONS)
    if unknown:
        raise ValueError(f"--only: unknown section(s) {', '.join(sorted(unknown))} (sections: {', '.join(SECTIONS)})")
    torch.set_num_threads(args.threads)
    result = run(args)
    tables = io.StringIO()
    with contextlib.redirect_stdout(tables):
        print_tables(result)
    print(json.dumps(result) if args.json else tables.getvalue().rstrip("\n"))
    if not args.quick and not args.only:  # bench.txt and bench.png come from full runs only
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "bench.txt").write_text(tables.getvalue())
        plot(result)
    if not args.quick and "pipeline" in result:
        report.save("pipeline", result["pipeline"], pipeline.print_rows, pipeline.plot)
    if not args.quick and "load" in result:
        report.save("load", result["load"], load.print_rows, load.plot)
    if not args.quick and "openai" in result:
        report.save("openai", result["openai"], openai_front.print_rows)
    if not args.quick and "aiperf" in result:
        report.save("aiperf", result["aiperf"], openai_aiperf.print_rows)
    if not args.quick and "moe" in result:
        report.save("moe", result["moe"], moe.print_rows, moe.plot)
    if not args.quick and "tensor_parallel" in result:
        report.save("tensor_parallel", result["tensor_parallel"], tensor_parallel.print_rows)
    if not args.quick and "cost_model" in result:
        report.save("cost_model", result["cost_model"], cost_model.print_rows)
    if not args.quick and "prefix" in result:
        prefix.save(result["prefix"])
    if "sessions" in result:  # computed, not timed: the same in quick runs
        report.save("memory_per_session", result["sessions"], session_memory.print_rows, session_memory.plot)
    return 0
