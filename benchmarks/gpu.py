"""The GPU section of `deltaspec bench` (`--only gpu`): Qwen3.5 shapes at their real sizes, random weights, against
the floor the memory bandwidth sets, HF transformers, and many sessions at once.

For each shape in `SHAPES` (Qwen3.5-9B, 0.8B, 27B and 35B-A3B; `benchmarks.shapes` says where each one's
numbers come from) whose weights and a margin fit the free device memory (else skipped, saying why):
- ms per pass at batch 1 after `Plan.context` positions: a decode step (T = 1) and a verify of k+1 tokens
  (k = 1..8), against its floor: the bytes the pass must move (`pass_bytes`: the weights, of which the embedding
  table gives only T rows and a MoE block only the experts the pass routed to; each GDN layer's state and conv
  window read and written and its round logs written; attention K/V read at every position and written at the new
  ones) over the bandwidth a large device-to-device copy reaches in the same run;
- the GDN state bytes a round moves per sequence (`gdn_round_bytes`, from the config);
- our target-only decoding against HF transformers' `generate()` on the same weights (HF's model built on the meta
  device and pointed at our tensors, so no second copy), one sequence; without transformers the row says so;
- many sessions at once (up to 256, or as many as fit): aggregate tokens/s target-only, with speculation at k = 2 and
  4 with accept counts drawn at 0.6 and 0.8 (`benchmarks.rounds`: a round's cost is measured, not
  acceptance), and at the k the cost model (`draft_length.best_k`) picks from this batch's measured pass costs; the
  draft a small random model (Qwen3.5-0.8B's widths, two layers) on the same device.
The goals of issue 31 are printed beside the figures, not asserted. Every path is warmed before it is timed; the
section starts no new shape or batch once its time budget is spent, and says what it left out. It runs on the CPU
too, at tiny shapes (`tests/test_bench_gpu.py`), with the wall clock where CUDA events are missing.
"""
from __future__ import annotations

import copy
import gc
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import torch

from benchmarks.moe_passes import break_even
from benchmarks.rounds import (PREFIX, Stopwatch, draft_model, drawn_rounds, pass_times, random_model_on,
                               sessions, target_only, tokens_per_s)
from benchmarks.shapes import DRAFT_08B_2L, QWEN35_08B, QWEN35_9B, QWEN35_27B, QWEN35_35B_A3B
from deltaspec.shared.decoding.draft_length import PassCosts, best_k
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.captured import covers_experts
from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.state.pool import mib
from deltaspec.shared.state.spec import LOG_CAPACITY

SHAPES = [("Qwen3.5-9B", QWEN35_9B), ("Qwen3.5-0.8B", QWEN35_08B), ("Qwen3.5-27B", QWEN35_27B),
          ("Qwen3.5-35B-A3B", QWEN35_35B_A3B)]  # the goals' shape first: the budget may not reach the last
VERIFY_KS = tuple(range(1, 9))
KS = (2, 4)
ALPHAS = (0.6, 0.8)
GIB = 2**30
MARGIN = 4 * GIB  # beyond a shape's weights: batch-1 states, activations, logits, HF's cache
RESERVE = 2 * GIB  # kept free when deciding how many sessions fit
GOALS = {"decode_x_floor": 1.3, "verify5_vs_decode": 1.15, "speedup_k4_a08": 1.5}


@dataclass(frozen=True)
class Plan:
    batches: tuple[int, ...]
    repeats: int  # timed repeats of each batch-1 pass and of HF's and our generation
    batch_repeats: int  # of each pass at a batch, for the cost model
    cost_k_max: int  # the cost model chooses k in 0..cost_k_max
    context: int  # positions before the batch-1 passes
    tokens: int  # a batch run produces max(min_tokens, tokens // batch) tokens per session
    min_tokens: int
    hf_tokens: int  # new tokens of each generation against HF
    copy_mib: int  # size of the copied buffer that measures bandwidth
    budget_s: float  # no new shape or batch starts after this
    divergence_prompts: int  # greedy speculation against target-only in the shape's dtype, on the shape named
    divergence_tokens: int
    divergence_shape: str = "Qwen3.5-0.8B"


