"""Rotary position embeddings (rotate-half convention, optionally on the first dims of a head only)."""
from __future__ import annotations

import functools

import torch
from torch import Tensor


@functools.lru_cache(maxsize=16)
def _inv_freq(dim: int, theta: float, device: torch.device) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def rotary_cos_sin(dim: int, theta: float, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin `(T, dim)` of `positions (T,)` for a rotary over `dim` dims."""
    freqs = positions.float()[:, None] * _inv_freq(dim, theta, positions.device)  # (T, dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x `(T, H, D)`; rotate the first `cos.shape[-1]` dims (rotate-half convention), pass the rest. The reference."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos[:, None] + rotated * sin[:, None], rest], dim=-1)


def rotary_signed(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(cos, sin with its first half negated): then rotate_half(x) * sin == roll(x, half) * signed sin."""
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)


def rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """`apply_partial_rotary` in fewer calls, from `rotary_signed`'s sin: x `(T, H, D)`."""
    dim = cos.shape[-1]
    rot = x[..., :dim]
    rot = torch.addcmul(rot * cos[:, None], rot.roll(dim // 2, -1), signed_sin[:, None])
    return rot if dim == x.shape[-1] else torch.cat([rot, x[..., dim:]], dim=-1)
