"""Paged prefill attention in Triton: a chunk of new tokens over the cached past.

One program per (sequence, query head, tile of ``BLOCK_M`` new tokens).  The
chunk's K/V were written to the cache first, so every key (the past and the
chunk itself) is read in its stored format through
:func:`kvq.attention.triton.tiles.load_tile`; the causal mask compares cache
positions.  Same contract as :func:`kvq.attention.reference.paged_attention`:

    q            [T, Hq, D]       new tokens of all sequences, packed
    cu_seqlens_q [B + 1] int32    q[cu[b]:cu[b+1]] are the last tokens of sequence b
    tables       [B, max_blocks]  int32, signed
    seq_lens     [B] int32        cached tokens, the new ones included
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import torch
import triton
import triton.language as tl

from kvq.attention.triton import dequant, store
from kvq.attention.triton.decode import _LOG2E, INTERPRET, _dot_dtype, layer_args
from kvq.attention.triton.splitk import softmax_step
from kvq.attention.triton.tiles import DENSE, load_tile, tile_channel
from kvq.cache.pool import LayerKV
from kvq.cache.step import host_ids

#: The launch's tiles per kind of read: queries per program (block_m), keys per loop iteration
#: (block_n), warps, pipeline stages.  "dense": 16-bit pages read as they are (bf16, or a format
#: dequantized first into an f16 scratch); "window": the windowed kernel over its f16 scratch;
#: "stored": codes read from the pages (FP8 with a static scale).  Chosen by
#: scripts/probe_prefill.py --window --tiles on the H200 (docs/kernels.md, session 18: 8 x 7936
#: tokens, bf16 14.4 ms at 128x32 against 15.8 ms at 64x64; windowed int4_kivi 17.7 ms at 64x64
#: against 19.4 ms at 128x32; fp8_e4m3 14.2 ms at 64x64 against 17.2 ms at 128x32).  One place, so
#: that probe_prefill.py can time others in the same process and scripts/kernel_resources.py can
#: show what each takes of an SM.
TILES = {
    "dense": {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 2},
    "window": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
    "stored": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
}


@triton.jit
def _prefill_tile(
    q, m_i, l_i, acc, t0, kv_end, qpos, win, h, table, tableq, SINK_T, qk_scale, qlo,
    kd, ks, kz, khp, kst, vd, vs, vz, vhp, vst,
    s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst, s_kzb,
    s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb,
    s_hb, s_hh, s_ht,
    D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    K_FMT: tl.constexpr, K_PER: tl.constexpr, V_FMT: tl.constexpr, V_PER: tl.constexpr,
    K_G: tl.constexpr, V_G: tl.constexpr, HAS_HP: tl.constexpr, DOT: tl.constexpr, MODE: tl.constexpr,
    LO: tl.constexpr = False,
):
    """One tile of ``BLOCK_N`` keys from ``t0`` for a tile of queries: online-softmax update.
    MODE 0: every (query, key) pair through ``table``; 1: every pair through ``tableq``; 2: only the
    pairs the window rule reads exact, through ``table``; 3: only the others, through ``tableq``.
    A tile its queries read both ways takes two passes (2, then 3), each loading one K and one V
    tile: the loop bodies stay alike, and so do their pipeline buffers in shared memory (a body
    that loaded both pages' tiles at once needed 148 KB of it, one CTA per SM, against 82 KB).
    ``LO``: each query also skips the keys below its own ``qlo`` (kvq.attention.triton.band)."""
    t = t0 + tl.arange(0, BLOCK_N)
    valid = t < kv_end
    off = t % PAGE
    # rows past the end read the row's first block (finite in its format; block 0 of a tier's view of
    # an arena may hold another tier's bytes), masked to -inf
    if MODE == 1 or MODE == 3:
        bid = tl.where(valid, tl.load(tableq + t // PAGE, mask=valid, other=0), tl.load(tableq))
    else:
        bid = tl.where(valid, tl.load(table + t // PAGE, mask=valid, other=0), tl.load(table))
    k, k_sc = load_tile(kd, ks, kz, khp, kst, s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst, s_kzb, s_hb, s_hh, s_ht,
                        bid, off, h, valid, BLOCK_N, D, K_FMT, K_PER, K_G, HAS_HP, DOT)
    s = tl.dot(q, tl.trans(k)) * (k_sc * qk_scale)[None, :]
    keep = valid[None, :] & (t[None, :] <= qpos[:, None])
    if LO:
        keep = keep & (t[None, :] >= qlo[:, None])
    if MODE >= 2:
        exact = (t[None, :] < SINK_T) | (t[None, :] >= win[:, None])
        keep = keep & (exact if MODE == 2 else ~exact)
    s = tl.where(keep, s, float("-inf"))
    m_new, alpha, p, l_i = softmax_step(s, m_i, l_i)
    v, v_sc = load_tile(vd, vs, vz, vhp, vst, s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb, s_hb, s_hh, s_ht,
                        bid, off, h, valid, BLOCK_N, D, V_FMT, V_PER, V_G, HAS_HP, DOT)
    acc = acc * alpha[:, None] + tl.dot((p * v_sc[None, :]).to(DOT), v)
    return m_new, l_i, acc


# the table width changes step to step, and the step's tables, lengths and query starts are views
# whose 16-byte alignment does too (one recompile each in a wave on the H200): no recompile for either
@triton.jit(do_not_specialize=["s_tb"], do_not_specialize_on_alignment=["cu_ptr", "table_ptr", "lens_ptr",
                                                                        "tableq_ptr"])
def _prefill_kernel(
    q_ptr, s_qt, s_qh, o_ptr, s_ot, s_oh, cu_ptr,
    kd, ks, kz, khp, kst, vd, vs, vz, vhp, vst,
    s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst, s_kzb,
    s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb,
    s_hb, s_hh, s_ht,
    table_ptr, s_tb, lens_ptr, qk_scale, tableq_ptr, SINK_T, RESID,
    GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_FMT: tl.constexpr, K_PER: tl.constexpr, V_FMT: tl.constexpr, V_PER: tl.constexpr,
    K_G: tl.constexpr, V_G: tl.constexpr, HAS_HP: tl.constexpr, DOT: tl.constexpr, WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    mt = tl.program_id(2)
    h = hq // GROUP
    q0 = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q0
    n = tl.load(lens_ptr + b)
    i = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = i < q_len
    qpos = n - q_len + i  # cache position of each query
    d = tl.arange(0, D)
    rows = (q0 + i).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * s_qt + hq * s_qh + tile_channel(d, K_PER, D)[None, :],
                mask=rmask[:, None], other=0.0).to(DOT)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    # keys up to the last query of this tile; zero iterations for tiles past the chunk
    kv_end = tl.where(mt * BLOCK_M < q_len, tl.minimum(n, n - q_len + (mt + 1) * BLOCK_M), 0)
    table = table_ptr + b.to(tl.int64) * s_tb
    tableq = tableq_ptr + b.to(tl.int64) * s_tb
    # WINDOW: ``table`` maps each block to its exact pages and ``tableq`` to its quantized ones
    # (they differ only for blocks the step reads both ways); each query reads a key exact
    # iff it is a sink or inside its recent window (kvq.cache.window.exact_from)
    win = tl.maximum(qpos - RESID, 0) // PAGE * PAGE
    # the keys in runs, each read one way by every query of the tile: [0, r0) holds the sinks, which
    # some queries read exact and others quantized (two passes, _prefill_tile's MODE 2 then 3); below
    # the first query's window start every query reads [r0, r1) quantized (MODE 1); between the first
    # and the last query's window start they differ, [r1, r2) (two passes); from there on, exact
    # (MODE 0).  Without WINDOW only the last run, from 0: the cache as stored.
    r0 = 0
    r1 = 0
    r2 = 0
    if WINDOW:
        q_first = n - q_len + mt * BLOCK_M
        q_last = tl.minimum(n, n - q_len + (mt + 1) * BLOCK_M) - 1
        win_lo = tl.maximum(q_first - RESID, 0) // PAGE * PAGE
        win_hi = tl.maximum(q_last - RESID, 0) // PAGE * PAGE
        r0 = tl.minimum(tl.cdiv(SINK_T, BLOCK_N) * BLOCK_N, kv_end)
        r1 = tl.minimum(tl.maximum(r0, win_lo // BLOCK_N * BLOCK_N), kv_end)
        r2 = tl.minimum(tl.maximum(r1, tl.cdiv(win_hi, BLOCK_N) * BLOCK_N), kv_end)
    for run in tl.static_range(6):
        if WINDOW or run == 5:
            lo = 0 if run <= 1 else r0 if run == 2 else r1 if run <= 4 else r2
            hi = r0 if run <= 1 else r1 if run == 2 else r2 if run <= 4 else kv_end
            for t0 in range(lo, hi, BLOCK_N):
                m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, t0, kv_end, qpos, win, h, table, tableq, SINK_T,
                                              qk_scale, qpos, kd, ks, kz, khp, kst, vd, vs, vz, vhp, vst, s_kdb, s_kdh,
                                              s_kdt, s_ksb, s_ksh, s_kst, s_kzb, s_vdb, s_vdh, s_vdt, s_vsb, s_vsh,
                                              s_vst, s_vzb,
                                              s_hb, s_hh, s_ht, D, PAGE, BLOCK_N, K_FMT, K_PER, V_FMT, V_PER, K_G,
                                              V_G, HAS_HP, DOT, 2 if run == 0 or run == 3 else
                                              3 if run == 1 or run == 4 else 1 if run == 2 else 0)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None] * s_ot + hq * s_oh + tile_channel(d, V_PER, D)[None, :],
             out.to(o_ptr.dtype.element_ty), mask=rmask[:, None])


def paged_attention(
    q: torch.Tensor,
    layer: LayerKV,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    max_q_len: int | None = None,
    has_hp: bool | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    dot_f16: bool | None = None,
    max_seq_len: int | None = None,
    dequant_first: bool | None = None,
    window=None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    host=None,
    tiered: bool = False,
) -> torch.Tensor:
    """Triton twin of :func:`kvq.attention.reference.paged_attention`.

    ``tiered``: the tables hold lower tiers' tagged blocks (elastic precision, kvq.cache.pool.TIER_BASE):
    the pages are read through the f16 scratch, each through its tier's format.

    ``window`` (:class:`kvq.cache.step.PrefillWindow`, with the step's new ``k_new``,
    ``v_new``): per-query exact windows over a quantized layer, always through the f16
    scratch (:func:`_windowed`); a window that lists no block reads the cache as stored,
    which is what the rule gives then.

    ``dot_f16`` (default: when K and V are both stored in 8 bits) runs both
    products in f16: every FP8/INT8 code is exact in f16 and e4m3 -> f16 is one
    hardware conversion per two codes, where e4m3 -> bf16 takes three; bf16
    queries and probabilities round to f16 (3 more mantissa bits, range to 65504).

    ``dequant_first`` (default: :func:`dequant_first_default`) dequantizes the
    pages of the step's sequences once into an f16 scratch
    (:mod:`kvq.attention.triton.dequant`) and runs the kernel over it as a dense
    pool, f16 dot; it is skipped when the scratch would pass
    ``dequant.SCRATCH_CAP_BYTES``.  ``max_seq_len`` (host int, longest
    ``seq_lens``) sizes the scratch; without it the table width does."""
    T, Hq, D = q.shape
    H = layer.num_kv_heads
    assert Hq % H == 0 and D == layer.head_dim, (Hq, H, D)
    assert cu_seqlens_q.dtype == torch.int32 and block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    B = seq_lens.shape[0]
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if B else 0
    if has_hp is None:
        has_hp = layer.k_hp.shape[0] > 0
    out = torch.empty_like(q)
    if T == 0 or max_q_len == 0:
        return out
    args, meta = layer_args(layer)
    PAGE = layer.block_size
    blocks = block_tables.shape[1]
    if max_seq_len is not None:
        blocks = min(blocks, triton.cdiv(max_seq_len, PAGE))
    if window is not None and layer.fmt.is_quantized and (window.exact_rows or window.sealed_rows):
        _windowed(q, out, layer, cu_seqlens_q, block_tables, seq_lens, sm_scale, max_q_len, window, k_new, v_new,
                  _tile("window", block_m, block_n), tiered)
        return out
    # a rotated codebook's tile rotated back inside the kernel's loop needs more shared memory than an
    # sm_90 block has (Triton 3.6: 410 KB at head_dim 128): its pages always go through the scratch
    rotated = any(f.family == "rot" for f in (layer.fmt.k, layer.fmt.v))
    if tiered or (rotated and dequant.scratch_bytes(B, blocks, H, PAGE, D) > dequant.SCRATCH_CAP_BYTES):
        # every page through the scratch, group by group (as the windowed path, no window)
        cu_h, lens_h = host if host is not None else (tuple(cu_seqlens_q.tolist()), tuple(seq_lens.tolist()))
        for g in window_scratch(layer, cu_seqlens_q, block_tables, seq_lens, None, None, None,
                                host=(cu_h, lens_h), tiered=tiered):
            dargs, dmeta = _dense_args(g.k, g.v)
            dot = tl.float16 if not INTERPRET else _dot_dtype(q.dtype)
            _launch(q[g.r0:g.r1], out[g.r0:g.r1], g.cu, dargs, dmeta, g.tab_exact, None, g.lens, sm_scale, max_q_len,
                    False, dot, _tile("dense", block_m, block_n), PAGE, H)
        return out
    if dequant_first is None or rotated:
        dequant_first = dequant_first_default(layer)
    if dequant_first and dequant.scratch_bytes(B, blocks, H, PAGE, D) <= dequant.SCRATCH_CAP_BYTES:
        k, v, block_tables = dequant.dequantize_pages(args, meta, block_tables, seq_lens, blocks, H, PAGE, D)
        args, meta = _dense_args(k, v)
        has_hp, dot_f16 = False, not INTERPRET
    if dot_f16 is None:
        dot_f16 = layer.fmt.k.bits == 8 and layer.fmt.v.bits == 8 and not INTERPRET
    dot = tl.float16 if dot_f16 else _dot_dtype(q.dtype)
    dense = meta["k_fmt"] == DENSE.value and meta["v_fmt"] == DENSE.value
    _launch(q, out, cu_seqlens_q, args, meta, block_tables, None, seq_lens, sm_scale, max_q_len, has_hp, dot,
            _tile("dense" if dense else "stored", block_m, block_n), PAGE, H)
    return out


def _tile(kind: str, block_m: int | None, block_n: int | None) -> dict:
    """The launch tile of a kind of read (:data:`TILES`), with the caller's sizes where given."""
    return dict(TILES[kind], **{k: x for k, x in (("block_m", block_m), ("block_n", block_n)) if x})


def _launch(q, out, cu, args, meta, table, tableq, lens, sm_scale, max_q_len, has_hp, dot, tile,
            page, num_kv_heads, sink_tokens: int = 0, residual: int = 0):
    B, Hq = lens.shape[0], q.shape[1]
    block_m, block_n = tile["block_m"], tile["block_n"]
    grid = (B, Hq, triton.cdiv(max_q_len, block_m))
    _prefill_kernel[grid](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), cu, *args,
        table, table.stride(0), lens, sm_scale * _LOG2E, table if tableq is None else tableq, sink_tokens, residual,
        GROUP=Hq // num_kv_heads, D=q.shape[2], PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
        K_FMT=meta["k_fmt"], K_PER=meta["k_per"], V_FMT=meta["v_fmt"], V_PER=meta["v_per"],
        K_G=meta["k_g"], V_G=meta["v_g"], HAS_HP=bool(has_hp), DOT=dot, WINDOW=tableq is not None,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"],
    )