QUICK = Plan(batches=(1, 16, 64, 256), repeats=3, batch_repeats=1, cost_k_max=4, context=512, tokens=96,
             min_tokens=8, hf_tokens=24, copy_mib=1024, budget_s=150, divergence_prompts=16, divergence_tokens=128)
FULL = Plan(batches=(1, 4, 16, 64, 128, 256), repeats=7, batch_repeats=2, cost_k_max=8, context=2048, tokens=256,
            min_tokens=16, hf_tokens=64, copy_mib=2048, budget_s=180, divergence_prompts=64, divergence_tokens=256)


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attempt(what: str, fn: Callable[[], dict]) -> dict:
    """fn's result, or its error (traceback on stderr): a shape that runs out of memory, or an HF class this
    transformers lacks, costs its own rows, not the run's other figures."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported in the row and on stderr
        traceback.print_exc(file=sys.stderr)
        return {"error": f"{what}: {type(e).__name__}: {e}"}
    finally:
        release()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.machine()}, {torch.get_num_threads()} torch threads)"


def free_bytes(device: torch.device) -> int | None:
    """Device memory free, counting what torch's allocator holds cached but unused; None off CUDA."""
    if device.type != "cuda":
        return None
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return torch.cuda.mem_get_info(device)[0] + cached


