"""FlashInfer's paged prefill (FA3 on Hopper, FA2 elsewhere) under kvq.attention.paged_lib's contract.

``pip install 'kvq[cuda]'`` brings it (flashinfer-python 0.7.0).  kvq's pages are HND
(``[pages, H, P, D]``), which FlashInfer reads in place; K and V go as a tuple of two tensors.
One :class:`flashinfer.BatchPrefillWithPagedKVCacheWrapper` per plan (its plan holds the step's
request layout and the kernel's schedule), all sharing one workspace buffer: the plans of a
step's calls run one after another on one stream.  ``plan`` reads the host lists only (no
device sync); the page indices stay on the device.  Fresh prompts (no cached past) may instead
go through :class:`flashinfer.BatchPrefillWithRaggedKVCacheWrapper` over their own K/V
(``prepare_ragged``; kvq.attention.split_prefill.RAGGED_FRESH), the same module's kernels.

A wrapper's ``plan`` writes the schedule into the wrapper's pinned host buffer and queues its
copy to the device.  Under async scheduling the host plans step N+1 while step N still runs, so
a wrapper is planned again only once the step that last used it has finished on the device
(:class:`Recycler`): re-planning it earlier overwrites the pinned buffer before the queued copy
reads it, and step N runs on step N+1's schedule (an illegal address on the H200 at a 32K prompt).
"""

from __future__ import annotations

import os
from collections import deque

import torch

from kvq.attention.paged_lib import LibPlan, indptr

#: FlashInfer's scratch for split-KV partial results (its documentation's recommendation).
WORKSPACE_BYTES = 128 << 20
#: head dims FlashInfer's prefill kernels are built for
HEAD_DIMS = (64, 128, 256)


def unavailable_reason(device: torch.device | str, head_dim: int | None = None) -> str | None:
    """Why FlashInfer's prefill cannot run here (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"needs a CUDA device (got {device.type})"
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} not in {HEAD_DIMS}"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"needs sm_80 or newer (got sm_{major}x)"
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"flashinfer is not importable ({type(e).__name__}: {e}); pip install 'kvq[cuda]'"
    return None


def kernel_name(device: torch.device | str) -> str:
    """``fa3`` on Hopper (sm_90), ``fa2`` elsewhere: the FlashInfer backend kvq asks for."""
    major, _ = torch.cuda.get_device_capability(torch.device(device))
    return "fa3" if major == 9 else "fa2"


class Recycler:
    """Objects that queued device work on a step are reused only after that work is done.

    ``end_step(event)`` closes the step (``event``: recorded after its last launch, with a
    ``query()`` that says whether the device passed it); ``take(make)`` gives an object whose
    step is done, or ``make()``.  The pool grows only while the host runs ahead of the device."""

    def __init__(self):
        self._free: list = []
        self._pending: deque = deque()  # (event, objects) of closed steps, oldest first
        self._used: list = []

    def take(self, make):
        while self._pending and self._pending[0][0].query():
            self._free += self._pending.popleft()[1]
        obj = self._free.pop() if self._free else make()
        self._used.append(obj)
        return obj

    def end_step(self, event) -> None:
        if self._used:
            self._pending.append((event, self._used))
            self._used = []

    @property
    def size(self) -> int:
        return len(self._free) + len(self._used) + sum(len(objs) for _, objs in self._pending)


class FlashInferLib:
    """Library calls through FlashInfer; ``backend`` ``fa3``/``fa2`` (default: :func:`kernel_name`)."""

    def __init__(self, device: torch.device | str, backend: str | None = None):
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a" if kernel_name(device) == "fa3" else "8.0")
        import flashinfer

        self._fi = flashinfer
        self.device = torch.device(device)
        self.backend = backend or kernel_name(self.device)
        self.name = f"flashinfer-{self.backend}"
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._wrappers = Recycler()
        self._ragged = Recycler()

    def new_step(self) -> None:
        """The last step's launches are all queued: its wrappers are planned again once the device
        has passed them (an event recorded now, on the stream they ran on)."""
        event = torch.cuda.Event()
        event.record()
        self._wrappers.end_step(event)
        self._ragged.end_step(event)

    def prepare(self, plan: LibPlan, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                sm_scale: float, out_dtype: torch.dtype | None = None):
        w = self._wrappers.take(lambda: self._fi.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, kv_layout="HND", backend=self.backend))
        i32 = dict(dtype=torch.int32)
        w.plan(torch.tensor(plan.qo_indptr, **i32), torch.tensor(plan.kv_indptr, **i32), plan.page_indices,
               torch.tensor(plan.last_page_len, **i32), num_qo_heads, num_kv_heads, head_dim, plan.page_size,
               causal=True, sm_scale=sm_scale, q_data_type=dtype, kv_data_type=dtype, o_data_type=out_dtype or dtype,
               window_left=plan.window_left, seq_lens=torch.tensor(plan.kv_lens, **i32))
        return w

    def run(self, handle, q, k_pages, v_pages, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        return handle.run(q, (k_pages, v_pages), out=out, return_lse=True)

    def run_fp8(self, handle, q, k_pages, v_pages, q_scale, k_scale, v_scale, out) -> tuple[torch.Tensor, torch.Tensor]:
        """FA3's FP8 kernel: e4m3 ``q`` and pages, the scales positional (a number, or a float32 tensor per
        head: FlashInfer's ``maybe_scale_*``), scores ``q.k * q_scale * k_scale * sm_scale``, P in e4m3."""
        return handle.run(q, (k_pages, v_pages), q_scale, k_scale, v_scale, out=out, return_lse=True)

    def prepare_ragged(self, qo_lens, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       sm_scale: float, device, kv_lens=None, window_left: int = -1):
        """A call over contiguous K/V rows ``[N, H, D]`` (request ``r``: ``kv_lens[r]`` of them, default its
        own rows' count, e.g. fresh prompts' K/V): FlashInfer's ragged prefill, whose FA3 kernel loads K/V
        by TMA (its paged kernel gathers pages with cp.async); causal and ``window_left`` as in
        kvq.attention.paged_lib."""
        w = self._ragged.take(lambda: self._fi.BatchPrefillWithRaggedKVCacheWrapper(
            self._workspace, kv_layout="NHD", backend=self.backend))
        qo = torch.tensor(indptr(qo_lens), dtype=torch.int32)
        kv = qo if kv_lens is None else torch.tensor(indptr(kv_lens), dtype=torch.int32)
        w.plan(qo, kv, num_qo_heads, num_kv_heads, head_dim, causal=True, sm_scale=sm_scale, q_data_type=dtype,
               kv_data_type=dtype, window_left=window_left)
        return w

    def run_ragged(self, handle, q, k, v, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        return handle.run(q, k, v, out=out, return_lse=True)
