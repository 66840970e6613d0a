"""KDA (`mixers.kda`) and multi-head latent attention (`mixers.mla`), Kimi Linear's and Bailing's, against HF's
layers as the oracle, their fast paths against their references on fresh random inputs, and the gated delta rule's
forms with a decay per key channel (the loops, the step, one chunk, chunks) against the naive loop, strong decays
included (no exp(-G) anywhere), and the closed-form commit of a logged prefix against the state a run stopped there
holds."""
from __future__ import annotations

import pytest
import torch
from transformers import BailingHybridConfig, KimiLinearConfig
from transformers.models.bailing_hybrid.modeling_bailing_hybrid import (BailingHybridAttention,
                                                                        BailingHybridDeltaAttention,
                                                                        BailingHybridRotaryEmbedding)
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention, KimiLinearDeltaAttention

from deltaspec.shared.kernels import gated_delta_rule
from deltaspec.shared.kernels.chunk import chunk_gated_delta_rule
from deltaspec.shared.kernels.naive import naive_recurrent_gated_delta_rule
from deltaspec.shared.kernels.recurrent import recurrent_gated_delta_rule
from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.model.families import bailing_hybrid, kimi_linear
from deltaspec.shared.model.mixers.kda import KimiDeltaAttention
from deltaspec.shared.model.mixers.mla import LatentAttention
from deltaspec.shared.model.rotary import rotary_cos_sin, rotary_signed
from deltaspec.shared.state.access import SequenceAccess
from deltaspec.shared.state.rollback import ModelState, RecurrentSlot
from deltaspec.shared.state.spec import ATTENTION, RECURRENT, RecurrentSpec, StateSpec
from support import rel_err

HIDDEN = 40
KIMI = dict(model_type="kimi_linear", vocab_size=53, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=3,
            kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, q_lora_rank=10,
            num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, intermediate_size=16,
            linear_attn_config=dict(head_dim=8, num_heads=3, short_conv_kernel_size=4), pad_token_id=None,
            bos_token_id=None, eos_token_id=None, layer_types=["linear_attention", "full_attention"])
BAILING = dict(model_type="bailing_hybrid", vocab_size=53, hidden_size=HIDDEN, num_hidden_layers=2,
               num_attention_heads=3, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
               head_dim=8, num_local_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
               moe_intermediate_size=8, intermediate_size=16, pad_token_id=None, eos_token_id=None,
               rope_parameters={"rope_type": "default", "rope_theta": 100.0},
               layer_types=["linear_attention", "full_attention"])


def randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 8, generator=gen).log())
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.ndim == 1 else p.shape[-1] ** -0.5))
    return module.eval()


def inputs(T: int, H: int, Dk: int, Dv: int, seed: int, decay: float) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, Dk, generator=gen), dim=-1) for _ in range(2))
    v, beta = torch.randn(1, T, H, Dv, generator=gen), torch.rand(1, T, H, generator=gen)
    g = -decay * torch.rand(1, T, H, Dk, generator=gen)  # a log decay per key channel
    return q, k, v, g, beta, torch.randn(1, H, Dk, Dv, generator=gen)


@pytest.mark.parametrize("T,decay", [(1, 1.0), (9, 1.0), (64, 6.0), (150, 0.5)])
def test_per_channel_decay_forms_match_the_naive_loop(T, decay):
    """Strong decays: a chunk's cumulative log decay reaches -380, where exp(-G) would be inf."""
    q, k, v, g, beta, s0 = inputs(T, 3, 8, 5, T, decay)
    out, delta, final = naive_recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    forms = [chunk_gated_delta_rule(q, k, v, g, beta, s0), recurrent_gated_delta_rule(q, k, v, g, beta, s0)]
    auto = gated_delta_rule("auto", q[0], k[0], v[0], g[0], beta[0], s0[0])  # the step, or one chunk
    forms.append(tuple(x[None] for x in auto[:3]))
    for got in forms:
        assert all(torch.isfinite(x).all() for x in got)
        assert rel_err(got[0], out) < 1e-5 and rel_err(got[1], delta) < 1e-5 and rel_err(got[2], final) < 1e-5


def test_closed_form_commit_of_a_logged_prefix_equals_the_run_stopped_there():
    q, k, v, g, beta, s0 = inputs(12, 2, 6, 4, 1, 2.0)
    _, delta, _ = naive_recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    spec = RecurrentSpec("kda", conv_dim=4, conv_width=2, heads=2, key_dim=6, value_dim=4)
    state = ModelState(StateSpec((RECURRENT,), spec, 1, 1))
    state.recurrent.state[0] = s0[0]
    RecurrentSlot(state.recurrent, 0, 0).stage(torch.zeros(12, 4), k[0], delta[0], g[0], torch.zeros(2, 6, 4))
    state.staged = 12
    for n in (1, 5, 11):
        _, _, want = naive_recurrent_gated_delta_rule(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], s0)
        window, got = state.recurrent.state_after(n, 12, torch.empty(1, 1, 4), torch.empty(1, 2, 6, 4))
        assert rel_err(got[0], want[0]) < 1e-5