def copy_bandwidth(device: torch.device, mib: int, repeats: int, watch: Stopwatch) -> dict:
    """GB/s of a device-to-device copy of `mib` MiB, counting the bytes read and the bytes written."""
    src = torch.ones(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    dst.copy_(src)  # warm-up
    rates = []
    for _ in range(repeats):
        watch.start()
        dst.copy_(src)
        rates.append(2 * src.nbytes / watch.stop() / 1e9)
    return {"gb_s": statistics.median(rates), "gb_s_min": min(rates), "gb_s_max": max(rates), "mib": mib}


def shape_config(config: dict) -> dict:
    """No end of sequence: ours and HF's generate every token asked for."""
    return {**config, "eos_token_id": None}


def weight_bytes(model: HybridLM, tokens: int, experts: float) -> int:
    """Weight bytes a pass of `tokens` tokens reads: every parameter once, but of an untied embedding table only its
    T rows, and of each sparse layer's routed experts only `experts` (a tied table is read whole, as the LM head)."""
    embed, total = model.model.embed_tokens.weight, 0
    for name, p in model.named_parameters():  # a tied LM head is named once, as the table
        if ".experts." in name:
            total += round(experts * p.nbytes / p.shape[0])
        elif p is embed and not model.config.tie_word_embeddings:
            total += tokens * p[0].nbytes
        else:
            total += p.nbytes
    return total


def recurrent_bytes_by_buffer(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of each of a sequence's GDN buffers, every GDN layer together; a log's hold `LOG_CAPACITY` tokens."""
    buffers = cfg.state_spec.recurrent_buffers(dtype)
    return {name: torch.Size(shape).numel() * kind.itemsize for name, (shape, kind) in buffers.items()}


def gdn_pass_bytes(cfg: ModelConfig, dtype: torch.dtype, tokens: int) -> dict[str, int]:
    """What a pass of `tokens` tokens moves of every GDN layer's state: the state and conv window read, the state
    after and the window written, and the round logs written (when the tokens fit them)."""
    size = recurrent_bytes_by_buffer(cfg, dtype)
    head = size["state"] + size["conv"]
    per_token = sum(size[name] for name in ("x", "k", "delta", "g")) // LOG_CAPACITY
    return {"read": head, "written": head, "logs": tokens * per_token if tokens <= LOG_CAPACITY else 0}


def gdn_round_bytes(cfg: ModelConfig, dtype: torch.dtype, k: int) -> dict[str, int]:
    """GDN bytes one sequence moves in a round of k drafts: the verify pass of k+1 tokens, then a partial commit of
    k tokens (the most a partial commit keeps; a full accept swaps pointers and moves nothing), which reads the head's
    state and window and the k tokens' logged keys, corrections and decays, and writes the new state and window."""
    verify, size = gdn_pass_bytes(cfg, dtype, k + 1), recurrent_bytes_by_buffer(cfg, dtype)
    head = size["state"] + size["conv"]
    logged = k * sum(size[name] for name in ("k", "delta", "g")) // LOG_CAPACITY
    return {"k": k, "pass_read": verify["read"], "pass_written": verify["written"], "logs_written": verify["logs"],
            "commit_read": head + logged, "commit_written": head}


def pass_bytes(model: HybridLM, tokens: int, context: int, experts: float) -> dict[str, int]:
    """Bytes a pass of `tokens` tokens after `context` positions must move: weights, GDN states, attention K/V."""
    gdn = gdn_pass_bytes(model.config, model.dtype, tokens)
    per_position = model.config.state_spec.kv_bytes_per_position(model.dtype)
    return {"weights": weight_bytes(model, tokens, experts), "gdn": gdn["read"] + gdn["written"] + gdn["logs"],
            "kv": (context + 2 * tokens) * per_position}  # read up to the last new position, the new ones written


def model_bytes(config: dict, dtype: torch.dtype) -> int:
    with torch.device("meta"):
        model = HybridLM(ModelConfig.from_dict(config)).to(dtype)
    return sum(p.nbytes for p in model.parameters())


def describe(model: HybridLM) -> dict:
    cfg = model.config
    out = {"layers": cfg.num_hidden_layers, "gdn_layers": cfg.layer_types.count("linear_attention"),
           "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
           "heads": f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}x{cfg.head_dim}",
           "gdn_heads": f"{cfg.linear_num_key_heads}/{cfg.linear_num_value_heads}x{cfg.linear_key_head_dim}",
           "tied": cfg.tie_word_embeddings, "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
           "weights_gib": sum(p.nbytes for p in model.parameters()) / GIB}
    if cfg.num_experts:
        out["experts"] = (f"{cfg.num_experts} top-{cfg.num_experts_per_tok} x{cfg.moe_intermediate_size}, shared "
                          f"x{cfg.shared_expert_intermediate_size}")
    return out


def batch1_passes(model: HybridLM, draft: HybridLM, plan: Plan, bandwidth: float, watch: Stopwatch) -> dict:
    """Decode and verify(k+1) at batch 1 after `plan.context` positions, each against its floor; the draft's step."""
    gen = torch.Generator().manual_seed(0)
    states = sessions(model, 1, gen, capacity=plan.context + 16, prefix=plan.context)
    lengths = (1, *(k + 1 for k in VERIFY_KS))
    times = pass_times(model, draft, states, sessions(draft, 1, gen), lengths, plan.repeats, gen, watch)
    rows = []
    for T in lengths:
        ms = [1000 * s for s in times.seconds[T]]
        experts = statistics.mean(times.experts[T])
        moved = pass_bytes(model, T, plan.context, experts)
        floor_ms = 1000 * sum(moved.values()) / (bandwidth * 1e9)
        rows.append({"tokens": T, "ms": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
                     "vs_decode": times.median(T) / times.median(1), "experts": experts, "bytes": moved,
                     "floor_ms": floor_ms, "x_floor": statistics.median(ms) / floor_ms})
    if covers_experts(model):
        model.capture()  # the same passes replayed as CUDA graphs
        try:
            graphs = pass_times(model, draft, states, sessions(draft, 1, gen), lengths, plan.repeats, gen, watch)
        finally:
            model.capture(False)
        for row in rows:
            ms = statistics.median(1000 * s for s in graphs.seconds[row["tokens"]])
            row.update(captured_ms=ms, captured_x_floor=ms / row["floor_ms"],
                       captured_vs_decode=graphs.median(row["tokens"]) / graphs.median(1))
    draft_ms = 1000 * statistics.median(times.draft_seconds)
    decode = rows[0]
    for row in rows[1:]:  # the acceptance at which a round of k drafts pays: measured (the fastest path), and at
        k = row["tokens"] - 1  # the floor with a free draft (what no kernel beats at these bytes)
        path = "captured_" if "captured_ms" in row else ""
        row["break_even"] = break_even(k, row[f"{path}vs_decode"], draft_ms / decode[f"{path}ms"])
        row["floor_break_even"] = break_even(k, row["floor_ms"] / decode["floor_ms"], 0.0)
    return {"context": plan.context, "rows": rows, "draft_step_ms": draft_ms}


def hf_twin(model: HybridLM, transformers) -> torch.nn.Module:
    """HF's class for our config (its `architectures`), built on the meta device and pointed at our tensors: our
    state_dict keys are HF's, so the same weights, in the same memory."""
    cls = getattr(transformers, model.config.raw["architectures"][0])
    config = cls.config_class(**model.config.raw)
    with torch.device("meta"):
        hf = cls(config)
    hf.load_state_dict(model.state_dict(), strict=True, assign=True)
    with torch.device(model.device):  # its rotary table is a buffer, not a weight: made afresh where it runs
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config)
    return hf.eval()


