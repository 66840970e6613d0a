"""On CUDA the model, its versioned state, the decoding loop and the served models give what the CPU gives.

Skipped without a GPU (CI has none); `scripts/gpu_check.sh` runs this file on one. float32 with TF32 off, so
the GPU differs from the CPU by float32 rounding only (other kernels: Triton for T <= 16 tokens, the chunked form
on CUDA beyond), compared per tensor to a relative 1e-4 of its scale as in test_rollback.
- Random models of every conftest config, layer and fused paths: a prefill, a verify with a partial commit, a
  reverted verify, a chained round (mark, commit_marked, commit) and a decode step, with K/V growing on the
  device: every pass's logits and the final head equal the CPU's; a batched pass (`forward_batch`, ragged) equals
  single passes.
- The embedded pair on the GPU: greedy target-only equals the CPU's tokens; greedy speculation (draft model, MTP,
  n-gram) equals target-only; sampled speculation draws what the CPU draws, seed for seed.
- Both services on the GPU over loopback gRPC: the server loop, the client-driven loop and concurrent (batched)
  sessions give the in-process tokens, greedy and sampled.
- Compiled passes (`--compile`: Inductor's graphs for the GPU), both ways of compiling: a random model's rounds
  equal the CPU's eager ones; the compiled embedded pair's greedy tokens, target-only and speculative, equal the
  eager GPU's.
- Captured passes (`--capture`: CUDA graphs, over eager or compiled kernels): a random model's rounds equal the
  CPU's, recorded and then replayed; the captured embedded pair's greedy tokens, target-only and speculative,
  equal the eager GPU's.
- `deltaspec generate --device cuda` from the command line gives the CPU's greedy tokens.
- A bf16 MoE target: experts as grouped matmuls on sm90/sm100, eager, compiled and captured, against the CPU.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from benchmarks.loopback import PROMPTS
from deltaspec.shared.decoding.drafters import make_drafter
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from deltaspec.shared.model.batched import forward_batch
from deltaspec.shared.model.checkpoint import hf_config, hf_moe_config, random_model
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)")

REL = 1e-4
TOKENS = torch.randint(0, 89, (31,), generator=torch.Generator().manual_seed(0)).tolist()  # 89: the smallest vocab
N = 48
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=3)


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # cudnn: the layer path's conv
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def assert_near(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    err = (got.cpu().double() - want.cpu().double()).abs().max()
    assert err <= REL * want.abs().max().clamp_min(1e-3), f"{what}: max abs diff {err:.3g}"


def rounds(model) -> tuple[list[torch.Tensor], object]:
    """A prefill, then rounds ending every way the state API allows; each pass's logits and the state after."""
    ids, state, logits = torch.tensor(TOKENS), model.new_state(capacity=16), []  # 16: K/V grows in the prefill

    def stage(a: int, b: int) -> None:
        logits.append(model(ids[a:b], state)[0])

    stage(0, 20)  # prefill: the chunked form on both devices
    state.commit(20)
    stage(20, 26)  # a verify of 6 (Triton on CUDA), 3 kept: a partial commit from the logs
    state.commit(3)
    stage(23, 27)  # a verify dropped
    state.revert()
    stage(23, 28)  # a verify, a round chained on it, the first kept by a pointer swap, 2 of the second kept
    state.mark()
    stage(28, 31)
    state.commit_marked()
    state.commit(2)
    stage(30, 31)  # a decode step
    state.commit(1)
    return logits, state


def assert_same_head(state, ref) -> None:
    assert (state.length, state.staged, state.marked) == (ref.length, ref.staged, ref.marked)
    n = ref.length
    pairs = [("recurrent", state.recurrent.state, ref.recurrent.state), ("conv window", state.recurrent.conv, ref.recurrent.conv)]
    pairs += [(f"attention {i} {kv}", getattr(a, kv)[:, :n], getattr(b, kv)[:, :n])
              for i, (a, b) in enumerate(zip(state.attn, ref.attn, strict=True)) for kv in ("k", "v")]
    for what, a, b in pairs:
        assert a.is_cuda, what
        assert_near(a, b, what)


@pytest.mark.parametrize("fused", [False, True], ids=["layers", "fused"])
def test_rounds_on_cuda_match_cpu(config_dict, fused):
    cpu, gpu = random_model(config_dict, seed=3), random_model(config_dict, seed=3).to("cuda")
    if fused:
        cpu.fuse()
        gpu.fuse()
    (want, ref), (got, state) = rounds(cpu), rounds(gpu)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.is_cuda
        assert_near(a, b, f"logits of pass {i}")
    assert state.length == len(TOKENS)
    assert_same_head(state, ref)


