"""Tensor parallelism over gloo: a model sharded on 2 ranks (and 4) gives the single-process logits (to 1e-5
relative: the all-reduce adds in another order) for a prefill, a verify, a partial commit, a revert and a decode, on
the fused and the layer path, and the same greedy tokens target-only and speculative (a draft model; MTP), with MoE
experts cut by columns or spread whole over the ranks (expert parallelism); the MTP head sharded like the trunk (its
draft logits through a leader and a follower); a prefix cache whose every entry each rank holds its shard of; each
round's collective time on its span; served, the same tokens over both gRPC loops, and a lost rank takes the group
down."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from benchmarks import shapes
from deltaspec.shared.cli import build_parser, main as cli_main
from deltaspec.shared.decoding.drafters import make_drafter
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.drafters.mtp import MTPDrafter, random_mtp_weights
from deltaspec.shared.decoding.drafters import attach
from deltaspec.shared.decoding.speculative import Stats, decode, generate
from deltaspec.shared.decoding.target import TargetSession
from deltaspec.shared.kernels.experts import apply_experts
from deltaspec.shared.model.batched import forward_batch
from deltaspec.shared.model.checkpoint import hf_config, hf_moe_config, random_model, save_checkpoint
from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.fields import ConfigError
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.lockstep import Leader, follow, join
from deltaspec.shared.model.mtp_head import MTPCache
from deltaspec.shared.model.nodes import Placement
from deltaspec.shared.model.parallel import Rank, shard, shard_tensors, sharded_config
from deltaspec.shared.rpc.generation import generate_on_server
from deltaspec.shared.state import prefix_cache
from deltaspec.shared.state.prefix_cache import Cursor
from deltaspec.shared.telemetry import attributes as attr
from deltaspec.shared.telemetry.metrics import Metrics

from support import Served, both_loops
from test_batching import run_threads
from test_drafters_mtp import Steered

CASES = {
    "qwen3_5": lambda: hf_config(mtp_num_hidden_layers=1),  # with an MTP head
    "qwen3_5_moe": lambda: hf_moe_config(layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "qwen3_next": lambda: hf_moe_config("qwen3_next", mlp_only_layers=[1], intermediate_size=96,
                                        num_attention_heads=8, num_key_value_heads=4),
    "qwen3_next-4": lambda: hf_moe_config("qwen3_next", mlp_only_layers=[1], intermediate_size=96,
                                          num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4,
                                          linear_num_value_heads=8, shared_expert_intermediate_size=64),
}
MTP_MOE = {**CASES["qwen3_5_moe"](), "mtp_num_hidden_layers": 1}  # its MTP layer: attention, routed, shared experts
RANKS = {"qwen3_next-4": 4}  # 2 unless named (4: its 2 K/V heads replicated, as Qwen3-Next-80B's are at TP 4)
PROMPT = [5, 17, 42, 9, 100, 3, 77]
N_NEW = 12


def rendezvous(directory: str) -> str:
    """Where the ranks meet: a file in the test's own folder (no port that another job could take first)."""
    return f"file://{directory}/rendezvous"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def near_copy(model: HybridLM, seed: int) -> HybridLM:
    """A draft that agrees with the target often, not always."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05 * p.abs().mean())
    return model


def passes(model: HybridLM, draft: HybridLM | None) -> dict[str, object]:
    """Logits of a prefill, a verify of 5 (2 kept), a verify reverted, a decode; then greedy generations (with a
    `draft`)."""
    st = model.new_state()
    out = {"prefill": model(torch.tensor(PROMPT), st)[0]}
    st.commit(len(PROMPT))
    out["verify"] = model(torch.tensor([8, 1, 200, 31, 6]), st)[0]
    st.commit(2)
    out["reverted"] = model(torch.tensor([4, 4, 4]), st)[0]
    st.revert()
    out["decode"] = model(torch.tensor([11]), st)[0]
    st.commit(1)
    out["decode2"] = model(torch.tensor([12]), st)[0]
    if draft is None:
        return out
    out["greedy"] = generate(model, PROMPT, N_NEW).token_ids
    out["speculative"] = generate(model, PROMPT, N_NEW, ModelDrafter(draft), 3).token_ids
    if model.mtp:
        out["mtp"] = generate(model, PROMPT, N_NEW, make_drafter("mtp", model), 3).token_ids
    return out


def target(cfg: dict) -> HybridLM:
    """The random target of `cfg`, with random MTP weights where it has an MTP head."""
    model = random_model(cfg, seed=3)
    if cfg.get("mtp_num_hidden_layers"):
        model.mtp = random_mtp_weights(model.config, cfg["mtp_num_hidden_layers"], seed=5)
    return model


def run_rank(rank: int, world: int, name: str, out: str) -> None:
    torch.set_num_threads(1)
    join(rank, world, rendezvous(out))
    try:
        cfg = CASES[name]()
        draft = near_copy(random_model(cfg, seed=3), seed=4).fuse()
        part = shard(target(cfg), Rank(rank, world))
        got = {"fused": passes(part, draft), "layers": passes(part.fuse(False), draft)}
        if cfg.get("num_experts"):  # and with the routed experts spread whole over the ranks (8 experts)
            part = shard(target(cfg), Rank(rank, world), expert_parallel=True)
            got |= {"ep-fused": passes(part, draft), "ep-layers": passes(part.fuse(False), None)}  # logits only
        if rank == 0:
            got["want"] = passes(target(cfg).fuse(), draft)
        torch.save(got, Path(out) / f"{rank}.pt")
        dist.barrier()  # no rank tears the group down while another still runs (gloo aborts the one left)
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., None], nprocs: int, *args: object) -> None:
    """`fn(rank, *args)` in `nprocs` spawned processes, each leaving at once once `fn` returns (its group left): the
    interpreter's own teardown of a gloo group can abort a rank ("terminate called without an active exception",
    about one run in six of a 2-rank test here), as `lockstep.exit_group` knows."""
    mp.spawn(_and_exit, args=(fn, args), nprocs=nprocs)


def _and_exit(rank: int, fn: Callable[..., None], args: tuple) -> None:
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


# 4 ranks on 2 cores (37 s with the expert-parallel passes: their time slices wait for each other) run with `-m slow`;
# the 4-rank shards' shapes are checked in the suite (test_k_v_heads_fewer_than_the_ranks_are_replicated)
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if RANKS.get(name, 2) > 2 else name
                                  for name in sorted(CASES)])
def test_ranks_give_the_single_process_logits_and_tokens(name, tmp_path):
    world = RANKS.get(name, 2)
    spawn_ranks(run_rank, world, world, name, str(tmp_path))
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    want = ranks[0]["want"]
    assert len(set(want["greedy"])) > 1
    assert want["speculative"] == want["greedy"] == want.get("mtp", want["greedy"])
    assert ("mtp" in want) == (name == "qwen3_5")
    assert ("ep-fused" in ranks[0]) == (name != "qwen3_5")
    for got in ranks:
        for path in [path for path in ("fused", "layers", "ep-fused", "ep-layers") if path in got]:
            for key, value in want.items():
                if key not in got[path]:  # the expert-parallel layer path: logits only
                    assert path == "ep-layers" and not isinstance(value, torch.Tensor), (path, key)
                    continue
                if isinstance(value, torch.Tensor):
                    assert rel(got[path][key], value) < 1e-5, (path, key)
                    assert torch.equal(got[path][key], ranks[0][path][key]), (path, key)  # the ranks agree exactly
                else:
                    assert got[path][key] == value, (path, key)


def test_sharded_state_holds_the_ranks_heads():
    cfg = ModelConfig.from_dict(CASES["qwen3_next"]())
    spec, part = cfg.state_spec, sharded_config(cfg, 2).state_spec
    assert (part.recurrent.heads, part.kv_heads) == (spec.recurrent.heads // 2, spec.kv_heads // 2)
    assert part.recurrent.conv_dim == spec.recurrent.conv_dim // 2


@pytest.mark.parametrize("world, fields, field", [
    (3, {}, "num_attention_heads"), (4, {}, "linear_num_key_heads"),
    (3, {"num_attention_heads": 12, "num_key_value_heads": 4, "linear_num_key_heads": 3, "linear_num_value_heads": 6,
         "intermediate_size": 96}, "num_key_value_heads"),
    (4, {"num_attention_heads": 8, "linear_num_key_heads": 4, "linear_num_value_heads": 8, "intermediate_size": 102},
     "intermediate_size")])
def test_a_size_that_does_not_divide_is_refused_naming_the_dimension(world, fields, field):
    with pytest.raises(ConfigError, match=f"does not divide {field}"):
        sharded_config(ModelConfig.from_dict(hf_config(**fields)), world)


def test_expert_parallelism_spreads_whole_experts_and_refuses_a_size_that_does_not_divide_them():
    cfg = CASES["qwen3_next"]()
    model = random_model(cfg, seed=3)
    experts = model.model.layers[0].mlp.experts
    parts = [shard_tensors(model, Rank(r, 2), expert_parallel=True) for r in range(2)]
    for r, part in enumerate(parts):
        assert torch.equal(part["model.layers.0.mlp.experts.gate_up_proj"], experts.gate_up_proj[4 * r:4 * r + 4])
        assert torch.equal(part["model.layers.0.mlp.experts.down_proj"], experts.down_proj[4 * r:4 * r + 4])
    assert sharded_config(ModelConfig.from_dict(cfg), 2, expert_parallel=True).moe_intermediate_size == \
        cfg["moe_intermediate_size"]
    # each rank's experts' share, zero for a token routed to none of them (0: to 5 and 6 only), adds up to the whole
    gen = torch.Generator().manual_seed(1)
    x, weights = torch.randn(5, cfg["hidden_size"], generator=gen), torch.rand(5, 2, generator=gen)
    chosen = torch.tensor([[5, 6], [0, 7], [3, 2], [4, 1], [1, 6]])
    for grouped in (False, True):
        whole, _ = apply_experts(experts.gate_up_proj, experts.down_proj, x, weights, chosen, grouped)
        shares = [apply_experts(experts.gate_up_proj[4 * r:4 * r + 4], experts.down_proj[4 * r:4 * r + 4], x,
                                weights, chosen, grouped, first=4 * r)[0] for r in range(2)]
        assert not shares[0][0].any() and shares[1][0].any()
        assert torch.allclose(shares[0] + shares[1], whole, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match=r"expert parallel size 4 does not divide num_experts \(6\)"):
        sharded_config(ModelConfig.from_dict(hf_moe_config(num_experts=6)), 4, expert_parallel=True)
    with pytest.raises(ConfigError, match="expert parallelism needs routed experts"):
        sharded_config(ModelConfig.from_dict(hf_config()), 2, expert_parallel=True)


def test_k_v_heads_fewer_than_the_ranks_are_replicated():
    cfg = ModelConfig.from_dict(CASES["qwen3_next-4"]())
    part = sharded_config(cfg, 4)
    assert (part.num_attention_heads, part.num_key_value_heads, part.state_spec.kv_heads) == (2, 1, 1)


def traced_rounds(model: HybridLM, draft: HybridLM) -> tuple[list[float | None], float]:
    """A speculative generation's round spans' collective time (None where a span has none), through the real
    tracer SDK with an in-memory exporter, and the rounds the collective time histogram counted."""
    exporter, provider, metrics = InMemorySpanExporter(), TracerProvider(), Metrics()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    session, drafter = TargetSession(model, PROMPT), ModelDrafter(draft)
    drafter.start(PROMPT)
    attach(drafter, session)
    for _ in decode(session, drafter, 8, 3, set(), Stats(), provider.get_tracer("test"), metrics):
        pass
    spans = [s.attributes.get(attr.TP_COLLECTIVE_S) for s in exporter.get_finished_spans() if s.name == "round"]
    return spans, metrics.registry.get_sample_value("deltaspec_tp_collective_seconds_count") or 0.0


def lead_or_follow(rank: int, world: int, out: str) -> None:
    """Rank 0 generates through a `Leader` (with its shard of the MTP head; target-only and speculative with a draft
    model; a partial commit by hand and a batched pass of two sessions), then again with the experts spread whole
    (the MTP head's rounds only); rank 1 follows what it sends, making each head cache and pass on its shard."""
    torch.set_num_threads(1)
    at = join(rank, world, rendezvous(out))
    try:
        got: dict[object, object] = {"errors": []}
        draft = near_copy(random_model(MTP_MOE, seed=3), seed=4).fuse()
        for ep in (False, True):
            part = shard(target(MTP_MOE), at, expert_parallel=ep)
            if rank:
                held = follow(part, at)
                got[ep] = shapes_of(held.mtp_head, [s for s in held.states.values() if isinstance(s, MTPCache)])
                continue
            leader = Leader(part, at, on_broken=got["errors"].append)
            got[ep], drafter = mtp_rounds(part)
            got[ep] |= shapes_of(drafter.head, [drafter.cache])
            if not ep:
                got |= lead(part, draft)
            leader.stop()
        if rank == 0:
            ref = target(MTP_MOE).fuse()
            got["want"] = passes(ref, draft) | mtp_rounds(ref)[0]
            st = ref.new_state()
            ref(torch.tensor(PROMPT), st)
            st.commit(3)
            got["want_batched"] = [ref(torch.tensor([1, 2]), st)[0],
                                   ref(torch.tensor(PROMPT[:4]), ref.new_state())[0]]
            got["traced_alone"] = traced_rounds(ref, draft)
            got["whole"] = shapes_of(MTPDrafter(ref).head, [])
        torch.save(got, Path(out) / f"{rank}.pt")
        dist.barrier()  # no rank tears the group down while another still runs
    finally:
        dist.destroy_process_group()


def lead(part: HybridLM, draft: HybridLM) -> dict[str, object]:
    """Rank 0's calls beside the MTP head's: target-only and speculative generations, a commit rank 0 refuses, a
    batched pass of two sessions, a traced generation."""
    got = {"greedy": generate(part, PROMPT, N_NEW).token_ids,
           "speculative": generate(part, PROMPT, N_NEW, ModelDrafter(draft), 3).token_ids}
    st = part.new_state()
    part(torch.tensor(PROMPT), st)
    st.commit(3)
    with pytest.raises(ValueError):
        st.commit(99)
    other = part.new_state()
    got["batched"] = [logits for logits, _ in forward_batch(part, [(torch.tensor([1, 2]), st),
                                                                   (torch.tensor(PROMPT[:4]), other)])]
    got["traced"] = traced_rounds(part, draft)
    return got


def mtp_rounds(model: HybridLM) -> tuple[dict[str, object], MTPDrafter]:
    """Greedy tokens with the MTP head steered to keep 0..3 of 3 drafts round by round (each draft's logits
    recorded) and drafting alone; and the steered drafter, whose head cache is still live."""
    want = generate(model, PROMPT, N_NEW).token_ids
    drafter, logits = MTPDrafter(model), []

    def record(_head: object, _args: object, y: torch.Tensor) -> None:
        with torch.inference_mode():
            logits.append(model.logits(y))

    drafter.head.register_forward_hook(record)
    steered = Steered(drafter, want)
    got = {"steered": generate(model, PROMPT, N_NEW, steered, 3).token_ids, "accepts": steered.accept_counts,
           "mtp_logits": logits, "mtp": generate(model, PROMPT, N_NEW, make_drafter("mtp", model), 3).token_ids}
    return got, drafter


def shapes_of(head: torch.nn.Module, caches: list[MTPCache]) -> dict[str, object]:
    return {"weights": {k: tuple(v.shape) for k, v in head.state_dict().items()},
            "kv": [tuple(layer.k.shape) for c in caches for layer in c.layers if layer is not None]}


def test_followers_make_every_call_rank_0_makes(tmp_path):
    """Tokens and logits of the single process through a leader and a follower. The MTP head's layer is split as a
    trunk layer (its fusion projection replicated): each draft's logits within 1e-5 of the single process's over
    rounds keeping 0..3 drafts, its greedy tokens the single process's; the follower holds the same shard of the head
    and of the live head cache as rank 0, half the K/V heads."""
    spawn_ranks(lead_or_follow, 2, 2, str(tmp_path))
    got, follower = (torch.load(tmp_path / f"{r}.pt") for r in range(2))
    want, whole = got["want"], got["whole"]["weights"]
    assert not got["errors"]
    assert got["greedy"] == want["greedy"] and got["speculative"] == want["speculative"]
    assert all(rel(a, b) < 1e-5 for a, b in zip(got["batched"], got["want_batched"], strict=True))
    # each round's time in the group's collectives, on its span and in the histogram; none in one process
    spans, counted = got["traced"]
    assert spans and all(s is not None and 0 < s < 10 for s in spans) and counted == len(spans)
    spans, counted = got["traced_alone"]
    assert spans and all(s is None for s in spans) and counted == 0
    # the MTP head's shard: its drafts' logits, tokens and shapes, experts cut by columns or spread whole
    assert set(want["accepts"]) == {0, 1, 2, 3} and want["steered"] == want["mtp"] == want["greedy"]
    cfg = ModelConfig.from_dict(MTP_MOE)
    for ep in (False, True):
        assert {k: got[ep][k] for k in ("steered", "accepts", "mtp")} == {k: want[k] for k in ("steered", "accepts",
                                                                                                "mtp")}
        assert len(got[ep]["mtp_logits"]) == len(want["mtp_logits"]) > 5
        assert all(rel(a, b) < 1e-5 for a, b in zip(got[ep]["mtp_logits"], want["mtp_logits"], strict=True))
        weights = got[ep]["weights"]
        assert follower[ep]["weights"] == weights and follower[ep]["kv"] == got[ep]["kv"] == \
            [(cfg.num_key_value_heads // 2, 256, cfg.head_dim)]
        assert weights["fc.weight"] == whole["fc.weight"]  # replicated
        for name, dim in (("self_attn.q_proj.weight", 0), ("self_attn.o_proj.weight", 1),
                          ("mlp.shared_expert.up_proj.weight", 0), ("mlp.experts.gate_up_proj", 0 if ep else 1)):
            cut = list(whole[f"layers.0.{name}"])
            cut[dim] //= 2
            assert weights[f"layers.0.{name}"] == tuple(cut), (ep, name)


def cached_prompts() -> list[list[int]]:
    """A prompt longer than the logs (its prefill takes its block heads in the pass), one branching off it inside a
    block without a recurrent state, and one extending it."""
    long = torch.randint(0, 256, (41,), generator=torch.Generator().manual_seed(7)).tolist()
    return [long, long[:20] + [3, 1, 4, 1, 5, 9, 2, 6], long + [7, 7, 8]]


def lead_with_a_prefix_cache(rank: int, world: int, out: str) -> None:
    """Rank 0 generates through a `Leader` with a prefix cache (blocks of 4, a recurrent state every 2): target-only
    and speculative (partial commits), a hit's logits by hand, then every entry evicted and the first prompt again;
    rank 1 follows, replaying the cache's journal on its shard."""
    torch.set_num_threads(1)
    at = join(rank, world, rendezvous(out))
    try:
        cfg = CASES["qwen3_next"]()
        part = shard(random_model(cfg, seed=3), at)
        if rank:
            mirror = follow(part, at).prefix_cache
            torch.save({k: (e.end, e.state is not None) for k, e in mirror.entries.items()}, Path(out) / "mirror.pt")
            dist.barrier()
            return
        errors: list[BaseException] = []
        Leader(part, at, on_broken=errors.append)
        cache = prefix_cache.attach(part, 4, state_every=2)
        draft = near_copy(random_model(cfg, seed=3), seed=4).fuse()
        prompts = cached_prompts()
        got: dict[str, object] = {"tokens": [generate(part, prompts[0], 6).token_ids,
                                             generate(part, prompts[1], 6, ModelDrafter(draft), 3).token_ids,
                                             generate(part, prompts[2], 6, ModelDrafter(draft), 3).token_ids]}
        st = part.new_state()
        cursor = Cursor(cache, st)
        cursor.prefill(part, prompts[2][:-1])
        got["cached"], got["logits"] = cursor.cached_tokens, part(torch.tensor(prompts[2][-1:]), st)[0]
        cache.reclaim(cache.bytes)
        got["emptied"] = len(cache.entries)
        got["tokens"].append(generate(part, prompts[0], 6).token_ids)
        got["tokens"].append(generate(part, prompts[0], 6).token_ids)
        got["stats"], got["errors"] = cache.stats, errors
        got["entries"] = {k: (e.end, e.state is not None) for k, e in cache.entries.items()}
        part.leader.stop()
        ref = random_model(cfg, seed=3).fuse()
        got["want"] = [generate(ref, ids, 6, ModelDrafter(draft) if i in (1, 2) else None, 3).token_ids
                       for i, ids in enumerate(prompts + [prompts[0]] * 2)]
        got["want_logits"] = ref(torch.tensor(prompts[2]), ref.new_state())[0][-1:]
        torch.save(got, Path(out) / "leader.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_group_shares_prefixes_through_the_prefix_cache(tmp_path):
    """Each rank caches its shard of every entry: later prompts hit (a branch resumed from the grid, an extension
    from the leaf), and their tokens and logits are the single process's; eviction is mirrored too."""
    spawn_ranks(lead_with_a_prefix_cache, 2, 2, str(tmp_path))
    got = torch.load(tmp_path / "leader.pt", weights_only=False)
    assert not got["errors"]
    assert got["tokens"] == got["want"]
    stats = got["stats"]
    assert stats.hits >= 4 and stats.evictions > 0 and got["emptied"] == 0  # prompts 1, 2, by hand, the last
    assert got["cached"] == 40
    assert got["entries"] and torch.load(tmp_path / "mirror.pt") == got["entries"]  # the same blocks, states alike
    assert rel(got["logits"], got["want_logits"]) < 1e-5


def test_a_served_two_rank_target_gives_the_single_process_tokens_and_fails_whole(tmp_path):
    """`serve-target --tensor-parallel 2` beside `serve-draft` (a near-copy: rounds kept in part): greedy tokens of
    the single-process target through Generate's loop and the client-driven one (pipelined), then for three
    Generate streams at once (batched passes), and for a prompt sent twice (the second from the prefix cache); a
    follower killed takes the group down (callers see it gone)."""
    save_checkpoint(random_model(hf_config(), seed=3), tmp_path / "target")
    save_checkpoint(near_copy(random_model(hf_config(), seed=3), seed=4), tmp_path / "draft")
    single = load_model(tmp_path / "target").fuse()
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    want = generate(single, prompt, 16).token_ids
    with Served("serve-draft", tmp_path / "draft") as drafted, \
            Served("serve-target", tmp_path / "target", "--tensor-parallel", "2", "--draft-addr", drafted.address,
                   "--draft-timeout", "30", "--draft-length", "fixed") as served:
        assert both_loops(served, drafted, prompt, 16, 3) == (want, want)
        streams = [(prompt, 3, 16), (prompt[:6], 2, 8), (prompt[:3], 0, 12)]
        out = run_threads(lambda i: generate_on_server(served.address, streams[i][0], "", streams[i][2],
                                                       streams[i][1])[0].token_ids, list(range(len(streams))))
        assert out == [generate(single, ids, n).token_ids for ids, _, n in streams]
        long = prompt * 3  # its first 16 positions cached by the first request (the default blocks of 16)
        first, again = (generate_on_server(served.address, long, "", 8, 3)[0] for _ in range(2))
        assert first.token_ids == again.token_ids == generate(single, long, 8).token_ids
        assert again.stats.cached_prompt_tokens >= 16
        kill_a_follower(served)
        assert served.proc.wait(timeout=60) == 70
        assert any("tensor parallel group broken" in line for line in served.log)
        with pytest.raises(grpc.RpcError) as gone:
            generate_on_server(served.address, prompt, "", 4, 0, recovery_window_s=0)
        assert gone.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow  # one more served group (about 8 s on 2 cores): the head's sharding runs in the suite in process
def test_a_served_two_rank_target_drafts_with_its_sharded_mtp_head(tmp_path):
    """`serve-target --tensor-parallel 2 --draft mtp`: each rank drafts with its shard of the MTP head; greedy tokens
    of the single-process target, for two Generate streams at once."""
    model = target(CASES["qwen3_5"]())
    save_checkpoint(model, tmp_path)
    single = load_model(tmp_path).fuse()
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], PROMPT]
    with Served("serve-target", tmp_path, "--tensor-parallel", "2", "--draft", "mtp") as served:
        out = run_threads(lambda i: generate_on_server(served.address, prompts[i], "", 16, 3)[0], [0, 1])
    assert [r.token_ids for r in out] == [generate(single, ids, 16).token_ids for ids in prompts]
    assert all(r.stats.drafted > 0 for r in out)


def kill_a_follower(served: Served) -> None:
    children = Path(f"/proc/{served.proc.pid}/task/{served.proc.pid}/children").read_text().split()
    os.kill(next(int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()),
            signal.SIGKILL)


FAULTS = Path(__file__).with_name("tp_faults.py")


# 10 kills start the group 11 times (about 70 s on 2 cores): with -m slow; 2 in the suite (about 25 s)
@pytest.mark.parametrize("kills", [2, pytest.param(10, marks=pytest.mark.slow)])
def test_sessions_whose_group_loses_a_rank_inside_rounds_end_as_undisturbed_ones(kills, tmp_path):
    """Three Generate streams at once while a rank dies `kills` times, each death inside a round on purpose
    (tests/tp_faults.py), in turn: a follower right after rank 0 announced a pass (rank 0 waits in its all-reduce),
    a follower right after rank 0 kept a commit the follower has not, rank 0 itself right after it announced a pass
    (the followers wait in an all-reduce it never joins), a follower between two layers of a pass. The group is laid
    out in turn on one host (the follower a child process rank 0 watches) and over two nodes (`--nnodes 2`: two
    processes, each learning of the other's death from its collectives alone). Each time the group exits (rank 0
    with 70 where a follower died) and its supervisor (here the test) starts it again on the same port; the
    streams, recovering as after any target restart, end with the undisturbed tokens, each streamed once: none
    lost, no round applied twice."""
    save_checkpoint(random_model(hf_config(), seed=3), tmp_path)
    single = load_model(tmp_path).fuse()
    prompts, n = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13], [42, 17, 3]], 8 + 8 * kills
    want = [generate(single, p, n).token_ids for p in prompts]
    assert all(len(tokens) == n for tokens in want)  # none ends early: every stream is in flight at every death
    port = free_port()
    # the N-th such call, or all-reduce (8 a pass of the test's 4 layers: the 7 N-th is inside a pass, past its first)
    deaths = [f"{('pass', 'commit', 'leader-pass', 'reduce')[i % 4]}:{(4 + 3 * i % 5) * (7 if i % 4 == 3 else 1)}"
              for i in range(kills)]

    def group(i: int) -> tuple[Served, subprocess.Popen | None]:
        """The i-th group (rank 0, and node 1's process when over two nodes); its follower dies at deaths[i]."""
        env = {**os.environ, "OMP_NUM_THREADS": "1"} | ({"DELTASPEC_TEST_DIE_AT": deaths[i]} if i < kills else {})
        layout: tuple[str, ...] = ("--tensor-parallel", "2")
        node1 = None
        if i % 2:
            layout += ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()))
            node1 = subprocess.Popen([sys.executable, str(FAULTS), "serve-target", "--model", str(tmp_path), "--port",
                                      "0", *layout, "--node-rank", "1"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env=env)
        return Served("serve-target", tmp_path, *layout, "--draft", "ngram", port=port, env=env,
                      program=(str(FAULTS),)), node1

    groups = [group(0)]
    seen: list[list[int]] = [[] for _ in prompts]

    def stream(i: int) -> list[int]:
        return generate_on_server(groups[0][0].address, prompts[i], "", n, 3, recovery_window_s=120,
                                  on_tokens=lambda tokens, _text: seen[i].extend(tokens))[0].token_ids

    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            out = [pool.submit(stream, i) for i in range(len(prompts))]
            for i in range(1, kills + 1):
                leader, node1 = groups[-1]
                follower_died = not deaths[i - 1].startswith("leader-")
                assert leader.proc.wait(timeout=120) == (70 if follower_died else 9)
                assert node1 is None or node1.wait(timeout=60) == (9 if follower_died else 70)
                # every stream still in flight at each death (n is well above the tokens a group lives for)
                assert not any(f.done() for f in out), [len(tokens) for tokens in seen]
                assert any("tensor parallel group broken" in line for line in leader.log) == follower_died
                groups.append(group(i))  # the supervisor: a new group on the same address
            got = [f.result(timeout=300) for f in out]
    finally:
        for leader, node1 in groups:
            leader.__exit__()
            if node1:
                node1.kill()
    assert len(groups) == kills + 1
    assert got == want and seen == want


@pytest.mark.parametrize("extra, message", [
    (("--tensor-parallel", "3"), "tensor parallel size 3 does not divide num_attention_heads (4)"),
    (("--tensor-parallel", "2", "--compile"), "--compile is not built for --tensor-parallel yet"),
    (("--tensor-parallel", "2", "--expert-parallel"), "expert parallelism needs routed experts"),
])
def test_serve_target_refuses_what_a_group_cannot_serve_at_start(extra, message, tmp_path):
    save_checkpoint(random_model(hf_config(), seed=3), tmp_path)
    out = subprocess.run([sys.executable, "-m", "deltaspec.shared.cli", "serve-target", "--model", str(tmp_path),
                          "--port", "0", *extra], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr


def serve_target_command(model: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "deltaspec.shared.cli", "serve-target", "--model", str(model), "--port", "0", *extra]


def test_two_nodes_form_one_group_that_serves_the_single_process_tokens(tmp_path):
    """Two `serve-target --nnodes 2` processes (node ranks 0 and 1, one rank each, meeting on loopback) form one
    2-rank group: node 0 serves the single process's greedy tokens; node 1 serves nothing, and exits 70 once the
    group breaks (node 0 killed). Node 1 dying inside rounds: the fault test below."""
    save_checkpoint(random_model(hf_config(), seed=3), tmp_path / "target")
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    want = generate(load_model(tmp_path / "target").fuse(), prompt, 16).token_ids
    nodes = ("--tensor-parallel", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()))
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen(serve_target_command(tmp_path / "target", *nodes, "--node-rank", "1"),
                                 stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        with Served("serve-target", tmp_path / "target", *nodes, "--node-rank", "0") as node0:
            node0.wait_serving()
            assert generate_on_server(node0.address, prompt, "", 16, 0)[0].token_ids == want
            node0.proc.kill()
        assert node1.wait(timeout=60) == 70
    finally:
        node1.kill()
    log = (tmp_path / "node1.log").read_text()
    assert "follow rank 0 at 127.0.0.1" in log and "tensor parallel group broken" in log and "listening" not in log


@pytest.mark.parametrize("extra, message", [
    (("--nnodes", "2", "--node-rank", "2"), "--node-rank 2 is not one of the 2 nodes' (0 to 1)"),
    (("--tensor-parallel", "3", "--nnodes", "2"), "--tensor-parallel 3 is not a multiple of --nnodes 2"),
    (("--nnodes", "2", "--master-addr", ""), "the group meets at --master-addr:--master-port"),
])
def test_a_node_that_cannot_join_a_group_is_refused_before_it_loads(extra, message, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    save_checkpoint(random_model(hf_config(), seed=3), tmp_path)
    argv = serve_target_command(tmp_path, "--tensor-parallel", "2", "--master-addr", "127.0.0.1", "--master-port",
                                "29500", *extra)[3:]
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err


def test_torchrun_started_ranks_form_one_group_that_serves_the_single_process_tokens(tmp_path):
    """`torchrun --nproc-per-node 2 -m deltaspec.shared.cli serve-target`: each process one rank (torchrun's RANK,
    WORLD_SIZE, LOCAL_RANK, meeting at its agent's store); rank 0 serves the single process's greedy tokens, and a
    rank killed ends the group (torchrun then fails the run, or restarts it with --max-restarts)."""
    save_checkpoint(random_model(hf_config(), seed=3), tmp_path)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    want = generate(load_model(tmp_path).fuse(), prompt, 16).token_ids
    torchrun = ("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                "-m", "deltaspec.shared.cli")
    with Served("serve-target", tmp_path, program=torchrun) as served:
        served.wait_serving()
        assert generate_on_server(served.address, prompt, "", 16, 0)[0].token_ids == want
        assert any("tensor parallel: rank 0 of 2 leads" in line for line in served.log)
        ranks = Path(f"/proc/{served.proc.pid}/task/{served.proc.pid}/children").read_text().split()
        os.kill(next(int(r) for r in ranks if b"RANK=1\0" in Path(f"/proc/{r}/environ").read_bytes()),
                signal.SIGKILL)
        assert served.proc.wait(timeout=60) != 0
    assert any("tensor parallel group broken" in line for line in served.log)


def test_a_node_holds_its_share_of_the_ranks_one_a_gpu():
    node = Placement(8, "10.0.0.1", 29500, nnodes=2, node_rank=1)
    assert node.ranks == range(4, 8) and node.device(5, "cuda") == "cuda:1" and node.device(5, "cpu") == "cpu"
    assert (node.rendezvous, node.meet_s) == ("tcp://10.0.0.1:29500", 600.0)  # nodes start minutes apart
    assert Placement(2, "127.0.0.1", 1).meet_s == 60.0 and Placement(8, "h", 1, 2, 1, wait_s=5).meet_s == 5
    torchrun = Placement.from_torchrun({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "16", "RANK": "11",
                                        "LOCAL_RANK": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, 1)
    assert torchrun.ranks == range(11, 12) and torchrun.device(11, "cuda") == "cuda:3"
    assert (torchrun.rendezvous, torchrun.meet_s) == ("env://", 60.0)  # its agents have met already
    assert Placement.from_torchrun({}, 2) is None


def test_the_master_address_defaults_to_torchs_variables(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    args = build_parser().parse_args(["serve-target", "--port", "1"])
    assert (args.master_addr, args.master_port) == ("10.0.0.1", 29511)
    args = build_parser().parse_args(["serve-target", "--port", "1", "--master-addr", "a", "--master-port", "2"])
    assert (args.master_addr, args.master_port) == ("a", 2)


@pytest.mark.parametrize("extra, message", [
    (("--tensor-parallel", "4"), "--tensor-parallel 4 is not torchrun's WORLD_SIZE 2"),
    (("--nnodes", "2"), "under torchrun, its own --nnodes and --node-rank place the ranks"),
])
def test_serve_target_under_torchrun_takes_its_placement(extra, message, tmp_path, capsys, monkeypatch):
    for name, value in {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    save_checkpoint(random_model(hf_config(), seed=3), tmp_path)
    assert cli_main(serve_target_command(tmp_path, *extra)[3:]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("node", [0, 1])
def test_a_node_whose_group_does_not_meet_fails_within_its_rendezvous_timeout(node, tmp_path, capsys):
    """Node 1 of 2 with nobody listening at the master's address, or node 0 whose node 1 never comes: refused
    naming the address, within twice the timeout (torch's store tries to connect twice) and the load."""
    save_checkpoint(random_model(hf_config(), seed=3), tmp_path)
    port, threads = free_port(), torch.get_num_threads()
    started = time.monotonic()
    try:
        assert cli_main(serve_target_command(tmp_path, "--tensor-parallel", "2", "--nnodes", "2", "--node-rank",
                                             str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                                             "--rendezvous-timeout", "1")[3:]) == 2
    finally:
        torch.set_num_threads(threads)  # the rank set its own
    assert time.monotonic() - started < 10
    assert f"tensor parallel rank {node} of 2 could not meet the others at 127.0.0.1:{port} within 1 s" in \
        capsys.readouterr().err


@pytest.mark.parametrize("shape", ["QWEN3_NEXT_80B_A3B", "QWEN35_35B_A3B"])
def test_the_published_moe_shapes_shard_over_2_4_and_8_ranks(shape):
    """Their 2 K/V heads replicated beyond 2 ranks; 3 ranks divide nothing."""
    cfg = ModelConfig.from_dict(getattr(shapes, shape))
    for world in (2, 4, 8):
        part = sharded_config(cfg, world)
        assert part.linear_num_value_heads * world == cfg.linear_num_value_heads
        assert part.num_key_value_heads == max(1, cfg.num_key_value_heads // world)
    with pytest.raises(ConfigError, match="does not divide num_attention_heads"):
        sharded_config(cfg, 3)


def join_alone(_rank: int, out: str) -> None:
    started = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - torch's own (a store timeout), whichever it is
        join(0, 2, rendezvous(out), timeout_s=3)
    assert time.monotonic() - started < 30


def test_a_rank_whose_peers_never_come_fails_start_up_within_the_timeout(tmp_path):
    mp.spawn(join_alone, args=(str(tmp_path),), nprocs=1)
