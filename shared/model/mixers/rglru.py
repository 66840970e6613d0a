"""The recurrent block of Griffin / RecurrentGemma (HF's `RecurrentGemmaRecurrentBlock` and `RecurrentGemmaRglru`),
with HF's parameter names.

linear_x and linear_y read each token; y = gelu_tanh(linear_y h) is the gate; a depthwise causal conv of width K (with
bias, no activation) runs over x; the Real-Gated Linear Recurrent Unit then reads the conv's output xc `(W,)` per
block of `W / heads` channels (block-diagonal gates):

    i_t = sigmoid(xc_t W_i + b_i),   r_t = sigmoid(xc_t W_r + b_r),   log a_t = -8 r_t softplus(Lambda)
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t xc_t)      (the factor is 1 at a sequence's first token: HF's reset)

and linear_out(h y) is what the block adds. In the state algebra `S_t = D(g_t) S_{t-1} + k_t d_t^T` every channel is
a head of one key and one value (k_t = 1, d_t the normalised input, g_t = log a_t). The state is W numbers, no larger
than one token's log, so the state floor keeps it as the kind `rglru` (a `snapshot` kind, as Mamba1's): the state
after each staged token is logged, the layer's state as one head of one key and W values, and a commit copies the one
it keeps. At a sequence's first token the state is zero, so HF's `a = 0` there changes nothing; its factor of 1 does,
and `Start.first` marks that token.

As `mamba1.py`, the pass is split in `inputs`, `recurrence` (the `Step`) and `output`; `RGLRUMixer.forward` is the
reference (one token at a time, as HF's scan).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltaspec.shared.kernels.conv import causal_conv
from deltaspec.shared.kernels.decay_scan import decay_states
from deltaspec.shared.state.access import StateAccess
from deltaspec.shared.state.rollback import RecurrentSlot
from deltaspec.shared.state.spec import RECURRENT
from deltaspec.shared.state.steps import Start, Step

GATE_SCALE = -8.0  # log a = GATE_SCALE * r * softplus(Lambda), Griffin's constant c


class RGLRU(nn.Module):
    """The RG-LRU's parameters, as HF names them: Lambda (`recurrent_param`) and the two block-diagonal gates."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.block = heads, width // heads
        self.recurrent_param = nn.Parameter(torch.zeros(width))
        self.input_gate_weight = nn.Parameter(torch.zeros(heads, self.block, self.block))
        self.input_gate_bias = nn.Parameter(torch.zeros(heads, self.block))
        self.recurrent_gate_weight = nn.Parameter(torch.zeros(heads, self.block, self.block))
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(heads, self.block))


@dataclass
class FusedRGLRU:
    w_in: Tensor  # (2 W, hidden): [linear_x; linear_y]
    b_in: Tensor  # (2 W,)
    gates_w: Tensor  # (heads, block, 2 block): [input gate | recurrent gate], per block
    gates_b: Tensor  # (heads, 1, 2 block)
    rates: Tensor  # GATE_SCALE softplus(Lambda) `(W,)`: log a = rates * r


class RGLRUMixer(nn.Module):
    """The block's parameters and shape; the pass is the module's functions `inputs`, `recurrence`, `output`."""

    state = RECURRENT
    compiles = False  # the elementwise scan's log-depth loop runs over the token count: no symbolic graph

    def __init__(self, hidden_size: int, width: int, heads: int, conv_width: int = 4) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"lru_width ({width}) must be a whole multiple of num_attention_heads ({heads})")
        self.width = width
        self.linear_y = nn.Linear(hidden_size, width)
        self.linear_x = nn.Linear(hidden_size, width)
        self.linear_out = nn.Linear(width, hidden_size)
        self.conv_1d = nn.Conv1d(width, width, conv_width, groups=width)
        self.rg_lru = RGLRU(width, heads)

    @property
    def conv_kernel(self) -> int:
        return self.conv_1d.kernel_size[0]

    def forward(self, h: Tensor, st: RecurrentSlot, start: int = 0, rope: object = None) -> Tensor:
        """The reference on one sequence's slot, its T tokens at positions start..: what it adds to the residual;
        its tokens staged."""
        y, x, final, (k, d, g) = reference(self, h, st.conv_window().to(h.dtype), st.initial_state(), start == 0)
        st.stage(x, k, d, g, final)
        return y

    def fuse(self) -> FusedRGLRU:
        lru = self.rg_lru
        return FusedRGLRU(
            w_in=torch.cat([self.linear_x.weight, self.linear_y.weight]).detach(),
            b_in=torch.cat([self.linear_x.bias, self.linear_y.bias]).detach(),
            gates_w=torch.cat([lru.input_gate_weight, lru.recurrent_gate_weight], dim=-1).detach(),
            gates_b=torch.cat([lru.input_gate_bias, lru.recurrent_gate_bias], dim=-1)[:, None].detach(),
            rates=(GATE_SCALE * F.softplus(lru.recurrent_param)).detach())

    def fused(self, f: FusedRGLRU, h: Tensor, residual: Tensor, rope: object, access: StateAccess, i: int) -> Tensor:
        """Recurrent layer i on the normed input h `(N, hidden)`, added to the residual."""
        x, y = F.linear(h, f.w_in, f.b_in).chunk(2, dim=-1)
        out = access.recurrent(i, x, (), functools.partial(recurrence, self, f))
        return output(self, out, F.gelu(y, approximate="tanh"), residual)


