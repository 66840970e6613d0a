"""Loading HF checkpoint directories, and refusing broken ones with one clear message."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaspec.shared.model.checkpoint import hf_config, random_model, save_checkpoint
from deltaspec.shared.model.loader import CheckpointError, load_model
from deltaspec.shared.model.tokenizer import ByteTokenizer, load_tokenizer


def logits(model, ids=(3, 1, 4, 1, 5, 9, 2, 6)):
    out, _ = model(torch.tensor(ids), model.new_state())
    return out


@pytest.fixture
def saved(tmp_path):
    model = random_model(hf_config(tie_word_embeddings=False), seed=2)
    save_checkpoint(model, tmp_path)
    return model, tmp_path


def rewrite(directory, fn):
    tensors = load_file(directory / "model.safetensors")
    save_file(fn(tensors), directory / "model.safetensors")


def edit_config(directory, fn):
    cfg = json.loads((directory / "config.json").read_text())
    fn(cfg)
    (directory / "config.json").write_text(json.dumps(cfg))


def test_roundtrip(saved):
    model, path = saved
    assert torch.equal(logits(load_model(path)), logits(model.fuse()))  # load_model takes the fused path


def test_shards_with_index_and_multimodal_prefix(saved):
    model, path = saved
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    renamed = lambda n: n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n
    weight_map = {}
    for shard, keys in shards.items():
        save_file({renamed(k): tensors[k] for k in keys}, path / shard)
        weight_map.update({renamed(k): shard for k in keys})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    edit_config(path, lambda c: c.update(model_type="qwen3_5", text_config={**c, "model_type": "qwen3_5_text"}))
    assert torch.equal(logits(load_model(path)), logits(model.fuse()))  # load_model takes the fused path


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints(saved, dtype):
    model, path = saved
    rewrite(path, lambda t: {k: v.to(getattr(torch, dtype)) for k, v in t.items()})
    edit_config(path, lambda c: c.update(dtype=dtype))
    loaded = load_model(path)
    assert loaded.dtype == getattr(torch, dtype)
    assert ((logits(loaded) - logits(model)).norm() / logits(model).norm()) < 0.05


def test_mtp_weights_are_kept(saved):
    _, path = saved
    rewrite(path, lambda t: {**t, "mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.randn(64)})
    assert set(load_model(path).mtp) == {"mtp.fc.weight", "mtp.norm.weight"}


def test_top_level_partial_rotary_factor(saved):
    _, path = saved
    edit_config(path, lambda c: (c.pop("rope_parameters"), c.update(partial_rotary_factor=0.5)))
    assert load_model(path).config.rotary_dim == 8


@pytest.mark.parametrize("breakage, message", [
    (lambda p: rewrite(p, lambda t: {k: v for k, v in t.items() if "layers.2.mlp.up_proj" not in k}),
     "missing tensor 'model.layers.2.mlp.up_proj.weight'"),
    (lambda p: rewrite(p, lambda t: {**t, "model.layers.9.extra.weight": torch.ones(2)}),
     "unexpected tensor 'model.layers.9.extra.weight'"),
    (lambda p: rewrite(p, lambda t: {**t, "model.norm.weight": torch.ones(3)}),
     "tensor 'model.norm.weight' has shape (3,), expected (64,)"),
    (lambda p: edit_config(p, lambda c: c.update(model_type="llama")), "unknown model_type 'llama'"),
    (lambda p: (p / "config.json").write_text("{ not json"), "bad JSON at line 1"),
    (lambda p: edit_config(p, lambda c: c.update(hidden_size="wide")), "field 'hidden_size'"),
    (lambda p: (p / "model.safetensors").unlink(), "no model.safetensors"),
    (lambda p: (p / "model.safetensors").write_bytes(b"garbage"), "cannot read safetensors file"),
], ids=["missing", "extra", "shape", "model_type", "json", "field", "no_weights", "corrupt"])
def test_broken_checkpoints_name_the_problem(saved, breakage, message):
    _, path = saved
    breakage(path)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(path)


def test_tokenizers(tmp_path):
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo\n")) == "héllo\n"
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("a b c") == [0, 1, 2]
