"""Dequantize the pages a prefill step reads into a dense f16 scratch, once.

The chunked-prefill kernel reads every K/V tile once per (query head, tile of
``BLOCK_M`` queries): for a 1024-token chunk with GQA 4 that is 64 reads and
64 dequantizations of the same tile.  For formats whose dequantization is more
than a free conversion (KIVI's per-channel scale/zero, int8 codes) that work
dominates the kernel.  This pass dequantizes each page of the step's sequences
once into ``[B * blocks, H, PAGE, D]`` f16 (natural channel order, scales
applied); the prefill kernel then reads the scratch as a dense bf16-like pool.
Prefill is compute bound, so the extra pass (read the stored bytes, write 4
bytes per element pair) costs a few microseconds per layer.

f16, not the model's bf16: a dequantized value ``code * scale (+ zero)`` keeps
11 significant bits, which is closer to the reference's fp32 than the in-loop
bf16 dequantization of KIVI tiles, and K/V values are far inside f16's range.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq.attention.triton.decode import layer_args
from kvq.attention.triton.tiles import (KIVI_K, ROT, group_cols, group_rows, load_tile, mean_rows, rot_values,
                                       unpack_natural)
from kvq.cache.pool import TIER_BASE

#: Scratch bytes (K and V together) above which the prefill dequantizes in its loop instead.
SCRATCH_CAP_BYTES = 512 * 1024 * 1024


@triton.jit
def _packed_page(data_ptr, scale_ptr, zero_ptr, qb, head, off, s_db, s_dh, s_dt, s_sb, s_sh, s_st,
                 PAGE: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, PER: tl.constexpr, G: tl.constexpr):
    """[PAGE, D] float32 of a whole KIVI-packed page (``qb`` its block, ``off`` = 0 .. PAGE - 1) in
    natural channel order: the page's packed rows as one byte tile, unpacked by a broadcast shift
    (kvq.attention.triton.tiles.unpack_natural), each value dequantized by one FMA with its scale
    and zero point, loaded a row per group and broadcast (not gathered per value)."""
    row = qb * s_db + head * s_dh + off.to(tl.int64) * s_dt
    code = unpack_natural(data_ptr, row, PAGE, D, 8 // PER).to(tl.float32)
    if FMT == KIVI_K:  # one scale/zero row per group of G tokens, per channel
        srow = qb * s_sb + head * s_sh + tl.arange(0, PAGE // G) * s_st
        return tl.fma(code, group_cols(scale_ptr, srow, PAGE, D, G).to(tl.float32),
                      group_cols(zero_ptr, srow, PAGE, D, G).to(tl.float32))
    else:  # KIVI_V: per token, per group of G channels
        GV: tl.constexpr = G if G < D else D
        grow = qb * s_sb + head * s_sh + off * s_st
        live = off >= 0
        return tl.fma(code, group_rows(scale_ptr, grow, live, PAGE, D, GV).to(tl.float32),
                      group_rows(zero_ptr, grow, live, PAGE, D, GV).to(tl.float32))


@triton.jit
def _page_tile(data_ptr, scale_ptr, zero_ptr, hp_ptr, static_ptr,
               s_db, s_dh, s_dt, s_sb, s_sh, s_st, s_zb, s_hb, s_hh, s_ht,
               bid, head, off, PAGE: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, PER: tl.constexpr,
               G: tl.constexpr):
    """[PAGE, D] float32, natural channel order, of one page (``bid`` a scalar signed block id)."""
    c = tl.arange(0, D)
    if bid < 0:  # a high-precision page (sinks, recent window)
        hrow = (-bid - 1).to(tl.int64) * s_hb + head * s_hh + off.to(tl.int64) * s_ht
        x = tl.load(hp_ptr + hrow[:, None] + c[None, :]).to(tl.float32)
    elif FMT >= ROT:
        qb = bid.to(tl.int64)
        row = qb * s_db + head * s_dh + off.to(tl.int64) * s_dt
        mrow = mean_rows(qb, head, off, s_zb, s_sh, D, G)
        x = rot_values(data_ptr, scale_ptr, zero_ptr, static_ptr, row, qb * s_sb + head * s_sh + off * s_st, mrow,
                       D, FMT)
    elif PER == 1:
        qb = bid.to(tl.int64) + tl.zeros((PAGE,), tl.int64)
        raw, sc = load_tile(data_ptr, scale_ptr, zero_ptr, hp_ptr, static_ptr, s_db, s_dh, s_dt, s_sb, s_sh, s_st, s_zb,
                            s_hb, s_hh, s_ht, qb, off, head, off >= 0, PAGE, D, FMT, PER, G, False, tl.float32)
        x = raw * sc[:, None]
    else:
        x = _packed_page(data_ptr, scale_ptr, zero_ptr, bid.to(tl.int64), head, off, s_db, s_dh, s_dt, s_sb, s_sh,
                         s_st, PAGE, D, FMT, PER, G)
    return x


# widths change step to step, and so does the 16-byte alignment of the step's table and length views
# (two recompiles in a wave on the H200): no recompile for either
@triton.jit(do_not_specialize=["s_tb", "NB", "lo", "hi"], do_not_specialize_on_alignment=["table_ptr", "lens_ptr",
                                                                                       "starts_ptr"])
def _dequant_kernel(
    kd, ks, kz, khp, kst, vd, vs, vz, vhp, vst,
    s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst, s_kzb,
    s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb,
    s_hb, s_hh, s_ht,
    table_ptr, s_tb, lens_ptr, starts_ptr, out_k, out_v, s_ob, s_oh, s_ot, NB,
    lo, hi,  # the table entries this launch reads (one tier's tag range); its blocks are entry - max(lo, 0)
    D: tl.constexpr, PAGE: tl.constexpr,
    K_FMT: tl.constexpr, K_PER: tl.constexpr, V_FMT: tl.constexpr, V_PER: tl.constexpr, K_G: tl.constexpr, V_G: tl.constexpr,  # noqa: E501
    ROWS: tl.constexpr = False,
):
    """One program per (sequence, page of its table, KV head).  ``ROWS``: the output is rows ``[T, H, D]``,
    sequence ``b``'s token ``i`` at row ``starts[b] + i``, its tokens past its length not written."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    inside = j * PAGE < n
    ref = tl.load(table_ptr + b.to(tl.int64) * s_tb + j, mask=inside, other=0)
    if inside & (ref >= lo) & (ref < hi):
        bid = ref - tl.maximum(lo, 0)
        off = tl.arange(0, PAGE)
        c = tl.arange(0, D)
        if ROWS:
            row = tl.load(starts_ptr + b).to(tl.int64) + j * PAGE + off.to(tl.int64)
            dst = row[:, None] * s_ot + h * s_oh + c[None, :]
            keep = (j * PAGE + off < n)[:, None] & (c[None, :] >= 0)
        else:
            dst = (b.to(tl.int64) * NB + j) * s_ob + h * s_oh + off[:, None].to(tl.int64) * s_ot + c[None, :]
            keep = None
        k = _page_tile(kd, ks, kz, khp, kst, s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst, s_kzb, s_hb, s_hh, s_ht,
                       bid, h, off, PAGE, D, K_FMT, K_PER, K_G)
        tl.store(out_k + dst, k.to(out_k.dtype.element_ty), mask=keep)
        v = _page_tile(vd, vs, vz, vhp, vst, s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb, s_hb, s_hh, s_ht,
                       bid, h, off, PAGE, D, V_FMT, V_PER, V_G)
        tl.store(out_v + dst, v.to(out_v.dtype.element_ty), mask=keep)