@pytest.mark.parametrize("lengths", [(1, 3, 5), (2, 20, 1)], ids=["triton", "chunked"])
def test_batched_pass_matches_single_passes(lengths):
    model = random_model(hf_config(), seed=5).to("cuda").fuse()
    ids = [torch.tensor(TOKENS[i:i + 3 * i + 2 + T]) for i, T in enumerate(lengths)]  # histories of 2, 5, 8 tokens

    def with_history() -> list:
        states = []
        for i, x in enumerate(ids):
            states.append(model.new_state())
            model(x[:3 * i + 2], states[-1])
            states[-1].commit(3 * i + 2)
        return states

    alone, together = with_history(), with_history()
    want = [model(x[3 * i + 2:], s) for i, (x, s) in enumerate(zip(ids, alone))]
    got = forward_batch(model, [(x[3 * i + 2:], s) for i, (x, s) in enumerate(zip(ids, together))])
    for (logits, hidden), (want_logits, want_hidden) in zip(got, want, strict=True):
        assert_near(logits, want_logits, "logits")
        assert_near(hidden, want_hidden, "hidden")
    for a, b in zip(together, alone):
        a.commit(a.staged)
        b.commit(b.staged)
        assert_same_head(a, b)


# ---- the embedded pair ----


@pytest.fixture(scope="module")
def pair():
    return load_model(DEFAULT_TARGET, device="cuda"), load_model(DEFAULT_DRAFT, device="cuda")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    return [tokenizer.encode(p) for p in PROMPTS[:4]]


@pytest.fixture(scope="module")
def greedy(pair, prompts) -> list[list[int]]:
    return [generate(pair[0], p, N).token_ids for p in prompts]


def drafter(name: str, target, draft, sampling: SamplingParams = SamplingParams()):
    return ModelDrafter(draft, sampling, 0.3) if name == "draft" else make_drafter(name, target, sampling)


def test_target_only_greedy_matches_cpu(prompts, greedy):
    cpu = load_model(DEFAULT_TARGET)
    assert [generate(cpu, p, N).token_ids for p in prompts] == greedy


@pytest.mark.parametrize("name,k", [("draft", 4), ("draft", 16), ("mtp", 4), ("ngram", 4)])
def test_greedy_speculation_equals_target_only(pair, prompts, greedy, name, k):
    for prompt, want in zip(prompts, greedy):
        result = generate(pair[0], prompt, N, drafter(name, *pair), k)
        assert result.token_ids == want
        assert name == "ngram" or result.stats.accepted > 0


@pytest.mark.parametrize("name", ["draft", "mtp", "ngram"])
def test_sampled_speculation_draws_what_the_cpu_draws(pair, prompts, name):
    cpu = load_model(DEFAULT_TARGET), load_model(DEFAULT_DRAFT)
    for prompt in prompts[:2]:
        got = generate(pair[0], prompt, N, drafter(name, *pair, SAMPLED), 4, SAMPLED)
        want = generate(cpu[0], prompt, N, drafter(name, *cpu, SAMPLED), 4, SAMPLED)
        assert got.token_ids == want.token_ids
        assert got.stats.drafted > got.stats.accepted  # rejections happened: the residual draws ran on the GPU


# ---- served on the GPU ----


@pytest.fixture(scope="module")
def served():
    """Both services in this process, models and states on the GPU; the target speculates with the draft."""
    from deltaspec.draft_service import servicer as draft_servicer
    from deltaspec.target_service import servicer as target_servicer
    from test_rpc_support import start

    with start(draft_servicer.service(lambda: load_model(DEFAULT_DRAFT, device="cuda"))) as draft:
        peer = target_servicer.DraftPeer(draft.address, timeout_s=30.0)  # a first proposal may wait on Triton's JIT
        with start(target_servicer.service(lambda: (load_model(DEFAULT_TARGET, device="cuda"),
                                                    load_tokenizer(DEFAULT_TARGET)), draft=peer)) as target:
            yield target.address, draft.address


