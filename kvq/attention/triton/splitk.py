"""Pieces of a split-K decode program shared by the decode kernels (kvq.attention.triton.decode,
decode_kivi): the program's share of its sequence, one online-softmax step, and where its partial
result goes.  Partial results: out ``[B, Hq, S, D]`` float32 and log-sum-exp ``[B, Hq, S]`` (log2
domain); a launch writes splits ``split_base .. split_base + num_splits - 1`` of the ``S`` a row, so
several launches (a tiered cache's tiers) fill one set that one reduction merges."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def program_share(lens_ptr, num_splits, BLOCK_N: tl.constexpr):
    """This program's (sequence, KV head, split) of the grid and the tokens ``[start, end)`` of its
    sequence that it reads.  Each sequence divides its own context into whole-tile shares, so the grid
    depends only on (B, H, num_splits): short sequences of a mixed batch spread over all splits, and a
    CUDA graph captured for a batch size serves any lengths."""
    b = tl.program_id(0)
    sp = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    tokens_per_split = tl.cdiv(tl.cdiv(n, BLOCK_N), num_splits) * BLOCK_N
    start = sp * tokens_per_split
    return b, tl.program_id(1), sp, start, tl.minimum(start + tokens_per_split, n)


@triton.jit
def softmax_step(s, m_i, l_i):
    """One tile's scores ``s`` [G, N] (log2 domain, -inf where masked) into the running maximum and sum:
    -> (new maximum, the factor that rescales what was accumulated, probabilities, new sum).  A tile
    masked whole before anything was read (the KIVI decode's quantized pass over hp pages, a prefill
    row's keys past it) leaves the running values at their start (-inf, 0) rather than NaN."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def partial_rows(b, h, g, sp, split_base, split_total, GROUP: tl.constexpr):
    """Rows of the partial results of query heads ``h * GROUP + g`` of sequence ``b`` for split ``sp``."""
    return (b * tl.num_programs(1) * GROUP + h * GROUP + g).to(tl.int64) * split_total + split_base + sp


@triton.jit
def finish(l_i, m_i):
    """(the sum to divide by, 1 where nothing was read; the log-sum-exp, -inf where nothing was read)."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    return l_safe, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
