"""A checkpoint's chat template, rendered as transformers' `apply_chat_template` renders it.

Templates come with checkpoints from anywhere, so they are untrusted code: they run in Jinja's
`ImmutableSandboxedEnvironment` with the globals and filters transformers gives them (`raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML, loop controls, the `{% generation %}` tag) and
nothing else. The template is read from `tokenizer_config.json`'s `chat_template` (a string, or a list of
named templates whose "default" is used) or from a `chat_template.jinja` file beside it, which wins.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or failed to render it."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant tokens with it; here it renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled template and the special tokens it may name (`bos_token`, `eos_token`, ...)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.template = _environment().from_string(source)
        self.special_tokens = special_tokens or {}

    def render(self, messages: list[dict[str, str]]) -> str:
        """The conversation as the prompt text, ending with the prompt of the assistant's turn."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, tools=None, documents=None,
                                        **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from e
        except Exception as e:  # noqa: BLE001 - a template's own bug (None + str, a missing key) is its input's fault
            raise ChatTemplateError(f"the chat template failed on the messages: {type(e).__name__}: {e}") from e


def load_chat_template(directory: str | Path) -> ChatTemplate | None:
    """The checkpoint's template, or None when it has none."""
    directory = Path(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    jinja_path = directory / "chat_template.jinja"
    source = jinja_path.read_text(encoding="utf-8") if jinja_path.exists() else config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not source:
        return None
    special = {key: _content(config[key]) for key in SPECIAL_TOKEN_KEYS if config.get(key) is not None}
    return ChatTemplate(source, special)


def _content(token: str | dict) -> str:
    """A special token as tokenizer_config.json writes it: the string, or an AddedToken dict with its content."""
    return token["content"] if isinstance(token, dict) else token
