"""Every decay scan form against the naive loop (run in float64), on fresh random inputs: scalar and per-channel
decays, with and without a batch axis, token counts around the chunk size."""
import pytest
import torch

from deltaspec.shared.kernels.decay_scan import (CHUNK_SIZE, chunk_decay_scan, decay_scan, naive_decay_scan,
                                                 scan_decay_scan)


def random_inputs(batch: tuple[int, ...], T: int, per_channel: bool, seed: int, H: int = 3, Dk: int = 6,
                  Dv: int = 10, strength: float = 1.0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(*batch, T, H, Dk, generator=gen) * Dk**-0.5 for _ in range(2))
    d = torch.randn(*batch, T, H, Dv, generator=gen)
    g = -torch.rand(*batch, T, H, *((Dk,) if per_channel else ()), generator=gen) * strength
    initial = torch.randn(*batch, H, Dk, Dv, generator=gen)
    return q, k, d, g, initial


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def truth(q, k, d, g, initial):
    return naive_decay_scan(*(x.double() for x in (q, k, d, g, initial)))


CASES = [(batch, T, per_channel) for batch in ((), (2,)) for T in (1, 2, 5, 17, 64, 130) for per_channel in (0, 1)]


@pytest.mark.parametrize("batch,T,per_channel", CASES,
                         ids=[f"B{b or '-'}-T{T}-{'channel' if c else 'head'}" for b, T, c in CASES])
def test_forms_match_naive(batch, T, per_channel):
    inputs = random_inputs(batch, T, bool(per_channel), seed=T + 7 * per_channel + len(batch))
    want_out, want_final = truth(*inputs)
    runs = {"naive": decay_scan(*inputs, form="naive"), "auto": decay_scan(*inputs),
            "chunk": decay_scan(*inputs, form="chunk"), "chunk16": chunk_decay_scan(*inputs, chunk_size=16),
            "scan": decay_scan(*inputs, form="scan"), "scan16": scan_decay_scan(*inputs, chunk_size=16)}
    if T == 1:
        runs["step"] = decay_scan(*inputs, form="step")
    if T <= CHUNK_SIZE:
        runs["static"] = decay_scan(*inputs, static=True)
    for name, (out, final) in runs.items():
        assert out.shape == want_out.shape and final.shape == want_final.shape, name
        assert rel_rms(out, want_out) < 1e-5 and rel_rms(final, want_final) < 1e-5, name


MAMBA1 = [(batch, T) for batch in ((), (2,)) for T in (1, 3, 17, 63, 75)]


@pytest.mark.parametrize("batch,T", MAMBA1, ids=[f"B{b or '-'}-T{T}" for b, T in MAMBA1])
def test_mamba1_shape_matches_naive(batch, T):
    """Mamba1's layout: every channel a head (H = d_inner, here 40), Dv = 1, one B and C for all heads (broadcast
    views, as the mixer passes them); `auto` takes the step or the elementwise scan, static too."""
    q, k, d, g, initial = random_inputs(batch, T, True, seed=T, H=40, Dk=7, Dv=1)
    q, k = (x[..., :1, :].expand_as(x) for x in (q, k))
    want_out, want_final = truth(q, k, d, g, initial)
    runs = [decay_scan(q, k, d, g, initial), scan_decay_scan(q, k, d, g, initial, chunk_size=16)]
    if T <= CHUNK_SIZE:
        runs.append(decay_scan(q, k, d, g, initial, static=True))
    for out, final in runs:
        assert out.shape == want_out.shape and final.shape == want_final.shape
        assert rel_rms(out, want_out) < 1e-5 and rel_rms(final, want_final) < 1e-5


@pytest.mark.parametrize("per_channel", [False, True], ids=["head", "channel"])
def test_strong_decay_stays_finite(per_channel):
    """Log decays of up to -60 a token: a chunk's cumulative decay is far below float32's exp range, which a form
    that divides by exp(G) would turn into inf or nan."""
    inputs = random_inputs((2,), 130, per_channel, seed=3, strength=60.0)
    want_out, want_final = truth(*inputs)
    for out, final in (decay_scan(*inputs), decay_scan(*(x[:, :64] for x in inputs[:4]), inputs[4], static=True)):
        assert torch.isfinite(out).all() and torch.isfinite(final).all()
    for out, final in (decay_scan(*inputs), decay_scan(*inputs, form="scan")):
        assert rel_rms(out, want_out) < 1e-5 and rel_rms(final, want_final) < 1e-5


def test_zero_decay_and_write_leave_the_state():
    """A token with g = 0 and d = 0 (a batch's padding) leaves the state exactly as it was, in every form."""
    q, k, d, g, initial = random_inputs((), 3, False, seed=5)
    d[1:], g[1:] = 0, 0
    after_first = decay_scan(q[:1], k[:1], d[:1], g[:1], initial)[1]
    for form in ("naive", "chunk", "scan"):
        assert torch.allclose(decay_scan(q, k, d, g, initial, form=form)[1], after_first, rtol=1e-6, atol=1e-6)
    assert torch.equal(decay_scan(q[1:2], k[1:2], d[1:2], g[1:2], initial)[1], initial)


def test_bad_forms_are_refused():
    inputs = random_inputs((), 2, False, seed=1)
    with pytest.raises(ValueError):
        decay_scan(*inputs, form="recurrent")
    with pytest.raises(ValueError):
        decay_scan(*inputs, form="step")
    with pytest.raises(ValueError):
        decay_scan(*random_inputs((), CHUNK_SIZE + 1, False, seed=1), static=True)
