"""The floor of one long prompt's time to first token, from library kernels measured in this process.

    ttft_floor_s = sum over GEMM shapes (GEMM FLOPs of the shape / cuBLAS rate at that shape)
                 + attention FLOPs / rate of the fastest library causal-attention kernel

What is counted, for a prompt of L tokens served in chunks of M = max_num_batched_tokens:

- GEMMs (the engine's projections, ``F.linear`` as in kvq.models.llama): per layer and token
  2*K*N for qkv_proj [h -> (Hq + 2 Hkv) D], o_proj [Hq D -> h], gate_up_proj [h -> 2 I] and
  down_proj [I -> h], timed at M rows (the chunk, or L if shorter; the last, shorter chunk is
  counted at the same rate); lm_head [h -> V] on one row per chunk step (the engine scores the last row of every step,
  kvq.engine.model_runner), timed at 1 row.  Norms, RoPE, SiLU and the embedding lookup are not
  counted (memory-bound, small beside these at L >= 8K).
- Attention: causal, 4 * Hq * D * L^2 / 2 FLOPs per layer (QK^T and PV, 2 FLOPs per multiply-add,
  half the L x L square; the diagonal's extra L/2 is not counted), summed over the layers.  Chunked
  prefill (each chunk attends to the whole past) does the same causal work, so the count is the
  same.  The rate is that of one [L, Hq, D] causal call of the fastest kernel that ran: torch SDPA
  with the cuDNN, flash or memory-efficient backend (K/V expanded to Hq heads: the same FLOPs),
  FlashInfer's ``single_prefill_with_kv_cache`` (fa3 and fa2, K/V [L, Hkv, D], NHD) where it imports;
  on the CPU, SDPA flash and math.  A kernel that fails is recorded with its error, not raised.

Timing: the median of ``iters`` calls after ``warmup`` calls, a 256 MiB buffer zeroed before each
(L2 flushed) and, on CUDA, a short GPU spin so launch overhead stays out of the events; CUDA events
on a GPU, ``time.perf_counter`` on the CPU.

Beside the floor (not in it): the prompt's projections run back to back in the engine's order and
timed as one span (``gemm_sequence``, ``ttft_floor_sequence_s``).  Single calls after an idle spin
run at the clocks of a short burst; a prompt keeps the tensor cores busy for seconds, at the power
cap's clocks, and every engine's GEMMs pay that.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from benchmarks.bench_decode import Timer as DecodeTimer

MiB = 1 << 20


@dataclass(frozen=True)
class PrefillShape:
    """The shape facts a prefill's FLOPs need (an HF config.json's names in comments)."""

    hidden: int  # hidden_size
    intermediate: int  # intermediate_size
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int
    vocab: int  # vocab_size

    @classmethod
    def from_hf(cls, cfg: dict) -> "PrefillShape":
        cfg = cfg.get("text_config", cfg)
        heads = cfg["num_attention_heads"]
        return cls(hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"], layers=cfg["num_hidden_layers"],
                   heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab=cfg["vocab_size"])

    def gemms(self, chunk: int) -> dict[str, tuple[int, int, int]]:
        """name -> (M, K, N) of one step's GEMM: x [M, K] @ W^T, W [N, K]."""
        h, d = self.hidden, self.head_dim
        return {"qkv": (chunk, h, (self.heads + 2 * self.kv_heads) * d), "o": (chunk, self.heads * d, h),
                "gate_up": (chunk, h, 2 * self.intermediate), "down": (chunk, self.intermediate, h),
                "lm_head": (1, h, self.vocab)}


def prompt_flops(shape: PrefillShape, prompt_len: int, chunk: int) -> dict:
    """FLOPs of one prompt of ``prompt_len`` tokens in chunks of ``chunk`` (module docstring):
    {"gemm": {name: FLOPs}, "attention_per_layer": FLOPs, "attention": FLOPs}."""
    steps = math.ceil(prompt_len / chunk)
    gemm = {}
    for name, (_, k, n) in shape.gemms(chunk).items():
        rows = steps if name == "lm_head" else prompt_len * shape.layers
        gemm[name] = 2 * rows * k * n
    per_layer = attention_flops(shape, prompt_len)
    return {"gemm": gemm, "attention_per_layer": per_layer, "attention": per_layer * shape.layers}


def attention_flops(shape: PrefillShape, n: int) -> float:
    """One layer's causal attention over n tokens: 4 * Hq * D * n^2 / 2."""
    return 4 * shape.heads * shape.head_dim * n * n / 2


