"""The parallel mixer (a Mamba2 mixer beside an attention, Falcon-H1's layer, state kind HYBRID): its fast path through
the engine's state access against its reference on the layer's pair of states, on random weights and inputs, over a
prefill, a partly committed verify pass and a decode step, every multiplier away from 1."""
from types import SimpleNamespace

import torch

from deltaspec.shared.model.mixers.attention import Attention
from deltaspec.shared.model.mixers.mamba2 import Mamba2Mixer
from deltaspec.shared.model.mixers.parallel import ParallelMixer
from deltaspec.shared.model.rotary import rotary_cos_sin, rotary_signed
from deltaspec.shared.state.access import SequenceAccess
from deltaspec.shared.state.rollback import ModelState
from deltaspec.shared.state.spec import HYBRID, RecurrentSpec, StateSpec
from support import rel_err

HIDDEN, HEADS, KV, D = 32, 4, 2, 8
ATTENTION = SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D,
                            attention_bias=True, attention_out_bias=None, attention_window=0,
                            attention_output_gate=False, attention_qk_norm=False, attention_qk_norm_per_head=True,
                            rms_norm_eps=1e-6, norm_offset=0.0, attention_scale=None, residual_multiplier=1.0,
                            rotary_dim=D)


def mixer() -> ParallelMixer:
    mamba = Mamba2Mixer(HIDDEN, num_heads=4, head_dim=12, state_size=8, n_groups=2, out_bias=True, in_multiplier=1.1,
                        ssm_multipliers=(0.5, 1.5, 0.8, 1.2, 0.9), out_multiplier=0.6, norm_before_gate=True)
    attention = Attention(ATTENTION, in_multiplier=1.2, key_multiplier=0.8, out_multiplier=0.9)
    m = ParallelMixer(mamba, attention)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.ndim > 1 else 0.3)
                    + name.endswith("norm.weight"))
    return m.eval()


def new_state(m: ParallelMixer) -> ModelState:
    mamba = m.mamba
    spec = RecurrentSpec("ssd", mamba.conv_dim, mamba.conv_kernel, mamba.num_heads, mamba.state_size, mamba.head_dim)
    return ModelState(StateSpec((HYBRID,), spec, KV, D), capacity=4)


@torch.no_grad()
def test_fast_path_matches_reference_on_both_states():
    m = mixer()
    f = m.fuse()
    ref, fast = new_state(m), new_state(m)
    gen = torch.Generator().manual_seed(1)
    for T, keep in ((6, 6), (5, 2), (1, 1), (4, 3)):
        h, residual = torch.randn(T, HIDDEN, generator=gen), torch.randn(T, HIDDEN, generator=gen)
        start = ref.length
        cos, sin = rotary_cos_sin(D, 1e4, torch.arange(start, start + T), h.dtype)
        (view,) = ref.layer_views()
        want = residual + m(h, view, start, (cos, sin))
        got = m.fused(f, h, residual, (cos, rotary_signed(cos, sin)[1]), SequenceAccess(fast), (0, 0))
        assert rel_err(got, want) < 1e-5
        for state in (ref, fast):
            state.staged += T
            state.commit(keep)
    assert rel_err(fast.recurrent.state, ref.recurrent.state) < 1e-5
    assert rel_err(fast.attn[0].k[:, :ref.length], ref.attn[0].k[:, :ref.length]) < 1e-6
