"""The contract kvq asks of a library prefill kernel, and its plain-torch definition.

A library call (FlashInfer's FA3/FA2 paged prefill, kvq.attention.flashinfer_lib) computes
causal attention of packed queries over keys gathered from pages, and returns the
log-sum-exp of each row so that kvq can merge it with attention over other keys
(kvq.attention.split_prefill).  Its inputs, prepared once per step on the host
(:func:`make_plan`) and reused by every layer::

    q              [T, Hq, D]        rows of request r: q[qo_indptr[r]:qo_indptr[r+1]]
    k_pages/v_pages [N, H, P, D]     pages (HND: a page holds P tokens of every KV head)
    page_indices   [sum pages] int32 request r reads pages page_indices[kv_indptr[r]:kv_indptr[r+1]]
    kv_lens        keys of request r: the first kv_lens[r] tokens of those pages

Row i of request r (``t`` rows, ``L`` keys) sees keys ``j <= i + L - t`` (causal, aligned at
the bottom right: the rows are the last ``t`` queries of a sequence whose keys end with them,
or, with an offset, end before them); with a window (``window_left = w >= 0``) only the last
``w + 1`` of them, ``j >= i + L - t - w`` (FlashInfer's sliding window).  A row that sees no key
gives output 0 and log-sum-exp -inf.  The log-sum-exp is in base 2 of ``sm_scale * q.k`` (FlashInfer's):
``lse = log2(sum_j 2^(s_j * log2(e)))``, what the Triton kernels' running max and sum hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class LibPlan:
    """One library call's requests (host lists) and page indices (on the device)."""

    qo_indptr: tuple[int, ...]  # [R + 1]
    kv_indptr: tuple[int, ...]  # [R + 1] into page_indices
    kv_lens: tuple[int, ...]  # [R] keys of each request (>= 1)
    page_indices: torch.Tensor  # [kv_indptr[-1]] int32, on the device
    page_size: int
    window_left: int = -1  # -1: every causal key; w >= 0: the last w + 1 of them

    @property
    def last_page_len(self) -> tuple[int, ...]:
        return tuple(n - (self.kv_indptr[r + 1] - self.kv_indptr[r] - 1) * self.page_size
                     for r, n in enumerate(self.kv_lens))


