"""The prefix cache on this machine (`deltaspec bench --only prefix`): what a hit saves in time to first token
and in prefilled tokens, and what an entry costs in memory.

Four runs are compared on every request, back to back in an order that rotates (a noisy neighbour slows them
alike): speculation off and on (the draft model, k = 4), each with the cache off and on. Each cached run has
caches of its own (`prefix_cache.attach` on a twin of the target and of the draft that shares their weights), so
one run never finds what another published; the caches are cleared before every repetition. Every path is warmed,
hits included, before timing. Greedy, held-out text (`speedup.heldout_prompts`' files, never trained on):
1. a 1,024-token system prompt, then 32-token user turns, one per request: the first request fills the cache,
   the following ones are measured (hit against miss);
2. prompts under 100 tokens sharing a 64-token prefix, the same way;
3. an 8-turn conversation, each turn's prompt the whole history (prompts, replies, a new 32-token user turn);
   and the same conversation kept in one session continued turn by turn (`TargetSession.extend`, what
   `ExtendSession` runs), against opening a session on the whole history without a cache;
4. a system prompt ending off the GDN-state grid, with a state every block and every `SPARSE_EVERY` blocks
   (`--prefix-cache-state-every`): where each request resumes, its time to first token, the cache's bytes;
then memory per entry and per 1,024-token prefix, measured for the embedded pair and computed for the
Qwen3.5-35B-A3B shape. Cached outputs must equal uncached ones (asserted); the cached positions must not depend
on speculation (an entry holds committed tokens only), so both counts are printed side by side.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import time
from typing import TypeVar
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import report
from benchmarks.generation import spread
from benchmarks.session_memory import QWEN35_35B_A3B
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.drafters import NoDrafter
from deltaspec.shared.decoding.speculative import Stats, decode, generate
from deltaspec.shared.decoding.target import TargetSession
from deltaspec.shared.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.state import prefix_cache
from deltaspec.shared.state.prefix_cache import Cursor, PrefixCache

BLOCK = 16  # tokens per cache entry
NUM_DRAFT_TOKENS = 4
T = TypeVar("T")
SUFFIXES = (16, 21, 26, 31, 35)  # short prompts' own tokens after the shared prefix, in turn (64 + 35 < 100)


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the full one, `QUICK`, or a test's tiny one."""

    system_tokens: int = 1024
    turn_tokens: int = 32
    requests: int = 6  # measured requests after the one that fills the cache
    short_prefix: int = 64
    short_requests: int = 6
    turns: int = 8
    reply_tokens: int = 64
    new_tokens: int = 16  # per request of scenarios 1 and 2: enough for a few rounds, TTFT being the figure
    repeats: int = 5
    block: int = BLOCK


QUICK = Plan(requests=3, short_requests=3, reply_tokens=32, repeats=2)
TINY = Plan(system_tokens=64, turn_tokens=16, requests=2, short_prefix=32, short_requests=1, turns=3, reply_tokens=8,
            new_tokens=6, repeats=1)  # seconds: the smoke test's


@dataclass
class Side:
    """One of the compared runs: speculation on or off, the cache on or off (its models then have their own)."""

    spec: bool
    cache: bool
    target: HybridLM
    draft: HybridLM

    @property
    def name(self) -> str:
        return side_name(self.spec, self.cache)

    def caches(self) -> list[PrefixCache]:
        models = (self.target, self.draft) if self.spec else (self.target,)
        return [c for c in (getattr(m, "prefix_cache", None) for m in models) if c is not None]

    def run(self, prompt: list[int], new_tokens: int) -> dict:
        """One generation: its TTFT, the target's prefilled and cached positions, the draft's cached ones."""
        target_cache = getattr(self.target, "prefix_cache", None)
        draft_cache = getattr(self.draft, "prefix_cache", None) if self.spec else None
        before = [(c.stats.cached_tokens, c.stats.prefilled_tokens) if c else (0, 0)
                  for c in (target_cache, draft_cache)]
        drafter = ModelDrafter(self.draft) if self.spec else None
        g = generate(self.target, prompt, new_tokens, drafter, NUM_DRAFT_TOKENS)
        cached = target_cache.stats.cached_tokens - before[0][0] if target_cache else 0
        prefilled = target_cache.stats.prefilled_tokens - before[0][1] if target_cache else len(prompt) - 1
        return {"ttft": g.stats.first_token_seconds, "prefill": g.stats.prefill_seconds, "prompt": len(prompt),
                "prefilled": prefilled, "cached": cached,
                "draft_cached": draft_cache.stats.cached_tokens - before[1][0] if draft_cache else 0,
                "tokens": g.token_ids}


