"""Tokenizers: `tokenizer.json` through the `tokenizers` package when the checkpoint has one, else bytes.

Besides encoding and decoding, a tokenizer carries what the checkpoint says about prompts and stops: its chat
template (`chat_template.py`) and the end-of-sequence ids of `generation_config.json`, which instruction-tuned
checkpoints use to end a turn (Qwen's `<|im_end|>`) beside the config's own `eos_token_id`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from deltaspec.shared.errors import FailedPrecondition, InvalidArgument
from deltaspec.shared.model.chat_template import ChatTemplate, ChatTemplateError, load_chat_template


class Tokenizer(Protocol):
    chat_template: ChatTemplate | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are the ids 0..255; ids above (EOS and other specials) decode to nothing."""

    def __init__(self, chat_template: ChatTemplate | None = None, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.chat_template, self.eos_token_ids = chat_template, eos_token_ids

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """Encodes without adding special tokens (a chat template writes its own); decodes skipping the tokens that
    `tokenizer.json` marks special (`<|im_end|>`), as vLLM and chat UIs show text, while added tokens that are not
    special (`<think>`) decode to their content."""

    def __init__(self, path: Path, chat_template: ChatTemplate | None = None,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))
        self.chat_template, self.eos_token_ids = chat_template, eos_token_ids

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def generation_eos_ids(directory: str | Path) -> tuple[int, ...]:
    """`eos_token_id` of `generation_config.json` (one id or a list), () when the file or the key is missing."""
    path = Path(directory) / "generation_config.json"
    eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id") if path.exists() else None
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


def load_tokenizer(directory: str | Path) -> Tokenizer:
    path = Path(directory) / "tokenizer.json"
    template, eos = load_chat_template(directory), generation_eos_ids(directory)
    return HFTokenizer(path, template, eos) if path.exists() else ByteTokenizer(template, eos)


def encode_chat(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The conversation rendered with the checkpoint's chat template, the assistant's turn opened, as token ids."""
    if tokenizer.chat_template is None:
        raise FailedPrecondition("the target's checkpoint has no chat template (chat_template in "
                                 "tokenizer_config.json, or chat_template.jinja): send prompt_text or prompt_ids",
                                 "messages",
                                 reason="NO_CHAT_TEMPLATE")
    try:
        return tokenizer.encode(tokenizer.chat_template.render(messages))
    except ChatTemplateError as e:
        raise InvalidArgument(str(e), "messages") from e
