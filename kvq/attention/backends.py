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

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvq.cache.plan import CachePlan


log = logging.getLogger("kvq")


@dataclass(frozen=True)
class BackendChoice:
    requested: str
    resolved: str
    reason: str
    decode_per_layer: tuple[str, ...] = field(default=())  # the kernel that decodes each layer
    prefill: str = ""  # the kernel that runs prefill attention (select_prefill): flashinfer-fa3, triton, torch
    prefill_reason: str = ""


#: What the Triton decode costs where the CUDA kernel would serve (H200, `make bench-kernels`,
#: docs/results/bench_decode.json; decode time of kvq bf16 over the format's, 4x128K and 16x32K).
CUDA_DECODE_GAIN = ("8-bit formats decode at 1.7-1.8x bf16's speed with the CUDA kernel and 0.84-1.24x with "
                    "Triton; KIVI at 1.9-2.0x with CUDA and 1.04-1.06x with Triton (4x131072 on an H100, "
                    "docs/results/probe_decode_kivi_s27_h100/)")


def cuda_extra() -> str:
    """The pip extra that brings CuPy for the CUDA major version torch was built with."""
    major = (torch.version.cuda or "13").split(".")[0]
    return "kvq[cuda12]" if major == "12" else "kvq[cuda]"


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


def _import_triton() -> None:
    """``import triton`` with SIGINT/SIGTERM held back: a KeyboardInterrupt raised inside its native
    module's start-up (Python code called from its nanobind extension) ends the process in
    std::terminate (exit -6, seen in tests/test_server_shutdown.py when Ctrl-C landed there); a signal
    that arrives meanwhile is delivered to the usual handler right after the import."""
    import signal
    import sys
    import threading

    if "triton" in sys.modules or threading.current_thread() is not threading.main_thread():
        import triton  # noqa: F401
        return
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        import triton  # noqa: F401
    finally:
        for s, handler in before.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: a handler not set from Python
    for s in dict.fromkeys(caught):
        signal.raise_signal(s)


def _triton_check(plan: CachePlan, device: torch.device, dtype: torch.dtype) -> str | None:
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type != "cuda" and not interpret:
        return f"needs a CUDA device (got {device.type})"
    try:
        _import_triton()
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


def _cuda_parts(plan: CachePlan) -> tuple[list[tuple[bool, ...]], str | None]:
    """Per layer, per tier (one tier without elastic precision): whether the CUDA kernel decodes that
    tier's blocks (a tiered layer runs one launch a tier, each by its own format's kernel), and why the
    first other one is not."""
    from kvq.attention.cuda import decode8

    m = plan.model
    group = m.num_attention_heads // m.num_kv_heads
    parts, why_not = [], None
    for i in range(len(plan.layers)):
        row = []
        for t in range(plan.num_tiers + 1):
            f = plan.tier_layers(t)[i]
            why = decode8.layer_reason(f.k, f.v, m.head_dim, plan.block_size, group)
            row.append(why is None)
            if why is not None and why_not is None:
                why_not = f"layer {i}{f' tier {t} ({f.name})' if t else ''}: {why}"
        parts.append(tuple(row))
    return parts, why_not


def _cuda_layers(plan: CachePlan, dtype: torch.dtype) -> tuple[list[int], str | None]:
    """Layers whose decode the CUDA kernel serves (wholly, or some tiers of a tiered layer), and why the
    first other layer or tier is not."""
    parts, why_not = _cuda_parts(plan)
    return [i for i, row in enumerate(parts) if any(row)], why_not


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


def decode_per_layer(resolved: str, plan: CachePlan, dtype: torch.dtype) -> tuple[str, ...]:
    """The kernel that runs each layer's decode under backend ``resolved``."""
    if resolved != "cuda":
        return (resolved,) * len(plan.layers)
    parts, _ = _cuda_parts(plan)  # a tiered layer whose tiers differ: e.g. triton+cuda (bf16 > fp8_e4m3)
    return tuple("+".join(dict.fromkeys("cuda" if ok else "triton" for ok in row)) for row in parts)


