"""The Triton KIVI decode with one dot a bit plane (kvq.attention.triton.decode_kivi.PLANES).

decode_kivi's kernel unpacks a tile's packed rows into ``[N, PER, DP]`` codes and reshapes them to
``[N, D]`` (natural channel order) before its dots; Triton makes that reshape, and the dot operands
after it, through shared memory (sm_90 static count, Triton 3.9, int4_kivi, 64-token tile: 1927
instructions a thread, of them 480 PRMT, 267 LDS and 130 STS).  Here the codes stay
``[PER, N, DP]``: plane p holds channels ``p * DP + j``, the query is loaded the same way
(``[PER, G, DP]``), the scores are a batched dot summed over the planes, the output accumulates per
plane (``[PER, G, DP]``) and is stored to its natural channels at the end.  The scales follow the
codes: K's per-channel rows (or per-token groups) and V's per-token groups are read per plane and
broadcast over their tokens or channels.  Same loop otherwise (no branch in it; hp rows masked, then a
pass over the hp pages in the model's dtype, planes too).  Static count of the same loop: 1498.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvq.attention.triton.splitk import finish, partial_rows, program_share, softmax_step
from kvq.attention.triton.tiles import codes_f16


@triton.jit
def _plane_codes(ptr, row, jj, pp, BITS: tl.constexpr):
    """[PER, N, DP] int32 codes of the packed rows at element offsets ``row`` [N]: plane p, byte j."""
    x = tl.load(ptr + row[:, None] + jj[None, :]).to(tl.int32)  # [N, DP]
    return (x[None, :, :] >> (pp * BITS)[:, None, None]) & ((1 << BITS) - 1)


@triton.jit
def _token_groups(ptr, grow, live, pp, N: tl.constexpr, DP: tl.constexpr):
    """[PER, N, DP]: per-token values of each 32-channel group (element offsets ``grow`` [N]) broadcast
    over the group's channels of each plane; 0 on rows not ``live``."""
    PER: tl.constexpr = pp.shape[0]
    if DP >= 32:  # a plane holds DP / 32 groups
        NGP: tl.constexpr = DP // 32
        gofs = pp[:, None, None] * NGP + tl.arange(0, NGP)[None, None, :]  # [PER, 1, NGP]
        x = tl.load(ptr + grow[None, :, None] + gofs, mask=live[None, :, None], other=0.0)  # [PER, N, NGP]
        return tl.reshape(tl.broadcast_to(x[:, :, :, None], (PER, N, NGP, 32)), (PER, N, DP))
    # a group holds 32 / DP planes (int2 at head_dim 64)
    x = tl.load(ptr + grow[None, :, None] + (pp * DP // 32)[:, None, None], mask=live[None, :, None], other=0.0)
    return tl.broadcast_to(x, (PER, N, DP))


# the table width and split count change step to step, the table and length views' alignment too
@triton.jit(do_not_specialize=["s_tb", "num_splits", "split_base", "split_total"],
            do_not_specialize_on_alignment=["table_ptr", "lens_ptr"])
def decode_kivi_planes_kernel(
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
    HP_PAGES: tl.constexpr, MAGIC: tl.constexpr,
):
    b, h, sp, start, end = program_share(lens_ptr, num_splits, N)
    DP: tl.constexpr = D * BITS // 8
    PER: tl.constexpr = 8 // BITS
    g = tl.arange(0, G_PAD)
    gmask = g < GROUP
    i = tl.arange(0, N)
    pp = tl.arange(0, PER)
    jj = tl.arange(0, DP)
    ch3 = pp[:, None, None] * DP + jj[None, None, :]  # [PER, 1, DP]: the planes' natural channels
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + (h * GROUP + g)[None, :, None] * s_qh + ch3,
                mask=gmask[None, :, None], other=0.0)  # [PER, G_PAD, DP]
    q_code = q.to(tl.float16)

    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((PER, G_PAD, DP), tl.float32)
    table = table_ptr + b.to(tl.int64) * s_tb
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
        code = codes_f16(_plane_codes(kd, bq * s_kdb + h * s_kdh + off * s_kdt, jj, pp, BITS), MAGIC)
        if K_TOKEN:  # scaled per token and 32 channels
            grow = bq * s_ksb + h * s_ksh + off * s_kst
            k = tl.fma(code, _token_groups(ks, grow, live, pp, N, DP), _token_groups(kz, grow, live, pp, N, DP))
        else:  # per channel over each 32-token group: [PER, N // 32, DP] rows broadcast over their tokens
            NGT: tl.constexpr = N // 32
            tg = t0 + tl.arange(0, NGT) * 32
            bg = tl.load(table + tg // PAGE, mask=tg < end, other=0)
            if HAS_HP:
                bg = tl.maximum(bg, 0)
            srow = (bg.to(tl.int64) * s_ksb + h * s_ksh + ((tg % PAGE) // 32) * s_kst)[None, :, None] + ch3
            sc = tl.reshape(tl.broadcast_to(tl.load(ks + srow)[:, :, None, :], (PER, NGT, 32, DP)), (PER, N, DP))
            zc = tl.reshape(tl.broadcast_to(tl.load(kz + srow)[:, :, None, :], (PER, NGT, 32, DP)), (PER, N, DP))
            k = tl.fma(code, sc, zc)
        s = tl.sum(tl.dot(q_code, tl.permute(k, (0, 2, 1))), axis=0)  # [G_PAD, N]
        m_new, alpha, p, l_i = softmax_step(tl.where(live[None, :], s * qk_scale, float("-inf")), m_i, l_i)
        code = codes_f16(_plane_codes(vd, bq * s_vdb + h * s_vdh + off * s_vdt, jj, pp, BITS), MAGIC)
        grow = bq * s_vsb + h * s_vsh + off * s_vst  # [N]: token rows of the scale planes
        v = tl.fma(code, _token_groups(vs, grow, live, pp, N, DP), _token_groups(vz, grow, live, pp, N, DP))
        p3 = tl.broadcast_to(p.to(tl.float16)[None, :, :], (PER, G_PAD, N))
        acc = acc * alpha[None, :, None] + tl.dot(p3, v)
        m_i = m_new
    if HAS_HP:  # the high-precision pages (sinks, recent window), as decode_kivi's pass, in planes
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
                        kh = tl.load(khp + hrow[None, :, None] + ch3).to(DOT)  # [PER, HN, DP]
                        s = tl.sum(tl.dot(qd, tl.permute(kh, (0, 2, 1))), axis=0)
                        valid = t0 + ih < end
                        m_new, alpha, p, l_i = softmax_step(tl.where(valid[None, :], s * qk_scale, float("-inf")),
                                                             m_i, l_i)
                        vh = tl.load(vhp + hrow[None, :, None] + ch3).to(DOT)
                        p3 = tl.broadcast_to(p.to(DOT)[None, :, :], (PER, G_PAD, HN))
                        acc = acc * alpha[None, :, None] + tl.dot(p3, vh)
                        m_i = m_new

    row = partial_rows(b, h, g, sp, split_base, split_total, GROUP)
    l_safe, lse = finish(l_i, m_i)
    tl.store(po_ptr + row[None, :, None] * D + ch3, acc / l_safe[None, :, None], mask=gmask[None, :, None])
    tl.store(plse_ptr + row, lse, mask=gmask)
