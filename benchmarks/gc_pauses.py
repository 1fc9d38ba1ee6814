"""The garbage collector's pauses during a benchmark's timed part."""

from __future__ import annotations

import gc
import time


class GcPauses:
    """The garbage collector's pauses while in a ``with`` block (gc.callbacks): count per generation,
    total and longest seconds.  A full collection walks every tracked object the engine holds (each
    request's token lists, its outputs): the host time it takes is not overlapped with anything."""

    def __init__(self):
        self.counts, self.total_s, self.max_s, self._t = [0, 0, 0], 0.0, 0.0, None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            d = time.perf_counter() - self._t
            self.counts[info["generation"]] += 1
            self.total_s += d
            self.max_s = max(self.max_s, d)
            self._t = None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def record(self) -> dict:
        return {"gc_collections": list(self.counts), "gc_pause_s": self.total_s, "gc_max_pause_s": self.max_s}