def compact_layers(per_layer: tuple[str, ...]) -> str:
    """``cuda 0-29`` / ``triton 0-1, cuda 2-29``: runs of equal kernels over the layers."""
    runs: list[list] = []
    for i, name in enumerate(per_layer):
        if runs and runs[-1][0] == name and runs[-1][2] == i - 1:
            runs[-1][2] = i
        else:
            runs.append([name, i, i])
    return ", ".join(f"{n} {a}" if a == b else f"{n} {a}-{b}" for n, a, b in runs)


_warned_cuda: list[str] = []


def warn_if_cuda_decode_missing(plan: CachePlan, device: torch.device, dtype: torch.dtype) -> str | None:
    """On a CUDA device where the CUDA decode kernel would serve some layer of ``plan`` but cannot run
    (no CuPy, an older GPU), log one WARNING per process naming what is missing and what it costs;
    -> the message (None when nothing is missing)."""
    if torch.device(device).type != "cuda":
        return None
    from kvq.attention.cuda import decode8

    why = decode8.unavailable_reason()
    if why is None or not _cuda_layers(plan, dtype)[0]:
        return None
    fix = f"pip install '{cuda_extra()}'" if "CuPy" in why else "an sm_90 GPU (H100/H200)"
    msg = (f"the CUDA decode kernel cannot run here ({why}): layers stored in 8 bits or as KIVI decode with "
           f"the Triton kernels instead; {CUDA_DECODE_GAIN} (H200, docs/results/bench_decode.json). Fix: {fix}")
    if not _warned_cuda:
        _warned_cuda.append(msg)
        log.warning("%s", msg)
    return msg


def describe_cuda(plan: CachePlan, dtype: torch.dtype) -> str:
    """Which layers decode through CUDA and which through Triton (engine start line, records)."""
    served, why_not = _cuda_layers(plan, dtype)
    n = len(plan.layers)
    if why_not is None:
        return f"CUDA decode on all {n} layers" + (" and tiers" if plan.tiers else "")
    if len(served) == n:
        return f"CUDA decode on all {n} layers, Triton for some tiers ({why_not})"
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
                if cand == "triton":
                    warn_if_cuda_decode_missing(plan, device, dtype)
                return _BACKENDS[cand], BackendChoice("auto", cand, reason, decode_per_layer(cand, plan, dtype))
            passed.append(f"{cand}: {why}")
        raise ValueError("no attention backend serves this plan: " + "; ".join(passed))
    backend = get_backend(name)
    why = backend.unsupported_reason(plan, device, dtype)
    if why is not None:
        raise ValueError(f"attention backend {name!r} cannot serve this request: {why}")
    reason = "requested explicitly" + (f": {describe_cuda(plan, dtype)}" if name == "cuda" else "")
    return backend, BackendChoice(name, name, reason, decode_per_layer(name, plan, dtype))


# -- prefill -------------------------------------------------------------------------------------
#: ``--prefill-backend``: ``flashinfer`` (kvq.attention.split_prefill over FlashInfer's FA3/FA2,
#: the band kernel and page scratch in Triton), ``flashinfer-fp8`` (the same, with fp8_e4m3 layers
#: read as stored through FA3's FP8 tensor cores: an opt-in whose quality `kvq eval` measures),
#: ``triton`` (kvq.attention.triton.prefill), or ``auto``: flashinfer where it runs, else the
#: attention backend's own prefill kernel.
PREFILL_NAMES = ("auto", "flashinfer", "flashinfer-fp8", "triton")

#: What the Triton prefill costs where FlashInfer would serve (H200, issue 43's table, causal bf16,
#: Llama-3-8B heads: kvq Triton 212-300 TFLOP/s, FlashInfer FA3 319-556, cuDNN 427-621).
FLASHINFER_PREFILL_GAIN = "the Triton prefill runs at about half of FlashAttention-3's speed on an H200"

_warned_prefill: list[str] = []


def _own_prefill(resolved: str) -> str:
    return "torch" if resolved == "torch" else "triton"