def dequant_first_default(layer: LayerKV) -> bool:
    """Whether prefill over this layer dequantizes its pages first: for every quantized
    format but FP8 with a per-tensor scale, whose codes the kernel's f16 dot reads as
    fast as bf16 (H200 sweep of scripts/probe_prefill.py in docs/kernels.md)."""
    return any(f.is_quantized and not (f.family == "fp8" and f.scale == "static") for f in (layer.fmt.k, layer.fmt.v))


def _dense_args(k: torch.Tensor, v: torch.Tensor) -> tuple[list, dict]:
    """Launch arguments that read f16 page scratches ``k``, ``v`` as a dense pool."""
    args = [k, k, k, k, k, v, v, v, v, v, *k.stride()[:3], 0, 0, 0, 0, *v.stride()[:3], 0, 0, 0, 0, 0, 0, 0]
    return args, dict(k_fmt=DENSE.value, k_per=1, v_fmt=DENSE.value, v_per=1, k_g=1, v_g=1)


def scratch_groups(lens: Sequence[int], num_kv_heads: int, page: int, head_dim: int) -> list[tuple[int, int, int]]:
    """Sequences in groups ``(b0, b1, width)`` whose page scratch (``width`` pages each, the longest
    of the group) stays under ``dequant.SCRATCH_CAP_BYTES``; greedy, at least one a group."""
    groups, b0, B = [], 0, len(lens)
    while b0 < B:
        b1, width = b0 + 1, triton.cdiv(lens[b0], page)
        while b1 < B:
            w = max(width, triton.cdiv(lens[b1], page))
            if dequant.scratch_bytes(b1 + 1 - b0, w, num_kv_heads, page, head_dim) > dequant.SCRATCH_CAP_BYTES:
                break
            b1, width = b1 + 1, w
        groups.append((b0, b1, width))
        b0 = b1
    return groups


