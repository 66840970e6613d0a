"""One forward pass over several sequences: the rounds of many sessions at the price of about one.

At these sizes a pass costs per-op dispatch, so a batch shares every op it can. The sequences'
tokens are packed into one `(sum T_i, hidden)` matrix: embeddings, norms, every projection and
the MLP run once for all of them. What is per sequence stays per sequence:
- Gated DeltaNet: the sequences' conv windows and recurrent states are gathered (`stack`) into a
  padded `(B, T_max)` layout and run through one batched step (all T = 1) or one chunk of the
  chunked form. Padding sits after each sequence's last token with beta = 0 and g = 0, so it
  adds exactly nothing to the state (delta = 0, decay 1) and touches no real output (causal).
  The staged state, window and logs go back to each sequence's own buffers in one `_foreach_copy_`; where the
  Triton kernel runs (CUDA) and the sequences are slots of one `StatePool`, it logs k, delta and g itself.
- Attention: each sequence writes its K/V at its own positions in its own cache; the caches are
  gathered into one zero-padded batch and one masked attention call serves every sequence.
The result for each sequence, and what it leaves staged, is what `HybridLM.forward` gives it alone
(the same fused pieces, `deltaspec.shared.model.fused`); `tests/test_batching.py` checks that on random models.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from deltaspec.shared.kernels import VerifyLogs, pick_kernel, triton_kernel
from deltaspec.shared.kernels.chunk import CHUNK_SIZE, one_chunk_gated_delta_rule
from deltaspec.shared.model import fused
from deltaspec.shared.model.hybrid import HybridLM
from deltaspec.shared.model.layers import Attention, GatedDeltaNet, attend
from deltaspec.shared.state.rollback import AttnLayerState, GDNSlot, ModelState, verify_logs


class BatchRefused(ValueError):
    """A batch refused before anything was staged: every state is as it was."""


@dataclass
class _Group:
    """Sequences whose GDN core runs together, padded to `T` tokens each."""

    members: list[int]  # item indices
    lengths: list[int]
    T: int
    rows: slice | Tensor  # rows of the packed tokens in (member, t) order; padding repeats a member's last row
    valid: Tensor | None  # (G, T, 1) 1 for real tokens, 0 for padding; None when nothing is padded
    logs: VerifyLogs | None = None  # where the Triton kernel logs the members: made at the first GDN layer that runs it


@dataclass
class _Plan:
    lengths: list[int]
    starts: list[int]  # position of each sequence's first token
    offsets: list[int]  # each sequence's first row in the packed tokens
    groups: list[_Group]
    unpad: Tensor | None  # packed row -> row of the groups' concatenated (G T) outputs; None when they coincide


def _plan(lengths: list[int], starts: list[int], device: torch.device) -> _Plan:
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    short = [i for i, T in enumerate(lengths) if T <= CHUNK_SIZE]
    groups = [_group(short, lengths, offsets, device)] if short else []
    groups += [_group([i], lengths, offsets, device) for i, T in enumerate(lengths) if T > CHUNK_SIZE]
    order = [i for g in groups for i in g.members]
    unpad = None
    if order != list(range(len(lengths))) or any(g.valid is not None for g in groups):
        flat, base = [0] * sum(lengths), 0
        for g in groups:
            for slot, (i, T) in enumerate(zip(g.members, g.lengths)):
                for t in range(T):
                    flat[offsets[i] + t] = base + slot * g.T + t
            base += len(g.members) * g.T
        unpad = torch.tensor(flat, device=device)
    return _Plan(lengths, starts, offsets, groups, unpad)


def _group(members: list[int], lengths: list[int], offsets: list[int], device: torch.device) -> _Group:
    lens = [lengths[i] for i in members]
    T = max(lens)
    contiguous = members == list(range(members[0], members[0] + len(members)))
    if min(lens) == T and contiguous:
        return _Group(members, lens, T, slice(offsets[members[0]], offsets[members[-1]] + T), None)
    rows = torch.tensor([offsets[i] + min(t, n - 1) for i, n in zip(members, lens) for t in range(T)], device=device)
    valid = torch.tensor([[float(t < n)] for n in lens for t in range(T)], device=device).view(len(members), T, 1)
    return _Group(members, lens, T, rows, valid if min(lens) < T else None)


def _take(x: Tensor, g: _Group) -> Tensor:
    """Rows of the packed `x` for group g as `(G, T, ...)`."""
    rows = x[g.rows] if isinstance(g.rows, slice) else x.index_select(0, g.rows)
    return rows.view(len(g.members), g.T, *x.shape[1:])


def _gdn_core(m: GatedDeltaNet, f: fused.FusedGDN, g: _Group, mixed: Tensor, b: Tensor, a: Tensor,
              slots: list[GDNSlot]) -> Tensor:
    """The delta rule for one group; stages each member into its own buffers; outputs `(G T, Hv, Dv)`."""
    G, T, H, Dk, Dv = len(g.members), g.T, m.n_v, m.d_k, m.d_v
    xs = _take(mixed, g)
    full = torch.cat([torch.stack([s.conv_window() for s in slots]), xs], dim=1)  # (G, K-1+T, conv_dim)
    q, k, v, beta, decay = fused.gdn_gates(m, f, full, _take(b, g), _take(a, g))  # (G, T, Hv, D), (G, T, Hv)
    if g.valid is not None:  # padding neither decays nor writes the state
        beta, decay = beta * g.valid, decay * g.valid
    initial = torch.stack([s.initial_state() for s in slots])  # (G, H, Dk, Dv)
    on_cpu = not mixed.is_cuda
    logs: VerifyLogs | None = None
    if T == 1 and m.kernel_name in ("auto", "recurrent") and on_cpu:
        state = initial * decay.view(G, H, 1, 1).exp()
        delta = (v.view(G, H, 1, Dv) - k.view(G, H, 1, Dk) @ state) * beta.view(G, H, 1, 1)  # (G, H, 1, Dv)
        final = state.add_(k.view(G, H, Dk, 1) @ delta)
        out, delta_hf = (q.view(G, H, 1, Dk) @ final).view(G, 1, H, Dv), delta
    elif T <= CHUNK_SIZE and m.kernel_name in ("auto", "chunk") and on_cpu:
        out, delta_hf, final = one_chunk_gated_delta_rule(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          decay.transpose(1, 2), beta.transpose(1, 2), initial)
        out = out.transpose(1, 2)  # (G, T, Hv, Dv)
    else:
        triton = triton_kernel(m.kernel_name, T, mixed.is_cuda)
        if triton is not None:  # it logs k, delta and g itself when the members are slots of one pool
            if g.logs is None:  # rows, offsets and counts are the same at every layer of the pass
                g.logs = verify_logs(slots, g.lengths)
            logs = None if g.logs is None else g.logs._replace(layer=slots[0].i)
            out, delta, final = triton(q, k, v, decay, beta, initial, logs)
        else:
            out, delta, final = pick_kernel(m.kernel_name, T, mixed.is_cuda)(q, k, v, decay, beta, initial)
        delta_hf = delta.transpose(1, 2)
    _stage(g, slots, xs, full, k.permute(0, 2, 3, 1), delta_hf, decay.transpose(1, 2), final, logs is not None)
    return out.reshape(G * T, H, Dv)


def _stage(g: _Group, slots: list[GDNSlot], xs: Tensor, full: Tensor, k_log: Tensor, delta_log: Tensor,
           g_log: Tensor, final: Tensor, kernel_logged: bool = False) -> None:
    """Each member's logs, window and state after its tokens, into its own buffers, in one foreach copy.

    Layouts as the logs keep them: xs `(G, T, C)`, k_log `(G, H, Dk, T)`, delta_log `(G, H, T, Dv)`, g_log `(G, H, T)`.
    `kernel_logged`: the kernel wrote k, delta and g into the logs (`verify_logs`); only x is copied.
    """
    width = full.shape[1] - g.T
    dsts: list[Tensor] = []
    srcs: list[Tensor] = []
    per_member = zip(slots, g.lengths, xs.unbind(0), k_log.unbind(0), delta_log.unbind(0), g_log.unbind(0),
                     full.unbind(0), final.unbind(0))
    for slot, n, x, k, delta, decay, window_and_x, state in per_member:
        logs = slot.log_targets(n)
        if logs:
            new = (x, k, delta, decay) if n == g.T else (x[:n], k[..., :n], delta[:, :n], decay[:, :n])
            dsts += logs[:1] if kernel_logged else logs
            srcs += new[:1] if kernel_logged else new
        dsts += (slot.states.layers["window"][slot.i], slot.state_out())
        srcs += (window_and_x[n:n + width], state)
    torch._foreach_copy_(dsts, srcs)


def _packed(outs: list[Tensor], plan: _Plan) -> Tensor:
    """The groups' outputs, each `(G T, ...)`, back in the packed tokens' order (padding dropped)."""
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out if plan.unpad is None else out.index_select(0, plan.unpad)


def _gdn(m: GatedDeltaNet, f: fused.FusedGDN, h: Tensor, residual: Tensor, slots: list[GDNSlot],
         plan: _Plan) -> Tensor:
    mixed, z, b, a = fused.gdn_inputs(f, h)
    outs = [_gdn_core(m, f, g, mixed, b, a, [slots[i] for i in g.members]) for g in plan.groups]
    return fused.gdn_output(m, f, _packed(outs, plan), z, residual)


def _attend_group(m: Attention, g: _Group, q: Tensor, k: Tensor, v: Tensor, states: list[AttnLayerState],
                  starts: list[int]) -> Tensor:
    """Masked attention for one group: each member writes its K/V at its positions, then all attend at once over
    their caches gathered into a zero-padded `(G, Hkv, L, D)` (a member's query t sees keys up to start + t)."""
    G, T, Hkv, D = len(g.members), g.T, m.n_kv, m.head_dim
    ends = [start + n for start, n in zip(starts, g.lengths)]
    L = max(ends)
    new_k, new_v = (_take(x, g).transpose(1, 2).unbind(0) for x in (k, v))  # G x (Hkv, T, D)
    cache_k, cache_v = (q.new_zeros(G, Hkv, L, D).unbind(0) for _ in range(2))
    dsts: list[Tensor] = []
    srcs: list[Tensor] = []
    for st, start, end, n, nk, nv in zip(states, starts, ends, g.lengths, new_k, new_v):
        dsts += (st.k[:, start:end], st.v[:, start:end])
        srcs += (nk, nv) if n == T else (nk[:, :n], nv[:, :n])
    torch._foreach_copy_(dsts, srcs)
    torch._foreach_copy_([c[:, :end] for c, end in zip(cache_k + cache_v, ends + ends)],
                         [st.k[:, :end] for st, end in zip(states, ends)]
                         + [st.v[:, :end] for st, end in zip(states, ends)])
    query_at = torch.tensor(starts, device=q.device)[:, None] + torch.arange(T, device=q.device)  # (G, T)
    mask = torch.arange(L, device=q.device) <= query_at[..., None]  # (G, T, L)
    out = F.scaled_dot_product_attention(_take(q, g).transpose(1, 2), torch.stack(cache_k), torch.stack(cache_v),
                                         attn_mask=mask[:, None], enable_gqa=m.n_heads != m.n_kv)  # (G, H, T, D)
    return out.transpose(1, 2).reshape(G * T, m.n_heads, D)


def _attention(m: Attention, f: fused.FusedAttention, h: Tensor, residual: Tensor, states: list[AttnLayerState],
               plan: _Plan, rope: tuple[Tensor, Tensor]) -> Tensor:
    q_gate, q, k, v = fused.attention_inputs(m, f, h, rope)
    outs = []
    for g in plan.groups:
        members = [states[i] for i in g.members]
        if len(g.members) == 1:  # a long prefill piece, or a group of one: the single-sequence form
            o, T, start = plan.offsets[g.members[0]], g.T, plan.starts[g.members[0]]
            outs.append(attend(members[0], q[o:o + T], k[o:o + T], v[o:o + T], start))
        else:
            outs.append(_attend_group(m, g, q, k, v, members, [plan.starts[i] for i in g.members]))
    return fused.attention_output(f, _packed(outs, plan), q_gate, residual)


@torch.inference_mode()
def forward_batch(model: HybridLM, items: Sequence[tuple[Tensor, ModelState]]) -> list[tuple[Tensor, Tensor]]:
    """`[model(ids, state) for ids, state in items]` in one pass; every state distinct.

    Everything is checked before anything is staged: a refused batch (`BatchRefused`, or a K/V budget's
    `ResourceExhausted`) changes no state.
    """
    if len({id(st) for _, st in items}) != len(items):
        raise BatchRefused("a batch names the same sequence state twice")
    for ids, _ in items:
        if ids.ndim != 1 or ids.numel() == 0:
            raise BatchRefused("forward takes a non-empty 1-D tensor of token ids")
    cfg, device = model.config, model.device
    ids = torch.cat([ids for ids, _ in items]).to(device)
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise BatchRefused(f"token ids outside the vocabulary [0, {cfg.vocab_size})")
    if model.fused is None or len(items) == 1 or any(st.gdn.capture is not None for _, st in items):
        return [model(ids, st) for ids, st in items]  # a prefix cache's heads are taken by the per-sequence pass
    lengths = [t.numel() for t, _ in items]
    starts = [st.length + st.staged for _, st in items]
    for (_, st), start, T in zip(items, starts, lengths):
        st.ensure_positions(start + T)
    plan = _plan(lengths, starts, device)
    positions = torch.tensor([p for s, T in zip(starts, lengths) for p in range(s, s + T)], device=device)
    x = model.model.embed_tokens(ids)
    cos, _, signed_sin = model.rope(0, max(s + T for s, T in zip(starts, lengths)), x)
    rope = cos[positions], signed_sin[positions]
    views = [st.layer_views() for _, st in items]
    for n, (layer, f) in enumerate(zip(model.model.layers, model.fused.layers)):
        h = F.rms_norm(x, x.shape[-1:], f.input_norm, layer.input_layernorm.eps)
        per_seq = [v[n] for v in views]
        if layer.kind == "linear_attention":
            x = _gdn(layer.linear_attn, f.mixer, h, x, per_seq, plan)  # type: ignore[arg-type]
        else:
            x = _attention(layer.self_attn, f.mixer, h, x, per_seq, plan, rope)  # type: ignore[arg-type]
        x = fused.mlp(layer, f, x)
    for (_, st), T in zip(items, lengths):
        st.staged += T
    logits = model.lm_head(F.rms_norm(x, x.shape[-1:], model.fused.final_norm, model.model.norm.eps)).float()
    return list(zip(logits.split(lengths), x.split(lengths)))