def side_name(spec: bool, cache: bool) -> str:
    return f"spec {'on' if spec else 'off'}, cache {'on' if cache else 'off'}"


def make_sides(block: int, target_dir: Path = DEFAULT_TARGET, draft_dir: Path = DEFAULT_DRAFT) -> list[Side]:
    """The four runs, on one target and one draft: each cached run sees them through a twin of its own (the same
    weights, shared, with its own prefix cache), so caches stay apart while every run reads the same weights from
    the same memory (models of their own gave the cached runs colder processor caches than the uncached ones)."""
    target, draft = load_model(target_dir).fuse(), load_model(draft_dir).fuse()
    sides = []
    for spec in (False, True):
        cached_target = with_own_cache(target, block)
        cached_draft = with_own_cache(draft, block) if spec else draft  # the draft resumes from its own cache too
        sides += [Side(spec, False, target, draft), Side(spec, True, cached_target, cached_draft)]
    return sides


def with_own_cache(model: HybridLM, block: int, state_every: int = 1) -> HybridLM:
    """`model` under another name, its weights shared, with a prefix cache of its own."""
    twin = copy.copy(model)
    prefix_cache.attach(twin, block, state_every=state_every)
    return twin


def heldout_stream() -> list[int]:
    """The held-out files (never trained on) one after another, as byte-level token ids."""
    stdlib = Path(os.__file__).parent
    names = [n.strip() for n in report.HELDOUT_LIST.read_text().splitlines() if n.strip() and not n.startswith("#")]
    return [b for name in names if (stdlib / name).exists() for b in (stdlib / name).read_bytes()]


class Text:
    """Consecutive, non-overlapping slices of held-out text, so every user turn differs."""

    def __init__(self) -> None:
        self.ids, self.at = heldout_stream(), 0

    def take(self, n: int) -> list[int]:
        if self.at + n > len(self.ids):
            raise ValueError(f"the held-out files hold {len(self.ids)} tokens, fewer than the bench needs")
        self.at += n
        return self.ids[self.at - n:self.at]


def rotated(items: list[T], turn: int) -> list[T]:
    return items[turn % len(items):] + items[:turn % len(items)]


def clear(sides: list[Side]) -> None:
    for side in sides:
        for cache in side.caches():
            cache.clear()


def check_same(runs: dict[str, dict], where: str) -> None:
    for spec in (False, True):
        off, on = runs[side_name(spec, False)]["tokens"], runs[side_name(spec, True)]["tokens"]
        assert on == off, f"{where}, speculation {'on' if spec else 'off'}: cache on {on} != cache off {off}"


def warm(sides: list[Side], text: list[int], new_tokens: int) -> None:
    """Every path once on a miss and once on a hit, then empty caches."""
    for ids in (text, text, text[:-8]):
        for side in sides:
            side.run(ids, new_tokens)
    clear(sides)


def shared_prefix(sides: list[Side], prefix: list[int], suffixes: list[list[int]], new_tokens: int,
                  repeats: int) -> list[list[dict[str, dict]]]:
    """Per repetition, per request (the first fills the cache): each side's run of `prefix + suffix`."""
    out = []
    for rep in range(repeats):
        clear(sides)
        reqs = []
        for i, suffix in enumerate(suffixes):
            runs = {s.name: s.run(prefix + suffix, new_tokens) for s in rotated(sides, rep + i)}
            check_same(runs, f"request {i}")
            reqs.append(runs)
        out.append(reqs)
    return out


def conversation(sides: list[Side], user_turns: list[list[int]], reply_tokens: int,
                 repeats: int) -> list[list[dict[str, dict]]]:
    """Per repetition, per turn: each side's run of its own history (prompts and replies) plus the next user turn;
    and ("extended") the same conversation kept in one session of the uncached target, continued turn by turn."""
    out = []
    target = next(s.target for s in sides if not s.cache)
    for rep in range(repeats):
        clear(sides)
        history: dict[str, list[int]] = {s.name: [] for s in sides}
        turns, session = [], None
        for t, user in enumerate(user_turns):
            runs = {}
            for s in rotated(sides, rep + t):
                runs[s.name] = s.run(history[s.name] + user, reply_tokens)
                history[s.name] += user + runs[s.name]["tokens"]
            check_same(runs, f"turn {t + 1}")
            session, runs["extended"] = continued(session, target, user, reply_tokens)
            turns.append(runs)
        out.append(turns)
    return out


