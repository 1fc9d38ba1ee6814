"""The rounding argument of seal.cu's KIVI codes (kivi_codes), in float32 arithmetic on the host:
rint(fl(fl(x - z) * fl(1 / s))) equals the reference's rint(fl(fl(x - z) / s)) wherever the
product lies farther than (QMAX + 1) * 2^-20 from a half-integer (max(|y|, 1) * 2^-20 of the
argument, bounded where a clamped code depends on it), the band the kernel sends to the
division.  Near-ties are built on purpose (a few ulps around half steps of the scale): a band
64 times narrower lets mismatches through, so the test would catch a wrong constant."""

import numpy as np

BAND = 2.0 ** -20  # seal.cu: fabsf(y - k) > 0.5f - (QMAX + 1) * 0x1p-20f


def _codes(d, s, qmax, band):
    r = np.float32(1) / s
    y = (d * r).astype(np.float32)
    k = np.rint(y)
    near = np.abs(y - k) > np.float32(0.5) - np.float32(qmax + 1) * np.float32(band)
    fast = np.clip(k, 0, qmax)
    exact = np.clip(np.rint((d / s).astype(np.float32)), 0, qmax)
    return np.where(near, exact, fast), exact, near


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
    return (x - z).astype(np.float32), s


def test_reciprocal_product_rounds_like_the_division_outside_the_band():
    rng = np.random.default_rng(0)
    for qmax in (np.float32(15), np.float32(3)):
        d, s = _groups(rng, 60000, qmax)
        got, exact, near = _codes(d, s, qmax, BAND)
        assert np.array_equal(got, exact)
        assert 0 < near.mean() < 0.25  # the fallback is exercised (half the values were built as near-ties)
        narrow, exact, _ = _codes(d, s, qmax, BAND / 64)
        assert not np.array_equal(narrow, exact)  # the band matters: too narrow, codes differ
