"""Loading a tile of paged K or V in its stored format, dequantized in registers.

Shared by the decode and prefill kernels.  A tile is ``N`` consecutive token
positions of one sequence and one KV head; each position's signed block id
(``>= 0``: resident pool, ``< 0``: high-precision pool, see kvq.cache.pool)
picks where its row comes from.  The loader returns

    raw   [N, D]  in the dot dtype, channels in *tile order* (below)
    scale [N]     float32, per-token factor to apply after the dot product

so that ``x[n, c] = raw[n, pos(c)] * scale[n]`` for every format: per-token,
per-block and static scales fold into the scores (K) or the probabilities (V)
instead of being multiplied into every element; KIVI's per-channel and
per-group scales and zero points are applied element-wise here.

Tile order: packed sub-byte rows are unpacked by joining the bit planes, which
puts channel ``(p % PER) * (D // PER) + p // PER`` at position ``p``.  Queries
are loaded and outputs stored through the same map (:func:`tile_channel`), so
no data is ever shuffled to restore the natural order.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvq.formats.spec import TensorFormat

#: Under TRITON_INTERPRET=1 (CPU CI) some casts are emulated; see _fp8_round.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

# Format codes: constexpr globals the kernels branch on at compile time.
DENSE = tl.constexpr(0)
FP8_STATIC = tl.constexpr(1)
TOKEN_SCALE = tl.constexpr(2)
BLOCK_SCALE = tl.constexpr(3)
KIVI_K = tl.constexpr(4)
KIVI_V = tl.constexpr(5)
#: rotated codebooks (kvq.formats.codebook): ROT + bits - 2 (norm per token), ROT_C + bits - 2 (K centred
#: per channel over its group); the kernels read the rotation, the levels and the thresholds from the
#: format's table (:func:`rot_table`) where other formats read their static scale
ROT = tl.constexpr(6)
ROT_C = tl.constexpr(9)


def format_code(fmt: TensorFormat) -> int:
    """The kernels' code for a tensor format (every stored format has one)."""
    if fmt.family == "dense":
        return DENSE.value
    if fmt.family == "rot":
        return (ROT_C.value if fmt.scale == "centred_norm" else ROT.value) + fmt.bits - 2
    return {
        "static": FP8_STATIC,
        "token_head": TOKEN_SCALE,
        "block_head": BLOCK_SCALE,
        "channel_group": KIVI_K,
        "token_group": KIVI_V,
    }[fmt.scale].value


@triton.jit
def _rne(y):
    """Round half to even (torch.round): one ``cvt.rni`` on the GPU; under the CPU
    interpreter the same rounding from floor."""
    if INTERPRET:
        r = tl.floor(y + 0.5)
        tie = (r - y) == 0.5
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where(tie & odd, r - 1.0, r)
    else:
        return libdevice.rint(y)


@triton.jit
def _fp8_round(y, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """Round fp32 to the FP8 grid (RNE) in fp32 arithmetic.  Used only under the CPU
    interpreter, whose fp32->fp8 cast gets values that round up to the next power
    of two wrong; on a GPU the hardware cast does this."""
    a = tl.abs(y)
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), EMIN)
    q = tl.exp2(e - MBITS)
    r = _rne(a / q) * q
    return tl.where(y < 0, -r, r)


@triton.jit
def to_fp8(y, dtype):
    """Round-to-nearest-even cast of in-range fp32 values to an FP8 dtype."""
    if INTERPRET:
        if dtype == tl.float8e5:
            y = _fp8_round(y, 2, -14)
        else:
            y = _fp8_round(y, 3, -6)
    return y.to(dtype)