@triton.jit
def _rows_to_pages_kernel(k_ptr, v_ptr, s_kt, s_kh, s_vt, s_vh, starts_ptr, out_k, out_v, s_ob, s_oh, s_ot,
                          PAGE: tl.constexpr, D: tl.constexpr):
    """One program per (page, KV head): rows ``starts[e] .. + PAGE`` of K and V ``[T, H, D]`` into page
    ``e`` of ``out_k`` / ``out_v`` ``[E, H, PAGE, D]`` (HND), cast to the pages' dtype."""
    e = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.load(starts_ptr + e) + tl.arange(0, PAGE).to(tl.int64)
    c = tl.arange(0, D)
    dst = e.to(tl.int64) * s_ob + h * s_oh + tl.arange(0, PAGE)[:, None] * s_ot + c[None, :]
    k = tl.load(k_ptr + rows[:, None] * s_kt + h * s_kh + c[None, :])
    tl.store(out_k + dst, k.to(out_k.dtype.element_ty))
    v = tl.load(v_ptr + rows[:, None] * s_vt + h * s_vh + c[None, :])
    tl.store(out_v + dst, v.to(out_v.dtype.element_ty))


def rows_to_pages(k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, out_k: torch.Tensor,
                  out_v: torch.Tensor) -> None:
    """Copy the ``page``-row runs of K and V ``[T, H, D]`` (channels contiguous) that start at rows
    ``starts`` [E] int64 into the HND pages ``out_k`` / ``out_v`` ``[E, H, page, D]`` (views of one
    scratch shape): one launch for both, where a gather and a transposing copy took two passes each."""
    E, H, page, D = out_k.shape
    if E:
        assert k.stride(2) == v.stride(2) == 1 and out_k.stride() == out_v.stride() and out_k.stride(3) == 1
        _rows_to_pages_kernel[(E, H)](k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), starts, out_k, out_v,
                                      out_k.stride(0), out_k.stride(1), out_k.stride(2), PAGE=page, D=D)


