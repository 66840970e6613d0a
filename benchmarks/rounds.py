"""Timed passes and rounds over many sessions at once, on random models, on any device: what the MoE section (on the
CPU) and the GPU section share.

Rounds run with a real draft model but accept counts drawn at a fixed per-token acceptance, so what they measure is
what a round costs (k batched draft steps, one batched verify of k+1 tokens, each session's commit), not how well a
random draft guesses. Token ids, accept counts and the rest of the bookkeeping are made before the clock starts.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from deltaspec.shared.model.batched import forward_batch
from deltaspec.shared.model.checkpoint import hf_config
from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.kernels.experts import experts_read as layer_read
from deltaspec.shared.model.mlp import GroupMoE, SparseMoE
from deltaspec.shared.state.rollback import ModelState

PREFIX = 32  # tokens each session holds before the timed passes
PREFILL_GROUP = 16  # sessions prefilled per batched pass (their logits are prefix x vocabulary floats each)


class Stopwatch:
    """Seconds between `start` and `stop`: CUDA events (after a synchronize) on a GPU, the wall clock elsewhere."""

    def __init__(self, device: str | torch.device) -> None:
        self.events = ((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                       if torch.device(device).type == "cuda" else None)
        self.began = 0.0

    def start(self) -> None:
        if self.events is None:
            self.began = time.perf_counter()
            return
        torch.cuda.synchronize()
        self.events[0].record()

    def stop(self) -> float:
        if self.events is None:
            return time.perf_counter() - self.began
        began, ended = self.events
        ended.record()
        ended.synchronize()
        return began.elapsed_time(ended) / 1000


def random_model_on(config: dict, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                    scale: float = 0.3) -> HybridLM:
    """A fused model with every parameter drawn at random where it lives, `checkpoint.random_model`'s way (decays and
    norm weights too): built on the meta device, so a 27B model never passes through host memory."""
    with torch.device("meta"):
        model = HybridLM(ModelConfig.from_dict(config)).to(dtype)
    model.to_empty(device=device)
    if model.config.tie_word_embeddings:  # to_empty gives each module its own tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(0.01, 16, generator=gen).log_()
            elif name.endswith("dt_bias"):
                p.uniform_(0.5, 1.5, generator=gen)
            else:
                p.normal_(0.0, scale if p.ndim == 1 else p.shape[-1] ** -0.5, generator=gen)
    return model.eval().fuse()


def draft_model(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                config: dict | None = None) -> HybridLM:
    """A small random draft: one GDN and one attention layer (the tiny test widths unless `config` says others)."""
    return random_model_on(config or hf_config(layer_types=["linear_attention", "full_attention"]), device, dtype,
                           seed=1)


def _ids(model: HybridLM, T: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (T,), generator=gen)


def sessions(model: HybridLM, batch: int, gen: torch.Generator, capacity: int = 1024,
             prefix: int = PREFIX) -> list[ModelState]:
    """`batch` sequence states, each holding `prefix` random tokens, prefilled `PREFILL_GROUP` at a time."""
    states = [model.new_state(capacity=capacity) for _ in range(batch)]
    for i in range(0, batch, PREFILL_GROUP):
        group = states[i:i + PREFILL_GROUP]
        forward_batch(model, [(_ids(model, prefix, gen), st) for st in group])
        for st in group:
            st.commit(prefix)
    return states


def experts_read(model: HybridLM) -> float:
    """Distinct experts the last pass read, per sparse layer (mean); 0 for a dense model."""
    sparse = [layer_read(layer.mlp.touched) for layer in model.model.layers
              if isinstance(layer.mlp, (SparseMoE, GroupMoE))]
    return statistics.mean(sparse) if sparse else 0.0


def timed_pass(model: HybridLM, states: list[ModelState], T: int, gen: torch.Generator, watch: Stopwatch) -> float:
    """Seconds of one batched pass of T random tokens per session; the states are left as they were."""
    items = [(_ids(model, T, gen), st) for st in states]
    watch.start()
    forward_batch(model, items)
    elapsed = watch.stop()
    for st in states:
        st.revert()
    return elapsed


@dataclass
class PassTimes:
    """Per pass length T: seconds of each timed pass and the experts it read per sparse layer; the draft's steps."""

    seconds: dict[int, list[float]] = field(default_factory=dict)
    experts: dict[int, list[float]] = field(default_factory=dict)
    draft_seconds: list[float] = field(default_factory=list)

    def median(self, T: int) -> float:
        return statistics.median(self.seconds[T])


def pass_times(model: HybridLM, draft: HybridLM, states: list[ModelState], drafts: list[ModelState],
               lengths: tuple[int, ...], repeats: int, gen: torch.Generator, watch: Stopwatch) -> PassTimes:
    """Every length in turn, then a draft step, `repeats` times after a first round that warms every path and is
    dropped."""
    out = PassTimes({T: [] for T in lengths}, {T: [] for T in lengths})
    for repeat in range(repeats + 1):
        for T in lengths:
            seconds = timed_pass(model, states, T, gen, watch)
            if repeat:
                out.seconds[T].append(seconds)
                out.experts[T].append(experts_read(model))
        seconds = timed_pass(draft, drafts, 1, gen, watch)
        if repeat:
            out.draft_seconds.append(seconds)
    return out


def drawn_rounds(model: HybridLM, draft: HybridLM, states: list[ModelState], drafts: list[ModelState], k: int,
                 alpha: float, tokens: int, gen: torch.Generator, watch: Stopwatch,
                 warm: int = 0) -> list[tuple[float, int]]:
    """Rounds of k drafts with accept counts drawn at per-token acceptance `alpha` (each draft accepted with
    probability alpha until the first rejection), until every session has `tokens` more: (seconds, tokens) a round.
    The first `warm` rounds run before them, untimed in the result."""
    rounds: list[tuple[float, int]] = []
    produced = 0
    while len(rounds) < warm or produced < tokens * len(states):
        steps = [[(_ids(draft, 1, gen), ds) for ds in drafts] for _ in range(k)]
        verify = [(_ids(model, k + 1, gen), st) for st in states]
        accepted = (torch.rand(len(states), k, generator=gen) < alpha).int().cumprod(1).sum(1).tolist()
        watch.start()
        for step in steps:  # the draft stages its k proposals, one batched step each
            forward_batch(draft, step)
        forward_batch(model, verify)
        for st, ds, a in zip(states, drafts, accepted):
            st.commit(a + 1)
            ds.commit(a)
        rounds.append((watch.stop(), len(states) + sum(accepted)))
        produced += rounds[-1][1] if len(rounds) > warm else 0
    return rounds[warm:]


def target_only(model: HybridLM, states: list[ModelState], tokens: int, gen: torch.Generator,
                watch: Stopwatch, warm: int = 0) -> list[tuple[float, int]]:
    """`tokens` batched decode steps, each session committing its one token, after `warm` more: (seconds, tokens) a
    step."""
    steps = []
    for _ in range(warm + tokens):
        items = [(_ids(model, 1, gen), st) for st in states]
        watch.start()
        forward_batch(model, items)
        for st in states:
            st.commit(1)
        steps.append((watch.stop(), len(states)))
    return steps[warm:]


def tokens_per_s(rounds: list[tuple[float, int]]) -> float:
    return sum(n for _, n in rounds) / sum(s for s, _ in rounds)
