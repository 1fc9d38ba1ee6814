"""Demotion in Triton: re-store whole blocks one tier down (elastic precision, kvq.cache.tiers).

Twin of :func:`kvq.attention.reference.demote_pairs`: each (block, KV head, role) program reads a
source block's ``[bs, D]`` K or V tile dequantized to float32 (the prefill scratch's page
reader), and quantizes it into the destination tier with the seal kernels' quantizer, so a
demoted block holds exactly the codes a seal of the dequantized values would write.  One
launch for a batch of blocks between one ordered pair of tiers in every layer of the same
formats (:func:`demote_layers`): a layer's planes are the first layer's moved by the distance
between their arenas (and static scales), so a step's demotions take one launch, not one a
layer (a block's tile is small and a launch lasts about as long as its longest program).

Floating-point contraction is off for this kernel: a KIVI value ``code * scale + zero`` must
round like the reference's separate multiply and add, not as one fma.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kvq.attention.triton.decode import layer_args
from kvq.attention.triton.dequant import _page_tile
from kvq.attention.triton.store import _quant_store, _role_args, _warps
from kvq.cache.pool import LayerKV
from kvq.cache.step import host_ids


@triton.jit
def _demote_role(sd, ss, sz, shp, sst, s_sdb, s_sdh, s_sdt, s_ssb, s_ssh, s_sst, s_szb, s_hb, s_hh, s_ht, src, h,
                 dd, ds, dz, dst_static, s_ddb, s_ddh, s_ddt, s_dsb, s_dsh, s_dst, s_dzb, dst,
                 PAGE: tl.constexpr, D: tl.constexpr, S_FMT: tl.constexpr, S_PER: tl.constexpr, S_G: tl.constexpr,
                 D_FMT: tl.constexpr, D_PER: tl.constexpr, D_G: tl.constexpr, D_QMAX: tl.constexpr):
    off = tl.arange(0, PAGE)
    x = _page_tile(sd, ss, sz, shp, sst, s_sdb, s_sdh, s_sdt, s_ssb, s_ssh, s_sst, s_szb, s_hb, s_hh, s_ht,
                   src, h, off, PAGE, D, S_FMT, S_PER, S_G)
    r = off.to(tl.int64)
    _quant_store(x, dd, ds, dz, dst_static, h, dst * s_ddb + h * s_ddh + r * s_ddt, dst * s_dsb + h * s_dsh + r * s_dst,
                 dst * s_dzb + h * (s_dsh * D // D_G), off >= 0, PAGE, D, D_FMT, D_PER, D_G, D_QMAX)


@triton.jit
def _at(p, delta):
    """``p`` moved by ``delta`` bytes: the same plane in another layer's arena (or static scales)."""
    return (p.to(tl.pointer_type(tl.int8)) + delta).to(p.dtype)


