"""How bad is a missing GDN rollback? The study the original report said was "not yet measured".

Benchmark-only: `StaleGDNState` rolls attention back by position, as every engine does, but
leaves each Gated DeltaNet layer's recurrent state and conv window advanced by all k+1 staged
tokens, rejected drafts included: what an engine that checkpoints nothing would do. It is
reachable only from `deltaspec study`, never from `generate` or the services.

For each model, drafter and k, every prompt is decoded greedily twice with the same drafter:
exactly (target-only output, which the exact engine reproduces) and with the stale state. We
report the share of generations whose output differs, the first divergent position, how often
the stale state still predicts the exact state's top-1 token on the same history, and the
recurrent state's relative error ||S_stale - S_exact||_F / ||S_exact||_F after each round, where
S_exact comes from a shadow state fed, exactly, the tokens the stale session committed (so the
error is measured on the stale run's own history, before and after its output diverges).

    deltaspec study [--quick]     # a table on stdout, PNG plots under docs/figures/, the data in
                                  # benchmarks/results/no_rollback_study.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.report import FIGURES, RESULTS
from deltaspec.shared.decoding.drafters import Drafter, attach, make_drafter
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.drafters.mtp import MTPDrafter, MTPHead, random_mtp_weights
from deltaspec.shared.decoding.speculative import Stats, decode, generate
from deltaspec.shared.decoding.target import TargetSession
from deltaspec.shared.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from deltaspec.shared.model.checkpoint import hf_config, random_model
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.state.rollback import ModelState


class StaleGDNState(ModelState):
    """Attention KV cut at the accepted length; GDN state and conv window left after every staged token."""

    def commit(self, n: int) -> None:
        if not 0 < n <= self.staged:
            raise ValueError(f"commit of {n} tokens, but {self.staged} are staged")
        self.recurrent.commit(self.staged, self.staged)  # the staging's buffers hold "after everything"
        self.length += n
        self.staged = 0


class StaleSession(TargetSession):
    """A `TargetSession` whose rollback forgets the GDN layers (the prefill commits everything: unaffected)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state.__class__ = StaleGDNState


def state_error(stale: ModelState, exact: ModelState) -> float:
    diff = (stale.recurrent.state - exact.recurrent.state).norm()
    return float(diff / exact.recurrent.state.norm().clamp_min(1e-30))


@dataclass
class Run:
    diverged_at: int | None  # first generated position that differs from target-only output
    errors: list[float]  # relative recurrent-state error after each round
    agree: list[bool] = field(default_factory=list)  # per round: stale and exact states predict the same top-1
    drafted: int = 0
    accepted: int = 0
    partial_rounds: int = 0  # rounds that rejected at least one draft (the ones that leave the state stale)


def stale_run(model: HybridLM, prompt: list[int], want: list[int], drafter: Drafter, k: int,
              session_cls: type[TargetSession] = StaleSession) -> Run:
    """One greedy generation with `session_cls` (the exact `TargetSession` gives the control)."""
    session = session_cls(model, prompt)
    drafter.start(list(prompt))
    attach(drafter, session)
    shadow = model.new_state(capacity=len(prompt) + 2 * len(want) + 8)
    if len(prompt) > 1:
        model(torch.tensor(prompt[:-1]), shadow)
        shadow.commit(shadow.staged)
    stats, errors, agree, partial = Stats(), [], [], 0
    fed = len(prompt) - 1
    for _ in decode(session, drafter, len(want), k, set(model.config.eos_token_id), stats):
        rnd = session.round
        partial += rnd.committed < len(rnd.drafts)
        new_inputs = session.tokens[fed:-1]  # the inputs this round committed: pending + accepted drafts
        exact_logits, _ = model(torch.tensor(new_inputs), shadow)
        shadow.commit(shadow.staged)
        # the round's first input is the same token on the same history in both: compare their predictions
        stale_logits = model.logits(model.model.norm(rnd.hidden[0]))
        agree.append(bool(stale_logits.argmax() == exact_logits[0].argmax()))
        fed += len(new_inputs)
        errors.append(state_error(session.state, shadow))
    out = session.generated
    diverged = next((i for i, (a, b) in enumerate(zip(out, want)) if a != b), None)
    if diverged is None and len(out) != len(want):
        diverged = min(len(out), len(want))
    return Run(diverged, errors, agree, stats.drafted, stats.accepted, partial)


@dataclass
class Setup:
    model: HybridLM
    prompts: list[list[int]]
    drafters: dict[str, Callable[[], Drafter]] = field(default_factory=dict)


