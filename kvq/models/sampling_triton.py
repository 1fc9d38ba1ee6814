"""One pass over the logits per row: greedy argmax, or a temperature draw by the Gumbel-max trick.

A row draws ``argmax_i(x_i / T + G_i)`` with ``G_i = -log(-log(u_i))`` and ``u_i`` uniform from
Philox keyed by the row's seed and counting over the vocabulary: the same distribution as
``softmax(x / T)`` (what kvq.engine.sampler's exponential race draws from), without the float
copy, the softmax, the noise tensor and the division, each a pass over ``[B, V]`` floats
(about 1.6 ms a step at 512 rows of Llama-3's 128256 logits on the H200, against one read of
the logits here).  Greedy rows take the first maximal logit.  Rows with top-k or top-p are the
caller's: their cut needs a sort.

Two kernels.  The first splits each row into chunks of ``CHUNK_V`` ids, one program each (a
row per program left 512 programs for 132 SMs, each walking 128K ids in sequence), and keeps a
chunk's best key and id; the second picks each row's best chunk (ties: the lower chunk, so the
lowest id overall); a vocabulary of one chunk needs only the first.  The noise costs one Philox
call per four ids: ``randint4x`` counts over ``id // 4`` and its four words go to ids ``4c ..
4c + 3`` (the Philox rounds are most of a draw's instructions; one word per call threw three
away).  An id's noise depends on the seed and the id alone, so the tiling never changes a draw.

    sample_rows(logits [B, V], temperature [B] f32, greedy [B] bool, seeds [B] int64) -> [B] int64
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # ids a program loads at once
CHUNK_V = 8192  # ids per program


@triton.jit
def _chunk_kernel(logits, s_row, temperature, greedy, seeds, best_key, best_id, out, V, S,
                  BLOCK: tl.constexpr, CHUNK: tl.constexpr, ALL_GREEDY: tl.constexpr, ONE_CHUNK: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    row = logits + b.to(tl.int64) * s_row
    is_greedy = tl.load(greedy + b) != 0
    t = tl.load(temperature + b)
    seed = tl.load(seeds + b)
    Q: tl.constexpr = BLOCK // 4
    i = tl.arange(0, Q)[:, None]
    j = tl.arange(0, 4)[None, :]
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for v0 in range(lo, hi, BLOCK):
        v = v0 + 4 * i + j  # [Q, 4]: id 4 (v0 / 4 + i) + j
        inside = v < V
        x = tl.load(row + v, mask=inside, other=float("-inf")).to(tl.float32)
        key = x
        if not ALL_GREEDY:
            r0, r1, r2, r3 = tl.randint4x(seed, v0 // 4 + tl.arange(0, Q))
            r = tl.where(j == 0, r0[:, None], tl.where(j == 1, r1[:, None], tl.where(j == 2, r2[:, None],
                                                                                      r3[:, None])))
            u = tl.random.uint_to_uniform_float(r)  # [0, 1): u = 0 gives -inf noise, never drawn
            key = tl.where(is_greedy, x, x / t - tl.log(-tl.log(u)))
        key = tl.where(inside, key, float("-inf"))
        m = tl.max(tl.max(key, axis=1), axis=0)
        # the first maximal id (ties go to the lowest); V - 1 caps a block whose keys are all NaN
        first = tl.minimum(tl.min(tl.min(tl.where(key == m, v, V), axis=1), axis=0), V - 1)
        better = m > best  # strict: an earlier block keeps a tie
        best_i = tl.where(better, first, best_i)
        best = tl.where(better, m, best)
    if ONE_CHUNK:  # the row's token: no second kernel
        tl.store(out + b, best_i.to(tl.int64))
    else:
        tl.store(best_key + b * S + c, best)
        tl.store(best_id + b * S + c, best_i)


@triton.jit
def _pick_kernel(best_key, best_id, out, S, SP: tl.constexpr):
    b = tl.program_id(0)
    s = tl.arange(0, SP)
    inside = s < S
    key = tl.load(best_key + b * S + s, mask=inside, other=float("-inf"))
    m = tl.max(key, axis=0)
    c = tl.min(tl.where(inside & (key == m), s, S - 1), axis=0)  # the lowest chunk holding the best key
    tl.store(out + b, tl.load(best_id + b * S + c).to(tl.int64))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor,
                all_greedy: bool = False) -> torch.Tensor:
    """Token id per row of ``logits`` [B, V] (any float dtype, rows contiguous): the argmax where
    ``greedy``, else a draw from softmax(logits / temperature) keyed by ``seeds`` (int64, one per
    row: the same seed and logits give the same token)."""
    B, V = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        block = min(BLOCK_V, max(4, triton.next_power_of_2(V)))
        chunk = max(CHUNK_V, block)
        S = triton.cdiv(V, chunk)
        key = torch.empty(B, S, dtype=torch.float32, device=logits.device)
        ids = torch.empty(B, S, dtype=torch.int32, device=logits.device)
        _chunk_kernel[(B, S)](logits, logits.stride(0), temperature, greedy, seeds, key, ids, out, V, S,
                              BLOCK=block, CHUNK=chunk, ALL_GREEDY=all_greedy, ONE_CHUNK=S == 1)
        if S > 1:
            _pick_kernel[(B,)](key, ids, out, S, SP=triton.next_power_of_2(S))
    return out
