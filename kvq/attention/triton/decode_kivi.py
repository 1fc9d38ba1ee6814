"""Paged decode attention over KIVI pools in Triton, channels in natural order.

The generic decode (kvq.attention.triton.decode) dequantizes every K and V tile
element by element, gathering a scale and a zero point for each of its values;
on the H200 that ran KIVI at 8-9% of copy bandwidth (0.29x bf16 at 4x131072,
docs/results/bench_decode_kivi_s20_h200.json).  This kernel moves the scales
and zero points to the other operand, as the CUDA decode does
(kvq/attention/cuda/decode8.cu), so a tile's codes enter the dot products as
exact integers:

    K (scale s_c, zero z_c per channel over the tile's 32-token group):
        q . k_n = sum_c (q_c s_c) code_nc + sum_c q_c z_c
    K per token (int4_per_token, int2_per_token: like V):
        q . k_n = sum_j s_nj (sum_{c in j} q_c code_nc) + sum_j z_nj (sum_{c in j} q_c)
    V (scale s_nj, zero z_nj per token over channel group j of 32):
        o_c = sum_n (p_n s_nj) code_nc + sum_n p_n z_nj          (j = c // 32)

A tile is one 32-token group, so one page (pages hold whole groups) and one
block id: the whole tile is quantized or high precision (sinks, recent window).
V's groups are the batch of a 3-D dot: [groups, queries, tokens] x [groups,
tokens, 32] -> [groups, queries, 32] (per-token K's too: [groups, queries, 32] x [groups,
32, tokens], its groups' scores scaled per token and summed).  Codes are read in natural channel order
(channel c is bit plane c // DP of byte c % DP), so the query, the outputs and
the partial results need no tile-order map.

    q        [B, Hq, D]       bf16/fp16
    tables   [B, max_blocks]  int32, signed (kvq.cache.pool)
    seq_lens [B]              int32
    partials [B, Hq, S, D] float32 (natural order) and [B, Hq, S] log2-domain log-sum-exps
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvq.attention.triton.splitk import finish, partial_rows, program_share, softmax_step
from kvq.cache.pool import LayerKV

#: Tokens a tile: one KIVI group (the kernel's scale rows are per group).
GROUP_TOKENS = 32


def serves(layer: LayerKV) -> bool:
    """Whether this kernel reads the layer: K KIVI per channel (or per token) and V KIVI per token, in groups
    of 32 and of one width (int4_kivi, int2_kivi, int4_per_token, int2_per_token), pages of whole groups,
    at least 16 packed bytes a row."""
    k, v = layer.fmt.k, layer.fmt.v
    return (k.family == "kivi" and v.family == "kivi" and k.scale in ("channel_group", "token_group")
            and v.scale == "token_group"
            and k.group_size == v.group_size == GROUP_TOKENS and k.bits == v.bits and k.bits in (2, 4)
            and layer.block_size % tile_tokens(layer) == 0 and layer.head_dim % GROUP_TOKENS == 0
            and layer.head_dim * k.bits // 8 >= 16)


def tile_tokens(layer: LayerKV) -> int:
    """Tokens a tile: a KIVI K group (32), or with K per token 16 where pages hold 16."""
    return 16 if layer.fmt.k.scale == "token_group" and layer.block_size % 32 else GROUP_TOKENS


@triton.jit
def _codes(ptr, row, col, D: tl.constexpr, BITS: tl.constexpr):
    """Codes (int32) at element offsets ``row`` (broadcast over the trailing axes) of natural channels
    ``col``: channel c is bit plane c // DP of byte c % DP (DP = D * BITS / 8, planar packing)."""
    DP: tl.constexpr = D * BITS // 8
    x = tl.load(ptr + row + col % DP).to(tl.int32)
    return (x >> ((col // DP) * BITS)) & ((tl.constexpr(1) << BITS) - 1)


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
    HAS_HP: tl.constexpr, DOT: tl.constexpr, K_TOKEN: tl.constexpr, N: tl.constexpr,
):
    NG: tl.constexpr = D // 32
    b, h, sp, start, end = program_share(lens_ptr, num_splits, N)

    g = tl.arange(0, G_PAD)
    gmask = g < GROUP
    c = tl.arange(0, D)
    i = tl.arange(0, N)
    ch = tl.arange(0, 32)
    j = tl.arange(0, NG)
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + (h * GROUP + g)[:, None] * s_qh + c[None, :],
                mask=gmask[:, None], other=0.0).to(tl.float32)
    vcol = (j[:, None, None] * 32 + ch[None, None, :])  # [NG, 1, 32]: V's channels, group by group
    if K_TOKEN:  # the query group by group: [NG, G_PAD, 32], and each group's sum
        q3 = tl.load(q_ptr + b.to(tl.int64) * s_qb + (h * GROUP + g)[None, :, None] * s_qh + vcol,
                     mask=gmask[None, :, None], other=0.0).to(tl.float32)
        qsum = tl.sum(q3, axis=2)  # [NG, G_PAD]
        q3 = q3.to(DOT)

    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((NG, G_PAD, 32), tl.float32)
    zacc = tl.zeros((NG, G_PAD), tl.float32)
    table = table_ptr + b.to(tl.int64) * s_tb
    for t0 in range(start, end, N):
        bid = tl.load(table + t0 // PAGE)
        off = t0 % PAGE + i  # [N] rows of the page
        valid = t0 + i < end
        if HAS_HP and bid < 0:  # sinks / recent window: one high-precision page
            hrow = (-bid - 1).to(tl.int64) * s_hb + h * s_hh + off.to(tl.int64) * s_ht
            kh = tl.load(khp + hrow[:, None] + c[None, :]).to(DOT)
            s = tl.dot(q.to(DOT), tl.trans(kh))
        elif K_TOKEN:
            qb = bid.to(tl.int64)
            krow = qb * s_kdb + h * s_kdh + off.to(tl.int64) * s_kdt
            kcol = j[:, None, None] * 32 + ch[None, :, None]  # [NG, 32, 1]
            code = _codes(kd, krow[None, None, :], kcol, D, BITS).to(DOT)  # [NG, 32, N]
            s3 = tl.dot(q3, code)  # [NG, G_PAD, N]: each channel group's share of the scores
            grow = qb * s_ksb + h * s_ksh + off.to(tl.int64) * s_kst
            ksc = tl.load(ks + grow[None, :] + j[:, None]).to(tl.float32)  # [NG, N]
            kzr = tl.load(kz + grow[None, :] + j[:, None]).to(tl.float32)
            s = tl.sum(s3 * ksc[:, None, :] + qsum[:, :, None] * kzr[:, None, :], axis=0)
        else:
            qb = bid.to(tl.int64)
            srow = qb * s_ksb + h * s_ksh + ((t0 % PAGE) // 32) * s_kst  # (N = 32: one group)
            sc = tl.load(ks + srow + c).to(tl.float32)
            zr = tl.load(kz + srow + c).to(tl.float32)
            krow = qb * s_kdb + h * s_kdh + off.to(tl.int64) * s_kdt
            code = _codes(kd, krow[:, None], c[None, :], D, BITS).to(DOT)
            s = tl.dot((q * sc[None, :]).to(DOT), tl.trans(code)) + tl.sum(q * zr[None, :], axis=1)[:, None]
        m_new, alpha, p, l_i = softmax_step(tl.where(valid[None, :], s * qk_scale, float("-inf")), m_i, l_i)
        p3 = tl.broadcast_to(p[None, :, :], (NG, G_PAD, N))
        acc = acc * alpha[None, :, None]
        zacc = zacc * alpha[None, :]
        if HAS_HP and bid < 0:
            hrow = (-bid - 1).to(tl.int64) * s_hb + h * s_hh + off.to(tl.int64) * s_ht
            vh = tl.load(vhp + hrow[None, :, None] + vcol).to(DOT)  # [NG, N, 32]
            acc += tl.dot(p3.to(DOT), vh)
        else:
            qb = bid.to(tl.int64)
            vrow = qb * s_vdb + h * s_vdh + off.to(tl.int64) * s_vdt
            code = _codes(vd, vrow[None, :, None], vcol, D, BITS).to(DOT)  # [NG, N, 32]
            grow = qb * s_vsb + h * s_vsh + off.to(tl.int64) * s_vst  # [N]: token rows of the scale planes
            vsc = tl.load(vs + grow[None, :] + j[:, None]).to(tl.float32)  # [NG, N]
            vzr = tl.load(vz + grow[None, :] + j[:, None]).to(tl.float32)
            acc += tl.dot((p3 * vsc[:, None, :]).to(DOT), code)
            zacc += tl.sum(p3 * vzr[:, None, :], axis=2)
        m_i = m_new

    row = partial_rows(b, h, g, sp, split_base, split_total, GROUP)
    l_safe, lse = finish(l_i, m_i)
    o = (acc + zacc[:, :, None]) / l_safe[None, :, None]
    tl.store(po_ptr + row[None, :, None] * D + vcol, o, mask=gmask[None, :, None])
    tl.store(plse_ptr + row, lse, mask=gmask)


def launch(q, layer: LayerKV, tables, lens, has_hp: bool, po, plse, base: int, qk_scale: float, splits: int,
           dot, num_warps: int = 4, num_stages: int = 2, g_pad: int | None = None) -> None:
    """One split-K launch over a KIVI layer (:func:`serves`) into partial results at splits
    ``base, ...`` of ``po`` / ``plse`` (natural channel order)."""
    B, Hq, D = q.shape
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
        N=tile_tokens(layer),
        num_warps=num_warps, num_stages=num_stages,
    )
