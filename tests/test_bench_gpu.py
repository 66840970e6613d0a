"""The bench's GPU section (`benchmarks.gpu`) on the CPU at a tiny shape: every row it reports is there, the
bytes behind its floors are the ones counted here by hand, and HF's model shares our weights (the same tokens)."""
import importlib.util
from dataclasses import replace

import pytest
import torch

from benchmarks import gpu, shapes
from benchmarks.generation import fast_paths, print_fast_paths
from benchmarks.moe_passes import break_even
from benchmarks.rounds import random_model_on
from deltaspec.shared.model.checkpoint import hf_config, hf_moe_config, random_model
from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.hybrid import HybridLM

# one GDN and one attention layer, untied: hidden 64, FFN 128, attention 4 heads / 2 K/V heads of 16, GDN 2 QK / 4 V
# heads of 16, conv kernel 4, vocabulary 257
TINY = hf_config(layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False)
DRAFT = hf_config(layer_types=["linear_attention", "full_attention"])
PLAN = replace(gpu.QUICK, batches=(1, 3), repeats=2, context=40, tokens=8, min_tokens=4, hf_tokens=6, copy_mib=4,
               budget_s=120, divergence_prompts=2, divergence_tokens=10, divergence_shape="tiny")
BF16 = 2


def by_hand_params() -> int:
    conv_dim = 2 * 2 * 16 + 4 * 16  # q and k of 2 key heads, v of 4 value heads
    gdn = conv_dim * 64 + 64 * 64 + 2 * 4 * 64 + conv_dim * 4 + 4 + 4 + 16 + 64 * 64  # in_proj qkv, z, b and a; conv;
    # dt_bias, A_log; the gated norm; out_proj
    attention = 2 * 64 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 16  # q (with its gate), k, v, o; q and k norms
    mlp_and_norms = 3 * 128 * 64 + 2 * 64
    return gdn + attention + 2 * mlp_and_norms + 64 + 2 * 257 * 64  # final norm, embedding table and LM head