@triton.jit
def _demote_kernel(
    pairs, s_pair,  # [S, 2] (source block, destination block); destination < 0: skip
    deltas,  # [L, 5] int64 bytes from the first layer's: arena, static K / V of the source, of the destination
    skd, sks, skz, skhp, skst, svd, svs, svz, svhp, svst,
    s_skdb, s_skdh, s_skdt, s_sksb, s_sksh, s_skst, s_skzb,
    s_svdb, s_svdh, s_svdt, s_svsb, s_svsh, s_svst, s_svzb,
    s_hb, s_hh, s_ht,
    dkd, dks, dkz, dkst, dvd, dvs, dvz, dvst,
    s_dkdb, s_dkdh, s_dkdt, s_dksb, s_dksh, s_dkst, s_dkzb,
    s_dvdb, s_dvdh, s_dvdt, s_dvsb, s_dvsh, s_dvst, s_dvzb,
    PAGE: tl.constexpr, D: tl.constexpr,
    SK_FMT: tl.constexpr, SK_PER: tl.constexpr, SK_G: tl.constexpr,
    SV_FMT: tl.constexpr, SV_PER: tl.constexpr, SV_G: tl.constexpr,
    DK_FMT: tl.constexpr, DK_PER: tl.constexpr, DK_G: tl.constexpr, DK_QMAX: tl.constexpr,
    DV_FMT: tl.constexpr, DV_PER: tl.constexpr, DV_G: tl.constexpr, DV_QMAX: tl.constexpr,
):
    """One program per (pair, KV head, layer and role): K and V side by side, not one after the other (a
    block's tile is small: a program is one chain of dependent loads, reductions and stores, and the
    launch lasts about as long as its longest program)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    lr = tl.program_id(2)
    dst = tl.load(pairs + i * s_pair + 1).to(tl.int64)
    if dst >= 0:
        src = tl.load(pairs + i * s_pair)
        row = deltas + (lr // 2) * 5
        a = tl.load(row)
        if lr % 2 == 0:
            _demote_role(_at(skd, a), _at(sks, a), _at(skz, a), skhp, _at(skst, tl.load(row + 1)), s_skdb, s_skdh,
                         s_skdt, s_sksb, s_sksh, s_skst, s_skzb, s_hb, s_hh, s_ht, src, h, _at(dkd, a), _at(dks, a),
                         _at(dkz, a), _at(dkst, tl.load(row + 3)), s_dkdb, s_dkdh, s_dkdt, s_dksb, s_dksh, s_dkst,
                         s_dkzb, dst, PAGE, D, SK_FMT, SK_PER, SK_G, DK_FMT, DK_PER, DK_G, DK_QMAX)
        else:
            _demote_role(_at(svd, a), _at(svs, a), _at(svz, a), svhp, _at(svst, tl.load(row + 2)), s_svdb, s_svdh,
                         s_svdt, s_svsb, s_svsh, s_svst, s_svzb, s_hb, s_hh, s_ht, src, h, _at(dvd, a), _at(dvs, a),
                         _at(dvz, a), _at(dvst, tl.load(row + 4)), s_dvdb, s_dvdh, s_dvdt, s_dvsb, s_dvsh, s_dvst,
                         s_dvzb, dst, PAGE, D, SV_FMT, SV_PER, SV_G, DV_FMT, DV_PER, DV_G, DV_QMAX)


def demote_pairs(layer: LayerKV, pairs: torch.Tensor, src_tier: int, dst_tier: int,
                 num_warps: int | None = None) -> None:
    """Triton twin of :func:`kvq.attention.reference.demote_pairs`."""
    demote_layers([layer], pairs, src_tier, dst_tier, num_warps)


def demote_layers(layers: list[LayerKV], pairs: torch.Tensor, src_tier: int, dst_tier: int,
                  num_warps: int | None = None) -> None:
    """:func:`demote_pairs` in each of ``layers``: one launch for each run of layers whose tiers have the
    same formats (all of them, unless the plan mixes formats per layer)."""
    if pairs.shape[0] == 0 or not layers:
        return
    for group in _groups(layers, src_tier, dst_tier):
        _launch(group, pairs, src_tier, dst_tier, num_warps)


def _groups(layers: list[LayerKV], src_tier: int, dst_tier: int) -> list[list[LayerKV]]:
    """Layers in runs that one launch serves: the same source and destination formats, each an arena."""
    groups: list[list[LayerKV]] = []
    key = None
    for lay in layers:
        k = id(lay)  # (no arena: a launch of its own)
        if lay.arena is not None:  # (a tier's block stride: its planes' first stride)
            k = tuple((_tier(lay, t).fmt, _tier(lay, t).k["data"].stride(0)) for t in (src_tier, dst_tier))
        if groups and k == key:
            groups[-1].append(lay)
        else:
            groups.append([lay])
            key = k
    return groups


def _tier(lay: LayerKV, t: int):
    """Tier ``t``'s format and planes in a layer (LayerKV.tier without building a layer)."""
    return lay if t == 0 else lay.tiers[t - 1]


#: The launches' distance tables by the pointers they are computed from (so an entry never goes stale);
#: never dropped, since a captured CUDA graph reads the one it was captured with
_DELTAS: dict[tuple, torch.Tensor] = {}


def _deltas(layers: list[LayerKV], src_tier: int, dst_tier: int) -> torch.Tensor:
    """int64 [L, 5]: each layer's byte distances from the first's: arena, the source tier's static K and V
    tables, the destination's (0 for a rotated codebook's table: one per format, shared by the layers)."""
    def ptrs(lay):
        ref = [lay.arena.data_ptr() if lay.arena is not None else 0]
        for t in (src_tier, dst_tier):
            fmt = _tier(lay, t).fmt
            for role, tf in (("k", fmt.k), ("v", fmt.v)):
                ref.append(0 if tf.family == "rot" else lay.static_scale(role).data_ptr())
        return ref

    rows = [ptrs(lay) for lay in layers]
    key = (str(layers[0].k_hp.device), tuple(map(tuple, rows)))
    out = _DELTAS.get(key)
    if out is None:
        d = np.asarray(rows, np.int64) - np.asarray(rows[0], np.int64)
        out = _DELTAS[key] = host_ids(d.tolist(), torch.int64, layers[0].k_hp.device)  # (no stream sync)
    return out


def _launch(layers: list[LayerKV], pairs: torch.Tensor, src_tier: int, dst_tier: int, num_warps: int | None) -> None:
    layer = layers[0]
    src, dst = layer.tier(src_tier), layer.tier(dst_tier)
    args, sm = layer_args(src)
    kp, ks, km = _role_args(dst, "k")
    vp, vs, vm = _role_args(dst, "v")
    _demote_kernel[(pairs.shape[0], layer.num_kv_heads, 2 * len(layers))](
        pairs, pairs.stride(0), _deltas(layers, src_tier, dst_tier), *args, kp[0], kp[1], kp[2], kp[4], vp[0], vp[1],
        vp[2], vp[4], *ks, *vs,
        PAGE=layer.block_size, D=layer.head_dim,
        SK_FMT=sm["k_fmt"], SK_PER=sm["k_per"], SK_G=sm["k_g"], SV_FMT=sm["v_fmt"], SV_PER=sm["v_per"], SV_G=sm["v_g"],
        DK_FMT=km["fmt"], DK_PER=km["per"], DK_G=km["g"], DK_QMAX=km["qmax"],
        DV_FMT=vm["fmt"], DV_PER=vm["per"], DV_G=vm["g"], DV_QMAX=vm["qmax"],
        num_warps=num_warps or max(_warps(src), _warps(dst)), enable_fp_fusion=False,
    )