def test_served_greedy_equals_in_process(served, prompts, greedy):
    from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server

    target, draft = served
    result, _ = generate_on_server(target, prompts[0], "", N)
    assert result.token_ids == greedy[0] and result.stats.accepted > 0
    result, _ = generate_client_driven(target, draft, prompts[0], "", N, draft_timeout_s=30.0)
    assert result.token_ids == greedy[0] and result.stats.accepted > 0
    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent sessions: batched passes on both servers
        loops = [pool.submit(generate_on_server, target, p, "", N) for p in prompts]
        loops += [pool.submit(generate_client_driven, target, draft, p, "", N, draft_timeout_s=30.0) for p in prompts]
        assert [f.result()[0].token_ids for f in loops] == greedy + greedy


def test_served_sampled_equals_in_process(served, pair, prompts):
    from deltaspec.shared.rpc.generation import generate_client_driven, generate_on_server

    target, draft = served
    want = generate(pair[0], prompts[0], N, ModelDrafter(pair[1], SAMPLED), 4, SAMPLED)
    assert want.stats.drafted > want.stats.accepted
    assert generate_on_server(target, prompts[0], "", N, 4, SAMPLED)[0].token_ids == want.token_ids
    assert generate_client_driven(target, draft, prompts[0], "", N, 4, SAMPLED,
                                  draft_timeout_s=30.0)[0].token_ids == want.token_ids


# ---- compiled passes (`--compile`) on the GPU ----


@pytest.mark.parametrize("layer_types", [["linear_attention", "full_attention"],
                                         ["full_attention", "linear_attention", "linear_attention", "full_attention",
                                          "linear_attention"]], ids=["whole-graph", "per-layer-kind"])
def test_compiled_rounds_on_cuda_match_cpu(layer_types):
    """Inductor's graphs for the GPU, both ways of compiling (one graph for a shallow model, one per layer kind for a
    deeper one): every pass and the head after every way a round ends equal the CPU's eager rounds."""
    from deltaspec.shared.model.compiled import WHOLE_GRAPH_LAYERS

    config = hf_config(layer_types=layer_types)
    cpu, gpu = random_model(config, seed=7).fuse(), random_model(config, seed=7).to("cuda").fuse().compile()
    assert gpu.compiled.per_layer == (len(layer_types) > WHOLE_GRAPH_LAYERS)
    (want, ref), (got, state) = rounds(cpu), rounds(gpu)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_near(a, b, f"logits of pass {i}")
    assert_same_head(state, ref)


def test_compiled_pair_on_cuda_speculates_target_only_tokens(prompts, greedy):
    """The embedded pair compiled on the GPU (`--device cuda --compile`): target-only and speculative greedy tokens
    equal the eager GPU's (and so the CPU's)."""
    target = load_model(DEFAULT_TARGET, device="cuda").compile()
    draft = load_model(DEFAULT_DRAFT, device="cuda").compile()
    for prompt, want in zip(prompts[:2], greedy):
        assert generate(target, prompt, N).token_ids == want
        result = generate(target, prompt, N, ModelDrafter(draft), 4)
        assert result.token_ids == want and result.stats.accepted > 0


