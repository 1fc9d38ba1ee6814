"""Attention backends: what each serves, and an explicit, reported choice.

A backend declares the devices, formats, head dims, page sizes and query
dtypes it supports.  ``select_backend(name, ...)`` returns the backend and a
:class:`BackendChoice` (requested, resolved, reason) that the engine logs and
the evaluation records.  Naming a backend that cannot serve the request raises
``ValueError`` with the reason; ``auto`` picks the first capable backend in
preference order and says why the others were passed over.  Nothing falls back
silently (seed 004).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from kvq.cache.plan import CachePlan


@dataclass(frozen=True)
class BackendChoice:
    requested: str
    resolved: str
    reason: str


@dataclass(frozen=True)
class AttentionBackend:
    """A set of kernels with the signatures of :mod:`kvq.attention.reference`."""

    name: str
    description: str
    check: Callable[[CachePlan, torch.device, torch.dtype], str | None]  # None = supported, else why not
    load: Callable[[], "object"]  # -> module with write_kv, seal_blocks, seal_pairs, paged_attention, paged_decode

    def unsupported_reason(self, plan: CachePlan, device, dtype: torch.dtype) -> str | None:
        return self.check(plan, torch.device(device), dtype)

    def kernels(self):
        return self.load()


def _torch_check(plan: CachePlan, device: torch.device, dtype: torch.dtype) -> str | None:
    return None  # the reference serves every format on every device


def _load_torch():
    from kvq.attention import reference

    return reference


TRITON_HEAD_DIMS = (64, 128, 256)
TRITON_PAGE_SIZES = (16, 32, 64, 128)


def _triton_check(plan: CachePlan, device: torch.device, dtype: torch.dtype) -> str | None:
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type != "cuda" and not interpret:
        return f"needs a CUDA device (got {device.type})"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'kvq[gpu]')"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"queries must be bfloat16 or float16, not {dtype}"
    m = plan.model
    if m.head_dim not in TRITON_HEAD_DIMS:
        return f"head_dim {m.head_dim} not in {TRITON_HEAD_DIMS}"
    if plan.block_size not in TRITON_PAGE_SIZES:
        return f"block size {plan.block_size} not in {TRITON_PAGE_SIZES}"
    for i, f in enumerate(plan.layers):
        for t in (f.k, f.v):
            if t.reference_only:
                return f"layer {i}: {t.name} has only a reference implementation"
            if t.family == "dense" and t.storage == "float32":
                return f"layer {i}: float32 KV is served by the torch reference only"
    return None


def _load_triton():
    from kvq.attention.triton import kernels

    return kernels


def _cuda_layers(plan: CachePlan, dtype: torch.dtype) -> tuple[list[int], str | None]:
    """Layers whose decode the CUDA kernel serves, and why the first other one is not."""
    from kvq.attention.cuda import decode8

    m = plan.model
    group = m.num_attention_heads // m.num_kv_heads
    served, why_not = [], None
    for i, f in enumerate(plan.layers):
        why = decode8.layer_reason(f.k, f.v, m.head_dim, plan.block_size, group)
        if why is None:
            served.append(i)
        elif why_not is None:
            why_not = f"layer {i}: {why}"
    return served, why_not


def _cuda_check(plan: CachePlan, device: torch.device, dtype: torch.dtype) -> str | None:
    """The cuda backend serves what Triton serves (its other layers run the Triton kernels), so
    every format of an evaluation resolves to the same backend name on one machine and a
    fallback (to the torch reference) still stands out; it needs CuPy and sm_90."""
    why = _triton_check(plan, device, dtype)
    if why is not None:
        return why
    from kvq.attention.cuda import decode8

    return decode8.unavailable_reason()


def _load_cuda():
    from kvq.attention.cuda import kernels

    return kernels


def describe_cuda(plan: CachePlan, dtype: torch.dtype) -> str:
    """Which layers decode through CUDA and which through Triton (engine start line, records)."""
    served, why_not = _cuda_layers(plan, dtype)
    n = len(plan.layers)
    if len(served) == n:
        return f"CUDA decode on all {n} layers"
    if not served:
        return f"Triton kernels on all {n} layers (no layer stored in 8 bits or KIVI: {why_not})"
    return f"CUDA decode on {len(served)} of {n} layers, Triton on the rest ({why_not})"


_BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        AttentionBackend("cuda", "CUDA decode (mma.sync, cp.async pipeline) where a layer is stored in 8 bits "
                         "or KIVI; the Triton kernels for prefill, writes and every other layer", _cuda_check,
                         _load_cuda),
        AttentionBackend("triton", "Triton kernels: fused dequant paged decode/prefill, quantize-on-store",
                         _triton_check, _load_triton),
        AttentionBackend("torch", "plain-torch reference (every format, every device; slow)", _torch_check,
                         _load_torch),
    )
}
#: Preference order for ``auto``.
AUTO_ORDER = ("cuda", "triton", "torch")


def backend_names() -> list[str]:
    return ["auto", *_BACKENDS]


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(backend_names())}")
    return _BACKENDS[name]


def select_backend(
    name: str, plan: CachePlan, device: torch.device | str, dtype: torch.dtype
) -> tuple[AttentionBackend, BackendChoice]:
    """Resolve ``--attention-backend``; raise ValueError if the named one can't serve."""
    device = torch.device(device)
    if name == "auto":
        passed = []
        for cand in AUTO_ORDER:
            why = _BACKENDS[cand].unsupported_reason(plan, device, dtype)
            if why is None:
                reason = f"auto: {cand} serves {plan.layers[0].name} on {device.type}"
                if cand == "cuda":
                    reason += f": {describe_cuda(plan, dtype)}"
                if passed:
                    reason += " (" + "; ".join(passed) + ")"
                return _BACKENDS[cand], BackendChoice("auto", cand, reason)
            passed.append(f"{cand}: {why}")
        raise ValueError("no attention backend serves this plan: " + "; ".join(passed))
    backend = get_backend(name)
    why = backend.unsupported_reason(plan, device, dtype)
    if why is not None:
        raise ValueError(f"attention backend {name!r} cannot serve this request: {why}")
    reason = "requested explicitly" + (f": {describe_cuda(plan, dtype)}" if name == "cuda" else "")
    return backend, BackendChoice(name, name, reason)
