"""Test-wide set-up and shared fixtures.

Triton kernels run under the interpreter when there is no GPU; the variable must be set before
triton is first imported.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The test models are tiny: one thread avoids oversubscription on a 2-core machine (15x faster here).
torch.set_num_threads(1)

from deltaspec.shared.model.checkpoint import hf_config  # noqa: E402

# Small configs covering the architecture's axes: key/value head ratios, d_k != d_v,
# GDN-first and attention-first orders, tied and untied embeddings.
CONFIGS = {
    "gdn_first-ratio2-dk16dv24-tied": hf_config(
        vocab_size=97, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, layer_types=["linear_attention", "linear_attention", "full_attention",
                                               "linear_attention"], tie_word_embeddings=True),
    "attn_first-ratio1-untied": hf_config(
        vocab_size=89, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["full_attention", "linear_attention", "linear_attention",
                                              "full_attention"], tie_word_embeddings=False),
    "ratio3-dk12dv20-kv1-rot05": hf_config(
        vocab_size=101, linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=12,
        linear_value_head_dim=20, num_key_value_heads=1, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}


@pytest.fixture(params=list(CONFIGS), ids=list(CONFIGS))
def config_dict(request):
    return CONFIGS[request.param]


LOOSE_GROUP = ("--dist loadgroup ignores xdist_group under this pytest and pytest-xdist (the test's node id does not "
               "name its group): install what pyproject.toml pins")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """`make test`'s `--dist loadgroup` keeps each `xdist_group` in one process (test_compiled's graphs, compiled
    once for the module; test_rpc_bad_input's count of what the others tried). pytest-xdist does it by naming the
    group in each test's node id, which pytest 9.2 no longer lets it do: its groups' tests then ran wherever, with
    nothing said. Such tests fail here, saying why."""
    if getattr(config.option, "loadgroup", False):
        for item in items:
            item.loose_group = bool(item.get_closest_marker("xdist_group")) and "@" not in item.nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if getattr(item, "loose_group", False):
        pytest.fail(LOOSE_GROUP, pytrace=False)
