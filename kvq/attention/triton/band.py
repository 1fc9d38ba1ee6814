"""The near-diagonal band of a windowed prefill, merged with the library's bulk and exact tail.

kvq.attention.split_prefill cuts each query's keys (position ``p``, sinks ``S`` tokens, recent
window ``R`` tokens, page ``P``, ``SPLIT = R + P``) into

    bulk   [S, p - SPLIT]                  every key there is read quantized by the window rule
                                           (kvq.cache.window.exact_from(p) > p - SPLIT): one causal
                                           library call over the quantized pages, offset by SPLIT
    tail   [max(S, p - R + 1), p]          every key there is read exact (exact_from(p) <= p - R):
                                           one causal library call over the exact pages with a
                                           sliding window of R keys
    band   [0, S) and [max(S, p - SPLIT + 1), p - R]   the sinks (exact) and the P keys between,
                                           of which each query reads exact those from exact_from(p)

This kernel computes the band from the page scratch of kvq.attention.triton.prefill.window_scratch
(both tables) and folds in the library calls' outputs and base-2 log-sum-exps
(kvq.attention.paged_lib's contract): ``out = (acc + sum_c o_c * 2^lse_c) / (l + sum_c 2^lse_c)`` in the
running max's units.  A band holds at most S + P keys per query (S + SPLIT without a tail call), so it
costs a few key tiles per query tile.  (Before the tail call it read all SPLIT keys: the largest
part of a KIVI prefill of 1K-4K-token chunks, H100 profile in docs/kernels.md.)

    q            [T, Hq, D]    the group's new tokens (model dtype)
    cu           [B + 1] int32 from 0;  lens [B] int32: cached tokens, the new ones included
    bulk, tail   ([T, Hq, D], [T, Hq] float32 base 2): each library call's output and log-sum-exp for the rows
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq.attention.triton.decode import _LOG2E, INTERPRET, _dot_dtype
from kvq.attention.triton.prefill import TILES, _dense_args, _prefill_tile
from kvq.attention.triton.tiles import tile_channel


#: Pack the query heads of a KV head into a program's rows (``band_attention(pack_gqa=...)``): per
#: query, a tile of BLOCK_M / group positions reads POS + P band keys instead of BLOCK_M + P, and each
#: key tile is loaded once for the group instead of once per query head.  The band kernel's own time on
#: an H100 (session 31, bench_prefill --profile, int4_kivi; ``--band-unpacked`` times the other side):
#: 8 x 1024 320 -> 314 us, 4 x 4096 638 -> 616, 32K 1344 -> 1261, 128K 5838 -> 5383, 122880 + 8192 371 -> 340.
PACK_GQA = True


@triton.jit
def _merge(acc, m_i, l_i, o_ptr, s_t, s_h, lse_ptr, s_lt, s_lh, rows, hq, d, rmask):
    """Fold a library call's rows (output and base-2 log-sum-exp; -inf: the row saw no key) into the
    running sum: -> (acc, m, l)."""
    lb = tl.load(lse_ptr + rows * s_lt + hq * s_lh, mask=rmask, other=float("-inf"))
    ob = tl.load(o_ptr + rows[:, None] * s_t + hq[:, None] * s_h + d[None, :], mask=rmask[:, None],
                 other=0.0).to(tl.float32)
    m_new = tl.maximum(m_i, lb)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m_i - m_use)
    c = tl.exp2(lb - m_use)
    return acc * a[:, None] + ob * c[:, None], m_new, l_i * a + c


@triton.jit(do_not_specialize=["s_tb"], do_not_specialize_on_alignment=["cu_ptr", "table_ptr", "lens_ptr",
                                                                        "tableq_ptr"])
def _band_kernel(
    q_ptr, s_qt, s_qh, o_ptr, s_ot, s_oh, cu_ptr,
    kd, ks, kz, khp, kst, vd, vs, vz, vhp, vst,
    s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst, s_kzb,
    s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb,
    s_hb, s_hh, s_ht,
    table_ptr, s_tb, lens_ptr, qk_scale, tableq_ptr, SINK_T, RESID, SPLIT,
    ob_ptr, s_bt, s_bh, lse_ptr, s_lt, s_lh,
    ot_ptr, s_tt, s_th, lset_ptr, s_mt, s_mh,
    GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_FMT: tl.constexpr, K_PER: tl.constexpr, V_FMT: tl.constexpr, V_PER: tl.constexpr,
    K_G: tl.constexpr, V_G: tl.constexpr, DOT: tl.constexpr, HAS_BULK: tl.constexpr, HAS_TAIL: tl.constexpr,
    PACK: tl.constexpr, SINK_N: tl.constexpr,
):
    # PACK: a program takes the GROUP query heads of one KV head, its rows (position, head) pairs, so
    # it loads each key tile once for the group and its band is POS + P keys wide instead of BLOCK_M + P
    HP = GROUP if PACK else 1  # query heads a program
    POS = BLOCK_M // HP  # query positions a tile
    b = tl.program_id(0)
    hx = tl.program_id(1)  # the KV head (PACK) or the query head
    mt = tl.program_id(2)
    h = hx if PACK else hx // GROUP
    q0 = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q0
    n = tl.load(lens_ptr + b)
    r = tl.arange(0, BLOCK_M)
    i = mt * POS + r // HP
    hq = hx * HP + r % HP
    rmask = (r // HP < POS) & (i < q_len)
    qpos = n - q_len + i
    d = tl.arange(0, D)
    rows = (q0 + i).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * s_qt + hq[:, None] * s_qh + d[None, :], mask=rmask[:, None],
                other=0.0).to(DOT)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    kv_end = tl.where(mt * POS < q_len, tl.minimum(n, n - q_len + (mt + 1) * POS), 0)
    table = table_ptr + b.to(tl.int64) * s_tb
    tableq = tableq_ptr + b.to(tl.int64) * s_tb
    win = tl.maximum(qpos - RESID, 0) // PAGE * PAGE  # kvq.cache.window.exact_from
    qlo = tl.maximum(SINK_T, qpos - SPLIT + 1)  # each query's first band key past the sinks
    # the sinks, exact (a key past a query is masked by causality), in tiles of SINK_N keys (a few sinks
    # in a tile of BLOCK_N cost a whole tile's products)
    sink_end = tl.minimum(SINK_T, kv_end)
    for t0 in range(0, sink_end, SINK_N):
        m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, t0, sink_end, qpos, win, h, table, tableq, SINK_T, qk_scale,
                                      qlo, kd, ks, kz, khp, kst, vd, vs, vz, vhp, vst, s_kdb, s_kdh, s_kdt, s_ksb,
                                      s_ksh, s_kst, s_kzb, s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb,
                                      s_hb, s_hh, s_ht, D,
                                      PAGE, SINK_N, K_FMT, K_PER, V_FMT, V_PER, K_G, V_G, False, DOT, 0)
    # the band: keys [max(S, p - SPLIT + 1), p - R] of query p (with the library's exact tail, which reads
    # the last R; without it up to p), in three runs of tiles: before the first query's window start,
    # which every query reads quantized (one pass); those its queries may read both ways (exact pairs,
    # then the others: two passes); past the last query's window start, which every query reads exact
    RHI = RESID if HAS_TAIL else 0
    qhi = qpos - RHI
    hi = tl.maximum(kv_end - RHI, 0)
    q_first = n - q_len + mt * POS
    q_last = kv_end - 1
    lo = tl.minimum(tl.maximum(SINK_T, q_first - SPLIT + 1) // BLOCK_N * BLOCK_N, hi)
    win_lo = tl.maximum(q_first - RESID, 0) // PAGE * PAGE
    win_hi = tl.maximum(q_last - RESID, 0) // PAGE * PAGE
    low = tl.minimum(tl.maximum(lo, win_lo // BLOCK_N * BLOCK_N), hi)
    mid = tl.minimum(tl.maximum(low, tl.cdiv(win_hi, BLOCK_N) * BLOCK_N), hi)
    for t0 in range(lo, low, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, t0, hi, qhi, win, h, table, tableq, SINK_T, qk_scale,
                                      qlo, kd, ks, kz, khp, kst, vd, vs, vz, vhp, vst, s_kdb, s_kdh, s_kdt, s_ksb,
                                      s_ksh, s_kst, s_kzb, s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb,
                                      s_hb, s_hh, s_ht, D,
                                      PAGE, BLOCK_N, K_FMT, K_PER, V_FMT, V_PER, K_G, V_G, False, DOT, 1, True)
    for t0 in range(low, mid, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, t0, hi, qhi, win, h, table, tableq, SINK_T, qk_scale,
                                      qlo, kd, ks, kz, khp, kst, vd, vs, vz, vhp, vst, s_kdb, s_kdh, s_kdt, s_ksb,
                                      s_ksh, s_kst, s_kzb, s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb,
                                      s_hb, s_hh, s_ht, D,
                                      PAGE, BLOCK_N, K_FMT, K_PER, V_FMT, V_PER, K_G, V_G, False, DOT, 2, True)
        m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, t0, hi, qhi, win, h, table, tableq, SINK_T, qk_scale,
                                      qlo, kd, ks, kz, khp, kst, vd, vs, vz, vhp, vst, s_kdb, s_kdh, s_kdt, s_ksb,
                                      s_ksh, s_kst, s_kzb, s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb,
                                      s_hb, s_hh, s_ht, D,
                                      PAGE, BLOCK_N, K_FMT, K_PER, V_FMT, V_PER, K_G, V_G, False, DOT, 3, True)
    for t0 in range(mid, hi, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, t0, hi, qhi, win, h, table, tableq, SINK_T, qk_scale,
                                      qlo, kd, ks, kz, khp, kst, vd, vs, vz, vhp, vst, s_kdb, s_kdh, s_kdt, s_ksb,
                                      s_ksh, s_kst, s_kzb, s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb,
                                      s_hb, s_hh, s_ht, D,
                                      PAGE, BLOCK_N, K_FMT, K_PER, V_FMT, V_PER, K_G, V_G, False, DOT, 0, True)
    if HAS_BULK:
        if n - SPLIT - SINK_T > 0:  # the sequence sent keys to the library (else its rows there are dummies)
            acc, m_i, l_i = _merge(acc, m_i, l_i, ob_ptr, s_bt, s_bh, lse_ptr, s_lt, s_lh, rows, hq, d, rmask)
    if HAS_TAIL:
        if n - SINK_T > 0:
            acc, m_i, l_i = _merge(acc, m_i, l_i, ot_ptr, s_tt, s_th, lset_ptr, s_mt, s_mh, rows, hq, d, rmask)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None] * s_ot + hq[:, None] * s_oh + tile_channel(d, 1, D)[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])


def band_attention(q: torch.Tensor, out: torch.Tensor, scratch, page: int, num_kv_heads: int, sm_scale: float,
                   max_q_len: int, sink_tokens: int, residual: int, bulk: tuple | None, tail: tuple | None = None,
                   tile: dict | None = None, pack_gqa: bool | None = None) -> None:
    """Write into ``out`` [T, Hq, D] the band of each query (module docstring) merged with the library's
    bulk and exact tail (``(out, lse)`` each; None when the group sent no call: no sequence had keys
    there, or no recent window).  ``scratch``: a :class:`kvq.attention.triton.prefill.WindowScratch` of
    these rows.  ``pack_gqa`` (default :data:`PACK_GQA`): a program per KV head and tile of query
    positions, its rows the group's query heads at those positions (a group wider than the tile:
    a program per query head)."""
    T, Hq, D = q.shape
    if T == 0 or max_q_len == 0:
        return
    tile = dict(TILES["window"], **(tile or {}))
    B = scratch.lens.shape[0]
    args, meta = _dense_args(scratch.k, scratch.v)
    dot = tl.float16 if not INTERPRET else _dot_dtype(q.dtype)
    ob, lse = bulk if bulk is not None else (out, out)
    ot, lset = tail if tail is not None else (out, out)
    group = Hq // num_kv_heads
    pack = (PACK_GQA if pack_gqa is None else pack_gqa) and group <= tile["block_m"]
    heads, pos = (num_kv_heads, tile["block_m"] // group) if pack else (Hq, tile["block_m"])
    grid = (B, heads, triton.cdiv(max_q_len, pos))
    _band_kernel[grid](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), scratch.cu, *args,
        scratch.tab_exact, scratch.tab_exact.stride(0), scratch.lens, sm_scale * _LOG2E, scratch.tab_q,
        sink_tokens, residual, residual + page,
        ob, ob.stride(0), ob.stride(1), lse, lse.stride(0), lse.stride(1),
        ot, ot.stride(0), ot.stride(1), lset, lset.stride(0), lset.stride(1),
        GROUP=group, D=D, PAGE=page, BLOCK_M=tile["block_m"], BLOCK_N=tile["block_n"],
        K_FMT=meta["k_fmt"], K_PER=meta["k_per"], V_FMT=meta["v_fmt"], V_PER=meta["v_per"],
        K_G=meta["k_g"], V_G=meta["v_g"], DOT=dot, HAS_BULK=bulk is not None, HAS_TAIL=tail is not None, PACK=pack,
        SINK_N=min(tile["block_n"], max(16, triton.next_power_of_2(max(sink_tokens, 1)))),
        num_warps=tile["num_warps"], num_stages=tile["num_stages"],
    )
