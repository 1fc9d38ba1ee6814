"""Time spent demoting blocks (elastic precision, kvq.cache.tiers), counted apart from the step.

Demotions run inside the forward, every layer's before the first layer's seals and K/V write, so
a step's time does not show them.  :class:`DemoteClock` stands in for the kernels module during
the forward of a tiered cache: every other kernel is the module's own, and the demotions are
timed (CUDA: an event pair around each launch on the current stream, summed once the events
have completed, so nothing waits on the device; CPU: the wall time of the call).
"""

from __future__ import annotations

import time


class DemoteClock:
    """The kernels module with its demotions timed (module docstring)."""

    def __init__(self, kernels, cuda: bool):
        self._kernels, self._cuda = kernels, cuda
        self._pending: list = []  # (start, end) CUDA events not yet summed
        self._seconds = 0.0
        self.launches = 0

    def __getattr__(self, name):  # every other kernel: the module's
        return getattr(self._kernels, name)

    def demote_pairs(self, layer, pairs, src_tier, dst_tier):
        return self._timed(self._kernels.demote_pairs, layer, pairs, src_tier, dst_tier)

    def demote_layers(self, layers, pairs, src_tier, dst_tier):
        return self._timed(self._kernels.demote_layers, layers, pairs, src_tier, dst_tier)

    def _timed(self, fn, *args):
        self.launches += 1
        if not self._cuda:
            t = time.perf_counter()
            out = fn(*args)
            self._seconds += time.perf_counter() - t
            return out
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args)
        end.record()
        self._pending.append((start, end))
        return out

    @property
    def seconds(self) -> float:
        """Demotion time so far (launches whose end the device has not reached yet are left for later)."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.pop(0)
            self._seconds += start.elapsed_time(end) / 1e3
        return self._seconds
