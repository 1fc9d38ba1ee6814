"""Quantize-on-store in Triton: token writes and block seals, every format.

Twins of :func:`kvq.attention.reference.write_kv` and ``seal_blocks``, bit for
bit on the same inputs (same fp32 arithmetic, correctly rounded division,
round-half-to-even codes, saturating FP8 casts).

* ``_write_kernel``: one program per (16 new tokens, KV head), K and V together.
  hp slots store the model dtype; q slots quantize the row (per-token formats;
  rows of block-sealed formats are skipped here and written by the seal kernel).
* ``_seal_hp_kernel``: one program per (hp block, KV head): quantizes its
  ``[bs, D]`` K and V tiles into a q block (window or block seals).
* ``_seal_kernel``: the same for one role, from the new tokens themselves (a
  prefill chunk that fills whole blocks of a block-sealed format).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq.attention.triton.tiles import (
    BLOCK_SCALE, DENSE, FP8_STATIC, KIVI_K, ROT, ROT_C, TOKEN_SCALE, format_code, rotate_rows, to_fp8,
)
from kvq.attention.triton.decode import static_arg
from kvq.cache.pool import LayerKV


@triton.jit
def _safe(s):
    return tl.where(s == 0.0, 1.0, s)


@triton.jit
def _divide(x, s, SMALL: tl.constexpr):
    """fl(x / s) for scales ``s`` broadcast over ``x``, without a division per value: with r =
    fl(1 / s) (once per scale), q0 = fl(x r) lies within two ulps of x / s, so one fma gives the
    remainder x - q0 s exactly and a second the correctly rounded quotient fl(q0 + rem r)
    (Markstein; tests/test_seal_rounding.py checks it in float32).  A subnormal quotient may differ
    in its last bit, which no code keeps (it codes 0 either way).  An infinite scale (a tile holding
    an infinity) has r = 0: q0 = x * 0 is what the division gives.  ``SMALL``: the scales may lie
    below 2^-64 (float32 scales of tiny values): the reciprocal of a subnormal one overflows, so
    such a scale and its values are first multiplied by 2^64, exactly (f16 scales never are).
    Only for scales of the values' own range, under which every quotient is at most QMAX."""
    if SMALL:
        k = tl.where(s < 5.421010862427522e-20, 1.8446744073709552e19, 1.0)
        s = s * k
        x = x * k
    r = tl.math.div_rn(1.0 + tl.zeros_like(s), s)  # per scale; below, per value
    s = s + tl.zeros_like(x)
    r = r + tl.zeros_like(x)
    q0 = x * r
    return tl.where(r == 0.0, q0, tl.fma(tl.fma(-q0, s, x), r, q0))


@triton.jit
def _int_code(y, LO: tl.constexpr, HI: tl.constexpr):
    """rint(clamp(y, LO, HI)) as int32 (integer bounds within 2^22) without a conversion, which
    issues at a fraction of the float rate: fl(y + 1.5 * 2^23) is 1.5 * 2^23 + rint(y) (ulp 1, a tie
    to the even sum, whose parity is rint's), so its bit pattern minus 1.5 * 2^23's is the code.
    Clamping first gives the same integer (the bounds are integers); NaN clamps to LO, as before."""
    t = tl.minimum(tl.maximum(y, LO), HI) + 12582912.0
    return t.to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def _codes(y, data_ptr, QMAX: tl.constexpr):
    """Scaled values -> stored values (FP8 saturating cast, or int8 codes)."""
    if data_ptr.dtype.element_ty.is_fp8():
        return to_fp8(tl.minimum(tl.maximum(y, -QMAX), QMAX), data_ptr.dtype.element_ty)
    else:
        return _int_code(y, -QMAX, QMAX).to(tl.int8)


