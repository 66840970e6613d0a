"""The state spec a family declares (`shared/state/spec.py`): what the state floor sizes everything from."""
import pytest
import torch

from deltaspec.shared.model.checkpoint import hf_config, hf_moe_config
from deltaspec.shared.model.config import ModelConfig
from deltaspec.shared.state.rollback import ModelState
from deltaspec.shared.state.spec import ATTENTION, HYBRID, RECURRENT, STATELESS, RecurrentSpec, StateSpec


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next"])
def test_a_family_declares_its_layers_and_the_state_holds_what_it_declares(family):
    raw = hf_config(layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12,
                    linear_value_head_dim=20) if family == "qwen3_5_text" else hf_moe_config("qwen3_next")
    cfg = ModelConfig.from_dict(raw)
    spec = cfg.state_spec
    assert spec.layers == tuple(RECURRENT if t == "linear_attention" else ATTENTION for t in cfg.layer_types)
    assert (spec.recurrent.kind, spec.recurrent.heads, spec.recurrent.key_dim, spec.recurrent.value_dim) == (
        "gdn", cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    state = ModelState(spec, capacity=7)
    assert state.recurrent.state.shape == (spec.n_recurrent, spec.recurrent.heads, spec.recurrent.key_dim,
                                         spec.recurrent.value_dim)
    assert state.recurrent.conv.shape == (spec.n_recurrent, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)
    # the mark snapshot (allocated on first use here, preallocated in a pool slot) counts as a pool charges it
    held = sum(t.nbytes for t in (state.recurrent.conv, state.recurrent.window, state.recurrent.state, state.recurrent.spare,
                                  state.recurrent.x, state.recurrent.k, state.recurrent.delta, state.recurrent.g))
    snapshot = state.recurrent.conv.nbytes + state.recurrent.state.nbytes
    kv = sum(t.nbytes for layer in state.attn for t in (layer.k, layer.v))
    assert spec.bytes(torch.float32, 7) == held + snapshot + kv


def test_bad_specs_are_refused_naming_the_problem():
    gdn = RecurrentSpec("gdn", conv_dim=8, conv_width=4, heads=2, key_dim=4, value_dim=4)
    with pytest.raises(ValueError, match="unknown recurrent state kind 'mamba3'"):
        RecurrentSpec("mamba3", conv_dim=8, conv_width=4, heads=2, key_dim=4, value_dim=4)
    with pytest.raises(ValueError, match="unknown layer kind 'linear_attention'"):
        StateSpec(("linear_attention",), gdn, 1, 8)
    with pytest.raises(ValueError, match="needs their RecurrentSpec"):
        StateSpec((RECURRENT, ATTENTION), None, 1, 8)
    with pytest.raises(ValueError, match="needs their RecurrentSpec"):
        StateSpec((HYBRID,), None, 1, 8)


def test_a_hybrid_layer_holds_both_states_each_at_its_own_index():
    """A HYBRID layer (attention and recurrent at once) counts among both kinds; its view is the pair."""
    ssd = RecurrentSpec("ssd", conv_dim=8, conv_width=4, heads=2, key_dim=4, value_dim=4)
    spec = StateSpec((RECURRENT, HYBRID, ATTENTION, STATELESS, HYBRID), ssd, 1, 8)
    assert (spec.n_recurrent, spec.n_attention) == (3, 3)
    state = ModelState(spec, capacity=3)
    views = state.layer_views()
    assert [v.i for v in (views[0], views[1][0], views[4][0])] == [0, 1, 2]
    assert [v[1] if isinstance(v, tuple) else v for v in views[1:5:1] if v is not None] == [
        state.attn[0], state.attn[1], state.attn[2]]
    assert views[3] is None and spec.kv_bytes_per_position(torch.float32) == 3 * 2 * 8 * 4
