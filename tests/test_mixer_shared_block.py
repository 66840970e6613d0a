"""Zamba2's hybrid layer (a shared transformer block with per-layer adapters before a Mamba2 mixer, state kind
HYBRID): two layers sharing one block, their fast path through the engine's state access against their reference on
each layer's pair of states, on random weights and inputs, over a prefill, partly committed verify passes and a
decode step."""
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from deltaspec.shared.model.mixers.mamba2 import Mamba2Mixer
from deltaspec.shared.model.mixers.shared_block import SharedBlock, SharedBlockMixer
from deltaspec.shared.model.rotary import rotary_cos_sin, rotary_signed
from deltaspec.shared.state.access import SequenceAccess
from deltaspec.shared.state.rollback import ModelState
from deltaspec.shared.state.spec import HYBRID, RecurrentSpec, StateSpec
from support import rel_err

HIDDEN, HEADS, D = 16, 4, 8  # attention over 2 x hidden inputs: head_dim 2 hidden / heads
CFG = SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=D,
                      attention_bias=False, attention_out_bias=None, attention_window=0, attention_output_gate=False,
                      attention_qk_norm=False, attention_qk_norm_per_head=True, rms_norm_eps=1e-5, norm_offset=0.0,
                      attention_scale=1 / math.sqrt(D / 2), residual_multiplier=1.0, rotary_dim=D,
                      intermediate_size=24, mlp_bias=True)


def layers() -> list[SharedBlockMixer]:
    """Two hybrid layers on one shared block (adapters on its attention and MLP), randomised."""
    block = SharedBlock(CFG, 0, 1, 2, attention_adapters=True, rank=3, act=F.gelu)
    mixers = [SharedBlockMixer(HIDDEN, 1e-5, Mamba2Mixer(HIDDEN, 4, 8, 6, n_groups=2)) for _ in range(2)]
    for c, m in enumerate(mixers):
        m.attach(block, c, owner=c == 0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in mixers:
            for name, p in m.named_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.ndim > 1 else 0.3)
                        + name.endswith("norm.weight") + name.endswith("layernorm.weight"))
    return mixers


def new_state(m: SharedBlockMixer) -> ModelState:
    mamba = m.mamba_decoder.mamba
    spec = RecurrentSpec("ssd", mamba.conv_dim, mamba.conv_kernel, mamba.num_heads, mamba.state_size, mamba.head_dim)
    return ModelState(StateSpec((HYBRID, HYBRID), spec, HEADS, D), capacity=4)


@torch.no_grad()
def test_two_layers_sharing_a_block_fast_path_matches_reference():
    mixers = layers()
    assert mixers[1].shared is mixers[0].shared and "shared_transformer" not in mixers[1]._modules
    fused = [m.fuse() for m in mixers]
    ref, fast = new_state(mixers[0]), new_state(mixers[0])
    gen = torch.Generator().manual_seed(1)
    for T, keep in ((6, 6), (5, 2), (1, 1), (4, 3)):
        x, embeds = torch.randn(T, HIDDEN, generator=gen), torch.randn(T, HIDDEN, generator=gen)
        start = ref.length
        cos, sin = rotary_cos_sin(D, 1e4, torch.arange(start, start + T), x.dtype)
        want, got = x, x
        access = SequenceAccess(fast)
        access.embeds = embeds
        for i, (m, f, view) in enumerate(zip(mixers, fused, ref.layer_views())):
            want = want + m(want, view, start, (cos, sin), embeds)
            got = m.fused(f, got, got, (cos, rotary_signed(cos, sin)[1]), access, (i, i))
        assert rel_err(got, want) < 1e-5
        for state in (ref, fast):
            state.staged += T
            state.commit(keep)
    assert rel_err(fast.recurrent.state, ref.recurrent.state) < 1e-5
    assert rel_err(fast.attn[1].v[:, :ref.length], ref.attn[1].v[:, :ref.length]) < 1e-5
