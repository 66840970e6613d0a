"""What every family's module shares: reading `config.json` fields (one error type, naming the field) and renaming
its published tensors."""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from torch import Tensor


class ConfigError(ValueError):
    """A checkpoint's config.json cannot describe a model this engine runs."""


def positive_int(cfg: dict[str, Any], name: str) -> int:
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config.json: field {name!r} must be a positive integer, got {value!r}")
    return value


def json_float(value: Any, name: str) -> float:
    """A float as HF writes it: a number, or `{"__float__": "Infinity"}` (JSON has no infinity)."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config.json: field {name!r} must be a number, got {value!r}") from None


def refuse_unless(cfg: dict[str, Any], name: str, supported: tuple[Any, ...], model_type: str) -> None:
    """A config feature deltaspec does not run stops the load, naming the field and what is supported."""
    if name in cfg and cfg[name] not in supported:
        raise ConfigError(f"config.json: {model_type} with {name}={cfg[name]!r} is not supported (supported: "
                          f"{', '.join(repr(v) for v in supported)})")


def rename(tensors: dict[str, Tensor], table: Iterable[tuple[str, str]]) -> None:
    """Rename, in place, every tensor whose name starts with a table entry's first prefix to start with its second;
    a `*` stands for a layer index, the same in both. The first entry that matches wins."""
    rules = [(re.compile(re.escape(old).replace(r"\*", r"(\d+)")), new) for old, new in table]
    for name in list(tensors):
        for pattern, new in rules:
            m = pattern.match(name)
            if m:
                tensors[(new.replace("*", m.group(1)) if m.groups() else new) + name[m.end():]] = tensors.pop(name)
                break
