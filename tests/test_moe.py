"""Qwen3-Next and Qwen3.5-MoE against HF transformers' `Qwen3NextForCausalLM` and `Qwen3_5MoeForCausalLM`.

Random configs of both families: top-1 and top-k > 1, `norm_topk_prob` both ways (Qwen3-Next; Qwen3.5-MoE always
renormalises), a dense layer among sparse ones, value heads != key heads, d_k != d_v. Checkpoints come as HF writes
them (per expert), as HF keeps them in memory (fused 3-D experts), mixed, sharded and bf16.
"""
import json
import logging
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaspec.shared.decoding.batcher import BatchConfig
from deltaspec.shared.decoding.drafters import make_drafter
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.drafters.mtp import random_mtp_weights
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.batched import forward_batch
from deltaspec.shared.model.checkpoint import hf_config, hf_moe_config, random_model, save_checkpoint
from deltaspec.shared.model.loader import CheckpointError, load_model
from deltaspec.shared.kernels.experts import apply_experts, experts_read
from deltaspec.shared.model.moe import Experts, route
from deltaspec.shared.model.tokenizer import load_tokenizer
from deltaspec.shared.rpc.generation import generate_on_server
from deltaspec.target_service import servicer as target_servicer
from test_batching import assert_batched, run_threads
from support import Served, both_loops
from test_rpc_support import start

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "qwen3_5_moe-top2-dk!=dv": hf_moe_config("qwen3_5_moe_text", linear_value_head_dim=8, mtp_num_hidden_layers=1),
    "qwen3_next-top1-unnormed-dense_layer": hf_moe_config(
        "qwen3_next", num_experts=4, num_experts_per_tok=1, norm_topk_prob=False, mlp_only_layers=[1],
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, mtp_num_hidden_layers=1),
    "qwen3_next-top3-normed-sparse_step2": hf_moe_config(
        "qwen3_next", num_experts=6, num_experts_per_tok=3, decoder_sparse_step=2, tie_word_embeddings=False,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        mtp_num_hidden_layers=1),
}
HF_CLASSES = {"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}


def moe_model(config: dict, seed: int):
    model = random_model(config, seed=seed)
    model.mtp = random_mtp_weights(model.config, config.get("mtp_num_hidden_layers", 0), seed=seed + 1)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    return save_checkpoint(moe_model(CONFIGS[request.param], seed=len(request.param)),
                           tmp_path_factory.mktemp(request.param))


def hf_model(directory):
    model_type = json.loads((directory / "config.json").read_text())["model_type"]
    return getattr(transformers, HF_CLASSES[model_type]).from_pretrained(directory, dtype=torch.float32).eval()


def relative(got, want) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_sparse_layers_follow_the_config(checkpoint):
    ours, ref = load_model(checkpoint), hf_model(checkpoint)
    ours_sparse = [type(layer.mlp).__name__ == "SparseMoE" for layer in ours.model.layers]
    hf_sparse = ["SparseMoeBlock" in type(layer.mlp).__name__ for layer in ref.model.layers]
    assert ours_sparse == hf_sparse and any(ours_sparse)


def test_logits_match_hf_full_forward_and_token_by_token(checkpoint):
    """Fused and layer paths, one verify pass and one token at a time, against HF's full forward."""
    ours, ref = load_model(checkpoint), hf_model(checkpoint)
    ids = torch.randint(0, ours.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    for fused in (True, False):
        ours.fuse(fused)
        assert relative(ours(ids, ours.new_state())[0], want) < 1e-4
        state, rows = ours.new_state(capacity=4), []
        for t in ids[:12]:
            rows.append(ours(t[None], state)[0][0])
            state.commit(1)
        assert relative(torch.stack(rows), want[:12]) < 1e-4


def test_greedy_generation_matches_hf_target_only_and_speculative(checkpoint):
    """Target-only, and speculative with a draft model, the MTP head and n-grams at several k: HF's tokens."""
    ours, ref = load_model(checkpoint), hf_model(checkpoint)
    prompt = torch.randint(0, ours.config.vocab_size, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    prompt += prompt[:4]  # a repeat, so n-gram lookup proposes
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    assert generate(ours, prompt, 24).token_ids == want
    draft = random_model(hf_config(vocab_size=ours.config.vocab_size, layer_types=["linear_attention",
                                                                                 "full_attention"]), seed=5).fuse()
    for k in (1, 3, 5):
        drafters = (ModelDrafter(draft), ModelDrafter(ours), make_drafter("mtp", ours), make_drafter("ngram", ours))
        for drafter in drafters:
            got = generate(ours, prompt, 24, drafter, k)
            assert got.token_ids == want, (type(drafter).__name__, k)
            assert got.stats.drafted > 0 or isinstance(drafter, type(make_drafter("ngram", ours)))
    self_drafted = generate(ours, prompt, 24, ModelDrafter(ours), 4).stats
    assert self_drafted.accepted == self_drafted.drafted  # the target drafting for itself: every token accepted


def test_batched_passes_equal_single_ones_and_touch_only_chosen_experts(checkpoint):
    """Sessions of different lengths in one pass (packed tokens routed at once) leave what each alone would."""
    model = load_model(checkpoint)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (5, 9, 3)]
    alone, together = [model.new_state() for _ in prompts], [model.new_state() for _ in prompts]
    for ids, st, (logits, _) in zip(prompts, alone, forward_batch(model, list(zip(prompts, together)))):
        assert relative(logits, model(ids, st)[0]) < 1e-4
    for ids, a, b in zip(prompts, alone, together):
        a.commit(len(ids)), b.commit(len(ids))
    step = [torch.randint(0, model.config.vocab_size, (T,), generator=gen) for T in (1, 5, 2)]
    for ids, st, (logits, _) in zip(step, alone, forward_batch(model, list(zip(step, together)))):
        assert relative(logits, model(ids, st)[0]) < 1e-4
    sparse = [layer.mlp for layer in model.model.layers if type(layer.mlp).__name__ == "SparseMoE"]
    model(step[0], model.new_state())  # one token: exactly top-k experts
    assert all(experts_read(m.touched) == m.top_k for m in sparse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_loop_over_used_ones(dtype):
    """The grouped form (`torch._grouped_mm` over every expert, empty groups included: what GPUs and compiled graphs
    run) against the loop over the distinct experts, on random tokens and routes: 1 token, a verify's 5, a batch's 40
    (every expert chosen), and all tokens on one expert."""
    gen = torch.Generator().manual_seed(8)
    experts = Experts(12, 48, 24)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    experts = experts.to(dtype)
    for T in (1, 5, 40, 6):
        x = torch.randn(T, 48, generator=gen).to(dtype)
        weights, chosen = route(torch.randn(T, 12, generator=gen).to(dtype), 3, renormalise=True)
        if T == 6:
            chosen = torch.full_like(chosen, 7)
        want, read = apply_experts(experts.gate_up_proj, experts.down_proj, x, weights, chosen, grouped=False)
        got, counted = apply_experts(experts.gate_up_proj, experts.down_proj, x, weights, chosen, grouped=True)
        assert relative(got, want) < 1e-6 and experts_read(counted) == read == len(set(chosen.flatten().tolist()))


def test_routing_near_a_tie_is_the_same_in_every_pass(tmp_path):
    """Two experts' router rows equal but for a small difference, so each token's top-k boundary sits near a
    tie (margin ~1e-3 of a probability): decode, verify and batched passes, and HF, route alike."""
    cfg = CONFIGS["qwen3_next-top1-unnormed-dense_layer"]
    model = moe_model(cfg, seed=8)
    with torch.no_grad():
        for layer in model.model.layers:
            if type(layer.mlp).__name__ == "SparseMoE":
                w = layer.mlp.gate.weight
                w[1] = w[0] + 1e-3 * torch.randn(w.shape[1], generator=torch.Generator().manual_seed(9)) / w.norm()
    save_checkpoint(model, tmp_path)
    ours, ref = load_model(tmp_path), hf_model(tmp_path)
    first = next(layer.mlp for layer in ours.model.layers if type(layer.mlp).__name__ == "SparseMoE")
    seen = []
    first.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    ids = torch.randint(0, ours.config.vocab_size, (24,), generator=torch.Generator().manual_seed(10))
    ours.fuse(False)
    ours(ids, ours.new_state())
    with torch.inference_mode():
        probs = torch.softmax(first.gate(seen[0]).float(), -1)
    chosen = probs.argmax(-1)
    assert ((probs[:, 0] - probs[:, 1]).abs() < 1e-2).all()
    assert (chosen <= 1).sum() >= 4  # several tokens pick one of the two near-tied experts
    ours.fuse(True)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    verify = ours(ids, ours.new_state())[0]
    state, rows = ours.new_state(), []
    for t in ids:
        rows.append(ours(t[None], state)[0][0])
        state.commit(1)
    a, b = ours.new_state(), ours.new_state()
    batched = forward_batch(ours, [(ids[:10], a), (ids[:7], b)])
    for got in (verify, torch.stack(rows)):
        assert relative(got, want) < 1e-4
    assert relative(batched[0][0], want[:10]) < 1e-4 and relative(batched[1][0], want[:7]) < 1e-4


def per_expert(tensors: dict, prefix: str) -> None:
    """Fused experts under `prefix` -> HF's per-expert checkpoint layout, in place."""
    for name in [n for n in tensors if n.startswith(prefix) and n.endswith("mlp.experts.gate_up_proj")]:
        base = name[: -len(".gate_up_proj")]
        gate_up, down = tensors.pop(name), tensors.pop(base + ".down_proj")
        for e in range(gate_up.shape[0]):
            gate, up = gate_up[e].chunk(2)
            tensors.update({f"{base}.{e}.gate_proj.weight": gate, f"{base}.{e}.up_proj.weight": up,
                            f"{base}.{e}.down_proj.weight": down[e]})


def test_published_layouts_load_the_same_model(tmp_path):
    """The published Qwen3.5-35B-A3B layout: a multimodal wrapper, main layers fused under
    `model.language_model.layers`, the MTP block per expert, a vision tower, bf16 in two shards."""
    model = moe_model(CONFIGS["qwen3_5_moe-top2-dk!=dv"], seed=12)
    plain = save_checkpoint(model, tmp_path / "plain")
    tensors = load_file(plain / "model.safetensors")
    per_expert(tensors, "mtp.")
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v.to(torch.bfloat16)
               for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2).to(torch.bfloat16)
    out = tmp_path / "published"
    out.mkdir()
    names = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: renamed[k].contiguous() for k in keys}, out / file)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: file for file, keys in shards.items() for k in keys}}))
    text = json.loads((plain / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text,
                                                 "vision_config": {"depth": 1}, "dtype": "bfloat16"}))
    got = load_model(out, dtype=torch.float32)
    want = load_model(plain)
    for (name, a), (_, b) in zip(sorted(got.state_dict().items()), sorted(want.state_dict().items())):
        assert torch.equal(a, b.to(torch.bfloat16).float()), name
    assert got.mtp.keys() == want.mtp.keys()
    ids = torch.arange(11) % got.config.vocab_size
    assert generate(got, ids.tolist(), 8, make_drafter("mtp", got), 3).token_ids == generate(got, ids.tolist(),
                                                                                              8).token_ids


