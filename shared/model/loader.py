"""Load a HF checkpoint directory into a `HybridLM`, for every family in `deltaspec.shared.model.families`.

Reads `config.json` and `model.safetensors` or its shards (`model.safetensors.index.json`); weight prefixes
`model.` and `model.language_model.`; float32, bfloat16, float16. Routed experts come per expert
(`mlp.experts.N.gate_proj.weight`, `up_proj`, `down_proj`) or fused as HF keeps them (`mlp.experts.gate_up_proj`
(E, 2 I, H), `mlp.experts.down_proj` (E, H, I)), or both in one checkpoint (the published Qwen3.5-35B-A3B: main
layers fused, MTP per expert); per-expert ones are stacked (non-gated ones too: Nemotron-H's `up_proj` alone). A
multimodal wrapper's vision tower (`model.visual.*`) is skipped with a log line. `mtp.*` tensors (named so by the
family's `convert`) are kept on `model.mtp` in the checkpoint's dtypes, for the MTP drafter to cast. Every tensor
must be consumed and every parameter found: any mismatch stops with one `CheckpointError` naming the tensor or
field. The tensors a module names in `keep_float32` (Nemotron-H's router, LFM2-MoE's expert bias) are loaded in
float32 whatever the dtype, as HF keeps them.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn

from deltaspec.shared.model.config import ConfigError, ModelConfig
from deltaspec.shared.model.families import family_of
from deltaspec.shared.model.hybrid import HybridLM

log = logging.getLogger(__name__)
VISION_PREFIXES = ("model.visual.", "visual.")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file, field or tensor."""


def read_tensors(directory: Path) -> dict[str, Tensor]:
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.exists():
        files = [single]
    elif index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, Tensor] = {}
    for path in files:
        try:
            tensors.update(load_file(path))
        except (FileNotFoundError, SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None
    return tensors


def canonical_name(name: str) -> str:
    """Map `model.language_model.X` (multimodal checkpoints) to `model.X`."""
    return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name


def load_model(directory: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> HybridLM:
    directory = Path(directory)
    try:
        cfg = ModelConfig.from_file(directory / "config.json")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    raw_dtype = cfg.raw.get("dtype") or cfg.raw.get("torch_dtype") or "float32"
    if dtype is None:
        if raw_dtype not in DTYPES:
            raise CheckpointError(f"config.json: field 'dtype' {raw_dtype!r} is not one of {sorted(DTYPES)}")
        dtype = DTYPES[raw_dtype]
    tensors = {canonical_name(k): v for k, v in read_tensors(directory).items()}
    vision = [k for k in tensors if k.startswith(VISION_PREFIXES)]
    if vision:
        log.info("%s: skipping the vision tower (%d tensors under model.visual); deltaspec serves the text model",
                 directory, len(vision))
        for k in vision:
            del tensors[k]
    try:
        family_of(cfg.raw.get("model_type")).convert(tensors, cfg)  # type: ignore[union-attr]
        stack_experts(tensors, cfg)
    except KeyError as e:
        raise CheckpointError(f"{directory}: missing tensor {e.args[0]!r}") from None
    except ValueError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    mtp = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith("mtp.")]}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = HybridLM(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{directory}: missing tensor {missing[0]!r}" + _more(missing))
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CheckpointError(f"{directory}: unexpected tensor {extra[0]!r}" + _more(extra))
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise CheckpointError(
                f"{directory}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {tuple(shape)}"
            )
    float32 = float32_names(model)
    model.load_state_dict({k: v.to(torch.float32 if k in float32 else dtype) for k, v in tensors.items()},
                          strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.mtp = mtp  # as the checkpoint stores them: the MTP head casts them, keeping its float32 ones
    return model.to(device).eval().fuse()


def float32_names(module: nn.Module) -> set[str]:
    """The state_dict keys of the tensors `module`'s parts name in `keep_float32`: float32 whatever the model's dtype,
    as HF keeps them (Nemotron-H's router)."""
    return {f"{m}.{t}".lstrip(".") for m, part in module.named_modules() for t in getattr(part, "keep_float32", ())}


def stack_experts(tensors: dict[str, Tensor], cfg: ModelConfig) -> None:
    """Per-expert tensors -> HF's fused ones, in place: `gate_up_proj` = [gate; up] per expert, stacked over experts;
    `up_proj` alone for non-gated experts (Nemotron-H's: no expert has a `gate_proj`).

    Every expert 0..E-1 of a block must be there, with all its projections, and a block must not come both ways."""
    blocks: dict[str, dict[int, dict[str, Tensor]]] = {}
    for name in [n for n in tensors if _PER_EXPERT.match(n)]:
        prefix, index, proj = _PER_EXPERT.match(name).groups()  # type: ignore[union-attr]
        blocks.setdefault(prefix, {}).setdefault(int(index), {})[proj] = tensors.pop(name)
    for prefix, experts in sorted(blocks.items()):
        gated = any("gate_proj" in e for e in experts.values())
        w_in = f"{prefix}.gate_up_proj" if gated else f"{prefix}.up_proj"
        if w_in in tensors or f"{prefix}.down_proj" in tensors:
            raise ValueError(f"{prefix} comes both fused ({w_in}) and per expert ({prefix}.0.*)")
        projs = ("gate_proj", "up_proj") if gated else ("up_proj",)
        for e in range(cfg.num_experts):
            for proj in (*projs, "down_proj"):
                if proj not in experts.get(e, {}):
                    raise KeyError(f"{prefix}.{e}.{proj}.weight")
        extra = sorted(e for e in experts if not 0 <= e < cfg.num_experts)
        if extra:
            raise ValueError(f"unexpected tensor '{prefix}.{extra[0]}.{projs[0]}.weight': the config has "
                             f"{cfg.num_experts} experts")
        tensors[w_in] = torch.stack([torch.cat([experts[e][p] for p in projs]) for e in range(cfg.num_experts)])
        tensors[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(cfg.num_experts)])


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""
