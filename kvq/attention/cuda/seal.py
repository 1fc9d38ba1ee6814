"""Launcher of the CUDA block seal (seal.cu), compiled with NVRTC through CuPy.

Serves the layers whose block-sealed roles are KIVI (int4/int2, groups of 32) or
per-block scaled (FP8 e4m3 / e5m2, INT8): a decode step's window seals (hp block ->
q block, K and V in one launch) and a prefill chunk's whole blocks (one role, from
the new tokens).  Bit for bit the reference's codes and scales; the other formats
(per-token, static, dense roles) are sealed by the Triton kernels, whose choice
depends only on the layer's formats (:func:`layer_reason`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kvq.attention.cuda.decode8 import _cupy_stream, _ptr
from kvq.cache.pool import LayerKV
from kvq.formats.spec import TensorFormat

_SOURCE = Path(__file__).with_name("seal.cu")
NT = 128
_KIND = {"float8_e4m3fn": 0, "float8_e5m2": 1, "int8": 2}
KIVI_GROUP = 32
#: Tile slots of a launch over a list that may be padded (seal_pairs: a decode step's list, one slot
#: per sequence of the batch, its real seals first): CTAs walk the list in strides of this many.
PAIR_SLOTS = 64


def role_code(t: TensorFormat) -> tuple[int, int, int, int] | None:
    """(format code, bits, kind, qmax) of a role this kernel seals, or None."""
    if t.family == "kivi" and t.group_size == KIVI_GROUP and t.bits in (2, 4):
        code = {"channel_group": 4, "token_group": 5}.get(t.scale)
        return None if code is None else (code, t.bits, 0, int(t.qmax))
    if t.scale == "block_head" and t.storage in _KIND and t.bits == 8 and t.scale_dtype == "float32":
        return 3, 8, _KIND[t.storage], int(t.qmax)
    return None


def role_reason(t: TensorFormat) -> str | None:
    """None if this kernel seals tensors of format ``t``, else why not."""
    if role_code(t) is not None:
        return None
    if t.family == "kivi":
        return f"{t.name}: groups of {t.group_size} (the CUDA seal takes groups of {KIVI_GROUP}, 4 or 2 bits)"
    return f"{t.name} is scaled per {t.scale}, not sealed per block by the CUDA seal"


def layer_reason(layer: LayerKV) -> str | None:
    """None if this kernel seals both roles of ``layer``, else why not."""
    for role in ("k", "v"):
        why = role_reason(layer.tensor_format(role))
        if why:
            return f"{role.upper()}: {why}"
    kivi = any(layer.tensor_format(r).family == "kivi" for r in ("k", "v"))
    if kivi and (layer.block_size % KIVI_GROUP or layer.head_dim % KIVI_GROUP):
        return f"block size {layer.block_size} / head dim {layer.head_dim} are not multiples of {KIVI_GROUP}"
    if layer.head_dim % 8:
        return f"head dim {layer.head_dim} is not a multiple of 8"
    if layer.k_hp.dtype not in (torch.bfloat16, torch.float16):
        return f"hp blocks in {layer.k_hp.dtype} (bfloat16 or float16 only)"
    for planes in (layer.k, layer.v):
        if not all(p.is_contiguous() for p in planes.values()):
            return "non-contiguous planes"
    return None


@functools.lru_cache(maxsize=None)
def _kernel(d: int, page: int, bf16: bool, k: tuple, v: tuple):
    import cupy

    opts = ["-std=c++17", f"-DHEAD_DIM={d}", f"-DPAGE={page}", f"-DMODEL_BF16={int(bf16)}", f"-DNT={NT}"]
    for name, (fmt, bits, kind, qmax) in (("K", k), ("V", v)):
        opts += [f"-D{name}_FMT={fmt}", f"-D{name}_BITS={bits}", f"-D{name}_KIND={kind}", f"-D{name}_QMAX={qmax}"]
    return cupy.RawModule(code=_SOURCE.read_text(), options=tuple(opts), backend="nvrtc").get_function("kvq_seal")


def _launch(layer: LayerKV, src_ids: torch.Tensor, dst_ids: torch.Tensor, ksrc: torch.Tensor, vsrc: torch.Tensor,
            s_src: int, s_head: int, s_tok: int, roles: tuple[int, int], slots: int | None = None) -> None:
    """``slots``: CTAs along the list (each walks every ``slots``-th tile); default one per tile."""
    import cupy
    import numpy as np

    codes = tuple(role_code(layer.tensor_format(r)) for r in ("k", "v"))
    kern = _kernel(layer.head_dim, layer.block_size, layer.k_hp.dtype == torch.bfloat16, *codes)
    assert src_ids.dtype == dst_ids.dtype == torch.int64 and src_ids.stride(0) == dst_ids.stride(0)
    k, v = layer.k, layer.v
    ks, vs = k.get("scale", k["data"]), v.get("scale", v["data"])
    kz, vz = k.get("zero", ks), v.get("zero", vs)
    dev = src_ids.device
    stream = _cupy_stream(torch.cuda.current_stream(dev).cuda_stream)
    with cupy.cuda.Device(dev.index or 0), stream:
        n = dst_ids.shape[0]
        kern((min(n, slots or n), layer.num_kv_heads, roles[1] - roles[0]), (NT,), (
            _ptr(src_ids), _ptr(dst_ids), np.int32(src_ids.stride(0)), _ptr(ksrc), _ptr(vsrc),
            np.int64(s_src), np.int64(s_head), np.int64(s_tok),
            _ptr(k["data"]), _ptr(ks), _ptr(kz), _ptr(v["data"]), _ptr(vs), _ptr(vz),
            np.int32(layer.num_kv_heads), np.int32(roles[0]), np.int64(n)))


def seal_pairs(layer: LayerKV, pairs: torch.Tensor) -> None:
    """Seal hp block ``pairs[i, 0]`` into q block ``pairs[i, 1]`` (K and V, one launch); rows
    with a negative q block are skipped (a padded list replays in a CUDA graph)."""
    if pairs.shape[0] == 0:
        return
    pairs = pairs.to(torch.int64)
    hp = layer.k_hp
    assert hp.is_contiguous() and layer.v_hp.stride() == hp.stride()
    _launch(layer, pairs[:, 0], pairs[:, 1], hp, layer.v_hp, hp.stride(0), hp.stride(1), hp.stride(2), (0, 2),
            PAIR_SLOTS)


def seal_blocks(layer: LayerKV, src_hp: torch.Tensor, dst_q: torch.Tensor) -> None:
    """CUDA twin of :func:`kvq.attention.reference.seal_blocks`."""
    if dst_q.numel() == 0:
        return
    seal_pairs(layer, torch.stack([src_hp.to(torch.int64), dst_q.to(torch.int64)], dim=1))


def _check_src(layer: LayerKV, src: torch.Tensor, s_src: int, s_head: int, s_tok: int) -> None:
    assert src.dtype == layer.k_hp.dtype and src.stride(-1) == 1
    # KIVI V rows are read in 16-byte pieces
    assert src.data_ptr() % 16 == 0 and s_src % 8 == 0 and s_head % 8 == 0 and s_tok % 8 == 0, src.stride()


def seal_from(layer: LayerKV, role: str, src: torch.Tensor, src_ids: torch.Tensor, s_src: int, s_head: int,
              s_tok: int, dst_q: torch.Tensor) -> None:
    """Quantize whole blocks of one role from ``src`` (same contract as the Triton ``seal_from``)."""
    if dst_q.numel() == 0:
        return
    _check_src(layer, src, s_src, s_head, s_tok)
    r = 0 if role == "k" else 1
    _launch(layer, src_ids.to(torch.int64), dst_q.to(torch.int64), src, src, s_src, s_head, s_tok, (r, r + 1))


def seal_both_from(layer: LayerKV, k: torch.Tensor, v: torch.Tensor, src_ids: torch.Tensor, s_src: int, s_head: int,
                   s_tok: int, dst_q: torch.Tensor) -> None:
    """:func:`seal_from` of both roles in one launch: ``k`` and ``v`` share their strides (a prefill
    chunk's whole blocks).  One grid of both roles' tiles: no second launch and no tail between the
    roles (on the H200 the two launches of 16384 int4_kivi tokens took 66 us, each alone 24 and 22)."""
    if dst_q.numel() == 0:
        return
    assert k.stride() == v.stride(), (k.stride(), v.stride())
    _check_src(layer, k, s_src, s_head, s_tok)
    _check_src(layer, v, s_src, s_head, s_tok)
    _launch(layer, src_ids.to(torch.int64), dst_q.to(torch.int64), k, v, s_src, s_head, s_tok, (0, 2))
