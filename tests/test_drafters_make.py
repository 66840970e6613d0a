"""`--draft` resolution: none | ngram | mtp | a checkpoint directory, in process and through the CLI."""
import json

import pytest

from deltaspec.shared.cli import main
from deltaspec.shared.decoding.drafters import NoDrafter, make_drafter
from deltaspec.shared.decoding.drafters.model_drafter import ModelDrafter
from deltaspec.shared.decoding.drafters.mtp import MTPDrafter, random_mtp_weights
from deltaspec.shared.decoding.drafters.ngram import NgramDrafter
from deltaspec.shared.model.checkpoint import hf_config, random_model, save_checkpoint
from deltaspec.shared.model.loader import CheckpointError

TARGET = random_model(hf_config(mtp_num_hidden_layers=1), seed=11)
TARGET.mtp = random_mtp_weights(TARGET.config, 1, seed=2)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    draft = random_model(hf_config(hidden_size=32, intermediate_size=64,
                                   layer_types=["linear_attention", "full_attention"]), seed=3)
    other_vocab = random_model(hf_config(vocab_size=100), seed=4)
    return {"target": save_checkpoint(TARGET, root / "target"), "draft": save_checkpoint(draft, root / "draft"),
            "other": save_checkpoint(other_vocab, root / "other")}


def test_make_drafter_resolves_every_spec(dirs):
    assert isinstance(make_drafter("none", TARGET), NoDrafter)
    assert isinstance(make_drafter(None, TARGET), NoDrafter)
    assert isinstance(make_drafter("ngram", TARGET), NgramDrafter)
    assert isinstance(make_drafter("mtp", TARGET), MTPDrafter)
    assert isinstance(make_drafter(str(dirs["draft"]), TARGET), ModelDrafter)
    with pytest.raises(ValueError, match="vocabulary"):
        make_drafter(str(dirs["other"]), TARGET)
    with pytest.raises(CheckpointError):
        make_drafter(str(dirs["target"] / "missing"), TARGET)


def test_cli_generate_every_drafter_same_tokens(dirs, capsys):
    outs = {}
    for draft in ("none", "ngram", "mtp", str(dirs["draft"])):
        rc = main(["generate", "--target", str(dirs["target"]), "--draft", draft, "--prompt-ids", "5,6,7,5,6,7,5",
                   "--max-new-tokens", "16", "--num-draft-tokens", "3", "--json"])
        assert rc == 0
        outs[draft] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]
    assert len(set(map(tuple, outs.values()))) == 1 and len(outs["none"]) == 16