def gates(m: RGLRUMixer, xc: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """The block-diagonal gates' pre-activations of xc `(..., T, W)`: per block b, xc_b W_b + bias_b, in one batched
    matmul over the blocks: `(..., T, heads, n)` for `weight` `(heads, block, n)`, `bias` `(heads, 1, n)`."""
    lead = xc.shape[:-1]
    blocks = xc.reshape(-1, m.rg_lru.heads, m.rg_lru.block).transpose(0, 1)  # (heads, N, block)
    return torch.baddbmm(bias, blocks, weight).transpose(0, 1).reshape(*lead, m.rg_lru.heads, -1)


def normalised(xc: Tensor, input_gate: Tensor, log_a: Tensor, first: Tensor | None) -> Tensor:
    """i_t xc_t sqrt(1 - a_t^2), the factor 1 where `first` (a sequence's first token), in xc's dtype as HF has it."""
    multiplier = torch.sqrt(1 - torch.exp(2 * log_a))
    if first is not None:
        multiplier = torch.where(first.bool(), torch.ones_like(multiplier), multiplier)
    return xc * input_gate * multiplier.to(xc.dtype)


def recurrence(m: RGLRUMixer, f: FusedRGLRU, full: Tensor, extras: tuple[Tensor, ...], start: Start) -> Step:
    """full = [conv window; x] `(..., K-1+T, W)` -> the pass's `Step`: out, the states `(..., T, W)`; and what the
    `snapshot` kind logs: the state after each token as d `(..., T, 1, W)` (k and g zeros, `(..., T, 1, 1)` and
    `(..., T, 1)`), `initial` being `(..., 1, 1, W)`. A padding token (start.valid 0) neither decays nor writes."""
    xc = causal_conv(full, m.conv_1d.weight[:, 0], m.conv_1d.bias)  # (..., T, W)
    opened = torch.sigmoid(gates(m, xc, f.gates_w, f.gates_b))  # (..., T, heads, 2 block)
    input_gate, recurrent_gate = (p.flatten(-2) for p in opened.chunk(2, dim=-1))  # (..., T, W)
    log_a = f.rates * recurrent_gate
    d = normalised(xc, input_gate, log_a, start.first).float()
    g = log_a.float()
    if start.valid is not None:
        d, g = d * start.valid, g * start.valid
    lead = start.initial.shape[:-3]
    if d.shape[-2] == 1:  # a decode step: one multiply-add (the scan's machinery costs more than the step)
        states = torch.addcmul(d, g.exp(), start.initial.reshape(*lead, 1, m.width))
    else:
        initial = start.initial.reshape(*lead, m.width, 1, 1)  # every channel a head of one key and one value
        states = decay_states(torch.ones_like(d)[..., None], d[..., None], g, initial)[..., 0, 0]  # (..., T, W)
    logged = states[..., None, :]  # (..., T, 1, W)
    zeros = logged.new_zeros(*logged.shape[:-1])
    return Step(states, zeros[..., None], logged, zeros, logged[..., -1, :, None, :])


def output(m: RGLRUMixer, states: Tensor, y: Tensor, residual: Tensor) -> Tensor:
    """The states `(..., T, W)` (a `Step`'s out) gated by y -> residual + linear_out(h y)."""
    return residual + m.linear_out(states.to(y.dtype) * y)


def reference(m: RGLRUMixer, h: Tensor, window: Tensor, state: Tensor,
              at_start: bool) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """The pass in its plainest form, HF's: h `(T, hidden)`, window `(K-1, W)` (the last pre-conv inputs), state
    `(1, 1, W)` (as the state floor holds it), `at_start` when the first token sits at position 0; returns what the
    block adds to the residual `(T, hidden)`, the pre-conv inputs x `(T, W)`, the state after the tokens, and what
    the state floor logs: zeros k `(T, 1, 1)`, the state after each token d `(T, 1, W)`, zeros g `(T, 1)`."""
    lru = m.rg_lru
    y = F.gelu(m.linear_y(h), approximate="tanh")
    x = m.linear_x(h)
    full = torch.cat([window, x])  # (K-1+T, W)
    xc = F.conv1d(full.t()[None], m.conv_1d.weight, m.conv_1d.bias, groups=m.width)[0].t()  # (T, W)
    blocks = xc.reshape(-1, lru.heads, lru.block).transpose(0, 1)  # (heads, T, block)
    input_gate = torch.sigmoid(torch.baddbmm(lru.input_gate_bias[:, None], blocks, lru.input_gate_weight))
    recurrent_gate = torch.sigmoid(torch.baddbmm(lru.recurrent_gate_bias[:, None], blocks, lru.recurrent_gate_weight))
    input_gate, recurrent_gate = (g.transpose(0, 1).reshape(xc.shape) for g in (input_gate, recurrent_gate))
    log_a = GATE_SCALE * recurrent_gate * F.softplus(lru.recurrent_param)
    first = torch.zeros(xc.shape[0], 1, device=xc.device)
    first[0] = float(at_start)
    inputs = normalised(xc, input_gate, log_a, first)
    state = state.reshape(m.width)
    states = []
    for t in range(xc.shape[0]):
        a = torch.exp(log_a[t]).float() * (1 - first[t])  # HF's reset zeroes a at the first token
        state = a * state + inputs[t].float()
        states.append(state)
    out = torch.stack(states)  # (T, W)
    T = out.shape[0]
    return (output(m, out, y, torch.zeros_like(h)), x, state.reshape(1, 1, -1),
            (out.new_zeros(T, 1, 1), out[:, None], out.new_zeros(T, 1)))
