"""Chat prompts, generation_config end-of-sequence ids and stop strings, over real loopback gRPC.

The checkpoint is a small random model beside a byte-level BPE `tokenizer.json` trained here with `tokenizers`
and a Qwen-style chat template; transformers' `apply_chat_template` on the same files is the reference for the
prompt ids the server builds, and in-process target-only decoding the reference for the tokens.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from deltaspec.shared.client import AsyncClient, Client, FailedPreconditionError, InvalidArgumentError
from deltaspec.shared.decoding.speculative import generate
from deltaspec.shared.decoding.text_stream import TextStream
from deltaspec.shared.model.chat_template import load_chat_template
from deltaspec.shared.model.checkpoint import hf_config, random_model, save_checkpoint
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import ByteTokenizer, load_tokenizer
from deltaspec.shared.rpc.status import reason_of
from deltaspec.v1 import target_service_pb2 as pb
from test_rpc_support import PROMPT, one_torch_thread, pair, refused, start, target_service, target_stub  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]

N = 24
QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and not loop.first %}{{ raise_exception('System message must be first') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)",
          "Speculative decoding drafts tokens and the target verifies them.", "Hello, how are you today?"] * 20
CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello, fox."}]


def write_tokenizer(directory: Path) -> Tokenizer:
    """A byte-level BPE with Qwen's chat specials and one added token that is not special (`<think>`)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=360, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": QWEN_TEMPLATE, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None}))
    return tok


def chat_checkpoint(directory: Path, generation_eos: list[int] | None = None) -> Path:
    directory.mkdir(parents=True)
    tok = write_tokenizer(directory)
    model = random_model(hf_config(vocab_size=tok.get_vocab_size(), eos_token_id=tok.token_to_id("<|endoftext|>")),
                         seed=3)
    save_checkpoint(model, directory)
    if generation_eos is not None:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return directory


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    return chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt")


@pytest.fixture(scope="module")
def hf_tokenizer(chat_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_dir)


@pytest.fixture(scope="module")
def expected_prompt(hf_tokenizer) -> list[int]:
    return chat_ids(hf_tokenizer, CONVERSATION)


def chat_ids(hf_tokenizer, messages: list[dict[str, str]]) -> list[int]:
    return list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))


@pytest.fixture(scope="module")
def reference(chat_dir, expected_prompt) -> list[int]:
    """Target-only greedy tokens from the prompt ids transformers builds (no generation_config: config eos only)."""
    return generate(load_model(chat_dir), expected_prompt, N).token_ids


@pytest.fixture(scope="module")
def chat_server(chat_dir):
    with start(target_service(chat_dir)) as server:
        yield server.address


def test_prompt_ids_equal_transformers_apply_chat_template(chat_server, expected_prompt, chat_dir):
    created = target_stub(chat_server).CreateSession(pb.CreateSessionRequest(
        messages=[pb.ChatMessage(**m) for m in CONVERSATION]))
    assert list(created.prompt_ids) == expected_prompt
    assert Tokenizer.from_file(str(chat_dir / "tokenizer.json")).token_to_id("<|im_start|>") in expected_prompt


def test_greedy_chat_over_grpc_equals_generating_from_those_ids(chat_server, expected_prompt, reference,
                                                                hf_tokenizer):
    with Client(chat_server) as client:
        pieces = list(client.stream(messages=CONVERSATION, max_new_tokens=N))
        whole = client.generate(messages=CONVERSATION, max_new_tokens=N, num_draft_tokens=0)
    assert [t for p in pieces for t in p.token_ids] == reference == whole.token_ids
    assert whole.prompt_ids == expected_prompt
    assert "".join(p.text for p in pieces) == whole.text == hf_tokenizer.decode(reference, skip_special_tokens=True)


def test_special_tokens_are_skipped_and_added_tokens_decode_as_the_checkpoint_defines(chat_dir, hf_tokenizer):
    ids = hf_tokenizer.encode("<think>fox<|im_end|>\n<|im_start|>", add_special_tokens=False)
    text = load_tokenizer(chat_dir).decode(ids)
    assert text == hf_tokenizer.decode(ids, skip_special_tokens=True) == "<think>fox\n"


def test_generation_config_eos_ids_end_the_generation(tmp_path, chat_dir, reference, expected_prompt):
    """A token the greedy output reaches becomes an end-of-sequence id in generation_config.json: the generation
    ends on it, and CreateSession lists it beside the config's eos."""
    j = next(j for j in range(3, N) if reference[j] not in reference[:j])
    directory = tmp_path / "eos"
    shutil.copytree(chat_dir, directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [reference[j], 7]}))
    with start(target_service(directory)) as server, Client(server.address) as client:
        created = target_stub(server.address).CreateSession(pb.CreateSessionRequest(prompt_ids=expected_prompt))
        assert set(created.eos_token_ids) == {reference[j], 7, load_model(chat_dir).config.eos_token_id[0]}
        out = list(target_stub(server.address).Generate(pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in CONVERSATION], max_new_tokens=N, num_draft_tokens=2)))
        assert [t for m in out for t in m.token_ids] == reference[:j + 1]
        assert out[-1].finish_reason == pb.FINISH_REASON_EOS
        assert client.generate(messages=CONVERSATION, max_new_tokens=N).token_ids == reference[:j + 1]
    in_process = generate(load_model(directory), expected_prompt, N,
                          eos_token_ids=load_tokenizer(directory).eos_token_ids)
    assert in_process.token_ids == reference[:j + 1]