def test_vision_tower_is_skipped_with_a_log_line(tmp_path, caplog):
    plain = save_checkpoint(moe_model(CONFIGS["qwen3_5_moe-top2-dk!=dv"], seed=13), tmp_path)
    tensors = load_file(plain / "model.safetensors")
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(6, 2)
    save_file(tensors, plain / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="deltaspec.shared.model.loader"):
        load_model(plain)
    assert "skipping the vision tower (1 tensors" in caplog.text
    out = subprocess.run([sys.executable, "-m", "deltaspec.shared.cli", "generate", "--target", str(plain),
                          "--prompt-ids", "1,2,3", "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "deltaspec: " in out.stderr and "skipping the vision tower" in out.stderr


@pytest.mark.parametrize("break_it, message", [
    (lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight"),
     "missing tensor 'model.layers.0.mlp.experts.3.up_proj.weight'"),
    (lambda t: t.update({"model.layers.0.mlp.experts.8.gate_proj.weight": torch.zeros(32, 64)}),
     "unexpected tensor 'model.layers.0.mlp.experts.8.gate_proj.weight'"),
    (lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(8, 64, 64)}),
     "model.layers.0.mlp.experts comes both fused"),
    (lambda t: t.pop("model.layers.1.mlp.shared_expert_gate.weight"),
     "missing tensor 'model.layers.1.mlp.shared_expert_gate.weight'"),
    (lambda t: t.update({"model.layers.2.mlp.router_bias": torch.zeros(8)}),
     "unexpected tensor 'model.layers.2.mlp.router_bias'"),
])
def test_broken_checkpoints_stop_naming_the_tensor(tmp_path, break_it, message):
    """Engines have shipped loaders that skipped expert tensors silently: every tensor is consumed or named."""
    plain = save_checkpoint(moe_model(CONFIGS["qwen3_5_moe-top2-dk!=dv"], seed=14), tmp_path)
    tensors = load_file(plain / "model.safetensors")
    per_expert(tensors, "model.layers.0.")
    break_it(tensors)
    save_file(tensors, plain / "model.safetensors")
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        load_model(plain)