def continued(session: TargetSession | None, target: HybridLM, user: list[int],
              reply_tokens: int) -> tuple[TargetSession, dict]:
    """One turn of a conversation kept in one session, target only: opened on the first user turn, then continued
    with each next one by `TargetSession.extend` (what `ExtendSession` runs), which prefills only that turn on the
    committed head; the turn's prefill (opening or extending) and first-token times, and its reply."""
    started = time.perf_counter()
    if session is None:
        session = TargetSession(target, user)
    else:
        session.extend(user)
    prefill, first = time.perf_counter() - started, None
    before = len(session.generated)
    for _ in decode(session, NoDrafter(), before + reply_tokens, 0, set(target.config.eos_token_id), Stats()):
        first = first or time.perf_counter() - started
    return session, {"prefill": prefill, "ttft": first, "tokens": session.generated[before:]}


def extended_rows(runs: list[list[dict[str, dict]]]) -> list[dict]:
    """Per turn: the session continued against opening one on the whole history without a cache (speculation off):
    prefill and TTFT ratios, and whether its replies were the same."""
    cold = side_name(False, False)
    return [{"turn": t + 1,
             "prefill_ms": spread([1000 * rep[t]["extended"]["prefill"] for rep in runs]),
             "prefill_ratio": spread([rep[t]["extended"]["prefill"] / rep[t][cold]["prefill"] for rep in runs]),
             "ratio": spread([rep[t]["extended"]["ttft"] / rep[t][cold]["ttft"] for rep in runs]),
             "same_replies": all(rep[t]["extended"]["tokens"] == rep[t][cold]["tokens"] for rep in runs)}
            for t in range(len(runs[0]))]


def rows(runs: list[list[dict[str, dict]]], requests: range) -> list[dict]:
    """Per speculation mode: the figures of `requests` over all repetitions, cache off against on."""
    out = []
    for spec in (False, True):
        pairs = [(rep[i][side_name(spec, False)], rep[i][side_name(spec, True)]) for rep in runs for i in requests]
        offs, ons = [off for off, _ in pairs], [on for _, on in pairs]

        def median(runs_: list[dict], field: str) -> float:
            return spread([float(r[field]) for r in runs_])["median"]

        out.append({"spec": spec, "prompt": median(offs, "prompt"), "prefill_off": median(offs, "prefilled"),
                    "prefill_on": median(ons, "prefilled"), "cached": median(ons, "cached"),
                    "draft_cached": median(ons, "draft_cached"), "cached_total": sum(on["cached"] for on in ons),
                    "ttft_off_ms": spread([1000 * off["ttft"] for off in offs]),
                    "ttft_on_ms": spread([1000 * on["ttft"] for on in ons]),
                    "ratio": spread([on["ttft"] / off["ttft"] for off, on in pairs]),
                    "prefill_ratio": spread([on["prefill"] / off["prefill"] for off, on in pairs]),
                    "same_as_spec_off": all(rep[i][side_name(spec, c)]["tokens"] == rep[i][side_name(False, c)][
                        "tokens"] for rep in runs for i in requests for c in (False, True))})
    return out


def entry_bytes(cfg: ModelConfig, dtype: torch.dtype, block: int) -> dict:
    """Computed: an entry's GDN conv windows and states at its end, and its positions' K/V."""
    shapes = cfg.state_spec.recurrent_buffers(dtype)
    gdn = sum(torch.Size(shape).numel() * kind.itemsize for shape, kind in (shapes["conv"], shapes["state"]))
    return {"gdn": gdn, "kv": block * cfg.state_spec.kv_bytes_per_position(dtype)}


def measured_prefix(model: HybridLM, ids: list[int]) -> tuple[int, int, int]:
    """Bytes, entries and GDN states of the cache after one sequence prefilled `ids` from an empty cache."""
    cache: PrefixCache = model.prefix_cache  # type: ignore[assignment]
    cache.clear()
    Cursor(cache, model.new_state(capacity=2 * len(ids))).prefill(model, ids)
    nbytes, entries, states = cache.bytes, len(cache.entries), cache.states()
    cache.clear()
    return nbytes, entries, states