def embedded_setup(n_prompts: int, length: int) -> Setup:
    from benchmarks.speedup import heldout_prompts

    target, draft = load_model(DEFAULT_TARGET), load_model(DEFAULT_DRAFT)
    drafters: dict[str, Callable[[], Drafter]] = {"model": lambda: ModelDrafter(draft),
                                                  "ngram": lambda: make_drafter("ngram", target)}
    if target.mtp:
        head = MTPHead(target)
        drafters["mtp"] = lambda: MTPDrafter(target, head=head)
    return Setup(target, heldout_prompts(n_prompts, length), drafters)


def random_setup(n_prompts: int, length: int, seed: int = 0) -> Setup:
    target = random_model(hf_config(mtp_num_hidden_layers=1), seed=seed)
    target.mtp = random_mtp_weights(target.config, 1, seed=seed + 1)
    draft = random_model(hf_config(hidden_size=32, intermediate_size=64,
                                   layer_types=["linear_attention", "full_attention"]), seed=seed + 2)
    head = MTPHead(target)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (length,), generator=gen).tolist() for _ in range(n_prompts)]
    drafters = {"model": lambda: ModelDrafter(draft), "ngram": lambda: make_drafter("ngram", target),
                "mtp": lambda: MTPDrafter(target, head=head)}
    return Setup(target, prompts, drafters)


def run_study(quick: bool, progress: Callable[[str], None] = lambda s: None) -> dict:
    ks = (2, 4) if quick else (1, 2, 4, 8)
    n_prompts, new_tokens = (3, 48) if quick else (6, 64)
    setups = {"embedded pair": embedded_setup(n_prompts, 64), "random 4-layer": random_setup(n_prompts, 24)}
    rows, curves = [], {}
    for model_name, setup in setups.items():
        wants = [generate(setup.model, p, new_tokens).token_ids for p in setup.prompts]
        for drafter_name, make in setup.drafters.items():
            for k in ks:
                t0 = time.perf_counter()
                runs = [stale_run(setup.model, p, w, make(), k) for p, w in zip(setup.prompts, wants)]
                firsts = [r.diverged_at for r in runs if r.diverged_at is not None]
                rows.append({
                    "model": model_name, "drafter": drafter_name, "k": k, "generations": len(runs),
                    "acceptance": sum(r.accepted for r in runs) / max(1, sum(r.drafted for r in runs)),
                    "partial_round_share": sum(r.partial_rounds for r in runs) / sum(len(r.errors) for r in runs),
                    "diverged_share": len(firsts) / len(runs),
                    "first_divergence_median": statistics.median(firsts) if firsts else None,
                    "first_divergence_min": min(firsts) if firsts else None,
                    "first_divergences": firsts,
                    "top1_agreement": sum(sum(r.agree) for r in runs) / sum(len(r.agree) for r in runs),
                    "error_round1": statistics.median(r.errors[0] for r in runs),
                    "error_final": statistics.median(r.errors[-1] for r in runs),
                })
                curves[(model_name, drafter_name, k)] = [r.errors for r in runs]
                progress(f"{model_name} / {drafter_name} / k={k}: {time.perf_counter() - t0:.1f} s")
    return {"ks": ks, "new_tokens": new_tokens, "rows": rows, "curves": curves}


