"""Paged decode attention in Triton: split-K over the context, GQA, every format.

One program per (sequence, KV head, split).  It loads the query rows of the
KV head's whole group once (padded to 16 rows for the MMA), walks its share of
the context a tile of ``BLOCK_N`` tokens at a time, reads each tile through
:func:`kvq.attention.triton.tiles.load_tile` (stored format, dequantized in
registers, high-precision blocks in the same pass), and keeps an online
softmax.  Each split writes its partial output and log-sum-exp; a second
kernel merges the splits.  Each KV head's bytes are read once per step.

    q        [B, Hq, D]       bf16/fp16
    tables   [B, max_blocks]  int32, signed (kvq.cache.pool)
    seq_lens [B]              int32
    out      [B, Hq, D]       q's dtype
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvq.attention.triton import decode_kivi
from kvq.attention.triton.splitk import finish, partial_rows, program_share, softmax_step
from kvq.attention.triton.tiles import (ROT, ROT_C, format_code, hp_rows, load_tile, rot_mags, rot_mean, rot_table,
                                       rot_tile, tile_channel)
from kvq.cache.pool import LayerKV

_LOG2E = 1.4426950408889634
#: Running under TRITON_INTERPRET=1 (CPU CI): kernels execute in numpy.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# the table width and split count change step to step, the table and length views' alignment too
# (eager steps: a recompile in bf16's wave on the H200): no recompile for any
@triton.jit(do_not_specialize=["s_tb", "num_splits", "split_base", "split_total"],
            do_not_specialize_on_alignment=["table_ptr", "lens_ptr"])
def _decode_split_kernel(
    q_ptr, s_qb, s_qh,
    qr_ptr,  # rotated K: the queries rotated by K's rotation, float32 [B, Hq, D] contiguous (else q_ptr)
    kd, ks, kz, khp, kst, vd, vs, vz, vhp, vst,
    s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst, s_kzb,
    s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb,
    s_hb, s_hh, s_ht,
    table_ptr, s_tb, lens_ptr,
    po_ptr, plse_ptr, num_splits,
    qk_scale,  # sm_scale * log2(e)
    split_base, split_total,  # this launch's splits are [split_base, + num_splits) of split_total per row
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    K_FMT: tl.constexpr, K_PER: tl.constexpr, V_FMT: tl.constexpr, V_PER: tl.constexpr,
    K_G: tl.constexpr, V_G: tl.constexpr, HAS_HP: tl.constexpr, DOT: tl.constexpr, PO_NATURAL: tl.constexpr,
):
    b, h, sp, start, end = program_share(lens_ptr, num_splits, BLOCK_N)

    g = tl.arange(0, G_PAD)
    gmask = g < GROUP
    pos = tl.arange(0, D)
    q_rows = q_ptr + b.to(tl.int64) * s_qb + (h * GROUP + g)[:, None] * s_qh
    q = tl.load(q_rows + tile_channel(pos, K_PER, D)[None, :], mask=gmask[:, None], other=0.0).to(DOT)

    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    c = tl.arange(0, D)
    if K_FMT >= ROT:  # rotated K: scores in the rotated domain, q rotated once (q . (u R)^T = (q R^T) . u^T)
        qr_rows = qr_ptr + (b * tl.num_programs(1) * GROUP + h * GROUP + g).to(tl.int64)[:, None] * D
        q_r = tl.load(qr_rows + pos[None, :], mask=gmask[:, None], other=0.0).to(DOT)
        k_mags = rot_mags(kst, D, K_FMT)
    if V_FMT >= ROT:  # rotated V: its share of the output summed in the rotated domain, rotated back at the end
        acc_r = tl.zeros((G_PAD, D), tl.float32)
        v_mags = rot_mags(vst, D, V_FMT)
    table = table_ptr + b.to(tl.int64) * s_tb
    # rows past the split's end read its first block (masked to -inf, they weigh 0): a block of this
    # format, whose values are finite (block 0 of a tier's view of an arena may hold another tier's bytes)
    first = tl.load(table + start // PAGE, mask=start < end, other=0)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        valid = t < end
        bid = tl.load(table + t // PAGE, mask=valid, other=0)
        bid = tl.where(valid, bid, first)
        off = t % PAGE
        if K_FMT >= ROT:
            lev, k_sc = rot_tile(kd, ks, k_mags, s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst, bid, off, h, D, K_FMT, DOT)
            s = tl.dot(q_r, tl.trans(lev)) * k_sc[None, :]
            if K_FMT >= ROT_C:
                s += tl.dot(q, tl.trans(rot_mean(kz, s_kzb, s_ksh, bid, off, h, D, K_G).to(DOT)))
            if HAS_HP:
                if tl.min(bid, axis=0) < 0:
                    kh = hp_rows(khp, s_hb, s_hh, s_ht, bid, off, h, D, DOT)
                    s = tl.where((bid < 0)[None, :], tl.dot(q, tl.trans(kh)), s)
            s = s * qk_scale
        else:
            k, k_sc = load_tile(kd, ks, kz, khp, kst, s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst, s_kzb, s_hb, s_hh, s_ht,
                                bid, off, h, valid, BLOCK_N, D, K_FMT, K_PER, K_G, HAS_HP, DOT)
            s = tl.dot(q, tl.trans(k)) * (k_sc * qk_scale)[None, :]
        m_new, alpha, p, l_i = softmax_step(tl.where(valid[None, :], s, float("-inf")), m_i, l_i)
        if V_FMT >= ROT:
            lev, v_sc = rot_tile(vd, vs, v_mags, s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, bid, off, h, D, V_FMT, DOT)
            acc = acc * alpha[:, None]
            if HAS_HP:
                is_hp = (bid < 0)[None, :]
                if tl.min(bid, axis=0) < 0:
                    vh = hp_rows(vhp, s_hb, s_hh, s_ht, bid, off, h, D, DOT)
                    acc += tl.dot(tl.where(is_hp, p, 0.0).to(DOT), vh)
                p = tl.where(is_hp, 0.0, p)
            if V_FMT >= ROT_C:
                acc += tl.dot(p.to(DOT), rot_mean(vz, s_vzb, s_vsh, bid, off, h, D, V_G).to(DOT))
            acc_r = acc_r * alpha[:, None] + tl.dot((p * v_sc[None, :]).to(DOT), lev)
        else:
            v, v_sc = load_tile(vd, vs, vz, vhp, vst, s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_vzb, s_hb, s_hh, s_ht,
                                bid, off, h, valid, BLOCK_N, D, V_FMT, V_PER, V_G, HAS_HP, DOT)
            pv = (p * v_sc[None, :]).to(DOT)
            acc = acc * alpha[:, None] + tl.dot(pv, v)
        m_i = m_new
    if V_FMT >= ROT:
        acc += tl.dot(acc_r, tl.load(vst + D * D + c[:, None] * D + c[None, :]), input_precision="tf32x3")

    # partial results: out [B, Hq, S, D] in V's tile order (PO_NATURAL: in channel order, so that parts
    # of other formats merge with it), lse [B, Hq, S] (log2 domain)
    row = partial_rows(b, h, g, sp, split_base, split_total, GROUP)
    l_safe, lse = finish(l_i, m_i)
    chan = tile_channel(pos, V_PER, D) if PO_NATURAL else pos
    tl.store(po_ptr + row[:, None] * D + chan[None, :], acc / l_safe[:, None], mask=gmask[:, None])
    tl.store(plse_ptr + row, lse, mask=gmask)


@triton.jit(do_not_specialize=["num_splits", "Hq"])
def _decode_reduce_kernel(
    po_ptr, plse_ptr, o_ptr, s_ob, s_oh, num_splits, Hq,
    S_TILE: tl.constexpr, D: tl.constexpr, V_PER: tl.constexpr,
):
    """One program per (sequence, query head): the splits' partial outputs merged by their
    log-sum-exps, S_TILE splits at a time with a running maximum, so that no compiled
    variant depends on the split count (it changes with the step's longest context)."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    base = (b * Hq + hq).to(tl.int64) * num_splits
    pos = tl.arange(0, D)
    m = float("-inf")
    wsum = 0.0
    acc = tl.zeros([D], dtype=tl.float32)
    for s0 in range(0, num_splits, S_TILE):
        s = s0 + tl.arange(0, S_TILE)
        smask = s < num_splits
        lse = tl.load(plse_ptr + base + s, mask=smask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        w = tl.where(smask, tl.exp2(lse - m_ref), 0.0)
        po = tl.load(po_ptr + (base + s)[:, None] * D + pos[None, :], mask=smask[:, None], other=0.0)
        acc = acc * alpha + tl.sum(po * w[:, None], axis=0)
        wsum = wsum * alpha + tl.sum(w, axis=0)
        m = m_new
    out = acc / tl.maximum(wsum, 1e-30)
    chan = tile_channel(pos, V_PER, D)
    tl.store(o_ptr + b.to(tl.int64) * s_ob + hq * s_oh + chan, out.to(o_ptr.dtype.element_ty))


def _plane(planes: dict[str, torch.Tensor], name: str, fallback: torch.Tensor) -> torch.Tensor:
    return planes.get(name, fallback)


def _scale_strides(fmt_code: int, planes: dict[str, torch.Tensor]) -> tuple[int, int, int, int]:
    """Block, head and token strides of the scale plane, then the zero plane's block stride (a centred
    K's means have a layout of their own)."""
    t, z = planes.get("scale"), planes.get("zero")
    zb = z.stride(0) if z is not None else 0
    if t is None:
        return 0, 0, 0, zb
    st = list(t.stride()) + [0, 0]
    return st[0], st[1], st[2] if t.dim() >= 3 else 0, zb


def static_arg(layer: LayerKV, role: str) -> torch.Tensor:
    """What the kernels read as a role's static table: its static scales, or a rotated codebook's
    rotation, levels and thresholds (kvq.attention.triton.tiles.rot_table)."""
    fmt = layer.tensor_format(role)
    if fmt.family == "rot":
        return rot_table(fmt, layer.head_dim, layer.k_hp.device)
    return layer.static_scale(role)


def tile_per(fmt) -> int:
    """Values a byte of a tensor format's tile order (kvq.attention.triton.tiles.tile_channel); 1: natural."""
    return 1 if fmt.family == "rot" else fmt.values_per_byte


def layer_args(layer: LayerKV) -> tuple[list, dict]:
    """Pointer/stride arguments and constexprs describing a layer's K and V pools."""
    args, meta = [], {}
    for role in ("k", "v"):
        planes, fmt = layer.planes(role), layer.tensor_format(role)
        data = planes["data"]
        args += [data, _plane(planes, "scale", data), _plane(planes, "zero", data), layer.hp(role),
                 static_arg(layer, role)]
        meta[f"{role}_fmt"] = format_code(fmt)
        meta[f"{role}_per"] = tile_per(fmt)
        meta[f"{role}_g"] = fmt.group_size or 1
    strides = []
    for role in ("k", "v"):
        planes = layer.planes(role)
        d = planes["data"].stride()
        strides += [d[0], d[1], d[2], *_scale_strides(0, planes)]
    hp = layer.k_hp.stride()
    strides += [hp[0], hp[1], hp[2]]
    return args + strides, meta


def _dot_dtype(dtype: torch.dtype):
    if INTERPRET:  # Triton's CPU interpreter computes bf16 tl.dot wrongly; fp32 checks the logic
        return tl.float32
    if dtype == torch.bfloat16:
        return tl.bfloat16
    if dtype == torch.float16:
        return tl.float16
    raise ValueError(f"the Triton kernels take bf16 or fp16 queries, got {dtype}")


def launch_defaults(layer: LayerKV) -> tuple[int, int, bool]:
    """(BLOCK_N, num_stages, split_always) by stored width, from the H200 sweeps
    recorded in docs/kernels.md: 16-bit pools 64/2 and split the context only when
    there are too few (sequence, head) pairs to fill the GPU; 8-bit pools 128/4 and
    always split to ~8 programs per SM; packed sub-byte 64/2 (KIVI: its own kernel, 64/2), split like 8-bit; rotated
    K 64/1 (chosen by shared memory, not yet swept on the H200)."""
    bits = min(layer.fmt.k.bits, layer.fmt.v.bits)
    if decode_kivi.serves(layer):  # KIVI groups a tile (kvq.attention.triton.decode_kivi)
        return decode_kivi.tile_tokens(layer), decode_kivi.NUM_STAGES, True
    if layer.fmt.k.family == "rot":  # rotated K: its level gather pipelined in 2 stages doubles shared memory
        return 64, 1, True          # (Triton 3.6, head_dim 128: 131 KB, one block an SM; 1 stage: 68 KB)
    if bits == 16:
        return 64, 2, False
    if bits == 8:
        return 128, 4, True
    return 64, 2, True


def choose_splits(batch_heads: int, max_len: int, block_n: int, num_sms: int = 132,
                  split_always: bool = True, programs_per_sm: int = 8) -> tuple[int, int]:
    """(num_splits, tokens_per_split).  Splitting aims at ``programs_per_sm``
    programs per SM so the last wave is a small part of the work (always, or only
    when ``batch_heads < 2 * num_sms``); each split is a whole number of tiles and
    no shorter than 4 tiles."""
    if split_always or batch_heads < 2 * num_sms:
        want = max(1, math.ceil(programs_per_sm * num_sms / max(batch_heads, 1)))
    else:
        want = 1
    tiles = max(1, math.ceil(max_len / block_n))
    splits = max(1, min(want, tiles // 4 or 1))
    tps = math.ceil(tiles / splits) * block_n
    return math.ceil(max_len / tps), tps


class DecodePart(NamedTuple):
    """One launch of a decode step: a layer (or a tier's view of it) and the tables that point into it."""

    layer: LayerKV
    tables: torch.Tensor
    lens: torch.Tensor
    longest: int  # host upper bound of lens
    has_hp: bool


def decode_parts(layer: LayerKV, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int | None,
                 has_hp: bool | None, tiers=None) -> list[DecodePart]:
    """The launches of one decode: the layer itself, or with ``tiers`` (kvq.cache.step.TierTables) its hp
    and resident blocks, then each lower tier's blocks (the tiers' tables hold no hp block).  A length
    bound or hp flag not given is read from the tables (the bound: one device sync)."""
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    has_hp = layer.k_hp.shape[0] > 0 if has_hp is None else bool(has_hp)
    if tiers is None:
        return [DecodePart(layer, block_tables, seq_lens, max_seq_len, has_hp)]
    return [DecodePart(layer, tiers.base_tables, tiers.base_lens, tiers.base_max_len, has_hp)] + [
        DecodePart(layer.tier(t), tab, lens, mx, False) for t, tab, lens, mx in tiers.tiers]


def _num_sms(q: torch.Tensor) -> int:
    return torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4


def part_splits(q: torch.Tensor, part: DecodePart, block_n: int | None = None) -> int:
    """The split count of one part's Triton launch (:func:`launch_part`)."""
    auto_n, _, split_always = launch_defaults(part.layer)
    return choose_splits(q.shape[0] * part.layer.num_kv_heads, max(int(part.longest), 1), block_n or auto_n,
                         _num_sms(q), split_always)[0]


def launch_part(q: torch.Tensor, part: DecodePart, po: torch.Tensor, plse: torch.Tensor, base: int,
                sm_scale: float, splits: int, natural: bool, block_n: int | None = None, num_warps: int = 4,
                num_stages: int | None = None, g_pad: int | None = None) -> None:
    """One part's split-K launch: its ``splits`` partial results at splits ``base, ...`` of ``po`` /
    ``plse`` ([B, Hq, S, D] / [B, Hq, S] float32); ``natural``: channels in natural order (parts of
    several formats merge), else in V's tile order."""
    lay = part.layer
    B, Hq, D = q.shape
    auto_n, auto_stages, _ = launch_defaults(lay)
    if decode_kivi.serves(lay):  # KIVI's own kernel (whole groups a tile, natural channel order)
        decode_kivi.launch(q, lay, part.tables, part.lens, part.has_hp, po, plse, base, sm_scale * _LOG2E, splits,
                           _dot_dtype(q.dtype), num_warps, num_stages or auto_stages, g_pad, block_n)
        return
    args, meta = layer_args(lay)
    q_rot = q
    if lay.fmt.k.family == "rot":  # q @ R^T: the rotated domain's query (one small product, not one a tile)
        q_rot = (q.float() @ static_arg(lay, "k")[:D * D].view(D, D)).contiguous()
    group = Hq // lay.num_kv_heads
    _decode_split_kernel[(B, lay.num_kv_heads, splits)](
        q, q.stride(0), q.stride(1), q_rot, *args,
        part.tables, part.tables.stride(0), part.lens, po, plse, splits, sm_scale * _LOG2E, base, po.shape[2],
        GROUP=group, G_PAD=g_pad or max(16, triton.next_power_of_2(group)), D=D, PAGE=lay.block_size,
        BLOCK_N=block_n or auto_n, K_FMT=meta["k_fmt"], K_PER=meta["k_per"], V_FMT=meta["v_fmt"],
        V_PER=meta["v_per"], K_G=meta["k_g"], V_G=meta["v_g"], HAS_HP=bool(part.has_hp), DOT=_dot_dtype(q.dtype),
        PO_NATURAL=natural, num_warps=num_warps, num_stages=num_stages or auto_stages,
    )


def run_parts(q: torch.Tensor, parts: list[DecodePart], splits: list[int], launch, v_per: int = 1,
              merger: int | None = None) -> torch.Tensor:
    """One decode as launches into one set of partial results, merged by log-sum-exp: ``launch(part, po,
    plse, base, n)`` writes part ``i``'s ``n = splits[i]`` splits from split ``base`` on (each part by
    the kernel of its format: kvq.attention.cuda.kernels runs the CUDA one where it reads the part).
    ``merger``: the part (of one split) that runs last and merges every other's partials itself,
    ``launch(part, po, plse, S, 1, merge_into=out)`` returning ``out``; else a reduce launch merges."""
    order = [i for i in range(len(parts)) if i != merger]
    po, plse = partial_buffers(q, sum(splits[i] for i in order))
    base = 0
    for i in order:
        launch(parts[i], po, plse, base, splits[i])
        base += splits[i]
    if merger is not None:
        return launch(parts[merger], po, plse, base, 1, merge_into=torch.empty_like(q))
    return merge_parts(po, plse, torch.empty_like(q), v_per)


def partial_buffers(q: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial results of ``splits`` splits a row for a decode of ``q`` [B, Hq, D]: outputs [B, Hq, S, D]
    and log2-domain log-sum-exps [B, Hq, S], float32."""
    B, Hq, D = q.shape
    return (torch.empty(B, Hq, splits, D, dtype=torch.float32, device=q.device),
            torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device))


def merge_parts(po: torch.Tensor, plse: torch.Tensor, out: torch.Tensor, v_per: int = 1) -> torch.Tensor:
    """Merge the partial results of every launch by their log-sum-exps into ``out`` [B, Hq, D]
    (``v_per``: the values per byte of V's tile order the partials are in; 1: natural order)."""
    B, Hq = out.shape[:2]
    _decode_reduce_kernel[(B, Hq)](po, plse, out, out.stride(0), out.stride(1), po.shape[2], Hq,
                                   S_TILE=16, D=out.shape[2], V_PER=v_per)
    return out


def paged_decode(
    q: torch.Tensor,
    layer: LayerKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    max_seq_len: int | None = None,
    has_hp: bool | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    g_pad: int | None = None,
    tiers=None,
) -> torch.Tensor:
    """Triton twin of :func:`kvq.attention.reference.paged_decode`.

    ``tiers`` (kvq.cache.step.TierTables, a tiered cache whose tables hold lower tiers' blocks):
    each part (the hp and resident blocks, then each lower tier's) runs its own format's split
    launch into one set of partial results, which one reduction merges by log-sum-exp.

    ``max_seq_len`` (host int, an upper bound of ``seq_lens``) sizes the split grid
    without a device sync; pass it from the scheduler (a CUDA graph passes the
    longest length it serves).  Each sequence splits its own length over the
    ``num_splits`` programs.  ``g_pad`` pads the query group to that many rows
    (default 16, the smallest MMA; 64 makes Triton use wgmma, measured slower).
    ``has_hp=False`` compiles out the high-precision
    path when no table holds an hp block.
    """
    B, Hq, D = q.shape
    H = layer.num_kv_heads
    assert Hq % H == 0 and D == layer.head_dim, (Hq, H, D, layer.head_dim)
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    parts = decode_parts(layer, block_tables, seq_lens, max_seq_len, has_hp, tiers)
    splits = [num_splits or part_splits(q, part, block_n) for part in parts]
    natural = len(parts) > 1

    def launch(part, po, plse, base, n):
        launch_part(q, part, po, plse, base, sm_scale, n, natural, block_n, num_warps, num_stages, g_pad)

    v_per = 1 if natural or decode_kivi.serves(layer) else tile_per(layer.fmt.v)
    return run_parts(q, parts, splits, launch, v_per)