def versus_hf(model: HybridLM, plan: Plan, watch: Stopwatch) -> dict:
    """Our target-only decoding against HF `generate()` on the same weights, one sequence, greedy."""
    try:
        import transformers
    except ImportError as e:
        return {"error": f"transformers is not importable ({e}): no HF row"}
    hf = hf_twin(model, transformers)
    prompt = torch.randint(0, model.config.vocab_size, (PREFIX,), generator=torch.Generator().manual_seed(3)).tolist()
    ids = torch.tensor([prompt], device=model.device)

    def theirs(n: int) -> list[int]:
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        return out[0, PREFIX:].tolist()

    captured = copy.copy(model).capture(covers_experts(model))  # the same weights, passes as CUDA graphs
    for run in (model, captured):
        generate(run, prompt, plan.hf_tokens)  # warm-up (and the graphs recorded)
    theirs(4)
    ours_s, graphs_s, hf_s = [], [], []
    for _ in range(plan.repeats):
        watch.start()
        got = generate(model, prompt, plan.hf_tokens).token_ids
        ours_s.append(watch.stop())
        watch.start()
        replayed = generate(captured, prompt, plan.hf_tokens).token_ids
        graphs_s.append(watch.stop())
        watch.start()
        want = theirs(plan.hf_tokens)
        hf_s.append(watch.stop())
    ratios = [h / o for o, h in zip(ours_s, hf_s)]
    n = plan.hf_tokens
    return {"transformers": transformers.__version__, "tokens": n, "ours_tok_s": n / statistics.median(ours_s),
            "captured_tok_s": n / statistics.median(graphs_s) if captured.captured else None,
            "hf_tok_s": n / statistics.median(hf_s),
            "ours_vs_hf": statistics.median(ratios), "ours_vs_hf_min": min(ratios), "ours_vs_hf_max": max(ratios),
            "same_tokens": got == want, "captured_same_tokens": replayed == got}


def divergence(model: HybridLM, plan: Plan) -> dict:
    """How often greedy speculation leaves target-only output in the model's dtype (a verify pass of k+1 tokens and a
    decode pass of one can round a near-tie differently): random prompts, target-only against speculation at k = 4
    with the target as its own draft, so every draft is what a decode pass picked and every rejection is a token on
    which the two passes disagreed. Passes captured where the model allows. Random weights: how often their top two
    logits nearly tie is not what a trained model's do."""
    run = copy.copy(model).capture(covers_experts(model))
    gen = torch.Generator().manual_seed(11)
    n, first, drafted, rejected = plan.divergence_tokens, [], 0, 0
    for _ in range(plan.divergence_prompts):
        prompt = torch.randint(0, model.config.vocab_size, (PREFIX,), generator=gen).tolist()
        want = generate(run, prompt, n).token_ids
        got = generate(run, prompt, n, ModelDrafter(run), 4)
        drafted, rejected = drafted + got.stats.drafted, rejected + got.stats.drafted - got.stats.accepted
        if got.token_ids != want:
            first.append(next(i for i, (a, b) in enumerate(zip(got.token_ids, want)) if a != b))
    return {"prompts": plan.divergence_prompts, "tokens": n, "dtype": str(model.dtype).removeprefix("torch."),
            "differ": len(first), "first_divergence": sorted(first), "drafted": drafted, "rejected": rejected}