def make_plan(qo_lens: Sequence[int], kv_lens: Sequence[int], first_block: Sequence[int], table: torch.Tensor,
              page_size: int, window_left: int = -1) -> LibPlan:
    """Requests reading ``kv_lens[r]`` keys from logical block ``first_block[r]`` of row ``r`` of
    ``table`` ([R, W] int32, non-negative page ids, on the device); ``window_left``: see the module
    docstring.  A request with no key
    (``kv_lens[r] <= 0``) reads one token of page ``table[r, 0]`` instead, and its rows must be
    ignored by the caller: libraries differ on empty requests, so none is ever sent."""
    R = len(qo_lens)
    rows, cols, lens, indptr, qo = [], [], [], [0], [0]
    for r in range(R):
        n = int(kv_lens[r])
        if n <= 0:
            rows.append(r)
            cols.append(0)
            lens.append(1)
        else:
            npages = -(-n // page_size)
            rows += [r] * npages
            cols += range(first_block[r], first_block[r] + npages)
            lens.append(n)
        indptr.append(len(rows))
        qo.append(qo[-1] + int(qo_lens[r]))
    dev = table.device
    r_t = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    c_t = torch.tensor(cols, dtype=torch.int64).to(dev, non_blocking=True)
    return LibPlan(tuple(qo), tuple(indptr), tuple(lens), table[r_t, c_t].to(torch.int32).contiguous(), page_size,
                   window_left)


def torch_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: LibPlan,
                    sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract in plain torch (float32 arithmetic): -> (out [T, Hq, D] in q's dtype,
    lse [T, Hq] float32, base 2)."""
    T, Hq, D = q.shape
    H = k_pages.shape[1]
    group = Hq // H
    out = torch.zeros(T, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.full((T, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    for r in range(len(plan.kv_lens)):
        q0, q1 = plan.qo_indptr[r], plan.qo_indptr[r + 1]
        t, L = q1 - q0, plan.kv_lens[r]
        if t == 0:
            continue
        pages = plan.page_indices[plan.kv_indptr[r]:plan.kv_indptr[r + 1]].long()
        k = k_pages[pages].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :L].float()  # [H, L, D]
        v = v_pages[pages].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :L].float()
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, L, D]
        s = torch.einsum("thd,hjd->htj", q[q0:q1].float(), k) * sm_scale  # [Hq, t, L]
        last = torch.arange(t, device=q.device)[:, None] + (L - t)  # each row's last key
        j = torch.arange(L, device=q.device)[None, :]
        seen = (j <= last) & (j >= last - plan.window_left if plan.window_left >= 0 else True)
        s = s.masked_fill(~seen, float("-inf"))
        m = s.amax(dim=2, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        tot = p.sum(dim=2)  # [Hq, t]
        o = torch.einsum("htj,hjd->thd", p, v) / tot.clamp_min(1e-30).transpose(0, 1)[:, :, None]
        out[q0:q1] = torch.where(tot.transpose(0, 1)[:, :, None] > 0, o, torch.zeros_like(o)).to(q.dtype)
        lse[q0:q1] = ((m[:, :, 0] + torch.log(tot)) * LOG2E).transpose(0, 1)
    return out, lse


def indptr(lens: Sequence[int]) -> tuple[int, ...]:
    """``(0, lens[0], lens[0] + lens[1], ...)``: where each request's rows start, and the end."""
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return tuple(out)


def ragged_plan(qo_lens: Sequence[int], device, kv_lens: Sequence[int] | None = None,
                window_left: int = -1) -> LibPlan:
    """The ragged call as a :class:`LibPlan` (for :func:`torch_attention`): request ``r`` reads
    ``kv_lens[r]`` keys (default: as many as its rows), consecutive rows of ``k``/``v`` ``[N, H, D]``
    seen as pages of one token, causal aligned at the bottom right like the paged call (fewer keys
    than rows: the rows' keys end before them), ``window_left`` as there."""
    qo = indptr(qo_lens)
    kv = qo if kv_lens is None else indptr(kv_lens)
    lens = tuple(b - a for a, b in zip(kv, kv[1:]))
    return LibPlan(qo, kv, lens, torch.arange(kv[-1], dtype=torch.int32, device=device), 1, window_left)


class TorchLib:
    """The reference library: :func:`torch_attention` behind the interface of
    :class:`kvq.attention.flashinfer_lib.FlashInferLib` (any device; tests and the CPU)."""

    name = "torch"

    def new_step(self) -> None:
        pass

    def prepare(self, plan: LibPlan, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                sm_scale: float, out_dtype: torch.dtype | None = None):
        return (plan, sm_scale)

    def run(self, handle, q, k_pages, v_pages, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        plan, sm_scale = handle
        o, lse = torch_attention(q, k_pages, v_pages, plan, sm_scale)
        if out is not None:
            out.copy_(o)
            o = out
        return o, lse

    def run_fp8(self, handle, q, k_pages, v_pages, q_scale, k_scale, v_scale, out) -> tuple[torch.Tensor, torch.Tensor]:
        """e4m3 queries and pages with their scales (``q_scale`` a number, ``k_scale``/``v_scale`` per KV
        head): the inputs' values exactly, in float32 (not the FP8 kernel's e4m3 probabilities)."""
        H = k_pages.shape[1]
        ks = torch.as_tensor(k_scale, dtype=torch.float32, device=q.device).reshape(-1).expand(H)
        vs = torch.as_tensor(v_scale, dtype=torch.float32, device=q.device).reshape(-1).expand(H)
        o, lse = self.run(handle, q.float() * q_scale, k_pages.float() * ks[None, :, None, None],
                          v_pages.float() * vs[None, :, None, None])
        out.copy_(o)
        return out, lse

    def prepare_ragged(self, qo_lens: Sequence[int], num_qo_heads: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, sm_scale: float, device, kv_lens: Sequence[int] | None = None,
                       window_left: int = -1):
        return (ragged_plan(qo_lens, device, kv_lens, window_left), sm_scale)

    def run_ragged(self, handle, q, k, v, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of each request's rows over its keys ``k``, ``v`` ``[N, H, D]`` (:func:`ragged_plan`)."""
        return self.run(handle, q, k.unsqueeze(2), v.unsqueeze(2), out=out)
