"""The fused path: the same hybrid stack in far fewer ATen calls, for decode and verify.

At these model sizes a step costs per-op dispatch, not arithmetic, so this path cuts ops:
each layer's input projections run as one matmul (GDN qkv/z/b/a, attention q/k/v, MLP
gate/up; a sparse MoE block's router, shared expert gate/up and shared expert gate), norms are
single `rms_norm` calls with their weights folded (`1 + w`, the l2norm's scales), residual adds
ride on `addmm`, q and k share one rotary call, and a one-token GDN step does its conv window and
recurrent update in a handful of batched ops, writing the new state straight into the staging
buffer. `fuse(model)` builds the concatenated weights once and re-points the original parameters
at slices of them (no extra memory; `state_dict` keys and values are unchanged).

This is the one forward pass (`forward`: one layer loop, one head). The eager, compiled, CUDA-graph and batched
passes differ only in the `deltaspec.shared.state.access.StateAccess` they hand it (how the state is addressed) and,
for compiled passes, in `run_layer`. The layer forwards in `deltaspec.shared.model.layers` stay the truth, its naive
twin: `tests/test_fused.py` checks this path against them on random weights.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.model.layers import Attention, DecoderLayer, GatedDeltaNet, HybridStack, RMSNorm, SparseMoE
from deltaspec.shared.kernels.experts import apply_experts
from deltaspec.shared.model.moe import route
from deltaspec.shared.state.access import StateAccess
from deltaspec.shared.state.rollback import ModelState

if TYPE_CHECKING:
    from deltaspec.shared.model.config import ModelConfig

L2NORM_EPS = 1e-6  # the GDN's l2norm of q and k (HF's default, not the config's rms_norm_eps)


class Model(Protocol):
    """What the passes (fused, compiled, captured) read of the model that runs them, `hybrid.HybridLM`: typed by
    shape here, so that they import nothing of it and it alone imports them."""

    config: ModelConfig
    model: HybridStack
    fused: FusedStack | None
    lm_head: nn.Linear
    compiled: Any  # its `compiled.CompiledPasses` while compile() is on

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def rope(self, start: int, end: int, like: Tensor) -> tuple[Tensor, Tensor, Tensor]: ...

    def new_state(self, capacity: int = ..., log_capacity: int = ...) -> ModelState: ...

    def __call__(self, ids: Tensor, state: ModelState) -> tuple[Tensor, Tensor]: ...


@dataclass
class FusedGDN:
    w_in: Tensor  # (conv_dim + value_dim + 2 Hv, hidden): in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    splits: tuple[int, int, int, int]
    conv_taps: Tensor  # (conv_dim, K): the depthwise conv weight
    qk_scale: Tensor  # (2 n_k, 1): rms_norm(x, eps/d) * scale = l2norm(x) * (d^-1/2 for q, 1 for k)
    neg_a: Tensor  # (Hv,) -exp(A_log)
    dt_bias: Tensor  # (Hv,) float32
    out_t: Tensor  # out_proj.weight.t(), a view (addmm takes the residual)


@dataclass
class FusedAttention:
    w_qkv: Tensor  # (2 H D + 2 Hkv D, hidden): q_proj (query and gate), k_proj, v_proj
    splits: tuple[int, int, int]
    q_norm: Tensor  # (D,) 1 + w
    k_norm: Tensor
    out_t: Tensor  # o_proj.weight.t(), a view


@dataclass
class FusedMoE:
    w_in: Tensor  # (E + 2 shared intermediate + 1, hidden): router, shared expert gate and up, shared expert gate
    splits: tuple[int, int, int]
    shared_down_t: Tensor  # shared_expert.down_proj.weight.t(), a view


@dataclass
class FusedLayer:
    input_norm: Tensor  # (hidden,) 1 + w
    post_norm: Tensor
    w_gate_up: Tensor | None  # (2 intermediate, hidden); None where the MLP is a sparse MoE block
    down_t: Tensor | None  # down_proj.weight.t(), a view
    mixer: FusedGDN | FusedAttention
    moe: FusedMoE | None = None


def _concat(*linears: nn.Linear) -> Tensor:
    """One weight for several projections of the same input; each Linear's weight becomes a row slice of it."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[row : row + n], requires_grad=lin.weight.requires_grad)
        row += n
    return weight


