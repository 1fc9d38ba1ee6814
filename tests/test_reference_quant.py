"""Reference quantizers: error bounds, packing, edge cases, FP8 numerics."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.formats import fp8 as fp8mod
from kvq.formats.reference import dequantize, pack, quantize, quantize_tokens, roundtrip, unpack
from kvq.formats.registry import entries, resolve_format

QUANTIZED = [e.name for e in entries() if resolve_format(e.name, "k").is_quantized]


def _data(seed, N, H, T, D, outlier):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, T, D, generator=g) * torch.rand(N, H, T, 1, generator=g).add(0.1) * 3
    if outlier:  # a few large channels, as real K has
        x[..., 3] += 40.0
        x[..., D // 2] -= 25.0
    return x


case = st.tuples(
    st.integers(0, 10_000), st.integers(1, 3), st.integers(1, 4), st.sampled_from([32, 64]),
    st.sampled_from([32, 64, 128]), st.booleans(),
)


@given(st.sampled_from(QUANTIZED), st.sampled_from(["k", "v"]), case)
@settings(max_examples=150, deadline=None)
def test_elementwise_error_bounds(name, role, c):
    seed, N, H, T, D, outlier = c
    fmt = resolve_format(name, role)
    x = _data(seed, N, H, T, D, outlier)
    planes = quantize(fmt, x)
    y = dequantize(fmt, planes)
    assert y.shape == x.shape and torch.isfinite(y).all()
    err = (y - x).abs()
    if fmt.family == "int":  # symmetric absmax: half a step
        step = planes["scale"].float().unsqueeze(-1)
        assert (err <= step * 0.5 * (1 + 1e-5) + 1e-7).all()
    elif fmt.family == "fp8" and fmt.scale != "static":
        # relative rounding of the format plus the subnormal spacing, in units of the scale
        mant = 3 if fmt.storage != "float8_e5m2" else 2
        s = planes["scale"].float()
        s = s.unsqueeze(-1) if fmt.scale == "token_head" else s.view(N, H, 1, 1)
        sub = {"float8_e4m3fn": 2.0**-9, "float8_e4m3fnuz": 2.0**-10}[fmt.storage]
        assert (err <= x.abs() * 2.0 ** -(mant + 1) * (1 + 1e-5) + s * sub / 2 + 1e-7).all()
    elif fmt.family == "fp8":  # static scale 1 = direct cast; real K/V fit the range here
        mant = 3 if fmt.storage != "float8_e5m2" else 2
        fmax = fmt.qmax
        inside = x.abs() <= fmax
        assert (err[inside] <= x.abs()[inside] * 2.0 ** -(mant + 1) + 2.0**-9).all()
    elif fmt.family == "kivi":
        G = fmt.group_size
        s = planes["scale"].float()
        s = s.repeat_interleave(G, dim=2) if fmt.scale == "channel_group" else s.repeat_interleave(G, dim=3)
        # half a step, plus what the fp16 rounding of zero/scale can add at the clamp ends
        rng = s * fmt.qmax
        assert (err <= s * 0.5 + rng * 2e-3 + 2e-3).all()
    elif fmt.family == "rot":
        _check_rotated(fmt, planes, x, y)


def _check_rotated(fmt, planes, x, y):
    """Norm correction: each dequantized vector (K centred: less its stored mean) has the stored norm,
    the original's to fp16 rounding; the error is the codebook's on Gaussian coordinates (kvq.formats.codebook:
    the rotation spreads outlier channels), within a factor of 2 over the whole tensor."""
    from kvq.formats.codebook import lloyd_max, mse

    N, H, T, D = x.shape
    if fmt.scale == "centred_norm":
        m = planes["zero"].float().repeat_interleave(fmt.group_size, dim=2)
        x, y = x - m, y - m
    nx, ny = x.norm(dim=-1), y.norm(dim=-1)
    assert torch.allclose(ny, nx, rtol=2e-3, atol=1e-6), (ny - nx).abs().max()
    if not bool(x.any()):  # a constant K centred away: the mean alone, exactly
        assert torch.equal(y, x)
        return
    rel = ((y - x).square().sum() / x.square().sum()).item()
    assert rel <= 2 * mse(lloyd_max(fmt.bits, D)[0], D), rel


@given(st.sampled_from([1, 2, 3, 4, 8]), st.integers(0, 1000), st.sampled_from([8, 32, 64, 128]))
@settings(max_examples=60, deadline=None)
def test_pack_unpack_roundtrip(bits, seed, D):
    if bits == 8:
        return
    codes = torch.randint(0, 2**bits, (3, 5, D), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (3, 5, D * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits), codes)


def test_planar_layout_is_documented_one():
    codes = torch.arange(8, dtype=torch.uint8).view(1, 8) % 4  # int2 codes c0..c7
    b = pack(codes, 2)
    # byte j = c[j] | c[j+2] << 2 | c[j+4] << 4 | c[j+6] << 6
    assert b.tolist() == [[0 | 2 << 2 | 0 << 4 | 2 << 6, 1 | 3 << 2 | 1 << 4 | 3 << 6]]
    assert pack(torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8), 4).tolist() == [[1 | 3 << 4, 2 | 4 << 4]]


@pytest.mark.parametrize("name", QUANTIZED)
def test_constant_and_zero_inputs_do_not_divide_by_zero(name):
    for role in ("k", "v"):
        fmt = resolve_format(name, role)
        for value in (0.0, 1.5, -3.0):
            x = torch.full((2, 2, 32, 64), value)
            y = roundtrip(fmt, x)
            assert torch.isfinite(y).all(), (name, role, value)
            if fmt.family == "rot":  # a constant is no special vector for a codebook after the rotation
                assert value != 0.0 or torch.equal(y, x), (name, role)
                _check_rotated(fmt, quantize(fmt, x), x, y)
                continue
            # zeros come back exactly; a constant within the rounding of an fp16 scale
            assert torch.allclose(y, x, rtol=1e-3, atol=0), (name, role, value, (y - x).abs().max())
            if value == 0.0 or fmt.family == "kivi":  # KIVI: scale 0, zero = the constant
                assert torch.equal(y, x), (name, role, value)


@pytest.mark.parametrize("name", ["int4_kivi", "int2_kivi", "fp8_per_block", "int8"])
def test_groups_never_straddle_blocks(name):
    """Each block (a sequence's page) is quantized on its own: an outlier in one block
    cannot change another block's codes, and quantizing blocks one at a time equals
    quantizing the batch."""
    for role in ("k", "v"):
        fmt = resolve_format(name, role)
        x = _data(1, 3, 2, 32, 64, False)
        base = quantize(fmt, x)
        x2 = x.clone()
        x2[0] *= 100.0
        other = quantize(fmt, x2)
        def raw(t):  # FP8 compared as bytes
            return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t

        for k in base:
            assert torch.equal(raw(base[k][1:]), raw(other[k][1:]))
        one_by_one = [quantize(fmt, x[i : i + 1]) for i in range(3)]
        for k in base:
            cat = torch.cat([p[k] for p in one_by_one])
            assert torch.equal(raw(cat), raw(base[k]))


@pytest.mark.parametrize("name", ["fp8_per_token_head", "int8", "int8_per_token_head", "fp8", "fp8_e5m2", "int4_kivi"])
def test_token_writes_match_block_quantization(name):
    """Writing tokens one by one gives the same bytes as quantizing the whole block
    (for formats whose scales are per token)."""
    fmt = resolve_format(name, "v")
    x = _data(5, 1, 3, 16, 64, True)  # [1, H, T, D]
    whole = quantize(fmt, x)
    toks = quantize_tokens(fmt, x[0].transpose(0, 1))  # [T, H, D]
    for k, v in whole.items():
        a = v[0].transpose(0, 1)
        b = toks[k]
        if a.element_size() == 1 and a.dtype.is_floating_point:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a.contiguous(), b), k


def test_token_writes_refuse_block_scoped_formats():
    with pytest.raises(ValueError, match="seal"):
        quantize_tokens(resolve_format("fp8_per_block", "k"), torch.zeros(4, 2, 64))
    with pytest.raises(ValueError, match="seal"):
        quantize_tokens(resolve_format("int4_kivi", "k"), torch.zeros(4, 2, 64))


def test_static_scales_scalar_and_per_head():
    fmt = resolve_format("fp8", "k")
    x = _data(2, 1, 4, 16, 64, True) * 20  # out of e4m3 range without a scale
    s_head = x.abs().amax(dim=(0, 2, 3)) / 448.0
    y = roundtrip(fmt, x, static_scale=s_head)
    assert ((y - x).norm() / x.norm()) < 0.05
    y1 = roundtrip(fmt, x)  # scale 1: saturates at 448, finite
    assert torch.isfinite(y1).all() and y1.abs().max() == 448.0
    with pytest.raises(ValueError, match="one value per KV head"):
        roundtrip(fmt, x, static_scale=torch.ones(3))
    with pytest.raises(ValueError, match="positive"):
        roundtrip(fmt, x, static_scale=0.0)


def test_saturation_is_finite_for_every_fp8_dtype():
    x = torch.tensor([1e6, -1e6, 300.0, 1.0])
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz):
        y = fp8mod.saturating_cast(x, dt).float()
        fmax = torch.finfo(dt).max
        assert torch.isfinite(y).all() and y[0] == fmax and y[1] == -fmax


def test_fp8_numerics_check_passes_and_catches_mismatch(monkeypatch):
    for storage in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"):
        fp8mod.check_fp8_numerics(storage)
    monkeypatch.setitem(fp8mod.FP8_MAX, "float8_e4m3fn", 240.0)  # a spec expecting FNUZ range
    with pytest.raises(RuntimeError, match="numerics mismatch"):
        fp8mod.check_fp8_numerics("float8_e4m3fn")
    monkeypatch.setitem(fp8mod._KNOWN_BYTES, "float8_e5m2", ((1.0, 0x38),))  # e4m3 bytes expected
    with pytest.raises(RuntimeError, match="encodes"):
        fp8mod.check_fp8_numerics("float8_e5m2")
    with pytest.raises(ValueError):
        fp8mod.check_fp8_numerics("int8")


def test_fp8_index_ops_go_through_byte_views():
    pool = torch.randn(6, 2, 4, 8).to(torch.float8_e4m3fn)
    idx = torch.tensor([4, 1])
    sel = fp8mod.index_select(pool, 0, idx)
    assert sel.dtype == torch.float8_e4m3fn
    assert torch.equal(sel.view(torch.uint8), pool.view(torch.uint8)[idx])
    dst = torch.zeros(6, 2, 4, 8, dtype=torch.float8_e4m3fn)
    fp8mod.index_copy_(dst, 0, torch.tensor([0, 5]), sel)
    assert torch.equal(dst.view(torch.uint8)[[0, 5]], sel.view(torch.uint8))
    assert (dst.view(torch.uint8)[1:5] == 0).all()


@pytest.mark.parametrize("bits", [4, 2])
def test_per_token_k_quantizes_k_exactly_as_kivi_quantizes_v(bits):
    """The torch reference serves int{bits}_per_token K: per token over channel groups, token by token
    (quantize_tokens) equal to whole blocks, and bit-identical to KIVI's V quantizer on the same data."""
    k_fmt, v_kivi = resolve_format(f"int{bits}_per_token", "k"), resolve_format(f"int{bits}_kivi", "v")
    x = _data(7, 2, 3, 32, 64, outlier=True)
    planes, ref = quantize(k_fmt, x), quantize(v_kivi, x)
    assert planes.keys() == ref.keys() and all(torch.equal(planes[n], ref[n]) for n in planes)
    tok = quantize_tokens(k_fmt, x[0].permute(1, 0, 2))  # [T, H, D] one token at a time
    assert torch.equal(tok["data"].transpose(0, 1), planes["data"][0])
    # per token, the channel outliers inflate every group that holds them: the error is large but bounded
    err = (roundtrip(k_fmt, x) - x).norm() / x.norm()
    kivi_k = (roundtrip(resolve_format(f"int{bits}_kivi", "k"), x) - x).norm() / x.norm()
    assert 0 < kivi_k < err < 1.0