def test_hf_written_checkpoints_load(tmp_path):
    """Checkpoints as HF's own `save_pretrained` writes them (experts per expert, Qwen3-Next's packed GDN)."""
    for model_type, cls in HF_CLASSES.items():
        config = hf_moe_config(model_type)
        config_cls = transformers.AutoConfig.for_model(**config)
        torch.manual_seed(15)
        hf = getattr(transformers, cls)(config_cls).eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_(0, 0.3 if p.ndim == 1 else p.shape[-1] ** -0.5)
        hf.save_pretrained(tmp_path / model_type)
        assert any(".experts.0.gate_proj" in k for k in load_file(tmp_path / model_type / "model.safetensors"))
        ours = load_model(tmp_path / model_type)
        ids = torch.randint(0, 257, (20,), generator=torch.Generator().manual_seed(16))
        with torch.no_grad():
            want = hf(ids[None]).logits[0]
        assert relative(ours(ids, ours.new_state())[0], want) < 1e-4


def test_services_serve_hf_tokens_for_a_moe_target(tmp_path):
    """serve-target on a Qwen3-Next checkpoint with its MTP head (server loop) and beside a draft service (client
    loop, pipelined): HF's greedy tokens both ways."""
    target_dir = save_checkpoint(moe_model(CONFIGS["qwen3_next-top3-normed-sparse_step2"], seed=17), tmp_path / "t")
    draft = random_model(hf_config(layer_types=["linear_attention", "full_attention"]), seed=18)
    with Served("serve-draft", save_checkpoint(draft, tmp_path / "d")) as drafted, \
            Served("serve-target", target_dir, "--draft", "mtp") as served:
        prompt = torch.randint(0, 257, (10,), generator=torch.Generator().manual_seed(19)).tolist()
        with torch.no_grad():
            want = hf_model(target_dir).generate(torch.tensor([prompt]), max_new_tokens=24,
                                                 do_sample=False)[0, len(prompt):].tolist()
        assert both_loops(served, drafted, prompt, 24, 3) == (want, want)


@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_batched_generate_streams_on_a_moe_target_equal_hf(drafter, tmp_path):
    """A batching target (Qwen3.5-MoE, its MTP head or n-grams in process): five Generate streams of different
    lengths and k at once, joining and leaving the batch as they start and finish, each HF's greedy tokens."""
    directory = save_checkpoint(moe_model(CONFIGS["qwen3_5_moe-top2-dk!=dv"], seed=20), tmp_path)
    service = target_servicer.service(lambda: (load_model(directory), load_tokenizer(directory)),
                                      local_draft=drafter, batching=BatchConfig(max_batch=8, max_wait_ms=10.0))
    streams = [(5, 3, 24), (12, 4, 16), (3, 2, 28), (9, 1, 20), (8, 0, 12)]  # (prompt length, k, new tokens)
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 257, (n,), generator=gen).tolist() for n, _, _ in streams]
    with start(service) as t:
        results = run_threads(lambda i: generate_on_server(t.address, prompts[i], "", streams[i][2],
                                                           streams[i][1])[0].token_ids, list(range(len(streams))))
        assert_batched(service.load.__self__.model)
    hf = hf_model(directory)
    for prompt, (_, _, n), out in zip(prompts, streams, results):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
        assert out == want
