"""Answers in OpenAI's shapes, built from the target's `Generate` messages as they arrive.

A `Reply` follows one generation (one choice: n = 1) and gives either the whole response or its stream of chunks,
in the order OpenAI's clients parse: on chat a first chunk with `role: assistant`; a chunk per message that
brings text or log-probabilities (a round may commit several tokens: they share a chunk); a last chunk with the
`finish_reason` (`stop` for a stop string or end of sequence, `length`) and an empty delta; with `include_usage`
a chunk with `choices: []` and the usage (`usage: null` on the others); then `data: [DONE]`. Stop strings need
nothing here: the target holds back text that may begin one and sends the text before it
(target_service.proto, GenerateRequest.stop_strings).

Events are UTF-8 bytes from one JSON encoder made once, and a chunk that brings only text (no log-probabilities, no
running usage: nearly all of them) is its text's JSON between a prefix and a suffix made once per reply: on a host
with few cores the front's CPU per chunk is taken from the target (docs/openai.md, Benchmark).
"""
from __future__ import annotations

import json
import time
import uuid

from deltaspec.v1 import target_service_pb2 as pb
from deltaspec.openai_service.schema import Request

FINISH = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_EOS: "stop", pb.FINISH_REASON_STOP: "stop"}
DONE = b"data: [DONE]\n\n"
_HOLE = "\ue000text\ue000"  # stands for a chunk's text while its template is made (a private-use character)
_json = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps with an argument makes an encoder every call


def sse(event: dict) -> bytes:
    return f"data: {_json(event)}\n\n".encode()


class Reply:
    def __init__(self, request: Request, model: str) -> None:
        self.request, self.model = request, model
        self.id = ("chatcmpl-" if request.chat else "cmpl-") + uuid.uuid4().hex
        self.object = "chat.completion" if request.chat else "text_completion"
        self.created = int(time.time())
        self.prompt_tokens, self.completion_tokens = 0, 0
        self.text, self.finish_reason = "", None
        self.logprobs: list[pb.TokenLogprob] = []
        self.text_offset = 0  # /v1/completions' logprobs.text_offset: where the next token's text starts
        self._text_only = request.top_logprobs is None and not request.continuous_usage
        self._around = self._chunk({"content": _HOLE} if request.chat else _HOLE).split(_json(_HOLE).encode())

    def add(self, msg: pb.GenerateResponse) -> None:
        self.prompt_tokens = self.prompt_tokens or len(msg.prompt_ids)
        self.completion_tokens += len(msg.token_ids)
        self.text += msg.text
        self.logprobs += msg.logprobs
        if msg.finish_reason:
            self.finish_reason = FINISH[msg.finish_reason]

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def whole(self) -> dict:
        """The non-streamed response, once every message was added."""
        logprobs = self._logprobs(self.logprobs)
        choice = ({"index": 0, "message": {"role": "assistant", "content": self.text}, "logprobs": logprobs,
                   "finish_reason": self.finish_reason} if self.request.chat else
                  {"index": 0, "text": self.text, "logprobs": logprobs, "finish_reason": self.finish_reason})
        return {**self._head(self.object), "choices": [choice], "usage": self.usage()}

    def first_chunk(self) -> bytes:
        """Chat's opening chunk (the assistant's role); nothing on /v1/completions."""
        return self._chunk({"role": "assistant", "content": ""}) if self.request.chat else b""

    def chunk(self, msg: pb.GenerateResponse) -> bytes:
        """The chunk a message makes (after `add`), or b'' when it brings no text and no log-probabilities."""
        if not msg.text and not msg.logprobs:
            return b""
        if self._text_only:
            before, after = self._around
            return before + _json(msg.text).encode() + after
        return self._chunk({"content": msg.text} if self.request.chat else msg.text, self._logprobs(msg.logprobs))

    def last_chunks(self) -> bytes:
        """The finishing chunk, the usage chunk when asked for, and [DONE]."""
        out = self._chunk({} if self.request.chat else "", None, self.finish_reason)
        if self.request.include_usage:
            out += sse({**self._head(self.object + ".chunk" if self.request.chat else self.object), "choices": [],
                        "usage": self.usage()})
        return out + DONE

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, delta: dict | str, logprobs: dict | None = None, finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta} if self.request.chat else {"index": 0, "text": delta}
        event = {**self._head(self.object + ".chunk" if self.request.chat else self.object),
                 "choices": [{**choice, "logprobs": logprobs, "finish_reason": finish}]}
        if self.request.include_usage or self.request.continuous_usage:
            event["usage"] = self.usage() if self.request.continuous_usage else None
        return sse(event)

    def _logprobs(self, entries: list[pb.TokenLogprob]) -> dict | None:
        """Chat's `{"content": [...]}` or /v1/completions' `{"tokens", "token_logprobs", "top_logprobs",
        "text_offset"}`; None when not asked for."""
        if self.request.top_logprobs is None:
            return None
        name = self._name
        if self.request.chat:
            return {"content": [{**self._token(e), "top_logprobs": [self._token(t) for t in e.top_logprobs]}
                                for e in entries]}
        offsets = []
        for e in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(e.token)
        return {"tokens": [name(e) for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{name(t): t.logprob for t in e.top_logprobs} for e in entries],
                "text_offset": offsets}

    def _name(self, entry: pb.TokenLogprob | pb.TopLogprob) -> str:
        return f"token_id:{entry.token_id}" if self.request.tokens_as_ids else entry.token

    def _token(self, entry: pb.TokenLogprob | pb.TopLogprob) -> dict:
        return {"token": self._name(entry), "logprob": entry.logprob, "bytes": list(entry.token.encode("utf-8"))}
