"""The embedded pair's quality figures and the demo that shows it, as a user runs them."""
import os
import re
import subprocess
import sys

import pytest
import torch

from deltaspec.shared import demo
from benchmarks.pair_quality import distinct_ngrams, generation_quality, heldout_loss
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.model.checkpoint import hf_config, random_model, save_checkpoint


def test_distinct_ngrams_counts_repeats():
    assert distinct_ngrams([1, 2, 3, 4, 5, 6]) == 1.0
    assert distinct_ngrams([7] * 10) == 1 / 7  # a loop: one 4-gram, seven times
    assert distinct_ngrams([1, 2, 1, 2, 1, 2], n=2) == 2 / 5
    with pytest.raises(ValueError, match="at least 4"):
        distinct_ngrams([1, 2, 3])


def test_heldout_loss_equals_hf(tmp_path):
    """Cross-entropy through the engine equals HF transformers' own loss on the same checkpoint."""
    from transformers import Qwen3_5ForCausalLM

    save_checkpoint(random_model(hf_config(), seed=3), tmp_path)
    ours = random_model(hf_config(), seed=3)
    hf = Qwen3_5ForCausalLM.from_pretrained(tmp_path).eval()
    gen = torch.Generator().manual_seed(4)
    texts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (40, 23)]
    with torch.no_grad():
        losses = [hf(torch.tensor([t]), labels=torch.tensor([t])).loss.item() for t in texts]
    want = (losses[0] * 39 + losses[1] * 22) / 61
    assert heldout_loss(ours, texts) == pytest.approx(want, rel=1e-5)


def test_generation_quality_reports_each_setting():
    target = random_model(hf_config(), seed=1)
    draft = random_model(hf_config(hidden_size=32, intermediate_size=64,
                                   layer_types=["linear_attention", "full_attention"]), seed=2)
    prompts = [[5, 6, 7, 8], [40, 41]]
    for sampling in (SamplingParams(), SamplingParams(0.8, top_p=0.9, seed=1)):
        out = generation_quality(target, draft, prompts, sampling, new_tokens=20, k=3)
        assert [len(s) for s in out["samples"]] == [20, 20]
        assert 0.0 <= out["acceptance_rate"] <= 1.0 and 0.0 < out["distinct_4grams"] <= 1.0
        assert out["temperature"] == sampling.temperature and out["k"] == 3


def test_demo_streams_clean_output():
    """`deltaspec demo` prints the prompt, its continuation and a report; no gRPC C-core log line, even when
    a gRPC trace is switched on in the environment (the demo silences C-core logging)."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"} | {"GRPC_TRACE": "http"}
    out = subprocess.run([sys.executable, "-m", "deltaspec.shared.cli", "demo", "--max-new-tokens", "24"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(demo.PROMPT)
    assert re.search(r"\[24 tokens in [\d.]+ s: .* acceptance rate [\d.]+", out.stdout)
    assert "loading the embedded pair" in out.stderr and f"temperature {demo.TEMPERATURE:g}" in out.stderr
    assert not re.search(r"^[IWE]\d{4} |chttp2|goaway|absl::InitializeLog", out.stderr, re.M), out.stderr
