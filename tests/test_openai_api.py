"""The OpenAI-compatible front, called with OpenAI's own `openai` package (sync and async) over real services on
loopback: a draft service and three targets (one speculating with the draft service, one with its MTP head, one
with n-gram lookup), each behind a front, all in this process.

The checkpoint is a small random model with a byte-level BPE and a Qwen-style chat template (test_chat.py's), an
MTP head, and as end of sequence a token its greedy chat reaches early, so chat ends on EOS. References are
in-process target-only decoding (`TargetSession` with `NoDrafter`, k = 0) on the same ids.
"""
from __future__ import annotations

import asyncio
import bisect
import http.client
import json
import math
import re
import time
from pathlib import Path

import grpc
import openai
import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from benchmarks.openai_front import bucket_quantile, bucket_sum, scrape_added
from deltaspec.openai_service.app import BackgroundFront, Settings
from deltaspec.openai_service.errors import from_rpc_error
from deltaspec.openai_service.metrics import ADDED_BUCKETS
from deltaspec.shared.client import Client
from deltaspec.shared.decoding.drafters import NoDrafter
from deltaspec.shared.decoding.drafters.mtp import random_mtp_weights
from deltaspec.shared.decoding.session_table import Limits
from deltaspec.shared.decoding.speculative import Stats, decode
from deltaspec.shared.decoding.target import TargetSession
from deltaspec.shared.model.checkpoint import hf_config, random_model, save_checkpoint
from deltaspec.shared.model.loader import load_model
from deltaspec.shared.model.tokenizer import encode_chat, load_tokenizer
from deltaspec.shared.rpc.server import BackgroundServer
from deltaspec.shared.telemetry import Telemetry
from deltaspec.shared.telemetry.tracing import make_provider
from deltaspec.target_service import servicer as target_servicer
from test_chat import CONVERSATION, write_tokenizer
from test_rpc_support import draft_service, one_torch_thread  # noqa: F401

N = 16
KEY = "sk-test"
MAX_PROMPT_TOKENS = 200
PROMPTS = ["The quick brown fox", "def fib(n):", "Hello, how are", "Speculative decoding drafts",
           "jumps over the lazy dog.", "return n if n < 2", "the target verifies them", "you today?"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """Target and draft (the target's weights with 2% noise); generation_config's EOS is the token greedy chat
    reaches at position 6."""
    root = tmp_path_factory.mktemp("openai")
    (root / "target").mkdir()
    tok = write_tokenizer(root / "target")
    config = hf_config(vocab_size=tok.get_vocab_size(), eos_token_id=tok.token_to_id("<|endoftext|>"),
                       mtp_num_hidden_layers=1)
    target = random_model(config, seed=3)
    target.mtp = random_mtp_weights(target.config, 1, seed=5)
    save_checkpoint(target, root / "target")
    chat = target_only(root / "target", encode_chat(load_tokenizer(root / "target"), CONVERSATION), N)[0]
    eos = next(t for j, t in enumerate(chat) if j >= 6 and t not in chat[:j])
    (root / "target" / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    draft = random_model(config, seed=3)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02 * p.abs().mean())
    save_checkpoint(draft, root / "draft")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (root / "draft" / name).write_bytes((root / "target" / name).read_bytes())
    return root / "target", root / "draft"


def target_only(directory: Path, prompt: list[int], n: int, eos: bool = True,
                top: int = 0) -> tuple[list[int], list]:
    """Greedy tokens and their log-probabilities, decoded in process without speculation."""
    model, tokenizer = load_model(directory), load_tokenizer(directory)
    session = TargetSession(model, prompt, top_logprobs=top)
    stops = set(model.config.eos_token_id) | set(tokenizer.eos_token_ids) if eos else set()
    for _ in decode(session, NoDrafter(), n, 0, stops, Stats()):
        pass
    return session.generated, session.logprobs


class Stack:
    """The services and the fronts, with the telemetry each keeps (spans in memory, its metrics)."""

    def __init__(self, pair: tuple[Path, Path]) -> None:
        self.spans = {name: InMemorySpanExporter() for name in ("front", "target", "draft")}
        self.telemetry = {name: Telemetry(make_provider(f"test-{name}", [exporter]))
                          for name, exporter in self.spans.items()}
        self.draft = BackgroundServer([draft_service(pair[1], telemetry=self.telemetry["draft"])],
                                      telemetry=self.telemetry["draft"]).wait_loaded(60)
        self.targets = {}
        for drafter in ("draft", "mtp", "ngram"):
            remote = target_servicer.DraftPeer(self.draft.address, 30.0) if drafter == "draft" else None
            telemetry = self.telemetry["target"] if remote else Telemetry()
            self.targets[drafter] = BackgroundServer([target_servicer.service(
                lambda: (load_model(pair[0]), load_tokenizer(pair[0])), Limits(max_prompt_tokens=MAX_PROMPT_TOKENS),
                remote, telemetry=telemetry, local_draft="none" if remote else drafter, model_name="tiny-chat")],
                telemetry=telemetry).wait_loaded(60)
        self.fronts = {drafter: BackgroundFront(Settings(target.address, api_key=KEY,
                                                         telemetry=self.telemetry["front"] if drafter == "draft"
                                                         else Telemetry()))
                       for drafter, target in self.targets.items()}

    def close(self) -> None:
        for front in self.fronts.values():
            front.__exit__()
        for server in (*self.targets.values(), self.draft):
            server.stop()


@pytest.fixture(scope="module")
def stack(pair):
    stack = Stack(pair)
    yield stack
    stack.close()


def sync_client(stack: Stack, drafter: str = "draft", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.fronts[drafter].base_url, api_key=KEY, max_retries=0, **kw)


def async_client(stack: Stack, drafter: str = "draft") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.fronts[drafter].base_url, api_key=KEY, max_retries=0)