def scratch_bytes(batch: int, blocks: int, num_kv_heads: int, page: int, head_dim: int) -> int:
    """Bytes of the K + V scratch for ``batch`` sequences of ``blocks`` pages each."""
    return 2 * 2 * batch * blocks * num_kv_heads * page * head_dim


#: Table entries of every kind (hp and resident blocks, lower tiers' tags): the untiered read.
ALL_ENTRIES = (-(2 ** 31), 2 ** 31 - 1)


def dequantize_pages(args: list, meta: dict, block_tables: torch.Tensor, seq_lens: torch.Tensor, blocks: int,
                     num_kv_heads: int, page: int, head_dim: int, num_warps: int = 4, extra: int = 0,
                     dtype: torch.dtype = torch.float16, entries: tuple[int, int] = ALL_ENTRIES, into=None,
                     table: torch.Tensor | None = None):
    """-> (k, v) ``dtype`` ``[B * blocks + extra, H, page, D]`` and the identity table ``[B, blocks]``
    that reads them: page ``j`` of sequence ``b`` sits at block ``b * blocks + j``; the
    ``extra`` pages after them are left for the caller.  ``dtype`` bf16 copies a bf16 pool exactly
    (the library prefill of a 16-bit layer that holds hp blocks).
    ``args``/``meta`` are :func:`kvq.attention.triton.decode.layer_args` of the layer.  ``entries``
    ``[lo, hi)``: only table entries in that range are read (one tier of a tiered cache, whose
    blocks are ``entry - max(lo, 0)``); ``into``: the ``(k, v)`` scratch of an earlier call to fill;
    ``table``: that identity table, made once for a step's layers (no new tensor a call)."""
    B = seq_lens.shape[0]
    dev = seq_lens.device
    shape = (B * blocks + extra, num_kv_heads, page, head_dim)
    k, v = into if into is not None else (torch.empty(shape, dtype=dtype, device=dev),
                                          torch.empty(shape, dtype=dtype, device=dev))
    if table is None:
        table = torch.arange(B * blocks, dtype=torch.int32, device=dev).view(B, blocks)
    if B and blocks:
        _dequant_kernel[(B, blocks, num_kv_heads)](
            *args, block_tables, block_tables.stride(0), seq_lens, seq_lens, k, v, k.stride(0), k.stride(1),
            k.stride(2), blocks, *entries, D=head_dim, PAGE=page, K_FMT=meta["k_fmt"], K_PER=meta["k_per"],
            V_FMT=meta["v_fmt"], V_PER=meta["v_per"], K_G=meta["k_g"], V_G=meta["v_g"], num_warps=num_warps,
        )
    return k, v, table


