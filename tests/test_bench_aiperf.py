"""`deltaspec bench --only aiperf`'s offline pieces: the embedded pair's byte-level tokenizer as HF's `AutoTokenizer`
loads it (what AIPerf counts tokens with) agrees with the engine's `ByteTokenizer`, and a missing AIPerf is named with
how to install it."""
import random

import pytest
from transformers import AutoTokenizer

from benchmarks.openai_aiperf import aiperf_executable, byte_tokenizer
from deltaspec.shared.model.tokenizer import ByteTokenizer


def test_the_byte_tokenizer_is_the_engines(tmp_path):
    theirs, ours = AutoTokenizer.from_pretrained(byte_tokenizer(tmp_path)), ByteTokenizer()
    rng = random.Random(0)
    texts = ["def fib(n):\n    return n", "naïve café ✓ 日本", " \t\r\n", "".join(chr(rng.randrange(32, 0x3000))
                                                                              for _ in range(200))]
    for text in texts:
        ids = theirs(text, add_special_tokens=False).input_ids
        assert ids == ours.encode(text)
        assert theirs.decode(ids) == ours.decode(ids) == text
    assert theirs.convert_tokens_to_ids(theirs.eos_token) == 256


def test_a_missing_aiperf_says_how_to_install_it(monkeypatch):
    monkeypatch.delenv("DELTASPEC_AIPERF", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="pip install aiperf"):
        aiperf_executable()