def ids(logprobs: list) -> list[int]:
    return [int(entry.token.removeprefix("token_id:")) for entry in logprobs]


@pytest.mark.parametrize("drafter", ["draft", "mtp", "ngram"])
def test_greedy_chat_and_completion_equal_target_only_decoding(drafter, stack, pair):
    """Chat ends on EOS (finish_reason stop) with the target's log-probabilities; a completion streamed from token
    ids ends at max_tokens (length), chunks in OpenAI's order with the usage chunk last; async chat streamed
    without usage has no usage chunk."""
    tokenizer = load_tokenizer(pair[0])
    chat_prompt = encode_chat(tokenizer, CONVERSATION)
    reference, reference_lp = target_only(pair[0], chat_prompt, N, top=2)
    assert len(reference) < N  # ended on the EOS generation_config names
    client = sync_client(stack, drafter)
    whole = client.chat.completions.create(model="tiny-chat", messages=CONVERSATION, max_tokens=N, temperature=0,
                                           logprobs=True, top_logprobs=2,
                                           extra_body={"return_tokens_as_token_ids": True})
    choice = whole.choices[0]
    assert ids(choice.logprobs.content) == reference and choice.finish_reason == "stop"
    assert choice.message.content == tokenizer.decode(reference) and choice.message.role == "assistant"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(chat_prompt), len(reference))
    for got, want in zip(choice.logprobs.content, reference_lp, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [int(t.token.removeprefix("token_id:")) for t in got.top_logprobs] == [t for t, _ in want.top]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([v for _, v in want.top], abs=1e-4)

    prompt = tokenizer.encode(PROMPTS[1])
    expected = target_only(pair[0], prompt, N)[0]
    chunks = list(client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=len(expected),
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected)
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-2].choices[0].text == "" and all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == tokenizer.decode(expected)

    async def chat_stream():
        async with async_client(stack, drafter) as aclient:
            return [c async for c in await aclient.chat.completions.create(
                model="tiny-chat", messages=CONVERSATION, max_completion_tokens=N, temperature=0, stream=True)]
    chunks = asyncio.run(chat_stream())
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].delta.content is None
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tokenizer.decode(reference)


def test_sampled_output_with_a_seed_equals_grpc_generate(stack, pair):
    tokenizer = load_tokenizer(pair[0])
    with Client(stack.targets["draft"].address) as grpc_client:
        want = grpc_client.generate(PROMPTS[0], max_new_tokens=N, temperature=0.8, top_p=0.9, seed=7)
    got = sync_client(stack).completions.create(model="tiny-chat", prompt=PROMPTS[0], max_tokens=N, temperature=0.8,
                                                top_p=0.9, seed=7, logprobs=0,
                                                extra_body={"return_tokens_as_token_ids": True})
    assert [int(t.removeprefix("token_id:")) for t in got.choices[0].logprobs.tokens] == want.token_ids
    assert got.choices[0].text == want.text == tokenizer.decode(want.token_ids)


def test_stop_strings_end_the_text_before_them_and_ignore_eos_goes_past_eos(stack, pair):
    tokenizer = load_tokenizer(pair[0])
    prompt = tokenizer.encode(PROMPTS[1])
    expected = target_only(pair[0], prompt, N)[0]
    text = tokenizer.decode(expected)
    stop = next(text[i:i + 2] for i in range(3, len(text)) if text[i:i + 2].strip() == text[i:i + 2])
    client = sync_client(stack, "ngram")
    whole = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=N, temperature=0,
                                      stop=["never \u2603", stop])
    streamed = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=N, temperature=0, stop=stop,
                                         stream=True)
    pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in streamed]
    assert whole.choices[0].text == "".join(p for p, _ in pieces) == text[:text.index(stop)]
    assert whole.choices[0].finish_reason == pieces[-1][1] == "stop"
    past = target_only(pair[0], encode_chat(tokenizer, CONVERSATION), N, eos=False)[0]
    out = client.chat.completions.create(model="tiny-chat", messages=CONVERSATION, max_tokens=N, temperature=0,
                                         logprobs=True, extra_body={"ignore_eos": True,
                                                                    "return_tokens_as_token_ids": True})
    assert ids(out.choices[0].logprobs.content) == past and out.choices[0].finish_reason == "length"