class Timer(DecodeTimer):
    """benchmarks/bench_decode.py's timer (median of single calls, L2 flushed before each, CUDA events on
    a GPU), in seconds."""

    def __call__(self, fn, iters: int, warmup: int) -> float:
        return super().__call__(fn, iters, warmup)["us"] / 1e6


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def measure_gemms(shape: PrefillShape, chunk: int, device: torch.device, dtype: torch.dtype, timer: Timer,
                  iters: int = 10, warmup: int = 3) -> dict:
    """name -> {"M", "K", "N", "s" (one call), "tflops"} of ``F.linear`` (cuBLAS on CUDA) at the
    prefill step's shapes; a shape that fails gets {"error"}."""
    out = {}
    g = torch.Generator(device=device).manual_seed(0)
    for name, (m, k, n) in shape.gemms(chunk).items():
        row = {"M": m, "K": k, "N": n}
        try:
            x = torch.randn(m, k, device=device, dtype=dtype, generator=g)
            w = torch.randn(n, k, device=device, dtype=dtype, generator=g) / math.sqrt(k)
            with torch.inference_mode():
                s = timer(lambda: F.linear(x, w), iters, warmup)
            row.update(s=s, tflops=2 * m * k * n / s / 1e12)
        except Exception as e:  # noqa: BLE001  (recorded, not raised: the floor says what ran)
            row["error"] = _error(e)
        finally:
            x = w = None
        out[name] = row
    return out


def measure_gemm_sequence(shape: PrefillShape, prompt_len: int, chunk: int, device: torch.device, dtype: torch.dtype,
                          warmup_layers: int = 2) -> dict:
    """The prompt's projections in the engine's order, back to back, timed as one span: every chunk step
    (the last one at its own rows), every layer, qkv, o, gate_up and down (one layer's weights for all
    layers: each matrix is larger than the L2, so nothing is reused across layers that the engine would
    not reuse).  The floor's rates come from single calls after an idle GPU spin, at the clocks a short
    burst gets; this is the rate cuBLAS keeps over the whole prompt, at the clocks and power a second of
    tensor-core work gets.  Reported beside the floor, not in it.  -> {"s", "tflops", "gemms"}."""
    g = torch.Generator(device=device).manual_seed(2)
    names = ("qkv", "o", "gate_up", "down")
    dims = {n: shape.gemms(chunk)[n][1:] for n in names}
    w = {n: torch.randn(n_, k, device=device, dtype=dtype, generator=g) / math.sqrt(k) for n, (k, n_) in dims.items()}
    rows = [min(chunk, prompt_len - s) for s in range(0, prompt_len, chunk)]
    x = {k: torch.randn(max(rows), k, device=device, dtype=dtype, generator=g) for k in {k for k, _ in dims.values()}}

    def layers(m: int, count: int):
        for _ in range(count):
            for n in names:
                F.linear(x[dims[n][0]][:m], w[n])

    with torch.inference_mode():
        layers(rows[0], warmup_layers)
        cuda = device.type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
        t0 = time.perf_counter()
        for m in rows:
            layers(m, shape.layers)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            s = start.elapsed_time(end) / 1e3
        else:
            s = time.perf_counter() - t0
    flops = sum(2 * m * k * n for m in rows for k, n in dims.values()) * shape.layers
    return {"s": s, "tflops": flops / s / 1e12, "gemms": len(rows) * shape.layers * len(names), "flops": flops}


def _sdpa(backend_name: str):
    def make(q, k, v, shape):  # q [L, Hq, D], k/v [L, Hkv, D] -> a call on [1, Hq, L, D]
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        rep = shape.heads // shape.kv_heads
        qh = q.transpose(0, 1).unsqueeze(0)
        kh, vh = (t.transpose(0, 1).repeat_interleave(rep, dim=0).unsqueeze(0) for t in (k, v))

        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        return call
    return make


def _flashinfer(backend: str):
    def make(q, k, v, shape):
        import flashinfer

        return lambda: flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, kv_layout="NHD", backend=backend)
    return make


def _flashinfer_ragged(backend: str):
    """FlashInfer's batch ragged prefill with one request, through kvq's own wrapper: the call kvq's prefill
    makes for a fresh prompt, whose modules travel prebuilt where the single-request API's may not."""
    def make(q, k, v, shape):
        from kvq.attention.flashinfer_lib import FlashInferLib

        lib = FlashInferLib(q.device, backend)
        handle = lib.prepare_ragged([q.shape[0]], shape.heads, shape.kv_heads, shape.head_dim, q.dtype,
                                    shape.head_dim ** -0.5, q.device)
        return lambda: lib.run_ragged(handle, q, k, v)
    return make