def passes(mixer: torch.nn.Module, kind: str, spec: StateSpec, x: torch.Tensor, rope_dim: int,
           pieces: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference and the fast path over x in `pieces` (prefill, decode, verify...), each piece committed, from
    fresh states, the rotary over `rope_dim` channels at theta 100: (reference outputs, fast outputs)."""
    ref_state, fast_state = ModelState(spec), ModelState(spec)
    refs, fasts, at = [], [], 0
    fused = None
    for n in pieces:
        h = x[at:at + n]
        st = RecurrentSlot(ref_state.recurrent, 0, 0) if kind == RECURRENT else ref_state.attn[0]
        cos, sin = rotary_cos_sin(rope_dim, 100.0, torch.arange(at, at + n), x.dtype)
        refs.append(mixer(h, st, at, (cos, sin)))
        fused = fused or mixer.fuse()
        fasts.append(mixer.fused(fused, h, torch.zeros_like(h), rotary_signed(cos, sin), SequenceAccess(fast_state),
                                 0))
        for state in (ref_state, fast_state):
            state.staged = n
            state.commit(n)
        at += n
    return torch.cat(refs), torch.cat(fasts)


@torch.no_grad()
@pytest.mark.parametrize("family,conv,safe", [("kimi", 2, False), ("kimi", 4, False), ("bailing", 3, True),
                                              ("bailing", 4, False)])
def test_kda_reference_and_fast_path_match_hf(family, conv, safe):
    """Kimi's low-rank gates and softplus decay; Bailing's full-rank gates, safe (bounded) or softplus decay."""
    if family == "kimi":
        fields = {**KIMI, "linear_attn_config": {**KIMI["linear_attn_config"], "short_conv_kernel_size": conv}}
        hf, form = KimiLinearDeltaAttention(KimiLinearConfig(**fields), 0), kimi_linear.KDA
    else:
        fields = {**BAILING, "short_conv_kernel_size": conv, "kda_safe_gate": safe}
        hf, form = BailingHybridDeltaAttention(BailingHybridConfig(**fields), 0), bailing_hybrid.KDA
    hf = randomised(hf, conv)
    ours = KimiDeltaAttention(ModelConfig.from_dict(fields), form)
    ours.load_state_dict({k.replace("forget_gate.", ""): v for k, v in hf.state_dict().items()})
    x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(3))
    want = hf(x[None])[0]
    spec = StateSpec((RECURRENT,), RecurrentSpec("kda", 3 * 24, conv, 3, 8, 8), 1, 1)
    ref, fast = passes(ours, RECURRENT, spec, x, 0, (7, 1, 1, 5, 6))
    assert rel_err(ref, want) < 1e-5 and rel_err(fast, want) < 1e-5


@torch.no_grad()
@pytest.mark.parametrize("family,q_lora_rank", [("kimi", None), ("kimi", 10), ("bailing", None), ("bailing", 10)])
def test_latent_attention_reference_and_absorbed_fast_path_match_hf(family, q_lora_rank):
    """Kimi's NoPE latent attention; Bailing's with DeepSeek's interleaved rotary and a per-head output gate."""
    fields = {**(KIMI if family == "kimi" else BAILING), "q_lora_rank": q_lora_rank}
    config = (KimiLinearConfig if family == "kimi" else BailingHybridConfig)(**fields)
    config._attn_implementation = "sdpa"  # causal without a mask
    hf = randomised((KimiLinearAttention if family == "kimi" else BailingHybridAttention)(config, 1), 7)
    ours = LatentAttention(ModelConfig.from_dict(fields))
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(4))
    if family == "kimi":
        want = hf(x[None], None)[0][0]
    else:
        rope = BailingHybridRotaryEmbedding(config)(x[None], torch.arange(20)[None])
        want = hf(x[None], rope, None)[0][0]
    spec = StateSpec((ATTENTION, RECURRENT), RecurrentSpec("conv", 1, 2, 0, 0, 0), 1, 12 + 4)  # the latent
    ref, fast = passes(ours, ATTENTION, spec, x, ours.d_rope if ours.rotary else 0, (7, 1, 1, 5, 6))
    assert rel_err(ref, want) < 1e-5 and rel_err(fast, want) < 1e-5