def session_capacity(plan: Plan, tokens: int) -> int:
    """Positions a session reaches over one batch's runs: target-only, the fixed ks and the cost model's two, each
    `tokens` and a round more."""
    runs = 1 + len(KS) * len(ALPHAS) + len(ALPHAS)
    return PREFIX + runs * (tokens + 2 * (plan.cost_k_max + 1))


def sessions_that_fit(model: HybridLM, draft: HybridLM, plan: Plan, capacity: int) -> int | None:
    """How many sessions (target and draft state, K/V for `capacity` positions, a pass's logits and stacked GDN
    states) the free device memory holds; None off CUDA."""
    free = free_bytes(model.device)
    if free is None:
        return None
    T, cfg = plan.cost_k_max + 1, model.config
    layer_state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    per_session = (sum(m.config.state_spec.bytes(m.dtype, capacity) for m in (model, draft))
                   + T * cfg.vocab_size * (4 + model.dtype.itemsize) + 2 * layer_state)
    return max(0, (free - RESERVE) // per_session)


def batch_rows(model: HybridLM, draft: HybridLM, batch: int, plan: Plan, watch: Stopwatch) -> dict:
    """At `batch` sessions: pass costs (T = 1..cost_k_max+1 and a draft step), then target-only, speculation at each
    fixed k and acceptance, and at the cost model's k, each run after a round that warms it up."""
    gen = torch.Generator().manual_seed(batch)
    tokens = max(plan.min_tokens, plan.tokens // batch)
    capacity = session_capacity(plan, tokens)
    states, drafts = sessions(model, batch, gen, capacity), sessions(draft, batch, gen, capacity)
    lengths = tuple(range(1, plan.cost_k_max + 2))
    times = pass_times(model, draft, states, drafts, lengths, plan.batch_repeats, gen, watch)
    costs = PassCosts(tuple(times.median(T) for T in lengths), statistics.median(times.draft_seconds))
    runs: dict[tuple[int, float], list[tuple[float, int]]] = {}

    def run(k: int, alpha: float) -> list[tuple[float, int]]:
        key = (k, alpha if k else 0.0)
        if key not in runs:
            runs[key] = (drawn_rounds(model, draft, states, drafts, k, alpha, tokens, gen, watch, warm=1) if k else
                         target_only(model, states, tokens, gen, watch, warm=1))
        return runs[key]

    base = tokens_per_s(run(0, 0.0))

    def row(policy: str, k: int, alpha: float | None) -> dict:
        rounds = run(k, alpha or 0.0)
        ms = [1000 * s for s, _ in rounds]
        return {"policy": policy, "k": k, "alpha": alpha, "tok_s": tokens_per_s(rounds),
                "speedup": tokens_per_s(rounds) / base, "round_ms": statistics.median(ms), "round_ms_min": min(ms),
                "round_ms_max": max(ms), "tokens_per_round": sum(n for _, n in rounds) / len(rounds) / batch}

    rows = [row("target-only", 0, None)]
    rows += [row("fixed", k, alpha) for k in KS for alpha in ALPHAS]
    rows += [row("cost model", best_k(costs, alpha), alpha) for alpha in ALPHAS]
    return {"batch": batch, "tokens_per_session": tokens, "pass_ms": [1000 * t for t in costs.target_s],
            "draft_step_ms": 1000 * costs.draft_s, "rows": rows}


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.started = seconds, time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)


def batches(model: HybridLM, draft: HybridLM, plan: Plan, budget: Budget, watch: Stopwatch) -> dict:
    """`batch_rows` at each of the plan's batches that fits (and at the most that fit, when that is fewer than the
    largest), while the budget allows one more batch at the rate the last one took."""
    fit = sessions_that_fit(model, draft, plan, session_capacity(plan, plan.min_tokens))
    sizes = [b for b in plan.batches if fit is None or b <= fit]
    if fit is not None and 0 < fit < max(plan.batches) and fit not in sizes:
        sizes.append(fit)
    out: dict = {"fit": fit, "rows": [], "left_out": []}
    last = (0.0, 1)  # seconds and batch of the last batch measured
    for batch in sizes:
        needed = last[0] * batch / last[1]
        if budget.left() < needed:
            out["left_out"].append(f"batch {batch}: the time budget ({budget.seconds:.0f} s) would be spent")
            continue
        started = time.monotonic()
        out["rows"].append(batch_rows(model, draft, batch, plan, watch))
        last = (time.monotonic() - started, batch)
    if fit is not None and fit < max(plan.batches):
        out["left_out"].append(f"batches over {fit}: their states do not fit the free device memory")
    return out


def fits(config: dict, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why a shape cannot be built here, or None."""
    free, need = free_bytes(device), model_bytes(config, dtype) + MARGIN
    if free is not None and need > free:
        return f"weights and margin need {need / GIB:.1f} GiB, {free / GIB:.1f} GiB free"
    return None


def at_batch_1(name: str, config: dict, draft: HybridLM, plan: Plan, bandwidth: float, watch: Stopwatch) -> dict:
    model = random_model_on(config, draft.device, draft.dtype)
    out = {"config": describe(model), "passes": batch1_passes(model, draft, plan, bandwidth, watch),
           "gdn_round": [gdn_round_bytes(model.config, model.dtype, k) for k in KS],
           "hf": attempt("HF generate()", lambda: versus_hf(model, plan, watch))}
    if name == plan.divergence_shape:
        out["divergence"] = attempt("divergence", lambda: divergence(model, plan))
    return out


def gpu(device: str | torch.device = "cuda", shapes: list[tuple[str, dict]] | None = None, plan: Plan = QUICK,
        draft_config: dict = DRAFT_08B_2L, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The section: bandwidth, then every shape at batch 1 (passes, GDN bytes, HF), then every shape's batches, as
    long as the budget lasts. `shapes`: (name, HF config dict) pairs, `SHAPES` by default."""
    device = torch.device(device)
    watch = Stopwatch(device)
    result: dict = {"device": device_name(device), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "plan": asdict(plan),
                    "bandwidth": copy_bandwidth(device, plan.copy_mib, max(plan.repeats, 5), watch)}
    draft = draft_model(device, dtype, shape_config(draft_config))
    result["draft"] = describe(draft)
    configs = {name: shape_config(config) for name, config in (SHAPES if shapes is None else shapes)}
    result["shapes"] = measure_shapes(configs, draft, plan, result["bandwidth"]["gb_s"], watch)
    del draft
    release()
    result["goals"] = goals(result)
    return result


def measure_shapes(configs: dict[str, dict], draft: HybridLM, plan: Plan, bandwidth: float,
                   watch: Stopwatch) -> list[dict]:
    """Every shape at batch 1, then every shape's batches, each model built afresh and freed after."""
    device, dtype, budget = draft.device, draft.dtype, Budget(plan.budget_s)
    spent = f"the time budget ({plan.budget_s:.0f} s) is spent"
    rows = []
    for name, config in configs.items():
        row: dict = {"shape": name, "skipped": fits(config, dtype, device) or (spent if budget.left() <= 0 else None)}
        if row["skipped"] is None:
            row.update(attempt(name, lambda: at_batch_1(name, config, draft, plan, bandwidth, watch)))
        rows.append(row)
    for row in rows:
        if row["skipped"] or "error" in row:
            continue
        config = configs[row["shape"]]
        row["batches"] = ({"rows": [], "left_out": [f"every batch: {spent}"]} if budget.left() <= 0 else
                          attempt(row["shape"], lambda: batches(random_model_on(config, device, dtype), draft, plan,
                                                                budget, watch)))
    return rows


def goals(result: dict) -> list[dict]:
    """Issue 31's goals, for every shape measured (they are set at 9B): decode within 1.3x of its floor at batch 1,
    verify(5) over decode(1) <= 1.15, and at the largest batch speculation at k = 4, acceptance 0.8, >= 1.5x
    target-only."""
    out = []

    def goal(shape: str, text: str, value: float, target: float, at_most: bool) -> None:
        out.append({"shape": shape, "goal": f"{text} {'<=' if at_most else '>='} {target}", "value": value,
                    "met": value <= target if at_most else value >= target})

    for shape in result["shapes"]:
        rows = shape.get("passes", {}).get("rows", [])
        if rows:
            path = "captured_" if "captured_ms" in rows[0] else ""  # the fastest path there is
            name = "captured " if path else ""
            goal(shape["shape"], f"{name}decode x floor at batch 1", rows[0][f"{path}x_floor"],
                 GOALS["decode_x_floor"], True)
            goal(shape["shape"], f"{name}verify(5) / decode(1) at batch 1", rows[4][f"{path}vs_decode"],
                 GOALS["verify5_vs_decode"], True)
        measured = shape.get("batches", {}).get("rows", [])
        if measured:
            last = measured[-1]
            spec = next(r for r in last["rows"] if r["policy"] == "fixed" and r["k"] == 4 and r["alpha"] == 0.8)
            goal(shape["shape"], f"speculation k = 4, a = 0.8, over target-only at batch {last['batch']}",
                 spec["speedup"], GOALS["speedup_k4_a08"], False)
    return out


def print_rows(result: dict) -> None:
    bw, plan = result["bandwidth"], result["plan"]
    print(f"\nGPU section: {result['device']}, {result['date']}, torch {result['torch']}, random {result['dtype']} "
          f"weights, budget {plan['budget_s']:.0f} s")
    print(f"copy bandwidth {bw['gb_s']:.0f} GB/s ({bw['gb_s_min']:.0f}-{bw['gb_s_max']:.0f}; {bw['mib']} MiB copied "
          "device to device, bytes read + written); floors below = bytes a pass moves / this")
    d = result["draft"]
    print(f"draft: {d['layers']} layers ({d['gdn_layers']} GDN), hidden {d['hidden']}, vocabulary {d['vocab']}, "
          f"{d['params_b'] * 1000:.1f}M parameters")
    for shape in result["shapes"]:
        name = shape["shape"]
        if shape["skipped"] or "error" in shape:
            print(f"\n{name}: skipped: {shape['skipped'] or shape['error']}")
            continue
        c = shape["config"]
        mlp = f"experts {c['experts']}" if "experts" in c else f"FFN {c['intermediate']}"
        print(f"\n{name} shape: {c['layers']} layers ({c['gdn_layers']} GDN), hidden {c['hidden']}, {mlp}, "
              f"attention heads {c['heads']}, GDN heads {c['gdn_heads']}, vocabulary {c['vocab']}"
              f"{', tied' if c['tied'] else ''}: {c['params_b']:.2f}B parameters, {c['weights_gib']:.1f} GiB")
        p = shape["passes"]
        print(f"batch 1 after {p['context']} positions (medians of {plan['repeats']}, min-max); bytes moved: weights, "
              f"GDN state and logs, K/V; experts: distinct routed experts read per sparse layer")
        print(f"{'tokens':>6} {'ms/pass':>8} {'min-max':>15} {'x decode':>8} {'experts':>7} {'weights':>11} "
              f"{'GDN':>10} {'K/V':>10} {'floor ms':>8} {'x floor':>7} {'graph ms':>8} {'x floor':>7} {'x decode':>8} "
              f"{'even a':>6} {'floor a':>7}")
        for r in p["rows"]:
            b = r["bytes"]
            graphs = (f" {r['captured_ms']:>8.2f} {r['captured_x_floor']:>7.2f} {r['captured_vs_decode']:>8.2f}"
                      if "captured_ms" in r else f" {'-':>8} {'-':>7} {'-':>8}")
            evens = " ".join(f"{'-' if r['tokens'] == 1 else 'never' if r.get(f) is None else format(r[f], '.2f'):>{w}}"
                             for f, w in (("break_even", 6), ("floor_break_even", 7)))
            print(f"{r['tokens']:>6} {r['ms']:>8.2f} {r['ms_min']:>7.2f}-{r['ms_max']:<7.2f} {r['vs_decode']:>8.2f} "
                  f"{r['experts']:>7.1f} {mib(b['weights']):>11} {mib(b['gdn']):>10} {mib(b['kv']):>10} "
                  f"{r['floor_ms']:>8.3f} {r['x_floor']:>7.2f}{graphs} {evens}")
        if "captured_ms" in p["rows"][0]:
            print("graph ms: the same passes replayed as CUDA graphs (`--capture`; on a CPU the static pass, no graph)")
        print("even a: the per-token acceptance at which a round of k = tokens - 1 drafts pays, from the fastest "
              "path's passes and the draft step; floor a: from the floors, with a free draft")
        print(f"draft step at batch 1: {p['draft_step_ms']:.2f} ms")
        for g in shape["gdn_round"]:
            print(f"GDN state per round per sequence, k = {g['k']}: the verify reads {mib(g['pass_read'])}, writes "
                  f"{mib(g['pass_written'])} and {mib(g['logs_written'])} of logs; a partial commit reads "
                  f"{mib(g['commit_read'])}, writes {mib(g['commit_written'])}")
        hf = shape["hf"]
        if "error" in hf:
            print(f"HF generate(): {hf['error']}")
        else:
            graphs = (f", captured {hf['captured_tok_s']:.1f} tok/s (same tokens: {hf['captured_same_tokens']})"
                      if hf["captured_tok_s"] else "")
            print(f"HF generate() (transformers {hf['transformers']}), {hf['tokens']} tokens, one sequence: ours "
                  f"{hf['ours_tok_s']:.1f} tok/s{graphs}, HF {hf['hf_tok_s']:.1f} tok/s: ours eager "
                  f"{hf['ours_vs_hf']:.2f}x ({hf['ours_vs_hf_min']:.2f}-{hf['ours_vs_hf_max']:.2f}); same tokens: "
                  f"{hf['same_tokens']}")
        if "divergence" in shape:
            print_divergence(shape["divergence"])
        print_batches(shape.get("batches", {}))
    print("\nGoals (issue 31's are at 9B; printed, not asserted)")
    for g in result["goals"]:
        print(f"{g['shape']:<16} {g['goal']}: {g['value']:.2f} ({'met' if g['met'] else 'not met'})")
    for shape in result["shapes"]:
        rows = shape.get("passes", {}).get("rows", [])
        if rows:
            graphs = (f"; captured {rows[0]['captured_x_floor']:.2f}x, {rows[4]['captured_vs_decode']:.2f}"
                      if "captured_ms" in rows[0] else "")
            print(f"GPU summary: {shape['shape']} decode {rows[0]['x_floor']:.2f}x floor, verify(5)/decode(1) "
                  f"{rows[4]['vs_decode']:.2f}{graphs}")


def print_divergence(d: dict) -> None:
    if "error" in d:
        print(f"greedy speculation against target-only: {d['error']}")
        return
    first = f"; first different token at {d['first_divergence']}" if d["differ"] else ""
    print(f"greedy speculation (k = 4, the target as its own draft) against target-only, {d['dtype']}, random weights: "
          f"{d['differ']} of {d['prompts']} prompts x {d['tokens']} tokens differ{first}; {d['rejected']} of "
          f"{d['drafted']} drafts rejected (each a token a verify pass and a decode pass picked differently)")


def print_batches(b: dict) -> None:
    if "error" in b:
        print(f"batches: {b['error']}")
        return
    if b.get("rows"):
        print("many sessions (aggregate tok/s; accepts drawn at a; a round is k draft steps, a verify and the commits, "
              "or one decode step target-only)")
        print(f"{'batch':>5} {'policy':<11} {'k':>2} {'a':>4} {'tok/s':>9} {'x t-only':>8} {'round ms':>9} "
              f"{'min-max':>17} {'tok/round':>9}")
    for m in b.get("rows", []):
        for r in m["rows"]:
            a = "-" if r["alpha"] is None else f"{r['alpha']:.1f}"
            print(f"{m['batch']:>5} {r['policy']:<11} {r['k']:>2} {a:>4} {r['tok_s']:>9.0f} {r['speedup']:>8.2f} "
                  f"{r['round_ms']:>9.2f} {r['round_ms_min']:>8.2f}-{r['round_ms_max']:<8.2f} "
                  f"{r['tokens_per_round']:>9.2f}")
        print(f"{'':>5} pass ms at T = 1..{len(m['pass_ms'])}: " + ", ".join(f"{t:.2f}" for t in m["pass_ms"])
              + f"; draft step {m['draft_step_ms']:.2f} ms; {m['tokens_per_session']} tokens per session a run")
    for reason in b.get("left_out", []):
        print(f"left out: {reason}")