def states_kept(tokens: int, block: int, every: int) -> int:
    """GDN states a cache keeps for one sequence of `tokens` cached positions: one every `every` blocks and its
    last block's."""
    entries = tokens // block
    return entries // every + bool(entries % every)


SPARSE_EVERY = 16  # the sparse rows' blocks between GDN states


def memory(sides: list[Side], sparse: HybridLM, system: list[int], block: int) -> list[dict]:
    """Bytes per entry and per `len(system)`-token prefix, with a GDN state every block and every `SPARSE_EVERY`
    (`sparse`: the target with such a cache): measured for the embedded pair (and checked against the computed
    size), computed for the Qwen3.5-35B-A3B shape at a few block sizes."""
    cached = next(s for s in sides if s.spec and s.cache)
    out = []
    for name, model, every in (("embedded target", cached.target, 1), ("embedded target", sparse, SPARSE_EVERY),
                               ("embedded draft", cached.draft, 1)):
        if getattr(model, "prefix_cache", None) is None:
            continue
        nbytes, entries, states = measured_prefix(model, system)
        parts = entry_bytes(model.config, model.dtype, block)
        assert states == states_kept(len(system), block, every), f"{name}: {states} states, not as computed"
        assert nbytes == entries * parts["kv"] + states * parts["gdn"], f"{name}: {nbytes} B, not as computed"
        out.append({"model": name, "dtype": str(model.dtype).removeprefix("torch."), "block": block, "every": every,
                    "entries": entries, "states": states, "how": "measured", **parts, "prefix": nbytes})
    cfg = ModelConfig.from_dict(QWEN35_35B_A3B)
    for size, every in sorted({(block, 1), (block, SPARSE_EVERY), (64, 1), (256, 1)}):
        parts = entry_bytes(cfg, torch.bfloat16, size)
        entries, states = len(system) // size, states_kept(len(system), size, every)
        out.append({"model": "Qwen3.5-35B-A3B shape", "dtype": "bfloat16", "block": size, "every": every,
                    "entries": entries, "states": states, "how": "computed", **parts,
                    "prefix": entries * parts["kv"] + states * parts["gdn"]})
    return out


def sparse_states(sides: list[Side], sparse: HybridLM, system: list[int], turns: list[list[int]], new_tokens: int,
                  repeats: int, block: int) -> dict:
    """Scenario 4, speculation off: per request (the first fills the cache), the positions each cache served and
    the time to first token against no cache, with a GDN state every block and every `SPARSE_EVERY` blocks
    (`sparse`: the target with such a cache); the caches' bytes after the last request."""
    cold = next(s for s in sides if not s.spec and not s.cache)
    runs = {"no cache": cold, "every block": next(s for s in sides if not s.spec and s.cache),
            f"every {SPARSE_EVERY}": Side(False, True, sparse, cold.draft)}
    per_request: list[list[dict[str, dict]]] = [[] for _ in turns]
    nbytes: dict[str, list[int]] = {name: [] for name in runs}
    for rep in range(repeats):
        clear(list(runs.values()))
        for i, turn in enumerate(turns):
            got = {name: runs[name].run(system + turn, new_tokens) for name in rotated(list(runs), rep + i)}
            assert len({tuple(g["tokens"]) for g in got.values()}) == 1, f"request {i}: outputs differ"
            per_request[i].append(got)
        for name, side in runs.items():
            nbytes[name].append(side.target.prefix_cache.bytes if side.cache else 0)
    rows_ = [{"request": i + 1,
              **{name: {"cached": spread([float(g[name]["cached"]) for g in reqs])["median"],
                        "ttft_ms": spread([1000 * g[name]["ttft"] for g in reqs]),
                        "ratio": spread([g[name]["ttft"] / g["no cache"]["ttft"] for g in reqs])} for name in runs}}
             for i, reqs in enumerate(per_request)]
    return {"system_tokens": len(system), "grid": block * SPARSE_EVERY, "names": list(runs), "rows": rows_,
            "bytes": {name: max(b) for name, b in nbytes.items()}}


