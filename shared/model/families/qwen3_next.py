"""Qwen3-Next (`qwen3_next`, e.g. Qwen3-Next-80B-A3B): Qwen3.5's hybrid stack with two differences in the tensors.

- The GDN input projections are packed per key head: `in_proj_qkvz` holds, for each of the n_k key heads, its
  q (d_k rows), k (d_k), v (r d_v) and z (r d_v) rows, r = n_v / n_k; `in_proj_ba` its b (r) and a (r) rows (HF's
  `fix_query_key_value_ordering`). The conv and everything after see [q of all heads; k; v], which is Qwen3.5's
  `in_proj_qkv` order, so `convert` regroups the rows once at load into `in_proj_qkv`, `in_proj_z`, `in_proj_b` and
  `in_proj_a`: the same matmuls, no per-token reshuffle; `publish` packs them back for saving.
- MLPs are sparse MoE blocks every `decoder_sparse_step`-th layer except `mlp_only_layers` (dense there), and the
  router renormalises its top-k weights only when `norm_topk_prob` is set.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from deltaspec.shared.model.families import qwen3_5
from deltaspec.shared.model.families.qwen3_5 import LAYER_KINDS, ConfigFields, layer, state_spec  # noqa: F401

TEXT_TYPES = ("qwen3_next",)
WRAPPER_TYPES: dict[str, str] = {}
ALWAYS_NORM_TOPK = False
fields = functools.partial(qwen3_5.fields, always_norm_topk=ALWAYS_NORM_TOPK)  # Qwen3.5's, routing as configured


def convert(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """Unpack every `linear_attn.in_proj_qkvz` / `in_proj_ba` (main layers and any others) into Qwen3.5's four."""
    n_k, d_k, d_v = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // n_k
    for name in [n for n in tensors if n.endswith("linear_attn.in_proj_qkvz.weight")]:
        prefix = name[: -len("in_proj_qkvz.weight")]
        qkvz = tensors.pop(name)
        per_head = qkvz.view(n_k, 2 * d_k + 2 * r * d_v, -1)
        q, k, v, z = per_head.split([d_k, d_k, r * d_v, r * d_v], dim=1)
        tensors[prefix + "in_proj_qkv.weight"] = torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)])
        tensors[prefix + "in_proj_z.weight"] = z.flatten(0, 1).contiguous()
        ba = tensors.pop(prefix + "in_proj_ba.weight", None)
        if ba is None:
            raise KeyError(prefix + "in_proj_ba.weight")
        b, a = ba.view(n_k, 2 * r, -1).split([r, r], dim=1)
        tensors[prefix + "in_proj_b.weight"] = b.flatten(0, 1).contiguous()
        tensors[prefix + "in_proj_a.weight"] = a.flatten(0, 1).contiguous()


def publish(tensors: dict[str, Tensor], cfg: ConfigFields) -> None:
    """`convert`'s inverse, in place: the four projections packed back per key head, as HF's Qwen3-Next loads them."""
    n_k, d_k, d_v = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // n_k
    for name in [n for n in tensors if n.endswith("linear_attn.in_proj_qkv.weight")]:
        prefix = name[: -len("in_proj_qkv.weight")]
        q, k, v = tensors.pop(name).split([n_k * d_k, n_k * d_k, n_k * r * d_v])
        z = tensors.pop(prefix + "in_proj_z.weight")
        per_head = [t.reshape(n_k, -1, t.shape[-1]) for t in (q, k, v, z)]
        tensors[prefix + "in_proj_qkvz.weight"] = torch.cat(per_head, dim=1).flatten(0, 1)
        b, a = (tensors.pop(prefix + f"in_proj_{x}.weight").reshape(n_k, r, -1) for x in "ba")
        tensors[prefix + "in_proj_ba.weight"] = torch.cat([b, a], dim=1).flatten(0, 1)