def raw(front: BackgroundFront, method: str, path: str, body: bytes | str | None = None,
        headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*front.address.split(":"), timeout=30)
    conn.request(method, path, body, {"authorization": f"Bearer {KEY}", **(headers or {})})
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read())
    conn.close()
    return status, data


REFUSALS = [  # (body fields over a valid chat request, status, param, code)
    ({"model": "gpt-4o"}, 404, "model", "model_not_found"),
    ({"n": 2}, 400, "n", "unsupported_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "unsupported_parameter"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format", "unsupported_parameter"),
    ({"logit_bias": {"1": 5}}, 400, "logit_bias", "unsupported_parameter"),
    ({"messages": []}, 400, "messages", "invalid_value"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type", "invalid_value"),
    ({"messages": CONVERSATION[::-1]}, 400, "messages", "invalid_field"),  # the template refuses it
    ({"max_tokens": "many"}, 400, "max_tokens", "invalid_value"),
    ({"max_tokens": 10**30}, 400, "max_tokens", "invalid_value"),
    ({"max_tokens": 5000}, 400, "max_tokens", None),  # past the context (max_position_embeddings 4096)
    ({"temperature": -1}, 400, "temperature", "invalid_value"),
    ({"temperature": 1e-6}, 400, "temperature", None),
    ({"seed": -1}, 400, "seed", "invalid_value"),
    ({"top_logprobs": 3}, 400, "top_logprobs", None),  # without logprobs
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ({"stop": ["x"] * 17}, 400, "stop", "invalid_field"),
    ({"messages": [{"role": "user", "content": "fox " * MAX_PROMPT_TOKENS}]}, 400, "messages",
     "context_length_exceeded"),
]


def test_refusals_have_openai_status_type_and_param(stack):
    client = sync_client(stack)
    for fields, status, param, code in REFUSALS:
        body = {"model": "tiny-chat", "messages": CONVERSATION, "max_tokens": 2, **fields}
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(**body)
        error = info.value.body
        assert (info.value.status_code, error["param"]) == (status, param), (fields, error)
        assert code is None or error["code"] == code, (fields, error)
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error") and error["message"]
    front = stack.fronts["draft"]
    completion = '{"model": "tiny-chat", "prompt": %s}'
    for body, param in [(b'{"model": "tiny-chat", "messages": [', None), (b"\xff\xfe", None), ("[1, 2]", None),
                        ('{"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
                         "temperature"),
                        ("[" * 100_000, None), (completion % '"x", "temperature": Infinity', "temperature"),
                        (completion % '["a", "b"]', "prompt"), (completion % "[1, 99999]", "prompt"),
                        (completion % "[]", "prompt"), (completion % '""', "prompt")]:
        path = "/v1/completions" if b"prompt" in (body if isinstance(body, bytes) else body.encode()) \
            else "/v1/chat/completions"
        status, data = raw(front, "POST", path, body)
        assert (status, data["error"]["param"]) == (400, param), (body[:60], data)
    with pytest.raises(openai.AuthenticationError) as info:
        sync_client(stack).with_options(api_key="wrong").models.list()
    assert info.value.body["code"] == "invalid_api_key"
    conn = http.client.HTTPConnection(*front.address.split(":"), timeout=10)
    conn.request("GET", "/health")  # open without a key
    assert conn.getresponse().status == 200
    models = client.models.list().data
    assert [(m.id, m.model_extra["max_model_len"]) for m in models] == [("tiny-chat", 4096)]
    with BackgroundFront(Settings("127.0.0.1:1", recovery_window_s=0)) as gone:
        status, data = raw(gone, "POST", "/v1/completions", completion % '"x"')
        assert (status, data["error"]["type"]) == (503, "service_unavailable_error")


class _Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "refused"

    def trailing_metadata(self) -> tuple:
        return ()


@pytest.mark.parametrize("code, status", [("UNAUTHENTICATED", 401), ("PERMISSION_DENIED", 403), ("NOT_FOUND", 404),
                                          ("RESOURCE_EXHAUSTED", 429), ("UNAVAILABLE", 503),
                                          ("DEADLINE_EXCEEDED", 504), ("INVALID_ARGUMENT", 400)])
def test_grpc_statuses_map_to_http_statuses(code, status):
    assert from_rpc_error(_Refusal(getattr(grpc.StatusCode, code)), "prompt").status == status


def live_sessions(stack: Stack) -> float:
    """deltaspec_sessions on the metrics page of the target that speculates with the draft service."""
    page = generate_latest(stack.telemetry["target"].metrics.registry).decode()
    return float(re.search(r"^deltaspec_sessions (\S+)$", page, re.M).group(1))


def test_a_disconnect_frees_the_session_and_8_concurrent_streams_are_exact(stack, pair):
    front = stack.fronts["draft"]
    conn = http.client.HTTPConnection(*front.address.split(":"), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "tiny-chat", "prompt": PROMPTS[2], "max_tokens": 3000, "temperature": 0, "stream": True,
        "ignore_eos": True}), {"authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    while b'"text": "' not in response.readline():  # the first content chunk
        pass
    assert live_sessions(stack) == 1
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.monotonic() + 20
    while live_sessions(stack) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_sessions(stack) == 0

    tokenizer = load_tokenizer(pair[0])
    expected = [tokenizer.decode(target_only(pair[0], tokenizer.encode(p), N)[0]) for p in PROMPTS]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=N, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once() -> list[str]:
        async with async_client(stack) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))
    assert asyncio.run(all_at_once()) == expected