def prefix(quick: bool = False, command: str = "deltaspec bench --only prefix", plan: Plan | None = None,
           target_dir: Path = DEFAULT_TARGET, draft_dir: Path = DEFAULT_DRAFT) -> dict:
    started = time.time()
    plan = plan or (QUICK if quick else Plan())
    sides = make_sides(plan.block, target_dir, draft_dir)
    text = Text()
    system = text.take(plan.system_tokens)
    turns = [text.take(plan.turn_tokens) for _ in range(plan.requests + 1)]
    short = text.take(plan.short_prefix)
    suffixes = [text.take(SUFFIXES[i % len(SUFFIXES)]) for i in range(plan.short_requests + 1)]
    chat = [text.take(plan.turn_tokens) for _ in range(plan.turns)]
    warm(sides, system[:2 * plan.block] + turns[0], plan.new_tokens)
    system_runs = shared_prefix(sides, system, turns, plan.new_tokens, plan.repeats)
    short_runs = shared_prefix(sides, short, suffixes, plan.new_tokens, plan.repeats)
    chat_runs = conversation(sides, chat, plan.reply_tokens, plan.repeats)
    off_grid = system[:plan.system_tokens - 3 * plan.block // 2]  # ends off every grid: not a block's end either
    sparse_target = with_own_cache(next(s for s in sides if not s.cache).target, plan.block, SPARSE_EVERY)
    sparse = sparse_states(sides, sparse_target, off_grid, turns, plan.new_tokens, plan.repeats, plan.block)
    return {"plan": plan.__dict__, "system": rows(system_runs, range(1, len(turns))),
            "system_filling": rows(system_runs, range(1)), "short": rows(short_runs, range(1, len(suffixes))),
            "conversation": [{"turn": t + 1, **r} for t in range(plan.turns) for r in rows(chat_runs, range(t, t + 1))],
            "extended": extended_rows(chat_runs), "sparse": sparse,
            "memory": memory(sides, sparse_target, system, plan.block), "seconds": time.time() - started,
            "header": report.header(command, started)}


def _cell(s: dict, digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def _print_table(rows_: list[dict], turn: bool = False) -> None:
    print(f"{'turn ' if turn else ''}{'spec':<4} {'prompt':>6} {'prefill off':>11} {'on':>5} {'cached T/D':>10} "
          f"{'TTFT off ms':>21} {'TTFT on ms':>19} {'on/off':>18}")
    for r in rows_:
        draft = f"{r['draft_cached']:.0f}" if r["spec"] else "-"
        print(f"{r['turn']:>4} " if turn else "", end="")
        print(f"{'on' if r['spec'] else 'off':<4} {r['prompt']:>6.0f} {r['prefill_off']:>11.0f} "
              f"{r['prefill_on']:>5.0f} {r['cached']:>5.0f}/{draft:<4} {_cell(r['ttft_off_ms']):>21} "
              f"{_cell(r['ttft_on_ms']):>19} {_cell(r['ratio'], 3):>18}")


def _equal_counts(rows_: list[dict]) -> str:
    off, on = (sum(r["cached_total"] for r in rows_ if r["spec"] == s) for s in (False, True))
    same = all(r["same_as_spec_off"] for r in rows_)
    return (f"cached target positions, speculation off / on: {off} / {on} ({'equal' if off == on else 'DIFFERENT'}); "
            f"outputs cache on = off: yes (asserted); speculation on = off: {'yes' if same else 'NO'}")


def print_rows(result: dict) -> None:
    p = result["plan"]
    reps = p["repeats"]
    print(f"\n{result['header']}")
    print(f"Prefix cache, embedded pair (greedy, held-out text, block {p['block']} tokens; spec on: draft model, "
          f"k = {NUM_DRAFT_TOKENS}; cache on/off runs alternated, warmed; median [min-max]; cached T/D: positions "
          f"the target / draft took from their caches; {result['seconds']:.0f} s)")
    print(f"\n1. {p['system_tokens']}-token system prompt + {p['turn_tokens']}-token user turns, {p['new_tokens']} new "
          f"tokens: {p['requests']} requests after the one filling the cache x {reps} runs (goal: hit <= 0.2x miss)")
    _print_table(result["system"])
    fill = "; ".join(f"spec {'on' if r['spec'] else 'off'} {_cell(r['ratio'], 2)}" for r in result["system_filling"])
    print(f"the filling request (a miss that publishes every block), cache on / off TTFT: {fill}")
    print(_equal_counts(result["system"]))
    print(f"\n2. Prompts of {p['short_prefix'] + min(SUFFIXES)}-{p['short_prefix'] + max(SUFFIXES)} tokens sharing a "
          f"{p['short_prefix']}-token prefix: {p['short_requests']} requests after the first x {reps} runs")
    _print_table(result["short"])
    print(_equal_counts(result["short"]))
    print(f"\n3. {p['turns']}-turn conversation ({p['turn_tokens']}-token user turns, {p['reply_tokens']}-token "
          f"replies; each prompt the whole history) x {reps} runs (goal: last turn <= 0.1x its cold prefill)")
    _print_table(sorted(result["conversation"], key=lambda r: (r["spec"], r["turn"])), turn=True)
    print(_equal_counts(result["conversation"]))
    for r in result["conversation"]:
        if r["turn"] == p["turns"]:
            print(f"last turn, spec {'on' if r['spec'] else 'off'}: prefill (opening the target session) "
                  f"{_cell(r['prefill_ratio'], 3)} x the cold one's, TTFT {_cell(r['ratio'], 3)} x "
                  f"({r['prefill_on']:.0f} of {r['prompt']:.0f} positions prefilled)")
    print(f"\n3b. The same conversation kept in one session of the target, continued each turn by extending it "
          f"(ExtendSession's engine call: only the turn is prefilled), against opening a session on the whole history "
          f"without a cache, speculation off, x {reps} runs")
    print(f"{'turn':>4} {'prefill ms':>19} {'prefill x cold':>20} {'TTFT x cold':>20} {'same replies':>12}")
    for r in result.get("extended", []):
        print(f"{r['turn']:>4} {_cell(r['prefill_ms']):>19} {_cell(r['prefill_ratio'], 3):>20} "
              f"{_cell(r['ratio'], 3):>20} {'yes' if r['same_replies'] else 'NO':>12}")
    sp = result["sparse"]
    names = sp["names"]
    print(f"\n4. GDN states every block and every {SPARSE_EVERY} blocks (a {sp['grid']}-token grid, leaves and "
          f"branch points): a {sp['system_tokens']}-token system prompt + {p['turn_tokens']}-token user turns, "
          f"speculation off, x {reps} runs; cached positions and TTFT ms (x no cache's)")
    print(f"{'request':>7} " + " ".join(f"{name:>34}" for name in names))
    for r in sp["rows"]:
        cells = [f"{r[n]['cached']:>5.0f} {_cell(r[n]['ttft_ms'])} {r[n]['ratio']['median']:>5.2f}x" for n in names]
        print(f"{r['request']:>7} " + " ".join(f"{c:>34}" for c in cells))
    print("cache bytes after the last request: " + ", ".join(
        f"{n} {sp['bytes'][n] / 2**20:.2f} MiB" for n in names if n != "no cache") + "; outputs identical (asserted)")
    print(f"\nMemory per cached prefix (an entry: its block's K/V, and where it keeps one, the GDN conv windows and "
          f"states at its end: every `every` blocks and at the last; a {p['system_tokens']}-token prefix is "
          f"{p['system_tokens']} // block entries)")
    print(f"{'model':<22} {'dtype':<9} {'block':>5} {'every':>5} {'GDN KiB':>9} {'K/V KiB':>8} {'entries':>7} "
          f"{'states':>6} {'prefix MiB':>10} {'K/V alone':>9} how")
    for m in result["memory"]:
        kv_only = m["entries"] * m["kv"] / 2**20
        print(f"{m['model']:<22} {m['dtype']:<9} {m['block']:>5} {m['every']:>5} {m['gdn'] / 2**10:>9.1f} "
              f"{m['kv'] / 2**10:>8.1f} {m['entries']:>7} {m['states']:>6} {m['prefix'] / 2**20:>10.2f} "
              f"{kv_only:>9.2f} {m['how'] + (' (= computed)' if m['how'] == 'measured' else '')}")


def save(result: dict, results: Path = report.RESULTS) -> None:
    """benchmarks/results/prefix_cache.txt: the table as printed."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_rows(result)
    results.mkdir(parents=True, exist_ok=True)
    (results / "prefix_cache.txt").write_text(text.getvalue().lstrip("\n"))
