"""Launcher of the CUDA 8-bit paged decode kernel (decode8.cu), compiled with NVRTC.

Serves K and V stored in 8 bits (FP8 e4m3 / e5m2 with static, per-token or
per-block scales; INT8 per token and head) at head_dim 128, pages a multiple of
16 tokens, up to 8 query heads per KV head, and tables without high-precision
blocks.  Compilation goes through CuPy's NVRTC (CuPy is on the GPU machine;
``available()`` says whether it is here).  The split-K partials are merged by
the Triton reduce kernel of :mod:`kvq.attention.triton.decode`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kvq.attention.triton.decode import _LOG2E, _decode_reduce_kernel, choose_splits
from kvq.cache.pool import LayerKV
from kvq.formats.spec import TensorFormat

_SOURCE = Path(__file__).with_name("decode8.cu")
_KIND = {"float8_e4m3fn": 0, "float8_e5m2": 1, "int8": 2}


def available() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _scale_mode(t: TensorFormat) -> int:
    if t.scale == "static":
        return 0
    if t.scale == "token_head":
        return 1 if t.scale_dtype == "float32" else 2
    if t.scale == "block_head":
        return 3
    raise ValueError(f"{t.name}: no 8-bit CUDA decode for scale {t.scale}")


def unsupported_reason(layer: LayerKV, group: int, has_hp: bool) -> str | None:
    """None if this kernel serves the layer, else why not."""
    for t in (layer.fmt.k, layer.fmt.v):
        if t.storage not in _KIND or t.bits != 8:
            return f"{t.name} is not stored in 8 bits"
        if t.scale not in ("static", "token_head", "block_head"):
            return f"{t.name}: scale {t.scale} not folded by this kernel"
    if layer.head_dim != 128:
        return f"head_dim {layer.head_dim} (needs 128)"
    if layer.block_size % 16:
        return f"page {layer.block_size} is not a multiple of 16"
    if group > 8:
        return f"{group} query heads per KV head (at most 8)"
    if has_hp:
        return "tables hold high-precision blocks"
    return None


@functools.lru_cache(maxsize=None)
def _kernel(page: int, group: int, k_kind: int, v_kind: int, k_scale: int, v_scale: int, min_blocks: int = 2):
    import cupy

    opts = ("-std=c++17", "-DHEAD_DIM=128", f"-DPAGE={page}", f"-DGROUP={group}", f"-DK_KIND={k_kind}",
            f"-DV_KIND={v_kind}", f"-DK_SCALE={k_scale}", f"-DV_SCALE={v_scale}", f"-DMIN_BLOCKS={min_blocks}")
    module = cupy.RawModule(code=_SOURCE.read_text(), options=opts, backend="nvrtc")
    return module.get_function("kvq_decode8")


def _dev(t: torch.Tensor):
    import cupy

    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = t.view(torch.uint8)
    elif t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return cupy.asarray(t)


def paged_decode(q: torch.Tensor, layer: LayerKV, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 sm_scale: float, max_seq_len: int | None = None, has_hp: bool | None = None,
                 num_splits: int | None = None, min_blocks: int = 2) -> torch.Tensor:
    """Same contract as :func:`kvq.attention.reference.paged_decode` (bf16 queries)."""
    import cupy
    import numpy as np
    import triton

    B, Hq, D = q.shape
    H = layer.num_kv_heads
    group = Hq // H
    has_hp = bool(has_hp) if has_hp is not None else False
    why = unsupported_reason(layer, group, has_hp)
    if why is not None:
        raise ValueError(f"CUDA 8-bit decode cannot serve this: {why}")
    assert q.dtype == torch.bfloat16 and q.stride(2) == 1, (q.dtype, q.stride())
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    if num_splits is None:
        # 4 warps of 16-token tiles per CTA: splits are whole multiples of 64 tokens
        num_splits, tps = choose_splits(B * H, max_seq_len, 64, num_sms * min_blocks // 4 or 1, True)
    else:
        per_split = -(-max_seq_len // num_splits)
        tps = -(-per_split // 64) * 64
        num_splits = max(1, -(-max_seq_len // tps))
    fk, fv = layer.fmt.k, layer.fmt.v
    kern = _kernel(layer.block_size, group, _KIND[fk.storage], _KIND[fv.storage], _scale_mode(fk), _scale_mode(fv),
                   min_blocks)
    po = torch.empty(B, Hq, 4 * num_splits, D, dtype=torch.float32, device=q.device)
    plse = torch.empty(B, Hq, 4 * num_splits, dtype=torch.float32, device=q.device)
    ks = layer.k.get("scale", layer.k_scale)
    vs = layer.v.get("scale", layer.v_scale)
    if fk.scale == "static":
        ks = layer.k_scale
    if fv.scale == "static":
        vs = layer.v_scale
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(q.device).cuda_stream)
    with stream:
        kern((num_splits, H, B), (128,), (
            _dev(q), np.int64(q.stride(0)), np.int64(q.stride(1)),
            _dev(layer.k["data"]), _dev(layer.v["data"]), _dev(ks), _dev(vs),
            _dev(block_tables), np.int64(block_tables.stride(0)), _dev(seq_lens),
            _dev(po), _dev(plse), np.int32(tps), np.float32(sm_scale * _LOG2E), np.int32(H),
        ))
    out = torch.empty_like(q)
    S4 = 4 * num_splits
    _decode_reduce_kernel[(B, Hq)](po, plse, out, out.stride(0), out.stride(1), S4, Hq,
                                   S_PAD=max(2, triton.next_power_of_2(S4)), D=D, V_PER=1)
    return out