@dataclass(frozen=True)
class WindowScratch:
    """One group of a windowed prefill step: sequences ``[b0, b1)`` (query rows ``[r0, r1)``), their
    pages dequantized into ``k``/``v`` ``[pages, H, P, D]`` with the extra pages after them, and
    the two tables that read them: ``tab_exact`` (each block as the queries that read it exact
    see it) and ``tab_q`` (as the others see it), ``[b1 - b0, width]`` int32."""

    b0: int
    b1: int
    r0: int
    r1: int
    cu: torch.Tensor  # [b1 - b0 + 1] int32, from 0
    lens: torch.Tensor  # [b1 - b0] int32
    k: torch.Tensor
    v: torch.Tensor
    tab_exact: torch.Tensor
    tab_q: torch.Tensor


def _no_memo(key, build):
    return build()


def window_scratch(layer, cu, tables, lens, window, k_new, v_new, dtype=torch.float16, host=None,
                   tiered: bool = False, memo=None) -> Iterator[WindowScratch]:
    """The page scratch of a prefill with per-query exact windows (kvq.attention.reference explains
    the rule), group by group (:func:`scratch_groups`): the step's pages dequantized, with two extra
    kinds of page, the exact new K/V of q blocks this step wrote and the sealed-then-read values
    of hp blocks some query reads quantized; two tables map each block to its exact and its
    quantized page.  Without a ``window`` (``host``: the host cu and lengths instead) only the
    pages, which is how a tiered cache's prefill reads them (``tiered``: each page in its tier).
    ``memo(key, build)``: a store of the step's values that do not depend on the layer (index
    tensors, the two tables, the seal's scratch blocks), kept by the caller for the step's layers
    (kvq.attention.split_prefill: each windowed layer made them again, a host cost per layer)."""
    memo = memo or _no_memo
    H, page, D = layer.num_kv_heads, layer.block_size, layer.head_dim
    host_cu, host_lens = (window.cu, window.lens) if window is not None else host
    B, dev = len(host_lens), cu.device
    for gi, (b0, b1, width) in enumerate(scratch_groups(host_lens, H, page, D)):
        r0, r1 = host_cu[b0], host_cu[b1]
        rows = memo(("window-rows", id(window), gi, H, page, D),
                    lambda: _group_rows(window, cu, host_cu, b0, b1, B, r0, width, page, dev))
        g_cu, E, S, ident, ex_rows, tab_exact, seal_pairs, tab_q, one, n_tok = rows
        g_tab, g_lens, nb = tables[b0:b1, :width], lens[b0:b1], (b1 - b0) * width
        kp, vp, _ = dequant.dequantize_layer_pages(layer, g_tab, g_lens, width, extra=E + S, dtype=dtype,
                                                   tiered=tiered, table=ident)
        if E:  # the new K/V of the q blocks this step wrote: [E, page, H, D] -> [E, H, page, D]
            dequant.rows_to_pages(k_new[r0:r1], v_new[r0:r1], ex_rows, kp[nb:nb + E], vp[nb:nb + E])
        if S:  # hp blocks as the seal kernel will store them, read back
            # (the seal's scratch blocks shared by the step's layers of one format; each layer seals into them anew)
            blocks = memo(("window-seal", gi, layer.fmt, H, page, D), lambda: layer.with_q_blocks(S))
            tmp = replace(layer, k=blocks.k, v=blocks.v)  # this layer's hp blocks sealed into them
            store.seal_pairs(tmp, seal_pairs)
            targs, tmeta = layer_args(tmp)
            dequant.dequantize_pages(targs, tmeta, one, n_tok, S, H, page, D, dtype=dtype,
                                     into=(kp[nb + E:], vp[nb + E:]), table=one)
        yield WindowScratch(b0, b1, r0, r1, g_cu, g_lens, kp, vp, tab_exact, tab_q)


