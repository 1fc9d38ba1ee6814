"""A step's host->device inputs in one copy.

Every array a step needs on the device (token ids, positions, slots, block
tables, lengths, seals, ...) is written into one pinned host buffer, each at a
16-byte aligned offset, and crosses in a single non-blocking copy into a
persistent device buffer; the step reads typed views of it.  Pageable copies
would each cost a launch and a stream synchronization on the host.

Two host buffers are used in turn.  With asynchronous scheduling the host
fills step N+1's buffer while step N's copy may still be queued behind step
N-1; before a buffer is refilled, the event recorded after its copy is waited
on (by then long complete, since step N-1's samples were read).  The device
buffer needs no such care: copies and kernels run on one stream, so step N+1's
copy lands after step N's kernels have read their inputs.

On the CPU the same packing runs and the "device" buffer is a copy of the host
one, so the layout is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# 16 bytes: Triton specializes a kernel on whether each pointer is 16-byte aligned, so offsets that
# were aligned on some steps only would compile new variants mid-run (and lose vector loads)
ALIGN = 16
_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}


def layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Byte offset of each array (``ALIGN``-byte aligned, in order) and the total size."""
    offsets, n = [], 0
    for a in arrays:
        offsets.append(n)
        n += -(-a.nbytes // ALIGN) * ALIGN
    return offsets, n


def views(buf: torch.Tensor, arrays: Sequence[np.ndarray], offsets: Sequence[int]) -> list[torch.Tensor]:
    """Typed views of a uint8 buffer at the offsets, shaped like the arrays."""
    return [buf[o:o + a.nbytes].view(_TORCH[a.dtype]).reshape(a.shape) for a, o in zip(arrays, offsets)]


class Staging:
    """Pinned host buffers (two, used in turn) and one device buffer, grown as needed."""

    def __init__(self, device: torch.device | str, nbytes: int = 1 << 16):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._host: list[torch.Tensor | None] = [None, None]
        self._events: list[object | None] = [None, None]
        self._turn = 0
        self._dev: torch.Tensor | None = None
        self._min = nbytes
        self.copies = 0  # host->device copies issued (one per pack / send)

    def host(self, nbytes: int) -> torch.Tensor:
        """The next host buffer (at least ``nbytes``), once its previous copy has landed."""
        i = self._turn
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()
            self._events[i] = None
        buf = self._host[i]
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, self._min, 2 * (buf.numel() if buf is not None else 0))
            buf = self._host[i] = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)
        return buf

    def send(self, src: torch.Tensor, dst: torch.Tensor, nbytes: int) -> None:
        """Copy the first ``nbytes`` of the current host buffer ``src`` into ``dst``; the turn passes."""
        dst[:nbytes].copy_(src[:nbytes], non_blocking=self.cuda)
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self._events[self._turn] = ev
        self._turn ^= 1
        self.copies += 1

    def pack(self, arrays: Sequence[np.ndarray | list], dtypes: Sequence[np.dtype] | None = None
             ) -> list[torch.Tensor]:
        """The arrays on the device, through one copy: typed views of the device buffer, valid
        until the next pack (later steps are stream-ordered after this one's kernels)."""
        arrs = [np.ascontiguousarray(a, dtype=None if dtypes is None else dtypes[i]) for i, a in enumerate(arrays)]
        offsets, n = layout(arrs)
        n = max(n, ALIGN)
        buf = self.host(n)
        host = buf.numpy()
        for a, o in zip(arrs, offsets):
            host[o:o + a.nbytes] = a.reshape(-1).view(np.uint8)
        if not self.cuda:  # the step owns a copy: the host buffer is refilled two packs later
            dev = buf[:n].clone()
            self._turn ^= 1
            self.copies += 1
        else:
            if self._dev is None or self._dev.numel() < n:
                self._dev = torch.empty(max(n, 2 * (self._dev.numel() if self._dev is not None else 0)),
                                        dtype=torch.uint8, device=self.device)
            dev = self._dev
            self.send(buf, dev, n)
        return views(dev, arrs, offsets)