def test_stop_strings_end_the_text_before_them(chat_server, reference, hf_tokenizer):
    """The tokens end with the one whose text completes the stop string; the text ends before it."""
    decode = lambda ids: hf_tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    stop = next(piece for t in reference[4:] if len(piece := decode([t]).strip()) >= 2 and piece.isprintable())
    n = next(n for n in range(1, N + 1) if stop in decode(reference[:n]))
    text = decode(reference[:n])
    out = list(target_stub(chat_server).Generate(pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in CONVERSATION], max_new_tokens=N, num_draft_tokens=3,
        stop_strings=["never in this text \u2603", stop])))
    assert [t for m in out for t in m.token_ids] == reference[:n]
    assert "".join(m.text for m in out) == text[:text.index(stop)]
    assert (out[-1].finish_reason, out[-1].stop_string) == (pb.FINISH_REASON_STOP, stop)
    assert out[-1].stats.rounds > 0
    with Client(chat_server) as client:
        whole = client.generate(messages=CONVERSATION, max_new_tokens=N, stop_strings=[stop])
    assert (whole.token_ids, whole.text) == (reference[:n], text[:text.index(stop)])

    async def run():
        async with AsyncClient(chat_server) as client:
            return await client.generate(messages=CONVERSATION, max_new_tokens=N, stop_strings=[stop])
    assert asyncio.run(run()).token_ids == reference[:n]


def test_text_that_may_begin_a_stop_string_waits_for_the_next_tokens():
    stream = TextStream(ByteTokenizer(), ["\n\n"])
    assert stream.push(list(b"one\n")) == (list(b"one\n"), "one")
    assert stream.push(list(b"\xc3")) == ([0xc3], "")  # half of a character waits too
    assert stream.push(list(b"\xa9\n\nthree")) == (list(b"\xa9\n\n"), "\n\u00e9")
    assert (stream.push(list(b"more")), stream.push([], final=True), stream.stopped) == (([], ""), ([], ""), "\n\n")
    plain = TextStream(ByteTokenizer())
    assert (plain.push(list(b"a\xc3")), plain.push([], final=True)) == ((list(b"a\xc3"), "a"), ([], "\ufffd"))


def test_chat_refusals_name_the_field(chat_server, pair):  # noqa: F811
    stub, chat = target_stub(chat_server), [pb.ChatMessage(**m) for m in CONVERSATION]
    refused(lambda: stub.CreateSession(pb.CreateSessionRequest(prompt_text="hi", messages=chat)),
            grpc.StatusCode.INVALID_ARGUMENT, "prompt_text")
    refused(lambda: stub.CreateSession(pb.CreateSessionRequest(
        messages=[chat[0], pb.ChatMessage(content="no role")])), grpc.StatusCode.INVALID_ARGUMENT, "messages[1].role")
    err = refused(lambda: stub.CreateSession(pb.CreateSessionRequest(messages=chat[::-1])),
                  grpc.StatusCode.INVALID_ARGUMENT, "messages")
    assert "System message must be first" in err.details()
    for stops in ([""], ["x" * 257], ["s"] * 17):
        refused(lambda: list(stub.Generate(pb.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=2,
                                                              stop_strings=stops))),
                grpc.StatusCode.INVALID_ARGUMENT, "stop_strings")
    with start(target_service(pair[0])) as plain, Client(plain.address) as client:
        with pytest.raises(FailedPreconditionError) as info:
            client.generate(messages=CONVERSATION, max_new_tokens=2)
        assert (info.value.reason, info.value.field) == ("NO_CHAT_TEMPLATE", "messages")
        assert "chat template" in info.value.message
        err = refused(lambda: target_stub(plain.address).CreateSession(pb.CreateSessionRequest(messages=chat)),
                      grpc.StatusCode.FAILED_PRECONDITION, "messages")
        assert reason_of(err) == "NO_CHAT_TEMPLATE"
    with Client(chat_server) as client, pytest.raises(InvalidArgumentError):
        client.generate("hi", messages=CONVERSATION, max_new_tokens=2)


def test_chat_template_jinja_beside_the_config_wins(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config", "eos_token": "</s>"}))
    assert load_chat_template(tmp_path).render([]) == "config"
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}{{ messages | tojson }}")
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "é<"}]) == \
        '</s>[{"role": "user", "content": "é<"}]'
    assert load_chat_template(tmp_path / "missing") is None


@pytest.mark.parametrize("where", ["server", "in process"])
def test_cli_chat_sends_the_prompt_as_a_user_message(where, chat_server, chat_dir, hf_tokenizer):
    user = [{"role": "user", "content": "Say hello, fox."}]
    place = ["--target-addr", chat_server] if where == "server" else ["--target", str(chat_dir)]
    out = subprocess.run([sys.executable, "-m", "deltaspec.shared.cli", "generate", *place, "--prompt",
                          user[0]["content"], "--chat", "--max-new-tokens", "8", "--json"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.splitlines()[-1])
    assert line["prompt_ids"] == chat_ids(hf_tokenizer, user)
    assert line["token_ids"] == generate(load_model(chat_dir), line["prompt_ids"], 8).token_ids
