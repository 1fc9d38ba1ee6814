"""The rounding argument of seal.cu's KIVI codes (kivi_code), in float32 arithmetic on the host:
q0 = fl(d * fl(1 / s)), then one fma for the remainder d - q0 s (exact) and one for the
correction fl(q0 + rem * fl(1 / s)), gives the correctly rounded quotient fl(d / s) (Markstein),
so the codes are the reference's rint(fl(d / s)) with no division.  Checked over every f16 scale
(normal and subnormal) with full-mantissa differences, and over KIVI-like groups whose values sit
a few ulps around half steps of their scale (exact ties and near-ties); without the correction
the codes differ, so the test would catch its loss.  numpy has no float32 fma: ``_fma32`` rounds
the exact a * b + c once (float64 holds a * b exactly; where the float64 sum lands on a float32
midpoint, the exact value decides)."""

from fractions import Fraction

import numpy as np


def _fma32(a, b, c):
    a, b, c = (np.asarray(t, np.float32) for t in (a, b, c))
    r64 = a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)
    r32 = r64.astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        lo = np.nextafter(r32, np.float32(-np.inf)).astype(np.float64)
        hi = np.nextafter(r32, np.float32(np.inf)).astype(np.float64)
        mid = (r64 == (r32.astype(np.float64) + lo) / 2) | (r64 == (r32.astype(np.float64) + hi) / 2)
    for i in np.flatnonzero(mid & np.isfinite(r64)):  # double rounding possible: round the exact value
        v = Fraction(float(a.flat[i])) * Fraction(float(b.flat[i])) + Fraction(float(c.flat[i]))
        f = np.float32(float(v))
        cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
        r32.flat[i] = min(cands, key=lambda t: (abs(Fraction(float(t)) - v), int(np.float32(t).view(np.uint32)) & 1))
    return r32


def _quotients(d, s, correct=True):
    """seal.cu's fl(d / s): the reciprocal product, then (``correct``) the fma correction."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        r = (np.float32(1) / s).astype(np.float32)
        q0 = (d * r).astype(np.float32)
        return _fma32(_fma32(-q0, s, d), r, q0) if correct else q0


def _codes(q, qmax):
    return np.clip(np.nan_to_num(np.rint(q), nan=0.0), 0, qmax)  # NaN -> 0, as fmaxf in the kernel


def _groups(rng, n, qmax):
    """KIVI-like groups: bf16 values, f16 scale (max - min) / qmax and zero point min; half the
    values moved to within a few ulps of a half step of the scale."""
    scale = np.float32(10.0) ** rng.uniform(-4, 3, (n, 1)).astype(np.float32)
    x = (rng.standard_normal((n, 32)).astype(np.float32) * scale)
    mn, mx = x.min(1, keepdims=True), x.max(1, keepdims=True)
    s = np.float16((mx - mn) / np.float32(qmax)).astype(np.float32)
    s[s == 0] = 1
    z = np.float16(mn).astype(np.float32)
    half = (rng.integers(0, int(qmax), (n, 32)) + np.float32(0.5)).astype(np.float32)
    tie = (z + half * s).astype(np.float32)
    tie = tie + rng.integers(-3, 4, tie.shape).astype(np.float32) * np.spacing(tie)
    x = np.where(rng.random((n, 32)) < 0.5, x, tie)
    x = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)  # bf16 values, as the cache's hp blocks hold
    return (x - z).astype(np.float32), np.broadcast_to(s, x.shape).copy()


def test_corrected_reciprocal_product_is_the_correctly_rounded_quotient():
    rng = np.random.default_rng(0)
    s = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)  # every finite f16 > 0
    s = np.repeat(s, 6)
    y = (rng.random(s.size) * 16).astype(np.float32)
    d = (y * s).astype(np.float32)
    d = ((d.view(np.uint32) & 0xFF800000) | rng.integers(0, 1 << 23, s.size).astype(np.uint32)).view(np.float32)
    assert np.array_equal(_quotients(d, s), (d / s).astype(np.float32))


def test_codes_at_ties_and_near_ties_are_the_divisions():
    rng = np.random.default_rng(1)
    for qmax in (np.float32(15), np.float32(3)):
        d, s = _groups(rng, 8000, qmax)
        exact = _codes((d / s).astype(np.float32), qmax)
        assert np.array_equal(_codes(_quotients(d, s), qmax), exact)
        assert not np.array_equal(_codes(_quotients(d, s, correct=False), qmax), exact)  # the fma matters


def test_nan_and_infinite_scales_code_zero_like_the_division():
    d = np.array([np.nan, 1.0, np.inf, 5.0], np.float32)
    s = np.array([1.0, np.inf, np.inf, 1.0], np.float32)
    with np.errstate(invalid="ignore"):
        want = _codes((d / s).astype(np.float32), 15)
    assert np.array_equal(_codes(_quotients(d, s), 15), want)
    assert want.tolist() == [0, 0, 0, 5]