def rot_table(fmt: TensorFormat, head_dim: int, device):
    """float32 ``[2 D^2 + 32]``: ``R^T`` for the rotation ``R = H diag(s) / sqrt(D)`` (row-major: a row
    ``x`` rotates as ``x @ R^T``), then ``R`` (back: ``y @ R``), the ``2^bits`` levels from ``2 D^2`` and
    the thresholds from ``2 D^2 + 16`` (kvq.formats.codebook; one table per format, head dim and device, cached)."""
    return _rot_table(fmt.bits, fmt.rotation_seed, head_dim, str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _rot_table(bits: int, seed: int, D: int, device: str):
    from kvq.formats import codebook

    eye = torch.eye(D)
    rt = codebook.rotate(eye, seed)  # row i is R e_i: R^T, so a row x rotates as x @ R^T
    levels, thresholds = codebook.lloyd_max(bits, D)
    out = torch.zeros(2 * D * D + 32, dtype=torch.float32)
    out[:D * D] = rt.reshape(-1)
    out[D * D:2 * D * D] = rt.T.reshape(-1)  # and back as y @ R (R orthogonal)
    out[2 * D * D:2 * D * D + len(levels)] = torch.tensor(levels)
    out[2 * D * D + 16:2 * D * D + 16 + len(thresholds)] = torch.tensor(thresholds)
    return out.to(device)


@triton.jit
def rot_codes(data_ptr, row, D: tl.constexpr, BITS: tl.constexpr):
    """[N, D] int32 codes in natural channel order from rows at element offsets ``row`` [N]: planar
    2/4-bit rows, or a 2-bit plane then a 1-bit plane, each read as one byte tile and unpacked by a
    broadcast shift (:func:`unpack_natural`; a byte gathered per value ran KIVI's decode at half speed)."""
    if BITS == 3:
        N: tl.constexpr = row.shape[0]
        lo = unpack_natural(data_ptr, row, N, D, 2)
        hi = unpack_natural(data_ptr + D // 4, row, N, D, 1)
        return lo | (hi << 2)
    else:
        return unpack_natural(data_ptr, row, row.shape[0], D, BITS)


@triton.jit
def hadamard_rows(x, table_ptr, R: tl.constexpr, D: tl.constexpr):
    """kvq.formats.codebook.hadamard over the rows of an [R, D] float32 tile: the same butterflies in the
    same order (stage h: ``a + b`` and ``a - b`` of channels ``j`` and ``j + h`` of each 2h-channel
    block), then one multiply by ``1 / sqrt(D)`` (read from the format's table, :func:`rot_table`, whose
    ``R^T[0, 0]`` is that float32 constant with the first sign): the reference's values bit for bit, in
    ``D log2 D`` additions a row where the ``[D, D]`` product took ``2 D^2`` (three times over in tf32x3)
    and a 64 KiB table per program."""
    two = tl.arange(0, 2)
    flip = (1 - 2 * two).to(tl.float32)[None, None, :, None]  # [1, -1]
    first = (two == 0)[None, None, :, None]
    for i in tl.static_range(9):  # head dims up to 512
        if (1 << i) < D:
            y = tl.reshape(x, (R, D // (2 << i), 2, 1 << i))
            total = tl.sum(y, axis=2)[:, :, None, :]  # a + b (one addition: exact order)
            diff = tl.sum(y * flip, axis=2)[:, :, None, :]  # a + (-b)
            x = tl.reshape(tl.where(first, total, diff), (R, D))
    return x * tl.abs(tl.load(table_ptr))


@triton.jit
def rot_signs(table_ptr, D: tl.constexpr):
    """[D] bool: the rotation's sign of each channel is +1 (``R^T[c, 0]`` is ``s_c / sqrt(D)``)."""
    return tl.load(table_ptr + tl.arange(0, D) * D) > 0


@triton.jit
def rotate_rows(x, table_ptr, R: tl.constexpr, D: tl.constexpr):
    """``codebook.rotate`` of each row of an [R, D] float32 tile: the signs, then the butterflies."""
    return hadamard_rows(tl.where(rot_signs(table_ptr, D)[None, :], x, -x), table_ptr, R, D)


@triton.jit
def unrotate_rows(y, table_ptr, R: tl.constexpr, D: tl.constexpr):
    """``codebook.unrotate`` of each row of an [R, D] float32 tile: the butterflies, then the signs."""
    x = hadamard_rows(y, table_ptr, R, D)
    return tl.where(rot_signs(table_ptr, D)[None, :], x, -x)


@triton.jit
def rot_values(data_ptr, norm_ptr, mean_ptr, table_ptr, row, nrow, mrow, D: tl.constexpr, FMT: tl.constexpr):
    """[N, D] float32 values of a rotated codebook tile in natural channel order: levels times the
    row's norm, rotated back (:func:`unrotate_rows`), plus the group mean of a centred K
    (``mrow``: element offsets of each row's mean row)."""
    BITS: tl.constexpr = (FMT - ROT) % 3 + 2
    codes = rot_codes(data_ptr, row, D, BITS)
    u = tl.load(table_ptr + 2 * D * D + codes) * tl.load(norm_ptr + nrow).to(tl.float32)[:, None]
    c = tl.arange(0, D)
    x = unrotate_rows(u, table_ptr, u.shape[0], D)
    if FMT >= ROT_C:
        x = x + tl.load(mean_ptr + mrow[:, None] + c[None, :]).to(tl.float32)
    return x


@triton.jit
def rot_mags(table_ptr, D: tl.constexpr, FMT: tl.constexpr):
    """The codebook's positive levels, ascending, as 8 scalars (2 bits: 2 of them, 3 bits: 4, 4 bits: 8;
    the rest repeat the last).  Lloyd-Max levels of the rotated coordinates' symmetric distribution are
    symmetric: level ``HALF + i`` is ``m_i`` and level ``HALF - 1 - i`` is ``-m_i``."""
    BITS: tl.constexpr = (FMT - ROT) % 3 + 2
    base = table_ptr + 2 * D * D + (tl.constexpr(1) << (BITS - 1))
    m0 = tl.load(base)
    m1 = tl.load(base + 1)
    m2 = m1
    m3 = m1
    if BITS >= 3:
        m2 = tl.load(base + 2)
        m3 = tl.load(base + 3)
    m4 = m3
    m5 = m3
    m6 = m3
    m7 = m3
    if BITS == 4:
        m4 = tl.load(base + 4)
        m5 = tl.load(base + 5)
        m6 = tl.load(base + 6)
        m7 = tl.load(base + 7)
    return m0, m1, m2, m3, m4, m5, m6, m7


@triton.jit
def rot_level(code, mags, BITS: tl.constexpr):
    """Levels of int32 codes by selects among the scalars of :func:`rot_mags` (no gather a value)."""
    HALF: tl.constexpr = tl.constexpr(1) << (BITS - 1)
    up = code >= HALF
    i = tl.where(up, code - HALF, HALF - 1 - code)
    mag = tl.where(i == 0, mags[0], mags[1])
    if BITS >= 3:
        mag = tl.where(i < 2, mag, tl.where(i == 2, mags[2], mags[3]))
    if BITS == 4:
        mag = tl.where(i < 4, mag, tl.where(i < 6, tl.where(i == 4, mags[4], mags[5]),
                                            tl.where(i == 6, mags[6], mags[7])))
    return tl.where(up, mag, -mag)


@triton.jit
def rot_tile(data_ptr, norm_ptr, mags, s_db, s_dh, s_dt, s_sb, s_sh, s_st, bid, off, head,
             D: tl.constexpr, FMT: tl.constexpr, DOT: tl.constexpr):
    """A rotated codebook tile left in the rotated domain: ([N, D] levels in DOT, [N] float32 norms),
    so ``x = norm * levels @ R`` (+ the group mean of a centred K, :func:`rot_mean`).  The decode
    rotates the query once and the output once instead of every tile (kvq.attention.triton.decode).
    ``mags``: :func:`rot_mags` of the format's table.  Rows of hp blocks read block 0 (finite values):
    the caller replaces them."""
    qb = tl.where(bid < 0, 0, bid).to(tl.int64)
    row = qb * s_db + head * s_dh + off.to(tl.int64) * s_dt
    BITS: tl.constexpr = (FMT - ROT) % 3 + 2
    lev = rot_level(rot_codes(data_ptr, row, D, BITS), mags, BITS).to(DOT)
    return lev, tl.load(norm_ptr + qb * s_sb + head * s_sh + off * s_st).to(tl.float32)


@triton.jit
def mean_rows(qb, head, off, s_zb, s_sh, D: tl.constexpr, GROUP: tl.constexpr):
    """Element offsets of each row's mean row in a centred K's mean plane (a row of D means per group of
    GROUP tokens: a block's ``[head, group, D]``, head stride the norm plane's ``s_sh`` x D / GROUP; the
    block stride ``s_zb`` its own, as a tier's view of an arena spaces blocks further apart)."""
    return qb * s_zb + head * (s_sh * D // GROUP) + (off // GROUP) * D


@triton.jit
def rot_mean(mean_ptr, s_zb, s_sh, bid, off, head, D: tl.constexpr, GROUP: tl.constexpr):
    """[N, D] float32 group means (natural channel order) of the rows of a centred rotated tile."""
    mrow = mean_rows(tl.where(bid < 0, 0, bid).to(tl.int64), head, off, s_zb, s_sh, D, GROUP)
    return tl.load(mean_ptr + mrow[:, None] + tl.arange(0, D)[None, :]).to(tl.float32)


@triton.jit
def hp_rows(hp_ptr, s_hb, s_hh, s_ht, bid, off, head, D: tl.constexpr, DOT: tl.constexpr):
    """[N, D] rows of the hp pool (natural channel order) for the tile's hp rows (``bid < 0``);
    other rows read hp block 0."""
    hb = tl.where(bid < 0, -bid - 1, 0).to(tl.int64)
    hrow = hb * s_hb + head * s_hh + off.to(tl.int64) * s_ht
    return tl.load(hp_ptr + hrow[:, None] + tl.arange(0, D)[None, :]).to(DOT)


@triton.jit
def tile_channel(p, PER: tl.constexpr, D: tl.constexpr):
    """Natural channel index of tile position ``p``."""
    if PER == 1:
        return p
    else:
        return (p % PER) * (D // PER) + p // PER


@triton.jit
def _unpack(x, N: tl.constexpr, D: tl.constexpr, PER: tl.constexpr):
    """[N, D // PER] uint8 -> [N, D] codes (int32) in tile order."""
    x = x.to(tl.int32)
    if PER == 2:
        c = tl.join(x & 15, (x >> 4) & 15)
    else:  # PER == 4
        c = tl.join(tl.join(x & 3, (x >> 4) & 3), tl.join((x >> 2) & 3, (x >> 6) & 3))
    return tl.reshape(c, (N, D))


@triton.jit
def unpack_natural(ptr, row, N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Codes [N, D] (int32, natural channel order) of the N planar-packed rows (1, 2 or 4 bits) starting at
    element offsets ``row`` [N]: one contiguous [N, DP] byte tile (wide loads), each byte's bit planes
    spread by a broadcast shift into [N, PER, DP], which row-major is channel p * DP + j = natural order."""
    DP: tl.constexpr = D * BITS // 8
    PER: tl.constexpr = 8 // BITS
    x = tl.load(ptr + row[:, None] + tl.arange(0, DP)[None, :]).to(tl.int32)  # [N, DP]
    sh = tl.arange(0, PER) * BITS
    c3 = (x[:, None, :] >> sh[None, :, None]) & ((tl.constexpr(1) << BITS) - 1)  # [N, PER, DP]
    return tl.reshape(c3, (N, D))


@triton.jit
def group_rows(ptr, grow, live, N: tl.constexpr, D: tl.constexpr, G: tl.constexpr):
    """[N, D] (the plane's dtype): per-token values of each group of G channels at element offsets
    ``grow`` [N] (D / G of them a row; G a power of two up to D) broadcast over their channels; 0 on
    rows not ``live``."""
    NG: tl.constexpr = D // G
    x = tl.load(ptr + grow[:, None] + tl.arange(0, NG)[None, :], mask=live[:, None], other=0.0)  # [N, NG]
    return tl.reshape(tl.broadcast_to(x[:, :, None], (N, NG, G)), (N, D))


@triton.jit
def group_cols(ptr, srow, N: tl.constexpr, D: tl.constexpr, G: tl.constexpr):
    """[N, D] (the plane's dtype): per-channel rows at element offsets ``srow`` [N // G], one for each
    G tokens of the tile, broadcast over their tokens (KIVI's K scales and zero points)."""
    NG: tl.constexpr = N // G
    x = tl.load(ptr + srow[:, None] + tl.arange(0, D)[None, :])  # [NG, D]
    return tl.reshape(tl.broadcast_to(x[:, None, :], (NG, G, D)), (N, D))


@triton.jit
def load_tile(
    data_ptr, scale_ptr, zero_ptr, hp_ptr, static_ptr,
    s_db, s_dh, s_dt,  # data plane strides: block, head, token (channels contiguous)
    s_sb, s_sh, s_st,  # scale/zero strides: block, head, token (KIVI K: group)
    s_zb,  # the zero plane's block stride (a centred K's means: its own layout)
    s_hb, s_hh, s_ht,  # hp pool strides
    bid, off, head, valid,  # [N] signed block ids, [N] offsets in block, scalar head, [N] mask
    N: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr,
    HAS_HP: tl.constexpr, DOT: tl.constexpr,
):
    # Loads are unmasked: rows past the sequence end, and hp rows in the q pool (and
    # q rows in the hp pool), read block 0 of that pool instead, which always holds
    # finite values (zeroed at allocation, then real K/V).  The caller masks their
    # scores to -inf, so they weigh exactly 0.  Callers pass bid = 0 for rows past the end.
    is_hp = bid < 0
    qb = tl.where(is_hp, 0, bid).to(tl.int64)
    p = tl.arange(0, D)
    chan = tile_channel(p, PER, D)
    row = qb * s_db + head * s_dh + off.to(tl.int64) * s_dt
    if FMT >= ROT:  # rotated codebook: values in natural order, no factor per row
        srow = qb * s_sb + head * s_sh + off * s_st
        mrow = mean_rows(qb, head, off, s_zb, s_sh, D, GROUP)
        raw = rot_values(data_ptr, scale_ptr, zero_ptr, static_ptr, row, srow, mrow, D, FMT)
    elif PER == 1:
        raw = tl.load(data_ptr + row[:, None] + p[None, :]).to(DOT)
    else:
        pb = tl.arange(0, D // PER)
        raw = _unpack(tl.load(data_ptr + row[:, None] + pb[None, :]), N, D, PER)
    scale = tl.full((N,), 1.0, tl.float32)
    if FMT == FP8_STATIC:
        scale = scale * tl.load(static_ptr + head)
    elif FMT == TOKEN_SCALE:
        scale = tl.load(scale_ptr + qb * s_sb + head * s_sh + off * s_st).to(tl.float32)
    elif FMT == BLOCK_SCALE:
        scale = tl.load(scale_ptr + qb * s_sb + head * s_sh).to(tl.float32)
    elif FMT == KIVI_K:
        if N == GROUP:  # one group per tile: one scale row and one zero row, broadcast over the rows
            srow0 = tl.max(qb, axis=0) * s_sb + head * s_sh + (tl.min(off, axis=0) // GROUP) * s_st
            sc = tl.load(scale_ptr + srow0 + chan).to(tl.float32)[None, :]
            zr = tl.load(zero_ptr + srow0 + chan).to(tl.float32)[None, :]
        elif N % GROUP == 0:  # tile rows come in whole groups: load each group's scale row once
            NG: tl.constexpr = N // GROUP
            qb_g = tl.max(tl.reshape(qb, (NG, GROUP)), axis=1)
            off_g = tl.min(tl.reshape(off, (NG, GROUP)), axis=1)
            srow = qb_g * s_sb + head * s_sh + (off_g // GROUP) * s_st
            sc = tl.load(scale_ptr + srow[:, None] + chan[None, :]).to(tl.float32)
            zr = tl.load(zero_ptr + srow[:, None] + chan[None, :]).to(tl.float32)
            sc = tl.reshape(tl.broadcast_to(sc[:, None, :], (NG, GROUP, D)), (N, D))
            zr = tl.reshape(tl.broadcast_to(zr[:, None, :], (NG, GROUP, D)), (N, D))
        else:
            srow = qb * s_sb + head * s_sh + (off // GROUP) * s_st
            sc = tl.load(scale_ptr + srow[:, None] + chan[None, :]).to(tl.float32)
            zr = tl.load(zero_ptr + srow[:, None] + chan[None, :]).to(tl.float32)
        raw = (raw.to(tl.float32) * sc + zr).to(DOT)
    elif FMT == KIVI_V:
        srow = qb * s_sb + head * s_sh + off * s_st
        sc = tl.load(scale_ptr + srow[:, None] + (chan // GROUP)[None, :]).to(tl.float32)
        zr = tl.load(zero_ptr + srow[:, None] + (chan // GROUP)[None, :]).to(tl.float32)
        raw = (raw.to(tl.float32) * sc + zr).to(DOT)
    else:  # dense, FP8 and int8 codes, rotated codebook values
        raw = raw.to(DOT)
    if HAS_HP:
        # sinks and the recent window are a few tiles at the ends of a table: a tile with no
        # hp row (the common case) skips the hp load
        if tl.min(bid, axis=0) < 0:
            hb = tl.where(is_hp, -bid - 1, 0).to(tl.int64)
            hrow = hb * s_hb + head * s_hh + off.to(tl.int64) * s_ht
            xh = tl.load(hp_ptr + hrow[:, None] + chan[None, :]).to(DOT)
            raw = tl.where(is_hp[:, None], xh, raw)
            scale = tl.where(is_hp, 1.0, scale)
    return raw, scale
