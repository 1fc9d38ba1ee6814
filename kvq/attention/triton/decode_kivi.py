"""Paged decode attention over KIVI pools in Triton, channels in natural order.

The generic decode (kvq.attention.triton.decode) dequantizes every K and V tile
element by element, gathering a scale and a zero point for each of its values;
on the H200 that ran KIVI at 8-9% of copy bandwidth (0.29x bf16 at 4x131072,
docs/results/bench_decode_kivi_s20_h200.json).  A first version of this kernel
gathered each code's byte on its own (1-byte loads, 3-D tiles, 194 registers) and
ran no faster (1787 us at 4x131072, docs/results/bench_decode_s26_first_h200.json).
This one reads a tile's packed rows as one contiguous byte tile [N, DP] (16-byte loads) and
unpacks it by a broadcast shift into [N, BITS-planes, DP], which reshaped row-major is [N, D] in
natural channel order (channel c is bit plane c // DP of byte c % DP; kvq.attention.triton.tiles.
unpack_natural).  Each value is dequantized in float16 with one FMA (the scales and zero points
are float16 as stored): K per channel with its group's scale and zero, K per token
(int4_per_token, int2_per_token) and V with the scale and zero of token n over channel group j of
32.  (Folding K's scales into the query instead kept a scaled copy of the query in every warp: 168
registers against 128 on sm_90.)  The dots' quantized operands are float16 whatever the model's
dtype (11 significant bits where bfloat16 keeps 8: a peaked softmax magnifies the scores'
rounding), as in the CUDA decode.

The loop over quantized tiles has no branch, so Triton pipelines its loads (num_stages): a tile of
:data:`TILE_TOKENS` tokens reads one block id per row, rows of high-precision pages (sinks, recent
window) are masked there, and a second pass reads those pages in the model's dtype, one page a tile,
skipping every run of :data:`HP_PAGES` table entries that holds none.  Session 26's form (a branch
per tile on the page's kind, which kept the loads out of the pipeline) ran at 958 us at 4x131072 on
the H200 against bf16's 527 (bench_decode_kivi_s26_h200.json); this one 869 us against bf16's 903
on an H100 in the same session (docs/results/probe_decode_kivi_s27_h100/).

    q        [B, Hq, D]       bf16/fp16
    tables   [B, max_blocks]  int32, signed (kvq.cache.pool)
    seq_lens [B]              int32
    partials [B, Hq, S, D] float32 (natural order) and [B, Hq, S] log2-domain log-sum-exps
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvq.attention.triton.splitk import finish, partial_rows, program_share, softmax_step
from kvq.attention.triton.tiles import group_cols, group_rows, unpack_natural
from kvq.cache.pool import LayerKV

#: Tokens a KIVI group (the kernel's per-channel scale rows are per group).
GROUP_TOKENS = 32
#: Tokens a tile of the quantized pass reads (H100 sweep at 4x131072, session 27: 64 beats 32 and 128).
TILE_TOKENS = 64
#: Pipeline stages of the quantized pass (Triton's num_stages).
NUM_STAGES = 2
#: Pages of the table the hp pass reads at once to skip those that hold no hp page.
HP_PAGES = 64


def serves(layer: LayerKV) -> bool:
    """Whether this kernel reads the layer: K KIVI per channel (or per token) and V KIVI per token, in groups
    of 32 and of one width (int4_kivi, int2_kivi, int4_per_token, int2_per_token), pages of whole groups,
    head dims a power of two with at least 16 packed bytes a row."""
    k, v = layer.fmt.k, layer.fmt.v
    return (k.family == "kivi" and v.family == "kivi" and k.scale in ("channel_group", "token_group")
            and v.scale == "token_group"
            and k.group_size == v.group_size == GROUP_TOKENS and k.bits == v.bits and k.bits in (2, 4)
            and layer.block_size % base_tokens(layer) == 0 and layer.head_dim % GROUP_TOKENS == 0
            and layer.head_dim & (layer.head_dim - 1) == 0 and layer.head_dim * k.bits // 8 >= 16)


def base_tokens(layer: LayerKV) -> int:
    """Tokens of an hp tile and the quantum of a quantized one: a KIVI K group (32), or with K per token 16
    where pages hold 16."""
    return 16 if layer.fmt.k.scale == "token_group" and layer.block_size % 32 else GROUP_TOKENS


def tile_tokens(layer: LayerKV) -> int:
    """Tokens a tile of the quantized pass by default: :data:`TILE_TOKENS` (a multiple of :func:`base_tokens`)."""
    return max(TILE_TOKENS, base_tokens(layer))


# the table width and split count change step to step, the table and length views' alignment too
@triton.jit(do_not_specialize=["s_tb", "num_splits", "split_base", "split_total"],
            do_not_specialize_on_alignment=["table_ptr", "lens_ptr"])
def _decode_kivi_kernel(
    q_ptr, s_qb, s_qh,
    kd, ks, kz, khp, vd, vs, vz, vhp,
    s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst,
    s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst,
    s_hb, s_hh, s_ht,
    table_ptr, s_tb, lens_ptr,
    po_ptr, plse_ptr, num_splits,
    qk_scale,  # sm_scale * log2(e)
    split_base, split_total,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr,
    HAS_HP: tl.constexpr, DOT: tl.constexpr, K_TOKEN: tl.constexpr, N: tl.constexpr, HN: tl.constexpr,
    HP_PAGES: tl.constexpr,
):
    b, h, sp, start, end = program_share(lens_ptr, num_splits, N)

    g = tl.arange(0, G_PAD)
    gmask = g < GROUP
    c = tl.arange(0, D)
    i = tl.arange(0, N)
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + (h * GROUP + g)[:, None] * s_qh + c[None, :],
                mask=gmask[:, None], other=0.0)
    q_code = q.to(tl.float16)

    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    table = table_ptr + b.to(tl.int64) * s_tb
    # the quantized pass: no branch in the loop, so Triton pipelines its loads; hp rows are masked
    for t0 in range(start, end, N):
        t = t0 + i
        live = t < end
        if N <= PAGE:  # one page a tile
            bids = tl.zeros((N,), tl.int32) + tl.load(table + t0 // PAGE)
        else:
            bids = tl.load(table + t // PAGE, mask=live, other=0)  # [N]
        if HAS_HP:
            live = live & (bids >= 0)
            bids = tl.maximum(bids, 0)
        bq = bids.to(tl.int64)
        off = (t % PAGE).to(tl.int64)
        code = unpack_natural(kd, bq * s_kdb + h * s_kdh + off * s_kdt, N, D, BITS).to(tl.float16)
        if K_TOKEN:  # scaled per token and 32 channels
            grow = bq * s_ksb + h * s_ksh + off * s_kst
            k = tl.fma(code, group_rows(ks, grow, live, N, D, 32), group_rows(kz, grow, live, N, D, 32))
        else:  # per channel over each 32-token group of the tile: [N // 32, D] rows broadcast over their tokens
            NGT: tl.constexpr = N // 32
            tg = t0 + tl.arange(0, NGT) * 32
            bg = tl.load(table + tg // PAGE, mask=tg < end, other=0)
            if HAS_HP:
                bg = tl.maximum(bg, 0)
            srow = bg.to(tl.int64) * s_ksb + h * s_ksh + ((tg % PAGE) // 32) * s_kst
            k = tl.fma(code, group_cols(ks, srow, N, D, 32), group_cols(kz, srow, N, D, 32))
        s = tl.dot(q_code, tl.trans(k))
        m_new, alpha, p, l_i = softmax_step(tl.where(live[None, :], s * qk_scale, float("-inf")), m_i, l_i)
        code = unpack_natural(vd, bq * s_vdb + h * s_vdh + off * s_vdt, N, D, BITS).to(tl.float16)
        grow = bq * s_vsb + h * s_vsh + off * s_vst  # [N]: token rows of the scale planes
        v = tl.fma(code, group_rows(vs, grow, live, N, D, 32), group_rows(vz, grow, live, N, D, 32))
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new
    if HAS_HP:  # the high-precision pages (sinks, recent window): chunks of HP_PAGES pages, skipped whole
        # where none is hp, else page by page
        qd = q.to(DOT)
        p0 = start // PAGE
        for pc in range(p0, tl.cdiv(end, PAGE), HP_PAGES):
            pj = pc + tl.arange(0, HP_PAGES)
            cb = tl.load(table + pj, mask=pj * PAGE < end, other=0)
            if tl.min(cb) < 0:
                for t0 in range(tl.maximum(pc * PAGE, start), tl.minimum((pc + HP_PAGES) * PAGE, end), HN):
                    bid = tl.load(table + t0 // PAGE)
                    if bid < 0:
                        ih = tl.arange(0, HN)
                        hrow = (-bid - 1).to(tl.int64) * s_hb + h * s_hh + (t0 % PAGE + ih).to(tl.int64) * s_ht
                        kh = tl.load(khp + hrow[:, None] + c[None, :]).to(DOT)
                        s = tl.dot(qd, tl.trans(kh))
                        valid = t0 + ih < end
                        m_new, alpha, p, l_i = softmax_step(tl.where(valid[None, :], s * qk_scale, float("-inf")),
                                                             m_i, l_i)
                        vh = tl.load(vhp + hrow[:, None] + c[None, :]).to(DOT)
                        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), vh)
                        m_i = m_new

    row = partial_rows(b, h, g, sp, split_base, split_total, GROUP)
    l_safe, lse = finish(l_i, m_i)
    tl.store(po_ptr + row[:, None] * D + c[None, :], acc / l_safe[:, None], mask=gmask[:, None])
    tl.store(plse_ptr + row, lse, mask=gmask)


def launch(q, layer: LayerKV, tables, lens, has_hp: bool, po, plse, base: int, qk_scale: float, splits: int,
           dot, num_warps: int = 4, num_stages: int = 2, g_pad: int | None = None, tile: int | None = None) -> None:
    """One split-K launch over a KIVI layer (:func:`serves`) into partial results at splits
    ``base, ...`` of ``po`` / ``plse`` (natural channel order); ``tile``: tokens a tile of the quantized
    pass (default :func:`tile_tokens`; rounded up to a power-of-two multiple of :func:`base_tokens`)."""
    B, Hq, D = q.shape
    hn = base_tokens(layer)
    tile = hn * triton.next_power_of_2(-(-tile // hn)) if tile else tile_tokens(layer)
    H = layer.num_kv_heads
    group = Hq // H
    kp, vp = layer.k, layer.v
    ks, vs_ = kp["scale"].stride(), vp["scale"].stride()
    _decode_kivi_kernel[(B, H, splits)](
        q, q.stride(0), q.stride(1),
        kp["data"], kp["scale"], kp["zero"], layer.k_hp, vp["data"], vp["scale"], vp["zero"], layer.v_hp,
        *kp["data"].stride()[:3], ks[0], ks[1], ks[2],
        *vp["data"].stride()[:3], vs_[0], vs_[1], vs_[2],
        *layer.k_hp.stride()[:3],
        tables, tables.stride(0), lens, po, plse, splits, qk_scale, base, po.shape[2],
        GROUP=group, G_PAD=g_pad or max(16, triton.next_power_of_2(group)), D=D, PAGE=layer.block_size,
        BITS=layer.fmt.k.bits, HAS_HP=bool(has_hp), DOT=dot, K_TOKEN=layer.fmt.k.scale == "token_group",
        N=tile, HN=hn, HP_PAGES=HP_PAGES,
        num_warps=num_warps, num_stages=num_stages,
    )