def test_traceparent_continues_into_one_trace_and_token_times_count_tokens(stack):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    for name, exporter in stack.spans.items():  # earlier tests' spans out of the way
        stack.telemetry[name].provider.force_flush()
        exporter.clear()
    before = generate_latest(stack.fronts["draft"].app.state.metrics.registry).decode()
    sent = time.time_ns()
    chunks = list(sync_client(stack).completions.create(
        model="tiny-chat", prompt=PROMPTS[3], max_tokens=N, temperature=0, stream=True, logprobs=0,
        stream_options={"include_usage": True}, extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}))
    for telemetry in stack.telemetry.values():
        telemetry.provider.force_flush()
    for name, exporter in stack.spans.items():  # every span this request made, in the three services
        spans = [s for s in exporter.get_finished_spans() if s.start_time >= sent and "GetModel" not in s.name]
        assert spans and {format(s.context.trace_id, "032x") for s in spans} == {trace_id}, name
    after = generate_latest(stack.fronts["draft"].app.state.metrics.registry).decode()

    def count(page: str, name: str) -> float:
        return float(re.search(rf"^{name} (\S+)$", page, re.M).group(1))
    tokens = chunks[-1].usage.completion_tokens
    first = len(next(c for c in chunks if c.choices and c.choices[0].logprobs.tokens).choices[0].logprobs.tokens)
    assert count(after, "deltaspec_openai_time_to_first_token_seconds_count") - \
        count(before, "deltaspec_openai_time_to_first_token_seconds_count") == 1
    assert count(after, "deltaspec_openai_time_per_output_token_seconds_count") - \
        count(before, "deltaspec_openai_time_per_output_token_seconds_count") == tokens - first


def test_the_front_added_time_is_observed_once_a_request_and_is_under_its_time_to_first_token(stack):
    """deltaspec_openai_front_added_seconds, streamed or not, chat or completion: one observation a request (its
    sum then is the request's value), above zero and under the time to first token the client sees, of which the
    target's part is not the front's. The bench's scrape of the page gives their median to a 0.1 ms bucket."""
    front = stack.fronts["draft"]
    registry, client, values = front.app.state.metrics.registry, sync_client(stack), []
    page = scrape_added(front.address)

    def added() -> tuple[float, float]:
        return tuple(registry.get_sample_value(f"deltaspec_openai_front_added_seconds_{s}") for s in ("count", "sum"))

    for chat in (False, True):
        for stream in (False, True):
            create = client.chat.completions.create if chat else client.completions.create
            asked = {"messages": CONVERSATION} if chat else {"prompt": PROMPTS[1]}
            (count, total), sent = added(), time.perf_counter()
            answer = create(model="tiny-chat", max_tokens=N, temperature=0, stream=stream, **asked)
            if stream:  # the first chunk with content
                next(c for c in answer if c.choices and (c.choices[0].delta.content if chat else c.choices[0].text))
            first_token = time.perf_counter() - sent
            if stream:
                list(answer)
            after = added()
            assert after[0] - count == 1, (chat, stream)
            assert 0 < after[1] - total < first_token, (chat, stream)
            values.append(after[1] - total)
    values.sort()
    bounds = (0.0, *ADDED_BUCKETS, math.inf)  # the median lies between the buckets of the middle two values
    low, high = bounds[bisect.bisect_left(bounds, values[1]) - 1], bounds[bisect.bisect_left(bounds, values[2])]
    assert low <= bucket_quantile(bucket_sum([scrape_added(front.address)], minus=page), 0.5) <= high
