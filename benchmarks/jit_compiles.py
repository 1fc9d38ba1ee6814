"""Host stalls inside a benchmark's timed part: Triton kernels compiled (or loaded from Triton's disk
cache) and the CUDA caching allocator's retries and cudaMalloc/cudaFree calls."""

from __future__ import annotations

import time
from collections import Counter


class JitCompiles:
    """Each time a Triton kernel misses the in-memory cache while in a ``with`` block (a launch with
    constexprs or argument specializations not seen before in this process): its name, and the
    seconds until it could launch.  A compile inside a timed wave stalls every sequence of the step
    (seconds for the big kernels): a warm-up that missed a specialization shows up here, not only as
    a slow TTFT.  Records nothing without Triton's JIT hooks (the CPU interpreter compiles nothing)."""

    def __init__(self):
        self.names: Counter[str] = Counter()
        self.total_s, self.max_s, self._t = 0.0, 0.0, None
        self._knobs = None
        self.variants: list[dict] = []  # per compile: the launch Triton saw (what a warm-up must repeat)

    def _before(self, *, fn, **kw):
        self._t = time.perf_counter()
        return False  # compile as usual

    def _after(self, *, fn, **kw):
        d = time.perf_counter() - (self._t or time.perf_counter())
        self.names[fn.name] += 1
        self.total_s += d
        self.max_s = max(self.max_s, d)
        self._t = None
        comp = kw.get("compile") or {}
        self.variants.append({"kernel": fn.name, "s": round(d, 3), "repr": str(kw.get("repr", ""))[:1500],
                              "configs": str(comp.get("configs", ""))[:1500]})

    def __enter__(self):
        try:
            from triton import knobs
        except ImportError:
            return self
        rt = knobs.runtime
        if getattr(rt, "jit_cache_hook", None) is None and getattr(rt, "jit_post_compile_hook", None) is None:
            self._knobs = rt
            rt.jit_cache_hook, rt.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc):
        if self._knobs is not None:
            self._knobs.jit_cache_hook = self._knobs.jit_post_compile_hook = None
            self._knobs = None

    def record(self) -> dict:
        return {"jit_compiles": sum(self.names.values()), "jit_compile_s": self.total_s,
                "jit_compile_max_s": self.max_s, "jit_compiled": dict(self.names.most_common()),
                "jit_variants": self.variants}


def allocator_counts() -> dict:
    """The CUDA caching allocator's counters that cost a step host time: retries (a failed cudaMalloc,
    then every cached block freed and the malloc tried again), cudaMalloc and cudaFree calls.  Empty
    without CUDA; the difference of two calls is what happened in between."""
    import torch

    if not torch.cuda.is_available():
        return {}
    st = torch.cuda.memory_stats()
    return {"alloc_retries": st.get("num_alloc_retries", 0), "cuda_mallocs": st.get("num_device_alloc", 0),
            "cuda_frees": st.get("num_device_free", 0)}


def counts_since(before: dict) -> dict:
    """``allocator_counts()`` now minus ``before``, as ``{"allocator": {...}}`` (empty without CUDA)."""
    after = allocator_counts()
    return {"allocator": {k: after[k] - before.get(k, 0) for k in after}} if after else {}
