"""MTP self-speculation with random MTP weights, saved to and loaded from a checkpoint in the published layout:
Qwen3.5's (one or two attention layers) and Nemotron-H's (NVIDIA's names, per-expert tensors, `backbone.`; attention
then MoE, as Nemotron-3 ships it, and an MLP then two attention blocks).

- greedy output identical to target-only, for accept counts spanning 0..k (a steering wrapper
  runs the head every round, then proposes the truth up to a chosen count, so every count occurs);
- the head's incremental KV cache (rows rolled back by position after every round) gives, at each
  round, the same next-token distribution as a from-scratch computation over the committed tokens;
- Nemotron-H's head gives the logits of a naive transcription of vLLM's `nemotron_h_mtp.py` on the published
  tensors (HF 5.25 drops `mtp.*`: there is no HF oracle for the head), and serves losslessly in a batching target.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from deltaspec.shared.decoding.drafters import Proposal, make_drafter
from deltaspec.shared.decoding.drafters.mtp import MTPDrafter, MTPHead, random_mtp_weights
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.decoding.target import TargetSession
from deltaspec.shared.model.checkpoint import hf_config, random_model, save_checkpoint
from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.loader import load_model

PROMPT = [40, 41, 42, 43, 10, 11, 40, 41]
N = 40
# group-limited routing over latent experts, biases, a plain MLP block: every part the head's blocks can have
NEMOTRON = dict(
    model_type="nemotron_h", vocab_size=257, hidden_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
    intermediate_size=56, mamba_num_heads=4, mamba_head_dim=10, ssm_state_size=8, n_groups=2, conv_kernel=4,
    mlp_bias=True, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=24,
    moe_shared_expert_intermediate_size=36, moe_latent_size=16, routed_scaling_factor=2.5, layer_norm_epsilon=1e-5,
    hybrid_override_pattern="ME*-E", num_nextn_predict_layers=1)
# the Ling hybrid's trunk clips its SwiGLUs, its MTP step's MoE does not (vLLM's limits are the trunk layers')
LING = dict(
    vocab_size=257, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=10,
    kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=16, head_dim=12, short_conv_kernel_size=3,
    num_local_experts=6, num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=2, moe_intermediate_size=12,
    intermediate_size=24, first_k_dense_replace=1, layer_group_size=2, expert_swiglu_limit_list=[0, 0.4, 0.4],
    share_expert_swiglu_limit_list=[0, 0.3, 0.3], attention_bias=True, rms_norm_eps=1e-5, pad_token_id=None,
    eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
HEADS = {"qwen-1layer": 1, "qwen-2layers": 2, "nemotron-attn-moe": {"mtp_hybrid_override_pattern": "*E"},
         "nemotron-mlp-attn-attn": {"mtp_layers_block_type": ["mlp", "attention", "full_attention"]},
         "ling-mla-moe": {**LING, "model_type": "bailing_hybrid"}}


def as_published(directory):
    """Rewrite a Nemotron-H checkpoint as NVIDIA publishes it: the trunk under `backbone.`, experts one by one."""
    path = directory / "model.safetensors"
    tensors = {}
    for name, t in load_file(path).items():
        name = re.sub(r"^model\.", "backbone.", name)
        fused = re.match(r"^(.*\.experts)\.(up_proj|down_proj)$", name)
        tensors.update({f"{fused[1]}.{j}.{fused[2]}.weight": w.clone() for j, w in enumerate(t)} if fused
                       else {name: t})
    save_file(tensors, path)
    return directory


@pytest.fixture(scope="module", params=list(HEADS))
def checkpoint(request, tmp_path_factory):
    head, directory = HEADS[request.param], tmp_path_factory.mktemp("mtp")
    if isinstance(head, int):
        model = random_model(hf_config(mtp_num_hidden_layers=head), seed=11)
        model.mtp = random_mtp_weights(model.config, head, seed=5)
        return save_checkpoint(model, directory)
    model = random_model(head if "model_type" in head else {**NEMOTRON, **head}, seed=11)
    model.mtp = random_mtp_weights(model.config, seed=5)
    directory = save_checkpoint(model, directory)  # the Ling hybrid's is published as it is
    return directory if "model_type" in head else as_published(directory)


@pytest.fixture(scope="module")
def target(checkpoint):
    return load_model(checkpoint)


def reference_next(target, tokens: list[int]) -> torch.Tensor:
    """From scratch: trunk over x_0..x_{m-1}, head over rows (h_i post-norm, x_{i+1}); probs for x_{m+1}."""
    head = MTPHead(target)
    _, hidden = target(torch.tensor(tokens[:-1]), target.new_state())
    with torch.inference_mode():
        y = head(torch.tensor(tokens[1:]), target.model.norm(hidden), head.new_cache(), 0)
        return target.lm_head(y[-1]).float().softmax(-1)


class Steered:
    """Runs the MTP drafter, then makes round r keep exactly r mod (k+1) drafts: the truth up to there,
    a wrong token after (unless `check` only watches: then the head's own tokens go through)."""

    def __init__(self, inner, truth, check=None):
        self.inner, self.truth, self.check = inner, truth, check
        self.accept_counts: list[int] = []

    def start(self, prompt_ids):
        self.inner.start(prompt_ids)
        self.pos = 0

    def attach_session(self, session):
        self.inner.attach_session(session)
        self.session = session

    def propose(self, k):
        p = self.inner.propose(k)
        if self.check:
            if p.tokens:
                self.check(self.session.tokens, p)
            return Proposal(p.tokens)
        a = len(self.accept_counts) % (k + 1)
        truth = self.truth[self.pos:self.pos + k]
        return Proposal([t if i < a else (t + 1) % 257 for i, t in enumerate(truth)])

    def advance(self, accepted, next_token):
        self.inner.advance(accepted, next_token)
        self.accept_counts.append(accepted)
        self.pos += accepted + 1


@pytest.mark.parametrize("k", [1, 2, 4, 7], ids=lambda k: f"k{k}")
def test_mtp_greedy_equals_target_only_all_accept_counts(target, k):
    want = generate(target, PROMPT, N).token_ids
    assert generate(target, PROMPT, N, make_drafter("mtp", target), k).token_ids == want
    steered = Steered(MTPDrafter(target), want)
    assert generate(target, PROMPT, N, steered, k).token_ids == want
    assert set(steered.accept_counts) == set(range(k + 1))


def test_mtp_incremental_cache_equals_from_scratch(target):
    want = generate(target, PROMPT, N).token_ids
    checked = []

    def check(tokens, proposal):
        ref = reference_next(target, list(tokens))
        torch.testing.assert_close(proposal.probs[0], ref, rtol=1e-4, atol=1e-5)
        checked.append(len(tokens))

    drafter = Steered(MTPDrafter(target, SamplingParams(temperature=1.0)), want, check=check)
    assert generate(target, PROMPT, N, drafter, 3).token_ids == want
    assert len(checked) >= 5


def test_mtp_single_token_prompt_and_zero_k(target):
    want = generate(target, [7], 12).token_ids
    assert generate(target, [7], 12, make_drafter("mtp", target), 3).token_ids == want
    assert generate(target, PROMPT, 12, make_drafter("mtp", target), 0).token_ids == generate(target, PROMPT, 12).token_ids


def test_mtp_needs_weights_and_a_session():
    plain = random_model(hf_config(), seed=1)
    with pytest.raises(ValueError, match="no MTP head"):
        make_drafter("mtp", plain)
    plain.mtp = random_mtp_weights(plain.config, 1, seed=0)
    drafter = MTPDrafter(plain)
    drafter.start(PROMPT)
    with pytest.raises(RuntimeError, match="target session"):
        drafter.propose(2)
    session = TargetSession(plain, PROMPT)
    drafter.attach_session(session)
    assert len(drafter.propose(2).tokens) == 2


def rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def naive_attention(t, p, x):
    """vLLM's `NemotronHAttention`: grouped K/V, no rotary, causal over the head's rows, scale head_dim^-1/2."""
    H, KV, d = NEMOTRON["num_attention_heads"], NEMOTRON["num_key_value_heads"], NEMOTRON["head_dim"]
    q = (x @ t[p + "q_proj.weight"].T).view(-1, H, d).transpose(0, 1)
    k, v = ((x @ t[p + n].T).view(-1, KV, d).transpose(0, 1).repeat_interleave(H // KV, 0)
            for n in ("k_proj.weight", "v_proj.weight"))
    mask = torch.ones(len(x), len(x), dtype=torch.bool).tril()
    scores = (q @ k.transpose(1, 2) * d ** -0.5).masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(len(x), H * d) @ t[p + "o_proj.weight"].T


def relu2_mlp(t, p, x):
    return F.relu(F.linear(x, t[p + "up_proj.weight"], t.get(p + "up_proj.bias"))).square() \
        @ t[p + "down_proj.weight"].T + t.get(p + "down_proj.bias", 0)


def naive_moe(t, p, x):
    """vLLM's `NemotronHMoE`, token by token: sigmoid scores, the choice biased by `e_score_correction_bias`
    among the `topk_group` groups of best top-2 sum, weights the unbiased scores renormalised and scaled; experts
    relu^2 in the latent space (fc1/fc2_latent_proj); the shared expert on the block input."""
    c = NEMOTRON
    out = []
    for h in x:
        scores = (h.float() @ t[p + "gate.weight"].float().T).sigmoid()
        choice = scores + t[p + "gate.e_score_correction_bias"]
        groups = choice.view(c["n_group"], -1).topk(2, -1).values.sum(-1).topk(c["topk_group"]).indices
        allowed = torch.zeros(c["n_group"], dtype=torch.bool)
        allowed[groups] = True
        chosen = choice.masked_fill(~allowed.repeat_interleave(c["n_routed_experts"] // c["n_group"]), float("-inf"))
        top = chosen.topk(c["num_experts_per_tok"]).indices
        weights = scores[top] / scores[top].sum() * c["routed_scaling_factor"]
        z = F.linear(h, t[p + "fc1_latent_proj.weight"], t[p + "fc1_latent_proj.bias"])
        routed = sum(w * (F.relu(z @ t[f"{p}experts.{e}.up_proj.weight"].T).square()
                          @ t[f"{p}experts.{e}.down_proj.weight"].T) for e, w in zip(top.tolist(), weights))
        out.append(F.linear(routed, t[p + "fc2_latent_proj.weight"], t[p + "fc2_latent_proj.bias"])
                   + relu2_mlp(t, p + "shared_experts.", h))
    return torch.stack(out)


def naive_nemotron_mtp(t, kinds, next_ids, hidden):
    """Logits of vLLM's `NemotronHMultiTokenPredictor` + the target's lm_head, from the published tensors `t`:
    rows (post-`norm_f` trunk state h_i, token x_{i+1}); its fused add-and-norm residual written out."""
    e = t["backbone.embeddings.weight"][next_ids]
    x = torch.cat([rms(e, t["mtp.layers.0.enorm.weight"]), rms(hidden, t["mtp.layers.0.hnorm.weight"])], -1) \
        @ t["mtp.layers.0.eh_proj.weight"].T
    residual = None
    for i, kind in enumerate(kinds):
        p = f"mtp.layers.{i}."
        residual = x if residual is None else x + residual
        block = {"full_attention": naive_attention, "mlp": relu2_mlp, "moe": naive_moe}[kind]
        x = block(t, p + "mixer.", rms(residual, t[p + "norm.weight"]))
    y = rms(x + residual, t[f"mtp.layers.{len(kinds) - 1}.final_layernorm.weight"])
    return (y @ t["lm_head.weight"].T).float()


@pytest.mark.parametrize("checkpoint", ["nemotron-attn-moe", "nemotron-mlp-attn-attn"], indirect=True)
def test_nemotron_mtp_logits_equal_a_naive_vllm_reference(checkpoint, target):
    """Every round's first proposal (temperature 1: the head's distribution) against the naive head over the
    committed tokens, from scratch; the trunk's states are the target's own (HF's, in test_families)."""
    published = load_file(checkpoint / "model.safetensors")
    assert not [k for k in target.mtp if ".experts." in k and k.endswith(".weight")]  # stacked by the loader
    want = generate(target, PROMPT, N).token_ids
    checked = []

    def check(tokens, proposal):
        _, hidden = target(torch.tensor(tokens[:-1]), target.new_state())
        logits = naive_nemotron_mtp(published, target.config.mtp_layer_types, torch.tensor(tokens[1:]),
                                    target.model.norm(hidden))
        torch.testing.assert_close(proposal.probs[0], logits[-1].softmax(-1), rtol=1e-4, atol=1e-5)
        checked.append(len(tokens))

    drafter = Steered(MTPDrafter(target, SamplingParams(temperature=1.0)), want, check=check)
    assert generate(target, PROMPT, N, drafter, 3).token_ids == want
    assert len(checked) >= 5


@pytest.mark.parametrize("checkpoint", ["ling-mla-moe"], indirect=True)
def test_ling_mtp_logits_equal_hf_layer_behind_the_vllm_fusion(checkpoint, target, tmp_path):
    """The Ling hybrid's MTP step (vLLM `bailing_moe_v3_mtp.py`) from its published tensors: the fusion written out
    naively, then HF's own one-layer model holding the step's layer (latent attention, MoE unclipped) with the step's
    `final_layernorm` as its final norm, and the target's LM head; every round's first proposal against it."""
    transformers = pytest.importorskip("transformers")
    published, step = load_file(checkpoint / "model.safetensors"), f"model.layers.{LING['num_hidden_layers']}."
    fusion = ("enorm", "hnorm", "eh_proj", "final_layernorm")
    one = {f"model.layers.0.{k[len(step):]}": v for k, v in published.items()
           if k.startswith(step) and k[len(step):].split(".")[0] not in fusion}
    one.update({"model.norm.weight": published[step + "final_layernorm.weight"],
                **{k: published[k] for k in ("model.word_embeddings.weight", "lm_head.weight")}})
    one_layer = {"num_hidden_layers": 1, "layer_types": ["full_attention"], "first_k_dense_replace": 0,
                 "expert_swiglu_limit_list": [0], "share_expert_swiglu_limit_list": [0], "num_mtp_layers": 0}
    transformers.BailingHybridConfig(**{**LING, **one_layer}).save_pretrained(tmp_path)
    save_file(one, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = transformers.BailingHybridForCausalLM.from_pretrained(tmp_path).eval()
    want = generate(target, PROMPT, N).token_ids
    checked = []

    def check(tokens, proposal):
        _, hidden = target(torch.tensor(tokens[:-1]), target.new_state())
        e = published["model.word_embeddings.weight"][torch.tensor(tokens[1:])]
        x = torch.cat([rms(e, published[step + "enorm.weight"]),
                       rms(target.model.norm(hidden), published[step + "hnorm.weight"])], -1) \
            @ published[step + "eh_proj.weight"].T
        with torch.no_grad():
            logits = hf(inputs_embeds=x[None]).logits[0, -1].float()
        torch.testing.assert_close(proposal.probs[0], logits.softmax(-1), rtol=1e-4, atol=1e-5)
        checked.append(len(tokens))

    drafter = Steered(MTPDrafter(target, SamplingParams(temperature=1.0)), want, check=check)
    assert generate(target, PROMPT, N, drafter, 3).token_ids == want
    assert len(checked) >= 5


def test_mtp_config_as_hf_reads_it():
    """Nemotron-H's head kinds from HF 5.25's fields: the list (legacy names remapped), else the pattern, else HF's
    default; heads this does not run are refused naming the field. The Ling hybrid's steps, under either name."""
    transformers = pytest.importorskip("transformers")
    for extra in ({}, {"mtp_hybrid_override_pattern": "*-"}, {"mtp_layers_block_type": ["attention", "mlp"]}):
        cfg = {k: v for k, v in NEMOTRON.items() if k != "model_type"}
        hf = transformers.NemotronHConfig(**cfg, **extra)
        assert ModelConfig.from_dict({**NEMOTRON, **extra}).mtp_layer_types == tuple(hf.mtp_layers_block_type)
    assert ModelConfig.from_dict({**NEMOTRON, "num_nextn_predict_layers": 0}).mtp_layer_types == ()
    ling = {**LING, "model_type": "bailing_hybrid"}  # HF's default: one step; its alias; none
    for steps, kinds in (({}, ("full_attention",)), ({"num_nextn_predict_layers": 2}, ("full_attention",)),
                         ({"num_mtp_layers": 0}, ())):
        assert ModelConfig.from_dict({**ling, **steps}).mtp_layer_types == kinds
    for change, named in (({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
                          ({"mtp_layers_block_type": ["linear_attention", "moe"]}, "mtp_layers_block_type")):
        with pytest.raises(ValueError, match=named):
            ModelConfig.from_dict({**NEMOTRON, **change})


def test_nemotron_mtp_tensors_must_match_the_layout(tmp_path):
    """An MTP block missing its fusion is named; a checkpoint without `mtp.*` loads, and `--draft mtp` says why not."""
    model = random_model(NEMOTRON, seed=3)
    model.mtp = {k: v for k, v in random_mtp_weights(model.config, seed=4).items() if k != "mtp.fc.weight"}
    with pytest.raises(ValueError, match="missing.*fc.weight"):
        MTPDrafter(load_model(save_checkpoint(model, tmp_path / "a")))
    model.mtp = {}
    with pytest.raises(ValueError, match="no MTP head"):
        make_drafter("mtp", load_model(save_checkpoint(model, tmp_path / "b")))


@pytest.mark.parametrize("checkpoint", ["nemotron-attn-moe"], indirect=True)
def test_nemotron_mtp_router_stays_float32(checkpoint):
    """In a bfloat16 model the head's router is float32, as the trunk's (and HF's) is, with the checkpoint's values;
    drafting stays lossless."""
    target = load_model(checkpoint, dtype=torch.bfloat16)
    head = MTPHead(target)
    gate = head.layers[1].mlp.gate
    assert head.fc.weight.dtype == head.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    published = load_file(checkpoint / "model.safetensors")
    for name, t in (("weight", gate.weight), ("e_score_correction_bias", gate.e_score_correction_bias)):
        assert t.dtype == torch.float32 and torch.equal(t, published[f"mtp.layers.1.mixer.gate.{name}"])
    want = generate(target, PROMPT, 12).token_ids
    assert generate(target, PROMPT, 12, MTPDrafter(target, head=head), 3).token_ids == want


@pytest.mark.parametrize("checkpoint", ["nemotron-attn-moe"], indirect=True)
def test_nemotron_serve_target_draft_mtp(checkpoint, target):
    """`serve-target --draft mtp` on the published checkpoint: four Generate streams at once, batched, each drafting
    with the head in the target's process, every one equal to target-only."""
    from deltaspec.shared.decoding.batcher import BatchConfig
    from deltaspec.shared.model.tokenizer import load_tokenizer
    from deltaspec.shared.rpc.generation import generate_on_server
    from deltaspec.target_service import servicer as target_servicer
    from test_batching import run_threads
    from test_rpc_support import start

    service = target_servicer.service(lambda: (load_model(checkpoint), load_tokenizer(checkpoint)),
                                      local_draft="mtp", batching=BatchConfig(max_batch=8, max_wait_ms=10.0))
    streams = [(PROMPT, 3, 20), (PROMPT[:3], 4, 16), ([5], 2, 12), (PROMPT[2:], 0, 12)]  # (prompt, k, new tokens)
    with start(service) as t:
        out = run_threads(lambda i: generate_on_server(t.address, streams[i][0], "", streams[i][2],
                                                       streams[i][1])[0].token_ids, list(range(len(streams))))
    assert out == [generate(target, p, n).token_ids for p, _, n in streams]
