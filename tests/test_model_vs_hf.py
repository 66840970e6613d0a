"""The project's model against HF transformers' Qwen3_5ForCausalLM, the outside oracle."""
import pytest
import torch

from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.model.checkpoint import save_checkpoint, random_model
from deltaspec.shared.model.loader import load_model

transformers = pytest.importorskip("transformers")


def hf_model(directory):
    return transformers.Qwen3_5ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture
def checkpoint(config_dict, tmp_path):
    save_checkpoint(random_model(config_dict, seed=len(str(config_dict))), tmp_path)
    return tmp_path


def test_logits_match_hf(checkpoint):
    ours, ref = load_model(checkpoint), hf_model(checkpoint)
    ids = torch.randint(0, ours.config.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    got, _ = ours(ids, ours.new_state())
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_token_by_token_logits_match_hf(checkpoint):
    """Decode path (recurrent kernel, KV cache) against HF's full forward."""
    ours, ref = load_model(checkpoint), hf_model(checkpoint)
    ids = torch.randint(0, ours.config.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    state = ours.new_state(capacity=4)  # forces the KV buffers to grow
    rows = []
    for t in ids:
        logits, _ = ours(t[None], state)
        state.commit(1)
        rows.append(logits[0])
    got = torch.stack(rows)
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_greedy_generation_matches_hf(checkpoint):
    ours, ref = load_model(checkpoint), hf_model(checkpoint)
    prompt = torch.randint(0, ours.config.vocab_size, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    assert generate(ours, prompt, 24).token_ids == want
    assert generate(ours, prompt, 24, ModelDrafter(ours), 4).token_ids == want  # self-draft: full acceptance