def plot(study: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, ks = study["rows"], study["ks"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.8), sharey=True, squeeze=False)
    styles = dict(zip(ks, ["-", "--", "-.", ":"]))
    for ax, m in zip(axes[0], models):
        for j, d in enumerate(dict.fromkeys(r["drafter"] for r in rows if r["model"] == m)):
            for r in (r for r in rows if r["model"] == m and r["drafter"] == d):
                n, firsts = r["generations"], r["first_divergences"]
                ts = range(study["new_tokens"] + 1)
                still = [100 * (n - sum(f < t for f in firsts)) / n for t in ts]  # identical through token t-1
                ax.step(ts, still, where="post", color=f"C{j}", ls=styles.get(r["k"], "-"), alpha=0.85,
                        label=f"{d}, k={r['k']}")
        ax.set(title=m, xlabel="generated tokens t", ylim=(-5, 105), xscale="symlog", xlim=(0, study["new_tokens"]))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("generations identical to target-only\nfor their first t tokens (%)")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.suptitle("No GDN rollback: how soon greedy output leaves the target-only output")
    fig.tight_layout()
    paths.append(out_dir / "no_rollback_divergence.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), sharey=True, squeeze=False)
    for ax, m in zip(axes[0], models):
        drafters = list(dict.fromkeys(r["drafter"] for r in rows if r["model"] == m))
        for j, d in enumerate(drafters):
            for r in (r for r in rows if r["model"] == m and r["drafter"] == d):
                xs = [r["k"] + 0.15 * (j - (len(drafters) - 1) / 2)] * len(r["first_divergences"])
                ax.scatter(xs, r["first_divergences"], s=14, color=f"C{j}", alpha=0.7,
                           label=d if r["k"] == ks[0] else None)
        ax.set(title=m, xlabel="draft tokens k", xticks=list(ks), ylim=(-2, study["new_tokens"]))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("first divergent position (0 = first generated token)")
    axes[0][-1].legend(title="drafter")
    fig.suptitle("No GDN rollback: where the output first differs (diverged generations only)")
    fig.tight_layout()
    paths.append(out_dir / "no_rollback_first_divergence.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    k_show = 4 if 4 in ks else ks[-1]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), sharey=True, squeeze=False)
    for ax, m in zip(axes[0], models):
        for j, d in enumerate(dict.fromkeys(r["drafter"] for r in rows if r["model"] == m)):
            runs = study["curves"][(m, d, k_show)]
            for errs in runs:
                ax.plot(range(1, len(errs) + 1), [max(e, 1e-9) for e in errs], color=f"C{j}", alpha=0.15, lw=0.8)
            n = max(len(e) for e in runs)
            med = [statistics.median(e[i] for e in runs if len(e) > i) for i in range(n)]
            ax.plot(range(1, n + 1), [max(e, 1e-9) for e in med], color=f"C{j}", lw=2, label=f"{d} (median)")
        ax.set(title=f"{m}, k={k_show}", xlabel="round", yscale="log")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("||S_stale - S_exact|| / ||S_exact||")
    axes[0][-1].legend(title="drafter", fontsize=8)
    fig.suptitle("No GDN rollback: recurrent-state error over rounds (all GDN layers; floor 1e-9)")
    fig.tight_layout()
    paths.append(out_dir / "no_rollback_state_error.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def print_table(rows: list[dict]) -> None:
    print(f"\n{'model':<15} {'drafter':<7} {'k':>2} {'gens':>4} {'accept':>6} {'partial%':>8} {'diverged%':>9} "
          f"{'1st div med':>11} {'1st div min':>11} {'top1 agree':>10} {'err r1':>8} {'err final':>9}")
    for r in rows:
        med = "-" if r["first_divergence_median"] is None else f"{r['first_divergence_median']:.0f}"
        low = "-" if r["first_divergence_min"] is None else str(r["first_divergence_min"])
        print(f"{r['model']:<15} {r['drafter']:<7} {r['k']:>2} {r['generations']:>4} {r['acceptance']:>6.2f} "
              f"{100 * r['partial_round_share']:>8.1f} {100 * r['diverged_share']:>9.1f} {med:>11} {low:>11} "
              f"{100 * r['top1_agreement']:>9.1f}% {r['error_round1']:>8.2e} {r['error_final']:>9.2e}")


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    study = run_study(args.quick, progress=lambda s: print(s, flush=True) if not args.json else None)
    figures, results = (Path(args.out), Path(args.out)) if args.out else (FIGURES, RESULTS)
    figures.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    paths = plot(study, figures)
    data = {**study, "curves": [{"model": m, "drafter": d, "k": k, "errors": e} for (m, d, k), e in study["curves"].items()]}
    (results / "no_rollback_study.json").write_text(json.dumps(data) + "\n")
    if args.json:
        print(json.dumps({"rows": study["rows"], "plots": [str(p) for p in paths]}))
        return 0
    print_table(study["rows"])
    print("\nplots: " + ", ".join(str(p) for p in paths))
    print(f"[{time.perf_counter() - started:.0f} s]")
    return 0


def replot(path: Path = RESULTS / "no_rollback_study.json", out_dir: Path | None = None) -> list[Path]:
    """Redraw the plots from a saved `no_rollback_study.json` (no model runs): into `out_dir`, by default beside the
    JSON, or docs/figures/ for the one under benchmarks/results/."""
    data = json.loads(Path(path).read_text())
    data["curves"] = {(c["model"], c["drafter"], c["k"]): c["errors"] for c in data["curves"]}
    data["ks"] = tuple(data["ks"])
    default = FIGURES if Path(path).resolve().parent == RESULTS.resolve() else Path(path).parent
    return plot(data, Path(out_dir) if out_dir else default)