def _plus_one(norm: RMSNorm) -> Tensor:
    return (1.0 + norm.weight.detach().float()).to(norm.weight.dtype)


def _fuse_gdn(m: GatedDeltaNet) -> FusedGDN:
    splits = (m.in_proj_qkv.weight.shape[0], m.in_proj_z.weight.shape[0], m.n_v, m.n_v)
    scale = torch.tensor([m.d_k**-1.0] * m.n_k + [m.d_k**-0.5] * m.n_k, device=m.A_log.device)
    return FusedGDN(
        w_in=_concat(m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a), splits=splits,
        conv_taps=m.conv1d.weight.detach()[:, 0], qk_scale=scale[:, None],
        neg_a=-m.A_log.detach().float().exp(), dt_bias=m.dt_bias.detach().float(), out_t=m.out_proj.weight.detach().t())


def _fuse_attention(m: Attention) -> FusedAttention:
    splits = (m.q_proj.weight.shape[0], m.k_proj.weight.shape[0], m.v_proj.weight.shape[0])
    return FusedAttention(w_qkv=_concat(m.q_proj, m.k_proj, m.v_proj), splits=splits,
                          q_norm=_plus_one(m.q_norm), k_norm=_plus_one(m.k_norm), out_t=m.o_proj.weight.detach().t())


@dataclass
class FusedStack:
    layers: list[FusedLayer]
    final_norm: Tensor  # (hidden,) 1 + w


def fuse_stack(stack: HybridStack) -> FusedStack:
    return FusedStack([fuse_layer(layer) for layer in stack.layers], _plus_one(stack.norm))


def fuse_layer(layer: DecoderLayer) -> FusedLayer:
    mixer = _fuse_gdn(layer.linear_attn) if layer.kind == "linear_attention" else _fuse_attention(layer.self_attn)
    norms = {"input_norm": _plus_one(layer.input_layernorm), "post_norm": _plus_one(layer.post_attention_layernorm)}
    m = layer.mlp
    if isinstance(m, SparseMoE):
        shared = m.shared_expert
        moe = FusedMoE(w_in=_concat(m.gate, shared.gate_proj, shared.up_proj, m.shared_expert_gate),
                       splits=(m.gate.weight.shape[0], 2 * shared.gate_proj.weight.shape[0], 1),
                       shared_down_t=shared.down_proj.weight.detach().t())
        return FusedLayer(**norms, w_gate_up=None, down_t=None, mixer=mixer, moe=moe)
    return FusedLayer(**norms, w_gate_up=_concat(m.gate_proj, m.up_proj), down_t=m.down_proj.weight.detach().t(),
                      mixer=mixer)


