"""Decayed linear recurrence without the delta rule (Mamba2/SSD and gated linear attention):

    S_t = D(g_t) S_{t-1} + k_t d_t^T,    o_t = S_t^T q_t

where D(g) = exp(g) is a scalar per head (g `(..., T, H)`) or a diagonal over key channels (g `(..., T, H, Dk)`:
row i of S decays by exp(g[i])). The output reads the state after token t's write, as Mamba2's does.

Unlike the gated delta rule, d_t does not depend on the state, so a chunk needs no triangular solve: with G the
in-chunk cumulative log decay,

    o_i = (q_i exp(G_i)) S_0 + sum_{j<=i} (q_i . (k_j exp(G_i - G_j))) d_j
    S_C = exp(G_C) S_0 + sum_j (k_j exp(G_C - G_j)) d_j^T

Every exponent above is <= 0 (log decays are): exp(-G) is never formed on its own, since it overflows for a chunk of
strongly decaying tokens. Layout: q, k `(..., T, H, Dk)`, d `(..., T, H, Dv)`, initial `(..., H, Dk, Dv)`, float32,
with `...` empty or one batch axis; every form returns (out `(..., T, H, Dv)`, final `(..., H, Dk, Dv)`).

Mamba1's selective scan is the per-channel form with Dv = 1 and H = d_inner (every channel a head, q = C, k = B,
d = dt x, g = dt A): there the chunk's `(H, Dk, C, C)` decays are C times the state of every token, so `auto` takes
the elementwise scan (`scan_decay_scan`), whose memory is the `(T, H, Dk, Dv)` states of a chunk.
"""
from __future__ import annotations

import torch
from torch import Tensor

CHUNK_SIZE = 64
FORMS = ("auto", "naive", "step", "chunk", "scan")


def _per_channel(g: Tensor, k: Tensor) -> Tensor:
    """g with a key-channel axis (of size 1 for a scalar per head), so both decays share one code path."""
    return g if g.dim() == k.dim() else g[..., None]


def naive_decay_scan(q: Tensor, k: Tensor, d: Tensor, g: Tensor, initial: Tensor) -> tuple[Tensor, Tensor]:
    """One token at a time, in the inputs' dtype: the reference every other form is tested against."""
    g = _per_channel(g, k)
    state = initial.clone()
    outs = []
    for t in range(q.shape[-3]):
        state = state * g[..., t, :, :, None].exp() + k[..., t, :, :, None] * d[..., t, :, None, :]  # (..., H, Dk, Dv)
        outs.append(torch.einsum("...hk,...hkv->...hv", q[..., t, :, :], state))
    return torch.stack(outs, -3), state


def step_decay_scan(q: Tensor, k: Tensor, d: Tensor, g: Tensor, initial: Tensor) -> tuple[Tensor, Tensor]:
    """One token (T == 1): a decay, a rank-1 write and a batched matvec; decode is dispatch-bound, so few ops."""
    decay = _per_channel(g, k).squeeze(-3).exp()[..., None]  # (..., H, Dk|1, 1)
    state = torch.addcmul(initial * decay, k.squeeze(-3)[..., None], d.transpose(-3, -2))  # (..., H, Dk, Dv)
    return (q.transpose(-3, -2) @ state).transpose(-3, -2), state


def pair_decays(G: Tensor) -> Tensor:
    """exp(G_i - G_j) for j <= i, exactly 0 above the diagonal (where it may be inf: `tril_` selects), from the
    in-chunk cumulative log decays G `(..., C, Dk|1)`: `(..., C, C)` for a decay per head, `(..., Dk, C, C)` per key
    channel (C x C x Dk decays, small for C <= 64 and the Dk of such layers). Every exponent a difference, never
    exp(-G) alone. Shared with the chunked gated delta rule (`chunk.py`), KDA's per-channel form included."""
    Gc = G.transpose(-1, -2)  # (..., Dk|1, C)
    decay = (Gc[..., :, None] - Gc[..., None, :]).exp_().tril_()  # (..., Dk|1, C, C)
    return decay.squeeze(-3) if G.shape[-1] == 1 else decay


def decayed_scores(a: Tensor, b: Tensor, decay: Tensor) -> Tensor:
    """sum_c a_i[c] b_j[c] exp(G_i[c] - G_j[c]) `(..., C, C)` for a, b `(..., C, Dk)` and `pair_decays`' `decay`."""
    if decay.dim() == a.dim():  # a decay per head: one matmul, then the decays
        return (a @ b.transpose(-1, -2)) * decay
    return torch.einsum("...ic,...jc,...cij->...ij", a, b, decay)