def test_bytes_a_pass_moves_counted_by_hand():
    model = random_model_on(TINY, "cpu", torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == by_hand_params()
    # weights: all but the untied embedding table, of which a pass reads its 5 rows
    assert gpu.weight_bytes(model, 5, 0) == BF16 * (by_hand_params() - 257 * 64 + 5 * 64)
    state = 4 * 16 * 16 * 4  # float32 (H, Dk, Dv)
    window = 3 * 128 * BF16  # K-1 pre-conv rows
    log_per_token = 128 * BF16 + 4 * 16 * 4 + 4 * 16 * 4 + 4 * 4  # x, k, delta, g
    kv_per_position = 2 * 2 * 16 * BF16  # one attention layer's K and V
    assert gpu.pass_bytes(model, 5, 40, 0) == {
        "weights": BF16 * (by_hand_params() - 257 * 64 + 5 * 64),
        "gdn": 2 * (state + window) + 5 * log_per_token,
        "kv": (40 + 5) * kv_per_position + 5 * kv_per_position}  # read up to the last new position, new ones written
    assert gpu.gdn_round_bytes(model.config, torch.bfloat16, 4) == {
        "k": 4, "pass_read": state + window, "pass_written": state + window, "logs_written": 5 * log_per_token,
        "commit_read": state + window + 4 * 4 * (16 + 16 + 1) * 4, "commit_written": state + window}


def test_routed_experts_count_only_those_read():
    moe = random_model_on(hf_moe_config(), "cpu", torch.bfloat16)  # 4 sparse layers of 8 experts, 32 wide
    per_expert = 3 * 32 * 64 * BF16  # gate and up (2 x 32, 64), down (64, 32)
    assert gpu.weight_bytes(moe, 1, 2) - gpu.weight_bytes(moe, 1, 0) == 4 * 2 * per_expert


def test_real_shapes_keep_their_sizes():
    """Text-model parameters of each real shape (no vision tower, no MTP layer), counted on the meta device: a guard
    against a config edited by mistake."""
    billions = {name: gpu.model_bytes(config, torch.bfloat16) / BF16 / 1e9 for name, config in gpu.SHAPES}
    assert billions == pytest.approx({"Qwen3.5-9B": 8.95, "Qwen3.5-0.8B": 0.75, "Qwen3.5-27B": 26.90,
                                      "Qwen3.5-35B-A3B": 34.15}, abs=0.005)


@pytest.mark.parametrize("shape", [shapes.QWEN35_35B_A3B, shapes.QWEN3_NEXT_80B_A3B])
def test_scaled_shapes_keep_what_a_decode_reads_from_each_weight(shape):
    """The MoE bench's small copies of the published shapes (`shapes.scaled`): the routed experts' and the LM head's
    shares of a decode step's weight reads stay within 5 points of the full size's; experts and top-k as published."""
    def shares(config: dict) -> tuple[float, float]:
        with torch.device("meta"):
            model = HybridLM(ModelConfig.from_dict(config))
        k = model.config.num_experts_per_tok
        read = gpu.weight_bytes(model, 1, k)
        return (read - gpu.weight_bytes(model, 1, 0)) / read, model.lm_head.weight.nbytes / read

    small = shapes.scaled(shape)
    assert (small["num_experts"], small["num_experts_per_tok"]) == (shape["num_experts"], shape["num_experts_per_tok"])
    assert small["hidden_size"] == shape["hidden_size"] // 8 and small["num_hidden_layers"] == 4
    assert shares(small) == pytest.approx(shares(shape), abs=0.05)


@pytest.fixture(scope="module")
def section():
    return gpu.gpu("cpu", [("tiny", TINY)], PLAN, DRAFT, torch.float32)


def test_section_reports_every_row(section, capsys):
    assert {"device", "date", "torch", "dtype", "plan", "bandwidth", "draft", "shapes", "goals"} <= set(section)
    assert section["bandwidth"]["gb_s"] > 0
    (shape,) = section["shapes"]
    assert shape["skipped"] is None and "error" not in shape
    rows = shape["passes"]["rows"]
    assert [r["tokens"] for r in rows] == list(range(1, 10))
    for r in rows:
        moved = sum(r["bytes"].values())
        assert r["floor_ms"] == pytest.approx(1000 * moved / (section["bandwidth"]["gb_s"] * 1e9))
        assert r["x_floor"] == pytest.approx(r["ms"] / r["floor_ms"])
        assert r["ms_min"] <= r["ms"] <= r["ms_max"]
        assert r["captured_x_floor"] == pytest.approx(r["captured_ms"] / r["floor_ms"])  # the static pass, on a CPU
    assert rows[0]["vs_decode"] == rows[0]["captured_vs_decode"] == 1
    draft_vs_decode = shape["passes"]["draft_step_ms"] / rows[0]["captured_ms"]
    for r in rows[1:]:  # the acceptance at which a round pays: from the captured passes, and from the floors
        k = r["tokens"] - 1
        assert r["break_even"] == break_even(k, r["captured_vs_decode"], draft_vs_decode)
        assert r["floor_break_even"] == break_even(k, r["floor_ms"] / rows[0]["floor_ms"], 0.0)
        assert 0 < r["floor_break_even"] < 1
    assert [g["k"] for g in shape["gdn_round"]] == list(gpu.KS)
    if importlib.util.find_spec("transformers") is None:
        assert "transformers is not importable" in shape["hf"]["error"]
    else:
        assert shape["hf"]["same_tokens"]  # float32: HF's model on our tensors decodes what ours does
        assert shape["hf"]["ours_tok_s"] > 0 and shape["hf"]["hf_tok_s"] > 0
        assert shape["hf"]["captured_same_tokens"] and shape["hf"]["captured_tok_s"] > 0
    d = shape["divergence"]  # float32 on a CPU: a verify and a decode pass agree, so no prompt differs
    assert (d["prompts"], d["tokens"], d["differ"], d["first_divergence"]) == (2, 10, 0, [])
    assert d["drafted"] > 0 and 0 <= d["rejected"] <= d["drafted"]
    measured = shape["batches"]["rows"]
    assert [m["batch"] for m in measured] == [1, 3]
    for m in measured:
        assert len(m["pass_ms"]) == PLAN.cost_k_max + 1
        policies = [(r["policy"], r["k"], r["alpha"]) for r in m["rows"]]
        assert policies[:5] == [("target-only", 0, None)] + [("fixed", k, a) for k in gpu.KS for a in gpu.ALPHAS]
        assert [p[::2] for p in policies[5:]] == [("cost model", a) for a in gpu.ALPHAS]
        assert m["rows"][0]["speedup"] == 1
        assert all(r["tok_s"] > 0 and 1 <= r["tokens_per_round"] <= r["k"] + 1 for r in m["rows"])
    assert {g["goal"].split()[1] for g in section["goals"][:2]} == {"decode", "verify(5)"}  # captured, the fastest
    assert section["goals"][2]["goal"].startswith("speculation")
    gpu.print_rows(section)
    out = capsys.readouterr().out
    assert "GPU summary: tiny decode" in out and "cost model" in out and "HF generate()" in out
    assert "0 of 2 prompts x 10 tokens differ" in out


def test_a_spent_budget_skips_the_shapes_and_says_so():
    result = gpu.gpu("cpu", [("tiny", TINY)], replace(PLAN, budget_s=0), DRAFT, torch.float32)
    assert result["shapes"] == [{"shape": "tiny", "skipped": "the time budget (0 s) is spent"}]
    assert result["goals"] == []


def test_memory_decides_which_shapes_and_how_many_sessions(monkeypatch):
    monkeypatch.setattr(gpu, "free_bytes", lambda device: 2**30)
    assert gpu.fits(TINY, torch.bfloat16, torch.device("cpu")).endswith("GiB, 1.0 GiB free")  # the 4 GiB margin
    monkeypatch.setattr(gpu, "sessions_that_fit", lambda *args: 2)
    model, draft = random_model_on(TINY, "cpu", torch.float32), random_model_on(DRAFT, "cpu", torch.float32)
    measured = gpu.batches(model, draft, PLAN, gpu.Budget(60), gpu.Stopwatch("cpu"))
    assert [m["batch"] for m in measured["rows"]] == [1, 2]  # the plan's 1, and the most that fit instead of 3
    assert measured["left_out"] == ["batches over 2: their states do not fit the free device memory"]


def test_fast_paths_report_each_path_against_eager(capsys):
    """The embedded pair's row of the GPU section, on tiny random models: eager and captured (on a CPU the static
    pass, no graph) generate the same tokens, each path's rate and its ratio to eager reported."""
    target = random_model(hf_config(), seed=1).fuse()
    draft = random_model(hf_config(layer_types=["linear_attention", "full_attention"]), seed=2).fuse()
    prompts = [torch.randint(0, 89, (10,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    r = fast_paths(target, draft, prompts, 12, repeats=1, paths=("captured",))
    assert set(r["tokens_per_s"]) == {f"{p} {k}" for p in ("eager", "captured") for k in ("target_only", "dynamic")}
    assert set(r["over_eager"]) == {"captured target_only", "captured dynamic"}
    print_fast_paths(r)
    assert "captured/eager" in capsys.readouterr().out