def dequantize_rows(args: list, meta: dict, block_tables: torch.Tensor, seq_lens: torch.Tensor, starts: torch.Tensor,
                    rows: int, blocks: int, num_kv_heads: int, page: int, head_dim: int, num_warps: int = 4,
                    dtype: torch.dtype = torch.float16, entries: tuple[int, int] = ALL_ENTRIES, into=None):
    """-> (k, v) ``dtype`` ``[rows, H, D]``: token ``i`` of sequence ``b`` (its first ``blocks`` table
    entries, ``seq_lens[b]`` tokens) dequantized into row ``starts[b] + i`` (int32 [B], on the device).
    A step of fresh prompts reads its keys this way, in the rows of its queries (a ragged library call).
    ``entries`` and ``into`` as in :func:`dequantize_pages` (the rows of other entries left as they are)."""
    if into is None:
        k = torch.empty(rows, num_kv_heads, head_dim, dtype=dtype, device=seq_lens.device)
        v = torch.empty_like(k)
    else:
        k, v = into
    B = seq_lens.shape[0]
    if B and blocks:
        _dequant_kernel[(B, blocks, num_kv_heads)](
            *args, block_tables, block_tables.stride(0), seq_lens, starts, k, v, 0, k.stride(1), k.stride(0), blocks,
            *entries, D=head_dim, PAGE=page, K_FMT=meta["k_fmt"], K_PER=meta["k_per"], V_FMT=meta["v_fmt"],
            V_PER=meta["v_per"], K_G=meta["k_g"], V_G=meta["v_g"], ROWS=True, num_warps=num_warps,
        )
    return k, v


def tier_reads(layer, tiered: bool) -> list[tuple[list, dict, tuple[int, int]]]:
    """``(args, meta, entries)`` of each launch that reads a layer's table entries: one over all of them,
    or (``tiered``: the tables hold lower tiers' tagged blocks) one a tier, each through its own format."""
    args, meta = layer_args(layer)
    if not tiered:
        return [(args, meta, ALL_ENTRIES)]
    return [(args, meta, (ALL_ENTRIES[0], TIER_BASE))] + [
        (*layer_args(layer.tier(t)), (t * TIER_BASE, (t + 1) * TIER_BASE)) for t in range(1, len(layer.tiers) + 1)]


def dequantize_layer_rows(layer, block_tables: torch.Tensor, seq_lens: torch.Tensor, starts: torch.Tensor, rows: int,
                          blocks: int, dtype: torch.dtype = torch.float16, tiered: bool = False):
    """:func:`dequantize_rows` of a layer's pages, each tier's through its own format (:func:`tier_reads`)
    into the same rows (one launch a tier, where the page scratch and a copy into rows took a launch more
    and a second pass)."""
    H, page, D = layer.num_kv_heads, layer.block_size, layer.head_dim
    into = None
    for args, meta, entries in tier_reads(layer, tiered):
        into = dequantize_rows(args, meta, block_tables, seq_lens, starts, rows, blocks, H, page, D, dtype=dtype,
                               entries=entries, into=into)
    return into


def dequantize_layer_pages(layer, block_tables: torch.Tensor, seq_lens: torch.Tensor, blocks: int, extra: int = 0,
                           dtype: torch.dtype = torch.float16, tiered: bool = False,
                           table: torch.Tensor | None = None):
    """:func:`dequantize_pages` of a layer's pages; ``tiered``: the tables hold lower tiers' tagged
    blocks (elastic precision), each read through its own tier's format into the one scratch."""
    H, page, D = layer.num_kv_heads, layer.block_size, layer.head_dim
    into = None
    for args, meta, entries in tier_reads(layer, tiered):
        k, v, table = dequantize_pages(args, meta, block_tables, seq_lens, blocks, H, page, D, extra=extra,
                                       dtype=dtype, entries=entries, into=into, table=table)
        into = (k, v)
    return k, v, table
