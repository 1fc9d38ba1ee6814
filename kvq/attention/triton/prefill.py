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

import torch
import triton
import triton.language as tl

from kvq.attention.triton import dequant
from kvq.attention.triton.decode import _LOG2E, INTERPRET, _dot_dtype, layer_args
from kvq.attention.triton.tiles import DENSE, load_tile, tile_channel
from kvq.cache.pool import LayerKV


@triton.jit
def _prefill_kernel(
    q_ptr, s_qt, s_qh, o_ptr, s_ot, s_oh, cu_ptr,
    kd, ks, kz, khp, kst, vd, vs, vz, vhp, vst,
    s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst,
    s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst,
    s_hb, s_hh, s_ht,
    table_ptr, s_tb, lens_ptr, qk_scale,
    GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_FMT: tl.constexpr, K_PER: tl.constexpr, V_FMT: tl.constexpr, V_PER: tl.constexpr,
    KIVI_G: tl.constexpr, HAS_HP: tl.constexpr, DOT: tl.constexpr,
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
    for t0 in range(0, kv_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        valid = t < kv_end
        bid = tl.load(table + t // PAGE, mask=valid, other=0)
        off = t % PAGE
        k, k_sc = load_tile(kd, ks, kz, khp, kst, s_kdb, s_kdh, s_kdt, s_ksb, s_ksh, s_kst, s_hb, s_hh, s_ht,
                            bid, off, h, valid, BLOCK_N, D, K_FMT, K_PER, KIVI_G, HAS_HP, DOT)
        s = tl.dot(q, tl.trans(k)) * (k_sc * qk_scale)[None, :]
        causal = valid[None, :] & (t[None, :] <= qpos[:, None])
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v, v_sc = load_tile(vd, vs, vz, vhp, vst, s_vdb, s_vdh, s_vdt, s_vsb, s_vsh, s_vst, s_hb, s_hh, s_ht,
                            bid, off, h, valid, BLOCK_N, D, V_FMT, V_PER, KIVI_G, HAS_HP, DOT)
        acc = acc * alpha[:, None] + tl.dot((p * v_sc[None, :]).to(DOT), v)
        m_i = m_new
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
    block_m: int = 64,
    block_n: int = 64,
    dot_f16: bool | None = None,
    max_seq_len: int | None = None,
    dequant_first: bool | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`kvq.attention.reference.paged_attention`.

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
    if dequant_first is None:
        dequant_first = dequant_first_default(layer)
    if dequant_first and dequant.scratch_bytes(B, blocks, H, PAGE, D) <= dequant.SCRATCH_CAP_BYTES:
        k, v, block_tables = dequant.dequantize_pages(args, meta, block_tables, seq_lens, blocks, H, PAGE, D)
        args = [k, k, k, k, k, v, v, v, v, v, *k.stride()[:3], 0, 0, 0, *v.stride()[:3], 0, 0, 0, 0, 0, 0]
        meta = dict(k_fmt=DENSE.value, k_per=1, v_fmt=DENSE.value, v_per=1, kivi_g=1)
        has_hp, dot_f16 = False, not INTERPRET
    if dot_f16 is None:
        dot_f16 = layer.fmt.k.bits == 8 and layer.fmt.v.bits == 8 and not INTERPRET
    dot = tl.float16 if dot_f16 else _dot_dtype(q.dtype)
    grid = (B, Hq, triton.cdiv(max_q_len, block_m))
    _prefill_kernel[grid](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), cu_seqlens_q, *args,
        block_tables, block_tables.stride(0), seq_lens, sm_scale * _LOG2E,
        GROUP=Hq // H, D=D, PAGE=PAGE, BLOCK_M=block_m, BLOCK_N=block_n,
        K_FMT=meta["k_fmt"], K_PER=meta["k_per"], V_FMT=meta["v_fmt"], V_PER=meta["v_per"],
        KIVI_G=meta["kivi_g"], HAS_HP=bool(has_hp), DOT=dot,
    )
    return out


def dequant_first_default(layer: LayerKV) -> bool:
    """Whether prefill over this layer dequantizes its pages first: for every quantized
    format but FP8 with a per-tensor scale, whose codes the kernel's f16 dot reads as
    fast as bf16 (H200 sweep of scripts/probe_prefill.py in docs/kernels.md)."""
    return any(f.is_quantized and not (f.family == "fp8" and f.scale == "static") for f in (layer.fmt.k, layer.fmt.v))
