"""OpenAI's request bodies, checked and turned into one typed `Request` for the target's `Generate`.

pydantic checks types and ranges (a NaN, a string for a number, a huge number: a 400 naming the field, through
errors.py); the rules it cannot state are in `Request.make`. Fields OpenAI defines that the engine does not do are
refused with a 400 naming them unless they hold their no-op value (`UNSUPPORTED`); fields nobody defines are
ignored, as vLLM does, and logged. One rule for the output length: `max_completion_tokens`, else `max_tokens`,
else the room the context leaves (16 tokens on /v1/completions, OpenAI's default there); above the context it is
a 400, and a generation ends where the prompt and its tokens fill the context (finish_reason `length`).
"""
from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from deltaspec.openai_service.errors import invalid, param
from deltaspec.shared.decoding.logprobs import MAX_TOP_LOGPROBS
from deltaspec.shared.decoding.sampling import SamplingParams
from deltaspec.shared.decoding.target import MAX_DRAFT_TOKENS
from deltaspec.shared.errors import InvalidArgument

log = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default on /v1/completions
UINT32, UINT64 = 2**32 - 1, 2**64 - 1
Number = Annotated[float, Field(allow_inf_nan=False)]
# OpenAI's parameters the engine does not do, with the values that ask for nothing (null is always fine)
UNSUPPORTED: dict[str, tuple] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "tools": ([],), "functions": ([],),
    "tool_choice": ("none",), "function_call": ("none",), "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"},), "logit_bias": ({},), "frequency_penalty": (0,), "presence_penalty": (0,),
    "repetition_penalty": (1,), "min_p": (0,), "min_tokens": (0,), "audio": (), "modalities": (["text"],),
    "prediction": (), "use_beam_search": (False,), "length_penalty": (1,), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (),
}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


class _Body(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(None, ge=1, le=UINT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=UINT32)  # -1 and 0: off
    seed: int | None = Field(None, ge=0, le=UINT64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    num_draft_tokens: int | None = Field(None, ge=0, le=MAX_DRAFT_TOKENS)  # deltaspec's: 0 turns speculation off
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens as "token_id:<id>"
    user: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # here: how many most likely tokens


@dataclass(frozen=True)
class Request:
    """One generation as the target's `Generate` takes it, and how to answer it."""

    chat: bool
    model: str
    prompt_ids: list[int] | None
    prompt_text: str
    messages: list[dict[str, str]] | None
    max_new_tokens: int
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    top_logprobs: int | None  # None: no log-probabilities
    num_draft_tokens: int | None  # None: the front's default
    tokens_as_ids: bool
    fields: dict = field(default_factory=dict)  # further GenerateRequest fields

    @staticmethod
    def make(body: ChatBody | CompletionBody, max_model_len: int) -> Request:
        _refuse_unsupported(body)
        chat = isinstance(body, ChatBody)
        if body.stream_options is not None and not body.stream:
            raise invalid("stream_options is only allowed with stream: true", "stream_options")
        if chat:
            if body.top_logprobs and not body.logprobs:
                raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
            top = (body.top_logprobs or 0) if body.logprobs else None
            ids, text, messages = None, "", [_message(m, i) for i, m in enumerate(body.messages)]
        else:
            top = body.logprobs
            ids, text = _prompt(body.prompt)
            messages = None
        asked = body.max_completion_tokens or body.max_tokens
        if asked is not None and max_model_len and asked > max_model_len:
            name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            raise invalid(f"{name} = {asked} is more than this model's context of {max_model_len} tokens", name)
        default = (max_model_len or UINT32) if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        options = body.stream_options or StreamOptions()
        return Request(chat, body.model, ids, text, messages, asked or default, _sampling(body), stop, body.stream,
                       options.include_usage, options.continuous_usage_stats, top, body.num_draft_tokens,
                       body.return_tokens_as_token_ids,
                       {"logprobs": top is not None, "top_logprobs": top or 0, "ignore_eos": body.ignore_eos,
                        "max_total_tokens": max_model_len})


def _refuse_unsupported(body: _Body) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED:
            if value is not None and value not in UNSUPPORTED[name]:
                raise invalid(f"{name} = {value!r} is not supported by this server", name, "unsupported_parameter")
        else:
            log.info("ignoring the unknown request field %r", name)


def _message(message: Message, i: int) -> dict[str, str]:
    """A message as the chat template takes it: text parts joined by newlines (as vLLM does), `developer` as
    `system` (OpenAI's newer name for it)."""
    for name, value in (message.model_extra or {}).items():
        if name in ("tool_calls", "function_call", "audio") and value:
            raise invalid(f"messages[{i}].{name} is not supported by this server", f"messages[{i}].{name}",
                          "unsupported_parameter")
    content = message.content
    if content is None and message.role != "assistant":
        raise invalid(f"messages[{i}].content is required for the {message.role} role", f"messages[{i}].content")
    text = "\n".join(part.text for part in content) if isinstance(content, list) else content or ""
    return {"role": "system" if message.role == "developer" else message.role, "content": text}


def _prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> tuple[list[int] | None, str]:
    """One prompt: text or token ids (a list holding one of them is that one; more is a batch, which is n > 1)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise invalid("one prompt per request: a list of prompts asks for several completions", "prompt",
                          "unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return None, prompt
    if not prompt:
        raise invalid("the prompt is empty", "prompt")
    if min(prompt) < 0 or max(prompt) > UINT32:
        raise invalid("prompt token ids are 0 or more and below the vocabulary size", "prompt")
    return list(prompt), ""


def _sampling(body: _Body) -> SamplingParams:
    """OpenAI's defaults: temperature 1; unseeded sampling draws a fresh seed (greedy needs none)."""
    temperature = 1.0 if body.temperature is None else body.temperature
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    try:
        return SamplingParams(temperature, max(body.top_k or 0, 0), 1.0 if body.top_p is None else body.top_p, seed)
    except InvalidArgument as e:  # the engine's own limits (a temperature too small to scale logits by)
        raise invalid(str(e), param(e.field)) from None