def one_chunk(q: Tensor, k: Tensor, d: Tensor, g: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk, heads first: q, k `(..., H, C, Dk)`, d `(..., H, C, Dv)`, g `(..., H, C, Dk|1)`; (out, state)."""
    G = g.cumsum(-2)  # (..., H, C, Dk|1), <= 0
    scores = decayed_scores(q, k, pair_decays(G))  # (..., H, C, C)
    last = G[..., -1:, :]  # (..., H, 1, Dk|1)
    out = scores @ d + (q * G.exp()) @ state  # (..., H, C, Dv)
    state = last.transpose(-1, -2).exp() * state + (k * (last - G).exp()).transpose(-1, -2) @ d
    return out, state


def chunk_decay_scan(q: Tensor, k: Tensor, d: Tensor, g: Tensor, initial: Tensor,
                     chunk_size: int = CHUNK_SIZE) -> tuple[Tensor, Tensor]:
    """Chunks of `chunk_size` tokens in matmul form, the state carried between them (prefill, long verify)."""
    q, k, d, g = (x.transpose(-3, -2) for x in (q, k, d, _per_channel(g, k)))  # heads first
    state, outs = initial, []
    for s in range(0, q.shape[-2], chunk_size):
        out, state = one_chunk(*(x[..., s:s + chunk_size, :] for x in (q, k, d, g)), state)
        outs.append(out)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, -2)).transpose(-3, -2), state


def _prefix_steps(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Every prefix of the affine steps S -> a_t S + b_t over the token axis (-4), composed in log2(T) rounds
    (Hillis-Steele): returns (A_t, B_t) with S_t = A_t S_0 + B_t. Products of decays in (0, 1] never overflow."""
    T, span = a.shape[-4], 1
    while span < T:
        late_a, late_b = a.narrow(-4, span, T - span), b.narrow(-4, span, T - span)
        early_a, early_b = a.narrow(-4, 0, T - span), b.narrow(-4, 0, T - span)
        b = torch.cat([b.narrow(-4, 0, span), torch.addcmul(late_b, late_a, early_b)], -4)
        a = torch.cat([a.narrow(-4, 0, span), late_a * early_a], -4)
        span *= 2
    return a, b


def decay_states(k: Tensor, d: Tensor, g: Tensor, initial: Tensor, chunk_size: int = CHUNK_SIZE) -> Tensor:
    """The state after every token `(..., T, H, Dk, Dv)`, elementwise, chunk by chunk (a log-depth scan within each
    chunk): for kinds whose state is as small as a token's inputs (Dv = 1), which keep these states as their logs."""
    g = _per_channel(g, k)
    state, chunks = initial, []
    for s in range(0, k.shape[-3], chunk_size):
        k_c, d_c, g_c = (x[..., s:s + chunk_size, :, :] for x in (k, d, g))
        A, B = _prefix_steps(g_c.exp()[..., None], k_c[..., None] * d_c[..., None, :])  # (..., C, H, Dk|1, 1|Dv)
        chunks.append(torch.addcmul(B, A, state[..., None, :, :, :]))  # (..., C, H, Dk, Dv)
        state = chunks[-1][..., -1, :, :, :]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, -4)


def scan_decay_scan(q: Tensor, k: Tensor, d: Tensor, g: Tensor, initial: Tensor,
                    chunk_size: int = CHUNK_SIZE) -> tuple[Tensor, Tensor]:
    """Elementwise: the states after every token (`decay_states`), then each token's output read from its state.
    No `(C, C)` matrix: the form for Dv = 1 (Mamba1)."""
    states = decay_states(k, d, g, initial, chunk_size)
    return torch.einsum("...thk,...thkv->...thv", q, states), states[..., -1, :, :, :]


def elementwise(k: Tensor, d: Tensor, g: Tensor) -> bool:
    """Whether the elementwise scan is the cheaper multi-token form: a decay per key channel and Dv = 1."""
    return g.dim() == k.dim() and d.shape[-1] == 1


def decay_scan(q: Tensor, k: Tensor, d: Tensor, g: Tensor, initial: Tensor, form: str = "auto",
               static: bool = False) -> tuple[Tensor, Tensor]:
    """The recurrence in the form asked (`FORMS`); `auto` is the step for one token, otherwise the elementwise scan
    where it is cheaper (`elementwise`) and chunks elsewhere.

    `static`: a pass recorded as a graph (compiled or CUDA-graph) takes the step, or a single chunk of the form
    `auto` would take, whatever the form, so no loop runs over its token count; it holds at most `CHUNK_SIZE`
    tokens."""
    T = q.shape[-3]
    if form not in FORMS:
        raise ValueError(f"unknown decay scan form {form!r} (expected one of {FORMS})")
    if static:
        if T > CHUNK_SIZE:
            raise ValueError(f"a static pass holds at most {CHUNK_SIZE} tokens, got {T}")
        if T == 1:
            return step_decay_scan(q, k, d, g, initial)
        if elementwise(k, d, g):
            return scan_decay_scan(q, k, d, g, initial)
        out, final = one_chunk(*(x.transpose(-3, -2) for x in (q, k, d, _per_channel(g, k))), initial)
        return out.transpose(-3, -2), final
    if form == "naive":
        return naive_decay_scan(q, k, d, g, initial)
    if form == "step" or (form == "auto" and T == 1):
        if T != 1:
            raise ValueError(f"the step form takes one token, got {T}")
        return step_decay_scan(q, k, d, g, initial)
    if form == "scan" or (form == "auto" and elementwise(k, d, g)):
        return scan_decay_scan(q, k, d, g, initial)
    return chunk_decay_scan(q, k, d, g, initial)