@triton.jit
def _pack(codes, R: tl.constexpr, D: tl.constexpr, PER: tl.constexpr):
    """[R, D] codes (natural channel order) -> [R, D // PER] uint8, planar."""
    BITS: tl.constexpr = 8 // PER
    c = tl.reshape(codes.to(tl.int32), (R, PER, D // PER))
    shift = (tl.arange(0, PER) * BITS)[None, :, None]
    return tl.sum(c << shift, axis=1).to(tl.uint8)


@triton.jit
def _rot_store(x, data_ptr, norm_ptr, mean_ptr, table_ptr, d_row, s_row, m_row, rmask,
               R: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr):
    """A rotated codebook tile (kvq.formats.reference's rule): K of ROT_C loses its per-channel group
    mean (fp16, stored at the block's mean rows from element ``m_row`` on), then each row is rotated
    (:func:`~kvq.attention.triton.tiles.rotate_rows`), coded against the thresholds,
    and its norm corrected."""
    BITS: tl.constexpr = (FMT - ROT) % 3 + 2
    m2 = rmask[:, None]
    c = tl.arange(0, D)
    if FMT >= ROT_C:  # whole blocks: groups of G rows
        g = tl.reshape(x, (R // G, G, D))
        mean = (tl.sum(g, axis=1) / G).to(mean_ptr.dtype.element_ty)
        gi = tl.arange(0, R // G)
        tl.store(mean_ptr + m_row + gi[:, None] * D + c[None, :], mean)
        x = tl.reshape(g - mean.to(tl.float32)[:, None, :], (R, D))
    r = rotate_rows(x, table_ptr, R, D)
    n = tl.sqrt(tl.sum(r * r, axis=1))
    u = r / _safe(n)[:, None] * tl.sqrt(D * 1.0)
    codes = tl.zeros((R, D), tl.int32)
    for i in tl.static_range((tl.constexpr(1) << BITS) - 1):
        codes += (u >= tl.load(table_ptr + 2 * D * D + 16 + i)).to(tl.int32)
    uh = tl.load(table_ptr + 2 * D * D + codes)
    nc = (n / _safe(tl.sqrt(tl.sum(uh * uh, axis=1)))).to(norm_ptr.dtype.element_ty)
    tl.store(norm_ptr + s_row, nc, mask=rmask)
    if BITS == 3:
        tl.store(data_ptr + d_row[:, None] + tl.arange(0, D // 4)[None, :], _pack(codes & 3, R, D, 4), mask=m2)
        tl.store(data_ptr + d_row[:, None] + (D // 4 + tl.arange(0, D // 8))[None, :], _pack(codes >> 2, R, D, 8),
                 mask=m2)
    else:
        tl.store(data_ptr + d_row[:, None] + tl.arange(0, D * BITS // 8)[None, :], _pack(codes, R, D, 8 // BITS),
                 mask=m2)


@triton.jit
def _quant_store(
    x, data_ptr, scale_ptr, zero_ptr, static_ptr, head,
    d_row, s_row,  # [R] element offsets of each row's data / scale row (KIVI K: of the block's scale row)
    m_row,  # a centred K: element offset of the block's first mean row (of this head)
    rmask,  # [R] rows to store (per-row formats; block-scoped formats store whole tiles)
    R: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, PER: tl.constexpr, G: tl.constexpr, QMAX: tl.constexpr,
):
    """Quantize an [R, D] float32 tile into its planes and store it."""
    m2 = rmask[:, None]
    p = tl.arange(0, D)
    dp = tl.arange(0, D // PER)
    if FMT == DENSE:
        tl.store(data_ptr + d_row[:, None] + p[None, :], x.to(data_ptr.dtype.element_ty), mask=m2)
    elif FMT == FP8_STATIC:
        s = tl.load(static_ptr + head)
        codes = _codes(tl.math.div_rn(x, s + tl.zeros_like(x)), data_ptr, QMAX)
        tl.store(data_ptr + d_row[:, None] + p[None, :], codes,
                 mask=m2)
    elif FMT == TOKEN_SCALE:
        amax = tl.max(tl.abs(x), axis=1)
        sc = tl.math.div_rn(amax, QMAX + tl.zeros_like(amax)).to(scale_ptr.dtype.element_ty)
        tl.store(scale_ptr + s_row, sc, mask=rmask)
        s = _safe(sc.to(tl.float32))
        y = _divide(x, s[:, None], True)
        tl.store(data_ptr + d_row[:, None] + p[None, :], _codes(y, data_ptr, QMAX), mask=m2)
    elif FMT == BLOCK_SCALE:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        sc = tl.math.div_rn(amax, QMAX).to(scale_ptr.dtype.element_ty)
        tl.store(scale_ptr + tl.min(s_row, axis=0), sc)
        s = _safe(sc.to(tl.float32))
        y = _divide(x, s, True)
        tl.store(data_ptr + d_row[:, None] + p[None, :], _codes(y, data_ptr, QMAX))
    elif FMT == KIVI_K:  # groups of G rows, one scale/zero per channel
        g = tl.reshape(x, (R // G, G, D))
        mn = tl.min(g, axis=1)
        mx = tl.max(g, axis=1)
        sc = tl.math.div_rn(mx - mn, QMAX + tl.zeros_like(mn)).to(tl.float16)
        zr = mn.to(tl.float16)
        gi = tl.arange(0, R // G)
        soff = tl.min(s_row, axis=0) + gi[:, None] * D + p[None, :]
        tl.store(scale_ptr + soff, sc)
        tl.store(zero_ptr + soff, zr)
        s = _safe(sc.to(tl.float32))
        y = _divide(g - zr.to(tl.float32)[:, None, :], s[:, None, :], False)
        codes = tl.reshape(_int_code(y, 0.0, QMAX), (R, D))
        tl.store(data_ptr + d_row[:, None] + dp[None, :], _pack(codes, R, D, PER))
    elif FMT >= ROT:
        _rot_store(x, data_ptr, scale_ptr, zero_ptr, static_ptr, d_row, s_row, m_row, rmask, R, D, FMT, G)
    else:  # KIVI_V: per row, groups of G channels
        g = tl.reshape(x, (R, D // G, G))
        mn = tl.min(g, axis=2)
        mx = tl.max(g, axis=2)
        sc = tl.math.div_rn(mx - mn, QMAX + tl.zeros_like(mn)).to(tl.float16)
        zr = mn.to(tl.float16)
        gi = tl.arange(0, D // G)
        soff = s_row[:, None] + gi[None, :]
        tl.store(scale_ptr + soff, sc, mask=m2)
        tl.store(zero_ptr + soff, zr, mask=m2)
        s = _safe(sc.to(tl.float32))
        y = _divide(g - zr.to(tl.float32)[:, :, None], s[:, :, None], False)
        codes = tl.reshape(_int_code(y, 0.0, QMAX), (R, D))
        tl.store(data_ptr + d_row[:, None] + dp[None, :], _pack(codes, R, D, PER), mask=m2)


@triton.jit(do_not_specialize=["T"])  # the step's token count: no recompile when it is 1 or 16k
def _write_kernel(
    k_ptr, v_ptr, s_xt, s_xh, T,  # new tokens [T, H, D]
    slots_ptr,
    kd, ks, kz, khp, kst, vd, vs, vz, vhp, vst,
    s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst, s_kzb,
    s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb,
    s_hb, s_hh, s_ht,
    PAGE: tl.constexpr, D: tl.constexpr, K_G: tl.constexpr, V_G: tl.constexpr, TB: tl.constexpr,
    K_FMT: tl.constexpr, K_PER: tl.constexpr, K_QMAX: tl.constexpr, K_DIRECT: tl.constexpr,
    V_FMT: tl.constexpr, V_PER: tl.constexpr, V_QMAX: tl.constexpr, V_DIRECT: tl.constexpr,
):
    """One program per (tile of TB new tokens, KV head); each row goes to its own slot."""
    t = tl.program_id(0) * TB + tl.arange(0, TB)
    h = tl.program_id(1)
    valid = t < T
    slot = tl.load(slots_ptr + t, mask=valid, other=0)
    p = tl.arange(0, D)
    src = t.to(tl.int64)[:, None] * s_xt + h * s_xh + p[None, :]
    is_hp = valid & (slot < 0)
    is_q = valid & (slot >= 0)
    # a role written only by the seal kernel reads just its hp rows here
    k_rows = (valid if K_DIRECT else is_hp)[:, None]
    v_rows = (valid if V_DIRECT else is_hp)[:, None]
    xk = tl.load(k_ptr + src, mask=k_rows, other=0.0).to(tl.float32)  # [TB, D]
    xv = tl.load(v_ptr + src, mask=v_rows, other=0.0).to(tl.float32)
    hs = tl.where(slot < 0, -slot - 1, 0)
    hrow = (hs // PAGE) * s_hb + h * s_hh + (hs % PAGE) * s_ht
    tl.store(khp + hrow[:, None] + p[None, :], xk.to(khp.dtype.element_ty), mask=is_hp[:, None])
    tl.store(vhp + hrow[:, None] + p[None, :], xv.to(vhp.dtype.element_ty), mask=is_hp[:, None])
    qs = tl.where(slot >= 0, slot, 0)
    blk = qs // PAGE
    off = qs % PAGE
    # a tile with no q row (a decode step of a windowed format: every new token goes to its hp
    # block) skips the quantization: it would only compute codes for masked-off rows
    if tl.max(is_q.to(tl.int32), axis=0) > 0:
        if K_DIRECT:
            _quant_store(xk, kd, ks, kz, kst, h, blk * s_kdb + h * s_kdh + off * s_kdt,
                         blk * s_ksb + h * s_ksh + off * s_kst, tl.min(blk, axis=0) * s_kzb + h * (s_ksh * D // K_G),
                         is_q, TB, D, K_FMT, K_PER, K_G, K_QMAX)
        if V_DIRECT:
            _quant_store(xv, vd, vs, vz, vst, h, blk * s_vdb + h * s_vdh + off * s_vdt,
                         blk * s_vsb + h * s_vsh + off * s_vst, tl.min(blk, axis=0) * s_vzb + h * (s_vsh * D // V_G),
                         is_q, TB, D, V_FMT, V_PER, V_G, V_QMAX)


@triton.jit
def _seal_tile(src_ptr, base, s_sh, s_st, blk, h, data_ptr, scale_ptr, zero_ptr, static_ptr,
               s_db, s_dh, s_dt, s_sb, s_shd, s_sst, s_zb,
               PAGE: tl.constexpr, D: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr, PER: tl.constexpr,
               QMAX: tl.constexpr):
    """Quantize the ``[PAGE, D]`` tile of head ``h`` at element ``base`` of ``src`` into q block ``blk``."""
    r = tl.arange(0, PAGE)
    p = tl.arange(0, D)
    x = tl.load(src_ptr + base + h * s_sh + r[:, None].to(tl.int64) * s_st + p[None, :]).to(tl.float32)
    d_row = blk * s_db + h * s_dh + r.to(tl.int64) * s_dt
    s_row = blk * s_sb + h * s_shd + r.to(tl.int64) * s_sst
    m_row = blk * s_zb + h * (s_shd * D // G)
    _quant_store(x, data_ptr, scale_ptr, zero_ptr, static_ptr, h, d_row, s_row, m_row, r >= 0, PAGE, D, FMT, PER, G,
                 QMAX)


@triton.jit
def _seal_kernel(
    src_ptr, src_ids, dst_ids, s_ids, s_src, s_sh, s_st,  # tile i: element src_ids[i * s_ids] * s_src of src
    data_ptr, scale_ptr, zero_ptr, static_ptr,
    s_db, s_dh, s_dt, s_sb, s_shd, s_sst, s_zb,
    PAGE: tl.constexpr, D: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr, PER: tl.constexpr, QMAX: tl.constexpr,
):
    """One role; one program per (block, KV head)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(dst_ids + i * s_ids).to(tl.int64)
    base = tl.load(src_ids + i * s_ids).to(tl.int64) * s_src
    _seal_tile(src_ptr, base, s_sh, s_st, blk, h, data_ptr, scale_ptr, zero_ptr, static_ptr,
               s_db, s_dh, s_dt, s_sb, s_shd, s_sst, s_zb, PAGE, D, G, FMT, PER, QMAX)


@triton.jit
def _seal_hp_kernel(
    pairs, s_pair, khp, vhp, s_hb, s_hh, s_ht,  # pairs [S, 2] (hp block, q block); q block < 0: skip
    kd, ks, kz, kst, vd, vs, vz, vst,
    s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst, s_kzb,
    s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb,
    PAGE: tl.constexpr, D: tl.constexpr, K_G: tl.constexpr, V_G: tl.constexpr,
    K_FMT: tl.constexpr, K_PER: tl.constexpr, K_QMAX: tl.constexpr,
    V_FMT: tl.constexpr, V_PER: tl.constexpr, V_QMAX: tl.constexpr,
):
    """Seal hp blocks into q blocks, K and V in one launch; one program per (pair, KV head)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(pairs + i * s_pair + 1)
    if blk >= 0:
        base = tl.load(pairs + i * s_pair) * s_hb
        _seal_tile(khp, base, s_hh, s_ht, blk, h, kd, ks, kz, kst, s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst, s_kzb,
                   PAGE, D, K_G, K_FMT, K_PER, K_QMAX)
        _seal_tile(vhp, base, s_hh, s_ht, blk, h, vd, vs, vz, vst, s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb,
                   PAGE, D, V_G, V_FMT, V_PER, V_QMAX)


def _warps(layer: LayerKV) -> int:
    """Warps per program of the write and seal kernels, from the H200 sweep of
    scripts/probe_write.py: 4, but 2 where a role is KIVI (its group reductions and
    planar packing run 2-3x slower with 4 or 8 warps)."""
    return 2 if "kivi" in (layer.fmt.k.family, layer.fmt.v.family) else 4


def _role_args(layer: LayerKV, role: str) -> tuple[list, list, dict]:
    planes, fmt = layer.planes(role), layer.tensor_format(role)
    data = planes["data"]
    ptrs = [data, planes.get("scale", data), planes.get("zero", data), layer.hp(role), static_arg(layer, role)]
    sc = planes.get("scale")
    sst = list(sc.stride()) + [0, 0] if sc is not None else [0, 0, 0]
    if sc is not None and sc.dim() == 2:  # per block: [nb, H]
        sst[2] = 0
    zero = planes.get("zero")  # (a centred K's means: a layout of their own)
    strides = [data.stride(0), data.stride(1), data.stride(2), sst[0], sst[1], sst[2],
               zero.stride(0) if zero is not None else 0]
    meta = dict(fmt=format_code(fmt), per=1 if fmt.family == "rot" else fmt.values_per_byte,
                qmax=float(fmt.qmax or 0.0),
                direct=fmt.write_direct, g=fmt.group_size or 1)
    return ptrs, strides, meta


def seal_from(layer: LayerKV, role: str, src: torch.Tensor, src_ids: torch.Tensor, s_src: int, s_head: int,
              s_tok: int, dst_q: torch.Tensor, num_warps: int | None = None) -> None:
    """Quantize whole blocks: tile ``i``'s ``[H, bs, D]`` origin is element ``src_ids[i] * s_src``
    of ``src``; it goes to q block ``dst_q[i]`` (``src_ids``/``dst_q`` [S] integer, equal strides)."""
    if dst_q.numel() == 0:
        return
    assert src_ids.stride(0) == dst_q.stride(0), "src_ids and dst_q must share a stride"
    ptrs, strides, meta = _role_args(layer, role)
    _seal_kernel[(dst_q.numel(), layer.num_kv_heads)](
        src, src_ids, dst_q, dst_q.stride(0), s_src, s_head, s_tok, ptrs[0], ptrs[1], ptrs[2], ptrs[4], *strides,
        PAGE=layer.block_size, D=layer.head_dim, G=meta["g"], FMT=meta["fmt"], PER=meta["per"], QMAX=meta["qmax"],
        num_warps=num_warps or _warps(layer),
    )


def seal_pairs(layer: LayerKV, pairs: torch.Tensor, num_warps: int | None = None) -> None:
    """Seal hp block ``pairs[i, 0]`` into q block ``pairs[i, 1]`` (K and V, one launch); rows
    with a negative q block are skipped, so a CUDA graph can replay a padded list."""
    if pairs.shape[0] == 0:
        return
    kp, ks, km = _role_args(layer, "k")
    vp, vs, vm = _role_args(layer, "v")
    hp = layer.k_hp.stride()
    _seal_hp_kernel[(pairs.shape[0], layer.num_kv_heads)](
        pairs, pairs.stride(0), layer.k_hp, layer.v_hp, hp[0], hp[1], hp[2],
        kp[0], kp[1], kp[2], kp[4], vp[0], vp[1], vp[2], vp[4], *ks, *vs,
        PAGE=layer.block_size, D=layer.head_dim, K_G=km["g"], V_G=vm["g"],
        K_FMT=km["fmt"], K_PER=km["per"], K_QMAX=km["qmax"], V_FMT=vm["fmt"], V_PER=vm["per"], V_QMAX=vm["qmax"],
        num_warps=num_warps or _warps(layer),
    )


def seal_blocks(layer: LayerKV, src_hp: torch.Tensor, dst_q: torch.Tensor) -> None:
    """Triton twin of :func:`kvq.attention.reference.seal_blocks`."""
    if dst_q.numel() == 0:
        return
    seal_pairs(layer, torch.stack([src_hp.to(torch.int64), dst_q.to(torch.int64)], dim=1))


def write_kv(layer: LayerKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             full_blocks: torch.Tensor | None = None, tokens_per_program: int = 16, num_warps: int | None = None,
             seal_warps: int | None = None, sealer=None, pair_sealer=None) -> None:
    """Triton twin of :func:`kvq.attention.reference.write_kv`.

    ``full_blocks`` [NB, 2] (q block, first token index) lists the q blocks that
    this write fills whole; it is needed only for block-sealed formats and is
    derived from ``slots`` (with a device sync) when not given.  ``sealer`` (same
    arguments as :func:`seal_from` without the warps) seals those blocks instead of
    the Triton seal kernel (the CUDA backend's, kvq.attention.cuda.seal); ``pair_sealer`` (arguments
    ``layer, k, v, src_ids, s_src, s_head, s_tok, dst_q``) seals both roles at once: where both are
    sealed per block, and where the write is whole blocks (then a role written per token too).
    """
    T, H, D = k.shape
    assert k.stride() == v.stride() and k.stride(2) == 1, "k and v must share a layout with contiguous channels"
    if T == 0:
        return
    kp, ks, km = _role_args(layer, "k")
    vp, vs, vm = _role_args(layer, "v")
    hp = layer.k_hp.stride()
    TB = tokens_per_program
    if num_warps is None:
        num_warps = _warps(layer)
    # every token in a block this write fills whole (a prefill chunk of whole blocks): no hp row to write
    cover = full_blocks is not None and full_blocks.shape[0] * layer.block_size == T
    if pair_sealer is not None and cover and not (km["direct"] and vm["direct"]):
        # one launch seals both roles from the new tokens, a role written per token too (KIVI V: its block
        # seal writes the bytes the per-token kernel would; on the H200 the per-token kernel took 43 us of
        # 16384 int4_kivi tokens' 66, the seal of both roles 40 in all)
        pair_sealer(layer, k, v, full_blocks[:, 1], k.stride(0), k.stride(1), k.stride(0), full_blocks[:, 0])
        return
    # both roles sealed per block: the seals below do all of it
    whole = not (km["direct"] or vm["direct"]) and cover
    if not whole:
        _write_kernel[(triton.cdiv(T, TB), H)](
            k, v, k.stride(0), k.stride(1), T, slots, *kp, *vp, *ks, *vs, hp[0], hp[1], hp[2],
            PAGE=layer.block_size, D=D, K_G=km["g"], V_G=vm["g"], TB=TB,
            K_FMT=km["fmt"], K_PER=km["per"], K_QMAX=km["qmax"], K_DIRECT=km["direct"],
            V_FMT=vm["fmt"], V_PER=vm["per"], V_QMAX=vm["qmax"], V_DIRECT=vm["direct"], num_warps=num_warps,
        )
    if km["direct"] and vm["direct"]:
        return
    if full_blocks is None:
        from kvq.attention.reference import full_block_writes

        full_blocks = full_block_writes(torch.where(slots < 0, -1, slots), layer.block_size)
    if full_blocks.numel() == 0:
        return
    if pair_sealer is not None and not (km["direct"] or vm["direct"]):
        pair_sealer(layer, k, v, full_blocks[:, 1], k.stride(0), k.stride(1), k.stride(0), full_blocks[:, 0])
        return
    for role, x, meta in (("k", k, km), ("v", v, vm)):
        if not meta["direct"]:
            args = (layer, role, x, full_blocks[:, 1], x.stride(0), x.stride(1), x.stride(0), full_blocks[:, 0])
            if sealer is not None:
                sealer(*args)
            else:
                seal_from(*args, seal_warps)