def _group_rows(window, cu, host_cu, b0, b1, B, r0, width, page, dev):
    """The layer-independent tensors of one group of :func:`window_scratch`: its query starts, the counts
    of exact and sealed pages, the identity table, the exact pages' first query rows, the two tables, the
    seal's (source hp block, scratch block) pairs and the sealed pages' own table and token count."""
    no_rows = torch.zeros((0, 3), dtype=torch.int64, device=dev)
    if (b0, b1) == (0, B):
        g_cu = cu
        ex, se = (window.exact, window.sealed) if window is not None else (no_rows, no_rows)
    else:
        def rows(rs, rebase_row):
            keep = [(b - b0, i, x - r0 if rebase_row else x) for b, i, x in rs if b0 <= b < b1]
            return host_ids(keep, torch.int64, dev).reshape(-1, 3)
        g_cu = host_ids([c - r0 for c in host_cu[b0:b1 + 1]], torch.int32, dev)
        ex, se = ((rows(window.exact_rows, True), rows(window.sealed_rows, False)) if window is not None
                  else (no_rows, no_rows))
    nb = (b1 - b0) * width
    E, S = ex.shape[0], se.shape[0]
    ident = torch.arange(nb, dtype=torch.int32, device=dev).view(b1 - b0, width)
    tab_exact = tab_q = ident
    ex_rows = seal_pairs = one = n_tok = None
    if E:
        ex_rows = ex[:, 2].contiguous()
        tab_exact = ident.clone()
        tab_exact[ex[:, 0], ex[:, 1]] = nb + torch.arange(E, dtype=torch.int32, device=dev)
    if S:
        seal_pairs = torch.stack([se[:, 2], torch.arange(S, dtype=torch.int64, device=dev)], dim=1)
        tab_q = ident.clone()
        tab_q[se[:, 0], se[:, 1]] = nb + E + torch.arange(S, dtype=torch.int32, device=dev)
        one = torch.arange(S, dtype=torch.int32, device=dev).view(1, S)
        n_tok = torch.full((1,), S * page, dtype=torch.int32, device=dev)
    return g_cu, E, S, ident, ex_rows, tab_exact, seal_pairs, tab_q, one, n_tok


def _windowed(q, out, layer, cu, tables, lens, sm_scale, max_q_len, window, k_new, v_new, tile, tiered=False):
    """Prefill with per-query exact windows through the page scratch (:func:`window_scratch`);
    the kernel picks the exact or the quantized page per (query, key)."""
    dot = tl.float16 if not INTERPRET else _dot_dtype(q.dtype)
    for g in window_scratch(layer, cu, tables, lens, window, k_new, v_new, tiered=tiered):
        dargs, dmeta = _dense_args(g.k, g.v)
        _launch(q[g.r0:g.r1], out[g.r0:g.r1], g.cu, dargs, dmeta, g.tab_exact, g.tab_q, g.lens, sm_scale, max_q_len,
                False, dot, tile, layer.block_size, layer.num_kv_heads, window.sink_tokens,
                window.policy.residual_tokens)
