"""What every family's module shares: reading `config.json` fields (one error type, naming the field) and renaming
its published tensors (and unstacking fused experts, to publish them per expert)."""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from torch import Tensor


# a DeepSeek-V3-style MTP step's fusion and end norm (published on its layer) -> the MTP drafter's names
MTP_FUSION = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
              "final_layernorm": "norm"}


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


def supported_kinds(kinds: list, allowed: tuple[str, ...], model_type: str, what: str = "layer kind",
                    named: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """`kinds` as a tuple, or a load stopped at the first (sorted) one not `allowed`, naming it and what is
    supported (`named`: as the config may spell them, legacy names included; default `allowed`)."""
    unsupported = sorted({str(k) for k in kinds if k not in allowed})
    if unsupported:
        raise ConfigError(f"config.json: {model_type} {what} {unsupported[0]!r} is not supported (supported: "
                          f"{', '.join(allowed if named is None else named)})")
    return tuple(kinds)


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


_FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.gate_up_proj$")


def unstack_experts(tensors: dict[str, Tensor]) -> None:
    """Fused gated experts (`experts.gate_up_proj` (E, 2 I, H), `experts.down_proj` (E, H, I)) -> per-expert
    `experts.j.gate_proj.weight`, `up_proj`, `down_proj`, in place: the loader's `stack_experts` undone, for a family
    whose published layout is per expert. Each a copy: safetensors writes no shared storage."""
    for name in [n for n in tensors if _FUSED_EXPERTS.match(n)]:
        prefix = _FUSED_EXPERTS.match(name).group(1)  # type: ignore[union-attr]
        down = tensors.pop(f"{prefix}.down_proj")
        for e, (w_in, w_out) in enumerate(zip(tensors.pop(name), down)):
            for proj, weight in zip(("gate_proj", "up_proj", "down_proj"), (*w_in.chunk(2), w_out)):
                tensors[f"{prefix}.{e}.{proj}.weight"] = weight.clone()


def rename_experts(tensors: dict[str, Tensor], projs: Iterable[tuple[str, str]]) -> None:
    """Per-expert tensors `....experts.j.<old>.weight` renamed `....experts.j.<new>.weight`, for each (old, new) of
    `projs`, in place: a family's published expert names (LFM2-MoE's, Kimi Linear's w1, w3, w2) to the loader's
    (gate_proj, up_proj, down_proj), or back."""
    table = dict(projs)
    pattern = re.compile(rf"^(.*\.experts\.\d+)\.({'|'.join(map(re.escape, table))})\.weight$")
    for name in list(tensors):
        m = pattern.match(name)
        if m:
            tensors[f"{m.group(1)}.{table[m.group(2)]}.weight"] = tensors.pop(name)