def rotary_signed(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(cos, sin with its first half negated): then rotate_half(x) * sin == roll(x, half) * signed sin."""
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)


def _rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x `(T, H, D)`: rotate the first `cos.shape[-1]` dims, pass the rest (same result as `apply_partial_rotary`)."""
    dim = cos.shape[-1]
    rot = x[..., :dim]
    rot = torch.addcmul(rot * cos[:, None], rot.roll(dim // 2, -1), signed_sin[:, None])
    return rot if dim == x.shape[-1] else torch.cat([rot, x[..., dim:]], dim=-1)


def gdn_inputs(f: FusedGDN, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One matmul for the four input projections: pre-conv x `(T, conv_dim)`, z `(T, Hv Dv)`, b and a `(T, Hv)`."""
    return F.linear(h, f.w_in).split(f.splits, dim=-1)  # type: ignore[return-value]


def gdn_gates(m: GatedDeltaNet, f: FusedGDN, full: Tensor, b: Tensor,
              a: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Conv, l2-normed q and k, v, beta and log decay g from `full = [window; x]` `(..., K-1+T, conv_dim)` and b, a
    `(..., T, Hv)`; any leading axes (a batch of sequences). q, k `(..., T, Hv, Dk)`, v `(..., T, Hv, Dv)`, float32."""
    taps = f.conv_taps
    if torch.compiler.is_compiling():  # a sum of shifted rows: unfold's shape checks would split a symbolic T in ranges
        T = full.shape[-2] - taps.shape[1] + 1
        conv = F.silu(sum(full[..., j:j + T, :] * taps[:, j] for j in range(taps.shape[1])))
    else:
        conv = F.silu((full.unfold(-2, taps.shape[1], 1) * taps).sum(-1))  # windows (..., T, conv_dim, K)
    if conv.dtype != torch.float32:  # the delta rule runs in float32 (no cast, no dispatch, for float32 models)
        conv, b, a = conv.float(), b.float(), a.float()
    lead, key_dim = conv.shape[:-1], m.n_k * m.d_k
    qk, v = conv.split([2 * key_dim, m.n_v * m.d_v], dim=-1)
    qk = F.rms_norm(qk.view(*lead, 2 * m.n_k, m.d_k), (m.d_k,), eps=L2NORM_EPS / m.d_k) * f.qk_scale
    if m.n_v != m.n_k:
        qk = qk.repeat_interleave(m.n_v // m.n_k, dim=-2)
    q, k = qk.split(m.n_v, dim=-2)
    return q, k, v.view(*lead, m.n_v, m.d_v), b.sigmoid(), f.neg_a * F.softplus(a + f.dt_bias)


def gdn_output(m: GatedDeltaNet, f: FusedGDN, out: Tensor, z: Tensor, residual: Tensor) -> Tensor:
    """Gated norm of the delta rule's output `(T, Hv, Dv)` and the output projection, added to the residual."""
    T = out.shape[0]
    if out.dtype != residual.dtype:
        out = out.to(residual.dtype)
    out = F.rms_norm(out, (m.d_v,), m.norm.weight, m.norm.eps) * F.silu(z.view(T, m.n_v, m.d_v))
    return torch.addmm(residual, out.view(T, -1), f.out_t)


def gdn(m: GatedDeltaNet, f: FusedGDN, h: Tensor, residual: Tensor, access: StateAccess, i: int) -> Tensor:
    """GDN layer i (among the GDN layers) on the normed input h `(N, hidden)`, added to the residual: the state
    access runs the conv window, the kernel and the staging."""
    mixed, z, b, a = gdn_inputs(f, h)
    out = access.gdn(i, mixed, b, a, functools.partial(gdn_gates, m, f), m.kernel_name)
    return gdn_output(m, f, out, z, residual)


def attention_inputs(m: Attention, f: FusedAttention, h: Tensor,
                     rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q_gate `(T, H, 2D)`, normed and rotated q `(T, H, D)` and k `(T, Hkv, D)`, v `(T, Hkv, D)`."""
    T, H, Hkv, D = h.shape[0], m.n_heads, m.n_kv, m.head_dim
    q_gate, k, v = F.linear(h, f.w_qkv).split(f.splits, dim=-1)
    q_gate = q_gate.view(T, H, 2 * D)
    q = F.rms_norm(q_gate[..., :D], (D,), f.q_norm, m.q_norm.eps)
    k = F.rms_norm(k.view(T, Hkv, D), (D,), f.k_norm, m.k_norm.eps)
    q, k = _rotary(torch.cat([q, k], dim=1), *rope).split([H, Hkv], dim=1)
    return q_gate, q, k, v.view(T, Hkv, D)


def attention_output(f: FusedAttention, out: Tensor, q_gate: Tensor, residual: Tensor) -> Tensor:
    """Sigmoid-gated attention output `(T, H, D)`, projected and added to the residual."""
    out = out * torch.sigmoid(q_gate[..., out.shape[-1]:])
    return torch.addmm(residual, out.reshape(out.shape[0], -1), f.out_t)


def attention(m: Attention, f: FusedAttention, h: Tensor, residual: Tensor, rope: tuple[Tensor, Tensor],
              access: StateAccess, j: int) -> Tensor:
    """Attention layer j (among the attention layers) on the normed input h, added to the residual."""
    q_gate, q, k, v = attention_inputs(m, f, h, rope)
    return attention_output(f, access.attend(j, q, k, v), q_gate, residual)


def mlp(layer: DecoderLayer, f: FusedLayer, x: Tensor) -> Tensor:
    """The post-mixer norm and MLP (dense, or sparse MoE over all of x's tokens at once), added to the residual."""
    h = F.rms_norm(x, x.shape[-1:], f.post_norm, layer.post_attention_layernorm.eps)
    if f.moe is not None:
        return _moe(layer.mlp, f.moe, h, x)  # type: ignore[arg-type]
    gate, up = F.linear(h, f.w_gate_up).chunk(2, dim=-1)
    return torch.addmm(x, F.silu(gate) * up, f.down_t)


def _moe(m: SparseMoE, f: FusedMoE, h: Tensor, residual: Tensor) -> Tensor:
    """`SparseMoE.forward` with the router and the shared expert's input projections in one matmul."""
    logits, gate_up, shared_gate = F.linear(h, f.w_in).split(f.splits, dim=-1)
    weights, chosen = route(logits, m.top_k, m.renormalise)
    routed, touched = apply_experts(m.experts.gate_up_proj, m.experts.down_proj, h, weights, chosen)
    if not torch.compiler.is_compiling():  # a graph's count would be one of its own buffers
        m.touched = touched
    gate, up = gate_up.chunk(2, dim=-1)
    shared = torch.sigmoid(shared_gate) * torch.mm(F.silu(gate) * up, f.shared_down_t)
    return residual + (routed + shared)


def decoder_layer(layer: DecoderLayer, f: FusedLayer, x: Tensor, rope: tuple[Tensor, Tensor], access: StateAccess,
                  index: int) -> Tensor:
    """`DecoderLayer.forward` in fewer ops: the mixer (the index-th of its kind) and the MLP, each on its pre-norm and
    added to the residual. `rope` is `rotary_signed(...)` of the layer path's (cos, sin) at the tokens' positions."""
    h = F.rms_norm(x, x.shape[-1:], f.input_norm, layer.input_layernorm.eps)
    if layer.kind == "linear_attention":
        x = gdn(layer.linear_attn, f.mixer, h, x, access, index)  # type: ignore[arg-type]
    else:
        x = attention(layer.self_attn, f.mixer, h, x, rope, access, index)  # type: ignore[arg-type]
    return mlp(layer, f, x)


LayerFn = Callable[[DecoderLayer, FusedLayer, Tensor, tuple[Tensor, Tensor], StateAccess, int], Tensor]


def forward(model: Model, x: Tensor, rope: tuple[Tensor, Tensor], access: StateAccess,
            run_layer: LayerFn = decoder_layer) -> tuple[Tensor, Tensor]:
    """The one forward pass, from the embeddings `x (N, hidden)`: every layer through `run_layer` (a compiled
    layer, or `decoder_layer`), then the head. Returns float32 logits `(N, vocab)` and the last layer's hidden states
    before the final norm. Where the state lives is the access's business alone."""
    counts = {"linear_attention": 0, "full_attention": 0}
    for layer, f in zip(model.model.layers, model.fused.layers):
        x = run_layer(layer, f, x, rope, access, counts[layer.kind])
        counts[layer.kind] += 1
    return head(model, x), x


def head(model: Model, x: Tensor) -> Tensor:
    """The final norm and the LM head: float32 logits."""
    return model.lm_head(F.rms_norm(x, x.shape[-1:], model.fused.final_norm, model.model.norm.eps)).float()