def test_generate_on_the_gpu_from_the_command_line(prompts, greedy):
    """`deltaspec generate --device cuda`: the embedded pair on the GPU, the CPU's greedy tokens."""
    ids = ",".join(map(str, prompts[0]))
    out = subprocess.run([sys.executable, "-m", "deltaspec.shared.cli", "generate", "--device", "cuda",
                          "--prompt-ids", ids, "--max-new-tokens", str(N), "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["token_ids"] == greedy[0] and result["stats"]["drafted"] > 0



# ---- captured passes (`--capture`: CUDA graphs) ----


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_captured_rounds_on_cuda_match_cpu(compiled):
    """Passes recorded as CUDA graphs (over eager or compiled kernels), then replayed: every pass and the head after
    every way a round ends equal the CPU's eager rounds, the second time through too (replays, not recordings)."""
    config = hf_config(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                                    "linear_attention"])
    cpu, gpu = random_model(config, seed=7).fuse(), random_model(config, seed=7).to("cuda").fuse()
    gpu.compile(compiled).capture()
    want, ref = rounds(cpu)
    for attempt in range(2):
        got, state = rounds(gpu)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_near(a, b, f"logits of pass {i}, attempt {attempt}")
        assert_same_head(state, ref)
        del state  # the second attempt's state may sit where this one's buffers were: its graphs replay
    assert gpu.captured.recorded > 0


def test_captured_pair_on_cuda_speculates_target_only_tokens(prompts, greedy):
    """The embedded pair captured on the GPU (`--device cuda --capture`): target-only and speculative greedy tokens
    equal the eager GPU's (and so the CPU's), with most passes replayed rather than recorded."""
    target = load_model(DEFAULT_TARGET, device="cuda").capture()
    draft = load_model(DEFAULT_DRAFT, device="cuda").capture()
    passes = 0
    for prompt, want in zip(prompts[:2], greedy):
        assert generate(target, prompt, N).token_ids == want
        result = generate(target, prompt, N, ModelDrafter(draft), 4)
        assert result.token_ids == want and result.stats.accepted > 0
        passes += 2 * N
    assert 0 < target.captured.recorded < passes // 4


# ---- sparse MoE targets in bfloat16: experts as grouped matmuls ----


def test_bfloat16_moe_target_groups_its_experts_and_captures_on_cuda():
    """bf16 Qwen3-Next targets on the GPU. On sm90/sm100 the experts run as `torch._grouped_mm` (no host sync): the
    grouped form gives the CPU's loop over the used experts on random tokens and routes (empty groups included) to
    bf16 rounding; eager, compiled and captured passes (over eager and compiled kernels, recorded then replayed) of
    a target whose tokens take every expert (so bf16 rounding cannot flip a route) give the CPU's logits to bf16
    rounding; captured speculation on a 16-expert top-4 target gives its target-only tokens. Elsewhere capture
    refuses such a model and says why."""
    from deltaspec.shared.kernels.experts import apply_experts, grouped_gemm_fast
    from deltaspec.shared.model.moe import Experts, route

    def on(config: dict, device: str, compiled: bool = False, captured: bool = False):
        model = random_model(config, seed=9).to(torch.bfloat16).to(device).fuse()
        return model.compile(compiled).capture(captured) if captured or compiled else model

    top4 = hf_moe_config("qwen3_next", num_experts=16, num_experts_per_tok=4)
    if not grouped_gemm_fast(torch.device("cuda"), torch.bfloat16, 64, 32):
        with pytest.raises(ValueError, match="sm90"):
            on(top4, "cuda", captured=True)
        pytest.skip("grouped matmuls are one kernel on sm90/sm100 GPUs only")
    gen = torch.Generator().manual_seed(8)
    experts = Experts(12, 64, 32).to(torch.bfloat16)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    on_gpu = copy.deepcopy(experts).to("cuda")
    for T in (1, 5, 40):
        x = torch.randn(T, 64, generator=gen).to(torch.bfloat16)
        weights, chosen = route(torch.randn(T, 12, generator=gen).to(torch.bfloat16), 3, renormalise=True)
        want, read = apply_experts(experts.gate_up_proj, experts.down_proj, x, weights, chosen, grouped=False)
        got, counted = apply_experts(on_gpu.gate_up_proj, on_gpu.down_proj, x.cuda(), weights.cuda(), chosen.cuda())
        assert (got.cpu().float() - want.float()).norm() / want.float().norm() < 1e-2 and int(counted) == read
        # expert parallelism: each half of the experts' share, grouped on the GPU, adds up to the whole
        shares = [apply_experts(on_gpu.gate_up_proj[6 * r:6 * r + 6], on_gpu.down_proj[6 * r:6 * r + 6], x.cuda(),
                                weights.cuda(), chosen.cuda(), first=6 * r)[0] for r in range(2)]
        assert ((shares[0] + shares[1]).cpu().float() - want.float()).norm() / want.float().norm() < 1e-2
    every = hf_moe_config("qwen3_next", num_experts=4, num_experts_per_tok=4)
    want, _ = rounds(on(every, "cpu"))
    for compiled, captured, attempts in ((False, False, 1), (True, False, 1), (False, True, 2), (True, True, 2)):
        model = on(every, "cuda", compiled, captured)
        for attempt in range(attempts):
            got, _ = rounds(model)
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                err = (a.cpu().float() - b.float()).norm() / b.float().norm()
                assert err < 5e-2, f"compiled {compiled}, captured {captured}: logits of pass {i}, attempt {attempt}"
    target = on(top4, "cuda", captured=True)
    draft = random_model(hf_config(layer_types=["linear_attention", "full_attention"]), seed=10).to(torch.bfloat16)
    draft = draft.to("cuda").fuse().capture()
    assert (generate(target, TOKENS[:12], N, ModelDrafter(draft), 4).token_ids
            == generate(target, TOKENS[:12], N).token_ids)
