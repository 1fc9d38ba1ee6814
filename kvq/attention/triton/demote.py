"""Demotion in Triton: re-store whole blocks one tier down (elastic precision, kvq.cache.tiers).

Twin of :func:`kvq.attention.reference.demote_pairs`: each (block, KV head, role) program reads a
source block's ``[bs, D]`` K or V tile dequantized to float32 (the prefill scratch's page
reader), and quantizes it into the destination tier with the seal kernels' quantizer, so a
demoted block holds exactly the codes a seal of the dequantized values would write.  One
launch per layer for a batch of blocks between one ordered pair of tiers.

Floating-point contraction is off for this kernel: a KIVI value ``code * scale + zero`` must
round like the reference's separate multiply and add, not as one fma.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq.attention.triton.decode import layer_args
from kvq.attention.triton.dequant import _page_tile
from kvq.attention.triton.store import _quant_store, _role_args, _warps
from kvq.cache.pool import LayerKV


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
def _demote_kernel(
    pairs, s_pair,  # [S, 2] (source block, destination block); destination < 0: skip
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
    """One program per (pair, KV head, role): K and V side by side, not one after the other (a block's
    tile is small: a program is one chain of dependent loads, reductions and stores, and the launch
    lasts about as long as its longest program)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    dst = tl.load(pairs + i * s_pair + 1).to(tl.int64)
    if dst >= 0:
        src = tl.load(pairs + i * s_pair)
        if tl.program_id(2) == 0:
            _demote_role(skd, sks, skz, skhp, skst, s_skdb, s_skdh, s_skdt, s_sksb, s_sksh, s_skst, s_skzb, s_hb,
                         s_hh, s_ht, src, h, dkd, dks, dkz, dkst, s_dkdb, s_dkdh, s_dkdt, s_dksb, s_dksh, s_dkst,
                         s_dkzb, dst, PAGE, D, SK_FMT, SK_PER, SK_G, DK_FMT, DK_PER, DK_G, DK_QMAX)
        else:
            _demote_role(svd, svs, svz, svhp, svst, s_svdb, s_svdh, s_svdt, s_svsb, s_svsh, s_svst, s_svzb, s_hb,
                         s_hh, s_ht, src, h, dvd, dvs, dvz, dvst, s_dvdb, s_dvdh, s_dvdt, s_dvsb, s_dvsh, s_dvst,
                         s_dvzb, dst, PAGE, D, SV_FMT, SV_PER, SV_G, DV_FMT, DV_PER, DV_G, DV_QMAX)


def demote_pairs(layer: LayerKV, pairs: torch.Tensor, src_tier: int, dst_tier: int,
                 num_warps: int | None = None) -> None:
    """Triton twin of :func:`kvq.attention.reference.demote_pairs`."""
    if pairs.shape[0] == 0:
        return
    src, dst = layer.tier(src_tier), layer.tier(dst_tier)
    args, sm = layer_args(src)
    kp, ks, km = _role_args(dst, "k")
    vp, vs, vm = _role_args(dst, "v")
    _demote_kernel[(pairs.shape[0], layer.num_kv_heads, 2)](
        pairs, pairs.stride(0), *args, kp[0], kp[1], kp[2], kp[4], vp[0], vp[1], vp[2], vp[4], *ks, *vs,
        PAGE=layer.block_size, D=layer.head_dim,
        SK_FMT=sm["k_fmt"], SK_PER=sm["k_per"], SK_G=sm["k_g"], SV_FMT=sm["v_fmt"], SV_PER=sm["v_per"], SV_G=sm["v_g"],
        DK_FMT=km["fmt"], DK_PER=km["per"], DK_G=km["g"], DK_QMAX=km["qmax"],
        DV_FMT=vm["fmt"], DV_PER=vm["per"], DV_G=vm["g"], DV_QMAX=vm["qmax"],
        num_warps=num_warps or max(_warps(src), _warps(dst)), enable_fp_fusion=False,
    )