def select_prefill(name: str, choice: BackendChoice, plan: CachePlan, device: torch.device | str) -> BackendChoice:
    """Resolve ``--prefill-backend`` beside the attention backend ``choice``: -> ``choice`` with its
    ``prefill`` kernel and the reason.  Raises ValueError when the named one cannot serve."""
    if name not in PREFILL_NAMES:
        raise ValueError(f"unknown prefill backend {name!r}; valid: {', '.join(PREFILL_NAMES)}")
    from dataclasses import replace

    from kvq.attention import flashinfer_lib

    device = torch.device(device)
    own = _own_prefill(choice.resolved)
    why = (f"the {choice.resolved} attention backend runs its own prefill" if own == "torch"
           else flashinfer_lib.unavailable_reason(device, plan.model.head_dim))
    if name == "flashinfer":
        if why is not None:
            raise ValueError(f"prefill backend 'flashinfer' cannot serve this request: {why}")
        return replace(choice, prefill=f"flashinfer-{flashinfer_lib.kernel_name(device)}",
                       prefill_reason="requested explicitly")
    if name == "flashinfer-fp8":
        if why is None and flashinfer_lib.kernel_name(device) != "fa3":
            why = "FP8 tensor-core prefill is FlashAttention-3's (Hopper, sm_90)"
        if why is None:
            why = _fp8_prefill_reason(plan)
        if why is not None:
            raise ValueError(f"prefill backend 'flashinfer-fp8' cannot serve this request: {why}")
        return replace(choice, prefill="flashinfer-fa3-fp8",
                       prefill_reason="requested explicitly: fp8_e4m3 layers read as stored through FA3's FP8 "
                                      "tensor cores (queries in e4m3), the others as 'flashinfer'")
    if name == "triton":
        if own != "triton":
            raise ValueError(f"prefill backend 'triton' cannot serve this request: attention backend "
                             f"{choice.resolved!r} (choose --attention-backend triton or cuda)")
        return replace(choice, prefill="triton", prefill_reason="requested explicitly")
    if why is None:
        return replace(choice, prefill=f"flashinfer-{flashinfer_lib.kernel_name(device)}",
                       prefill_reason="auto: FlashInfer's paged prefill serves this plan")
    if device.type == "cuda" and own == "triton" and not _warned_prefill:
        msg = f"FlashInfer's prefill cannot run here ({why}): prefill runs the Triton kernel; {FLASHINFER_PREFILL_GAIN}"
        _warned_prefill.append(msg)
        log.warning("%s", msg)
    return replace(choice, prefill=own, prefill_reason=f"auto: {why}")


def _fp8_prefill_reason(plan: CachePlan) -> str | None:
    """Why no layer of ``plan`` prefills through FP8 tensor cores (None: some layer does): an fp8_e4m3
    layer with static scales, read as stored, i.e. with no sink or recent window in high precision."""
    from kvq.attention.split_prefill import fp8_tensor_cores_reason

    if all(fp8_tensor_cores_reason(f) for f in plan.layers):
        return "no layer is fp8_e4m3 (K and V, static scales); valid KV cache dtypes: fp8_e4m3 (fp8, e4m3)"
    if plan.tiers:
        return ("FP8 tensor cores read the pool's e4m3 codes in place; a tiered cache (--kv-cache-tiers) "
                "holds other formats' blocks in its tables, read through the page scratch (use 'flashinfer')")
    pol = plan.window_policy
    if pol.sink_blocks or pol.residual_tokens:
        return (f"FP8 tensor cores read the cache as stored; this plan keeps {pol.sink_blocks} sink block(s) and "
                f"{pol.residual_tokens} recent token(s) in high precision (set both windows to 0)")
    return None


def prefill_kernels(kernels, choice: BackendChoice, device: torch.device | str):
    """The backend's ``kernels`` with ``paged_attention`` from ``choice.prefill`` (a namespace with the
    kernels' names; ``kernels`` itself when the backend's own prefill runs)."""
    if not choice.prefill.startswith("flashinfer"):
        return kernels
    from kvq.attention.flashinfer_lib import FlashInferLib
    from kvq.attention.split_prefill import SplitPrefill

    backend, _, opt = choice.prefill.split("-", 1)[1].partition("-")  # "fa3", "fa2", "fa3-fp8"
    return with_prefill(kernels, SplitPrefill(FlashInferLib(device, backend), fp8=opt == "fp8").paged_attention)


def with_prefill(kernels, paged_attention):
    """A namespace of ``kernels``' functions (its ``__all__``) with ``paged_attention`` replaced."""
    from types import SimpleNamespace

    return SimpleNamespace(**{**{n: getattr(kernels, n) for n in kernels.__all__}, "paged_attention": paged_attention,
                              "__all__": kernels.__all__})