def attention_kernels(device: torch.device) -> dict:
    """name -> make(q, k, v, shape) -> call: the library causal kernels tried on this device."""
    if device.type == "cuda":
        return {"sdpa_cudnn": _sdpa("CUDNN_ATTENTION"), "sdpa_flash": _sdpa("FLASH_ATTENTION"),
                "sdpa_efficient": _sdpa("EFFICIENT_ATTENTION"), "flashinfer_fa3": _flashinfer("fa3"),
                "flashinfer_fa3_ragged": _flashinfer_ragged("fa3"), "flashinfer_fa2": _flashinfer("fa2")}
    return {"sdpa_flash": _sdpa("FLASH_ATTENTION"), "sdpa_math": _sdpa("MATH"), "sdpa_cudnn": _sdpa("CUDNN_ATTENTION"),
            "flashinfer_fa3": _flashinfer("fa3")}


def measure_attention(shape: PrefillShape, n: int, device: torch.device, dtype: torch.dtype, timer: Timer,
                      kernels: dict | None = None, iters: int = 5, warmup: int = 2) -> dict:
    """kernel -> {"s" (one layer's causal call over n tokens), "tflops"} or {"error"}."""
    kernels = attention_kernels(device) if kernels is None else kernels
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(n, shape.heads, shape.head_dim, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(n, shape.kv_heads, shape.head_dim, device=device, dtype=dtype, generator=g)
            for _ in range(2))
    flops, out = attention_flops(shape, n), {}
    for name, make in kernels.items():
        try:
            with torch.inference_mode():
                s = timer(make(q, k, v, shape), iters, warmup)
            out[name] = {"s": s, "tflops": flops / s / 1e12}
        except Exception as e:  # noqa: BLE001  (a kernel absent or refusing the shape: recorded)
            out[name] = {"error": _error(e)}
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the expanded K/V of SDPA, workspaces
    return out


def ttft_floor(shape: PrefillShape, prompt_len: int, chunk: int, device: torch.device | str | None = None,
               dtype: torch.dtype | None = None, attention_len: int | None = None, kernels: dict | None = None,
               flush_bytes: int | None = None, gemm_iters: int = 10, attention_iters: int = 5,
               sequence: bool = True) -> dict:
    """The floor of one prompt's TTFT (module docstring) and every rate it came from.

    ``attention_len``: the length the attention rate is measured at (default: the prompt's own);
    ``dtype``: bf16 on CUDA, float32 on the CPU (the engine's defaults); ``kernels``: attention
    candidates (default :func:`attention_kernels`).  ``ttft_floor_s`` is None when no GEMM or no
    attention kernel ran.  ``sequence``: also time the prompt's projections back to back
    (:func:`measure_gemm_sequence`; ``gemm_sequence``, and ``ttft_floor_sequence_s`` with them in place of
    the per-shape GEMM time, for context beside the floor)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    attention_len = attention_len or prompt_len
    timer = Timer(device, flush_bytes or (256 * MiB if device.type == "cuda" else 32 * MiB))
    flops = prompt_flops(shape, prompt_len, chunk)
    gemm = measure_gemms(shape, min(chunk, prompt_len), device, dtype, timer, iters=gemm_iters)
    attn = measure_attention(shape, attention_len, device, dtype, timer, kernels, iters=attention_iters)
    timer = None
    sequence = measure_gemm_sequence(shape, prompt_len, chunk, device, dtype) if sequence else None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gemm_ok = all("tflops" in r for r in gemm.values())
    gemm_s = sum(flops["gemm"][n] / (r["tflops"] * 1e12) for n, r in gemm.items()) if gemm_ok else None
    gemm_flops = sum(flops["gemm"].values())
    ran = {n: r for n, r in attn.items() if "tflops" in r}
    best = max(ran, key=lambda n: ran[n]["tflops"]) if ran else None
    attn_s = flops["attention"] / (ran[best]["tflops"] * 1e12) if best else None
    return {
        "prompt_len": prompt_len, "chunk": chunk, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "shape": asdict(shape),
        "gemm_flops": gemm_flops, "gemm_flops_per_shape": flops["gemm"], "gemm": gemm,
        "gemm_s": gemm_s, "gemm_tflops": gemm_flops / gemm_s / 1e12 if gemm_s else None,
        "gemm_best_tflops": max((r["tflops"] for r in gemm.values() if "tflops" in r), default=None),
        "attention_flops": flops["attention"], "attention_len": attention_len, "attention": attn,
        "attention_kernel": best, "attention_tflops": ran[best]["tflops"] if best else None, "attention_s": attn_s,
        "ttft_floor_s": gemm_s + attn_s if gemm_s is not None and attn_s is not None else None,
        "gemm_sequence": sequence,
        "ttft_floor_sequence_s": sequence["s"] + attn_s if sequence and attn_s is not None else None,
        "counts": "GEMMs: qkv, o, gate_up, down per layer and token at M=chunk rows + lm_head on one row per "
                  "chunk step, each shape at its own measured rate; attention: 4*Hq*D*L^2/2 per layer (causal, "
                  "chunked or not), at the fastest library kernel's rate measured at attention_len",
    }
