#!/usr/bin/env python3
"""Paged decode attention and quantize-on-store throughput, every KV format, with baselines.

What it measures (details and byte counting in benchmarks/README.md):

1. the device-to-device copy bandwidth (the ceiling every GB/s is compared with);
2. kvq's Triton ``write_kv`` (quantize-on-store) for a prefill-sized write;
3. kvq's Triton ``paged_decode`` for every format and shape, on a resident pool
   filled with random K/V (no high-precision blocks, ``has_hp=False``), pages
   scattered at random;
4. baselines on the same data and page layout: FlashInfer's tensor-core batch
   decode (bf16 and fp8 e4m3 KV), FlashInfer's XQA decode (fp8 e4m3 KV), and
   torch SDPA on dense contiguous bf16 K/V.

Every decode result is checked against :func:`kvq.attention.reference.paged_decode`
before it is timed, and the check is recorded next to the time.

Usage::

    python benchmarks/bench_decode.py [--smoke] [--shapes 64x4096,...] [--formats ...]
        [--iters N] [--out PATH] [--no-flashinfer]

Without a CUDA device the Triton kernels run under TRITON_INTERPRET=1 (set here
before triton is imported) and times come from ``time.perf_counter``: use
``--smoke`` there (tiny shapes).  JSON is rewritten after every result, so a
killed run still leaves what it measured; a PNG plot is written next to it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without installing kvq

# FlashInfer's JIT settings; must be in the environment before `import flashinfer`.
os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(REPO / ".flashinfer"))
os.environ.setdefault("FLASHINFER_NO_DOWNLOAD", "1")
os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton's CPU interpreter; must precede the first `import triton` (kvq.attention.triton).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from kvq.attention import reference as ref_attn  # noqa: E402
from kvq.attention.triton import decode as tri_decode  # noqa: E402
from kvq.attention.triton import store as tri_store  # noqa: E402
from kvq.cache.plan import bare_model, make_plan  # noqa: E402
from kvq.cache.pool import KVPool  # noqa: E402
from kvq.formats import fp8 as fp8_util  # noqa: E402
from kvq.formats.registry import resolve_kv  # noqa: E402

DEFAULT_SHAPES = "64x4096,16x32768,4x131072,256x1024"
DEFAULT_FORMATS = (
    "bfloat16,fp8_e4m3,fp8_e5m2,fp8_per_token_head,fp8_per_block,int8,int8_per_token_head,int4_kivi,int2_kivi"
)
SMOKE_SHAPES = "2x64,1x96"
#: GPU spin before each timed call, after the L2 flush: ~0.5 ms at 1.98 GHz, so the
#: host's launch overhead (several launches for a write with block seals) overlaps the
#: flush and sleep instead of the timed region.
SLEEP_CYCLES = 1_000_000
#: Flag a check whose relative L2 error exceeds this.
FLAG_REL_ERR = 2e-2
POOL_SEED = 1234  # same random K/V in every format's pool
MiB = 1 << 20


@dataclass(frozen=True)
class Config:
    hq: int
    hkv: int
    d: int
    page: int  # block size; formats that need more (KIVI: 32) use lcm(page, their minimum)
    write_tokens: int
    flush_bytes: int
    copy_bytes: int
    iters: int
    warmup: int
    copy_iters: int
    fill_chunk: int  # hp blocks filled with fresh random data per seal round


FULL = dict(hq=32, hkv=8, d=128, page=16, write_tokens=16384, flush_bytes=256 * MiB, copy_bytes=4096 * MiB,
            iters=30, warmup=5, copy_iters=10, fill_chunk=1024)
SMOKE = dict(hq=4, hkv=2, d=64, page=16, write_tokens=64, flush_bytes=4 * MiB, copy_bytes=16 * MiB,
             iters=2, warmup=1, copy_iters=2, fill_chunk=3)

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def err_str(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {e}"[:2000] + where


# -- results file ----------------------------------------------------------------------------------
def _clean(x):
    """JSON-safe copy: NaN/inf -> None, tuples -> lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


class Results:
    def __init__(self, path: Path, doc: dict):
        self.path = path
        self.doc = doc
        path.parent.mkdir(parents=True, exist_ok=True)
        self.save()

    def add(self, section: str, row: dict) -> None:
        self.doc.setdefault(section, []).append(row)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(_clean(self.doc), indent=1) + "\n")
        os.replace(tmp, self.path)


# -- timing ------------------------------------------------------------------------------------------
class Timer:
    """Median of ``iters`` single calls, L2 flushed before each (CUDA events on a GPU)."""

    def __init__(self, device: torch.device, flush_bytes: int):
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device)
        self.sleep = getattr(torch.cuda, "_sleep", None) if self.cuda else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn, iters: int, warmup: int) -> dict:
        for _ in range(warmup):
            fn()
        self.sync()
        times, host = [], []
        if self.cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(iters)]
            for start, end in events:
                self.flush.zero_()
                if self.sleep is not None:
                    self.sleep(SLEEP_CYCLES)
                start.record()
                h0 = time.perf_counter()
                fn()
                host.append((time.perf_counter() - h0) * 1e6)
                end.record()
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) * 1e3 for s, e in events]
        else:
            for _ in range(iters):
                self.flush.zero_()
                h0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - h0) * 1e6)
            host = times
        return {
            "us": statistics.median(times),
            "us_min": min(times),
            "us_max": max(times),
            "host_us": statistics.median(host),  # enqueue time of one call (GPU: hidden behind flush+sleep)
            "n": len(times),
            "samples_us": [round(t, 2) for t in times],
        }


def bw(nbytes: int, us: float | None) -> float | None:
    return nbytes / (us * 1e-6) / 1e9 if us else None


# -- data ----------------------------------------------------------------------------------------------
class KVGen:
    """Random normal K/V with a few outlier channels (large and biased in K, as in real models)."""

    def __init__(self, d: int, device: torch.device, seed: int):
        self.device = device
        self.g = torch.Generator(device=device)
        self.g.manual_seed(seed)
        self.k_out = torch.tensor(sorted({3 % d, 17 % d, 42 % d, 101 % d}), device=device)
        self.v_out = torch.tensor([7 % d], device=device)

    def _randn(self, shape) -> torch.Tensor:
        return torch.randn(shape, generator=self.g, device=self.device, dtype=torch.float32)

    def k(self, shape) -> torch.Tensor:
        x = self._randn(shape)
        x[..., self.k_out] = x[..., self.k_out] * 6.0 + 4.0
        return x.to(torch.bfloat16)

    def v(self, shape) -> torch.Tensor:
        x = self._randn(shape)
        x[..., self.v_out] = x[..., self.v_out] * 4.0
        return x.to(torch.bfloat16)


def block_size_for(fmt_name: str, cfg: Config) -> int:
    return math.lcm(cfg.page, resolve_kv(fmt_name).min_block_size())


def make_layer(fmt_name: str, cfg: Config, num_q: int, num_hp: int, device: torch.device):
    bs = block_size_for(fmt_name, cfg)
    model = bare_model(1, cfg.hkv, cfg.d, num_attention_heads=cfg.hq)
    plan = make_plan(model, fmt_name, block_size=bs, sink_tokens=0, residual_tokens=0)
    pool = KVPool.create(plan, num_q, num_hp, device)
    return plan, pool, pool.layers[0], bs


def build_filled_pool(fmt_name: str, cfg: Config, num_q: int, device: torch.device):
    """A resident pool of ``num_q`` blocks, every block sealed from fresh random hp data."""
    nhp = max(1, min(cfg.fill_chunk, num_q))
    plan, pool, layer, bs = make_layer(fmt_name, cfg, num_q, nhp, device)
    gen = KVGen(cfg.d, device, POOL_SEED)
    src = torch.arange(nhp, dtype=torch.int64, device=device)
    shape = (nhp, cfg.hkv, bs, cfg.d)
    for start in range(0, num_q, nhp):
        cnt = min(nhp, num_q - start)
        layer.k_hp.copy_(gen.k(shape))
        layer.v_hp.copy_(gen.v(shape))
        dst = torch.arange(start, start + cnt, dtype=torch.int64, device=device)
        tri_store.seal_blocks(layer, src[:cnt], dst)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return plan, pool, layer, bs


def shape_seed(B: int, L: int, bs: int) -> int:
    return (B * 1_000_003 + L * 7919 + bs) % (2**31)


def make_tables(B: int, L: int, bs: int, num_q: int, device: torch.device):
    """Block tables [B, ceil(L/bs)]: a random permutation of physical block ids."""
    nb = -(-L // bs)
    g = torch.Generator().manual_seed(shape_seed(B, L, bs))
    perm = torch.randperm(num_q, generator=g)[: B * nb]
    tables = perm.view(B, nb).to(torch.int32).to(device)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    return tables, lens


def make_q(B: int, L: int, cfg: Config, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(shape_seed(B, L, 0) + 1)
    return torch.randn(B, cfg.hq, cfg.d, generator=g).to(torch.bfloat16).to(device)


def blocks_needed(shapes, bs: int) -> int:
    return max(B * -(-L // bs) for B, L in shapes)


# -- checks --------------------------------------------------------------------------------------------
def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    o, r = out.double().cpu(), ref.double().cpu()
    finite = bool(torch.isfinite(o).all())
    diff = o - r
    rel_l2 = (diff.norm() / r.norm().clamp_min(1e-30)).item() if finite else float("nan")
    max_rel = (diff.abs().max() / r.abs().max().clamp_min(1e-30)).item() if finite else float("nan")
    return {"rel_l2": rel_l2, "max_rel": max_rel, "finite": finite,
            "ok": bool(finite and rel_l2 <= FLAG_REL_ERR)}


def check_rows(B: int) -> list[int]:
    return sorted({0, B - 1})


def reference_rows(q, layer, tables, lens, rows, sm_scale) -> torch.Tensor:
    """fp32 reference output of sequences ``rows`` (same bf16 query values)."""
    idx = torch.tensor(rows, device=q.device)
    return ref_attn.paged_decode(q[idx].float(), layer, tables[idx], lens[idx], sm_scale)


def partial_lens(L: int) -> list[int]:
    """Two truncated lengths that end inside a block (tests masking of partial pages/tiles)."""
    n1 = min(L, 1000)
    n2 = max(1, min(L, n1 * 3 // 4 + 3))
    return [n1, n2]


# -- environment ---------------------------------------------------------------------------------------
def pkg_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except Exception:
        return None


def environment(device: torch.device) -> dict:
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "flashinfer": pkg_version("flashinfer-python") or pkg_version("flashinfer"),
        "device": str(device),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0") == "1",
        "env": {k: os.environ.get(k) for k in ("FLASHINFER_CUDA_ARCH_LIST", "FLASHINFER_WORKSPACE_BASE",
                                                 "FLASHINFER_NO_DOWNLOAD", "TVM_FFI_DISABLE_TORCH_C_DLPACK",
                                                 "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")},
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, sm_count=p.multi_processor_count, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   capability=f"{p.major}.{p.minor}")
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            pass
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine())
    try:
        env["git_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                           text=True, timeout=20).stdout.strip()
        env["git_dirty"] = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                                               capture_output=True, text=True, timeout=20).stdout.strip())
    except Exception:
        pass
    return env


NOTES = {
    "GBps": "bytes / median time, 1 GB = 1e9 bytes; pct_copy = GBps / measured copy GBps",
    "decode_bytes": (
        "Q (B*Hq*D*2) + O (B*Hq*D*2) + every byte of the K and V planes read: blocks read "
        "(B*ceil(L/block_size)) x TensorFormat.block_bytes(Hkv, D, block_size) for K and for V "
        "(data + scales + zero points, from kvq.formats.spec). NOT counted: the split-K partial "
        "output / LSE workspace (kvq and FlashInfer), block tables, sequence lengths, per-layer static scales."
    ),
    "sdpa_bytes": "Q + O + the dense K and V tensors passed to SDPA (contiguous [B,Hkv,L,D] bf16)",
    "write_bytes": (
        "input bf16 K and V read (2*T*H*D*2) + stored planes written ((T/block_size) x "
        "KVFormat.block_bytes, data + scales + zero points); slots not counted"
    ),
    "copy": "device-to-device copy of copy_bytes; bytes = read + written; median of copy_iters",
    "timing": (
        "one call per sample; before each: a flush_bytes buffer is written (L2 flush) and, on a GPU, "
        f"torch.cuda._sleep({SLEEP_CYCLES}) so the host's launch overhead overlaps it; CUDA events around the "
        "call; median over iters after warmup calls (FlashInfer JIT compile is in the first, untimed call). "
        "host_us = host time to enqueue one call (if it approaches flush+sleep time, launch gaps leak in)."
    ),
    "cache": (
        "pools built with make_plan(bare_model(1, Hkv, D, num_attention_heads=Hq), fmt, block_size, "
        "sink_tokens=0, residual_tokens=0); every resident block sealed by kvq's Triton seal kernel from fresh "
        "random normal K/V (K: 4 outlier channels x6+4, V: 1 channel x4); tables hold resident blocks only "
        "(has_hp=False); pages are a random permutation of the pool's block ids; every sequence has length L"
    ),
    "checks": (
        "check: rows {0, B-1} of the timed call's output vs kvq.attention.reference.paged_decode in fp32 on the "
        "same stored data; check_partial (smallest shape only): a separate call on 2 sequences truncated to "
        "lengths ending inside a block; vs_kvq: whole-batch output vs kvq Triton on the same pool; "
        f"flagged (!) when rel_l2 > {FLAG_REL_ERR} or non-finite"
    ),
    "flashinfer": (
        "flashinfer-tc: BatchDecodeWithPagedKVCacheWrapper(ws, 'HND', use_tensor_cores=True), plan(indptr, "
        "indices, last_page_len, Hq, Hkv, D, page, q_data_type=bf16, kv_data_type=bf16|float8_e4m3fn, "
        "sm_scale), run(q, (k_pages, v_pages), out=out), reading kvq's own bf16 / fp8_e4m3 pools (layout "
        "[pages, Hkv, page, D] = HND). flashinfer-xqa: flashinfer.decode.xqa_batch_decode_with_kv_cache(q, "
        "(k_pages, v_pages), ws, block_tables, seq_lens, L, bmm1_scale=sm_scale, bmm2_scale=1.0, out=out, "
        "kv_layout='HND'). fp8 KV scales are 1.0 (kvq's fp8_e4m3 is a direct cast)"
    ),
    "sdpa": "torch.nn.functional.scaled_dot_product_attention(q[B,Hq,1,D], K, V [B,Hkv,L,D], scale, enable_gqa=True)",
}


# -- measurements --------------------------------------------------------------------------------------
def measure_copy(cfg: Config, device: torch.device, timer: Timer, res: Results) -> float | None:
    log(f"copy bandwidth: {cfg.copy_bytes / 2**30:.2f} GiB device-to-device")
    try:
        src = torch.empty(cfg.copy_bytes, dtype=torch.uint8, device=device)
        src.random_(0, 256)
        dst = torch.empty_like(src)
        t = timer(lambda: dst.copy_(src), cfg.copy_iters, 2)
        nbytes = 2 * cfg.copy_bytes
        row = {"bytes": nbytes, **t, "GBps": bw(nbytes, t["us"])}
        src = dst = None  # free (the timed lambda above refers to them)
    except Exception as e:
        row = {"error": err_str(e)}
    res.doc["copy"] = row
    res.save()
    free(device)
    if row.get("GBps"):
        log(f"copy: {row['us']:.1f} us, {row['GBps']:.0f} GB/s")
    else:
        log(f"copy FAILED: {row.get('error')}")
    return row.get("GBps")


def free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def pct(gbps, copy_gbps):
    return 100.0 * gbps / copy_gbps if gbps and copy_gbps else None


def measure_write(fmt_name: str, cfg: Config, device: torch.device, timer: Timer, copy_gbps) -> dict:
    """write_kv of a prefill-sized chunk (T tokens filling T/bs whole, scattered blocks): Triton's, and
    the cuda backend's where its block seal (seal.cu) serves the layer."""
    bs = block_size_for(fmt_name, cfg)
    T = cfg.write_tokens - cfg.write_tokens % bs
    nb = T // bs
    row = {"format": fmt_name, "block_size": bs, "T": T, "H": cfg.hkv, "D": cfg.d}
    plan, pool, layer, _ = make_layer(fmt_name, cfg, nb, 1, device)
    fmt = plan.layers[0]
    row["path"] = "per-token" if fmt.write_direct else "per-token + block seal (whole blocks)"
    gen = KVGen(cfg.d, device, POOL_SEED + 1)
    k = gen.k((T, cfg.hkv, cfg.d))
    v = gen.v((T, cfg.hkv, cfg.d))
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(shape_seed(T, 0, bs))).to(device)
    tok = torch.arange(T, device=device)
    slots = (perm[tok // bs] * bs + tok % bs).to(torch.int64)
    full_blocks = torch.stack([perm, torch.arange(nb, device=device) * bs], dim=1).to(torch.int64).contiguous()
    read = k.numel() * k.element_size() + v.numel() * v.element_size()
    written = nb * fmt.block_bytes(cfg.hkv, cfg.d, bs)
    row["bytes"] = {"read": read, "written": written, "total": read + written}

    writers = {"triton": tri_store.write_kv}
    cuda_write = cuda_write_kv(layer, device)
    if cuda_write is not None:  # the cuda backend seals KIVI and per-block layers with seal.cu
        writers["cuda"] = cuda_write
    for impl, write in writers.items():
        out = row if impl == "triton" else row.setdefault("cuda", {})

        def fn():
            write(layer, k, v, slots, full_blocks)

        fn()  # compile
        t = timer(fn, cfg.iters, cfg.warmup)
        out.update(t)
        out["GBps"] = bw(read + written, t["us"])
        out["pct_copy"] = pct(out["GBps"], copy_gbps)
        out["check"] = check_write(fmt_name, cfg, nb, bs, layer, k, v, slots, perm, device)
    del pool
    layer = k = v = None  # free before the next format (the timed closure refers to them)
    free(device)
    return row


def cuda_write_kv(layer, device):
    """The cuda backend's write_kv where it differs from the Triton one (a CUDA block seal), else None."""
    if device.type != "cuda":
        return None
    from kvq.attention.cuda import decode8, seal
    from kvq.attention.cuda import kernels as cuda_kernels

    if decode8.unavailable_reason() or seal.layer_reason(layer):
        return None
    return cuda_kernels.write_kv


def check_write(fmt_name, cfg, nb, bs, layer, k, v, slots, perm, device) -> dict:
    """The first few written blocks against the reference write (bit patterns of every plane)."""
    try:
        T = k.shape[0]
        tc = min(T, 4 * bs)
        _, rpool, rlayer, _ = make_layer(fmt_name, cfg, nb, 1, device)
        ref_attn.write_kv(rlayer, k[:tc], v[:tc], slots[:tc])
        blocks = perm[: tc // bs].to(torch.int64)
        total = diff = 0
        for role in ("k", "v"):
            for name, t_plane in layer.planes(role).items():
                a = fp8_util.index_select(t_plane, 0, blocks).contiguous().view(torch.uint8)
                b = fp8_util.index_select(rlayer.planes(role)[name], 0, blocks).contiguous().view(torch.uint8)
                total += a.numel()
                diff += int((a != b).sum().item())
        # a rotated codebook rotates with one float32 product in the kernels and a butterfly in the reference:
        # a coordinate within rounding of a threshold may code a level apart (tests/test_codebook.py allows
        # one data byte in a thousand); every other format's bytes are equal
        rotated = any(rlayer.tensor_format(r).family == "rot" for r in ("k", "v"))
        ok = diff <= 1e-3 * total if rotated else diff == 0
        return {"blocks": int(blocks.numel()), "bytes_compared": total, "bytes_differ": diff, "ok": ok}
    except Exception as e:
        return {"error": err_str(e), "ok": False}


def decode_row(impl: str, fmt_name: str, B: int, L: int, cfg: Config, bs: int, q_bytes: int, kv_bytes: int,
               nblocks: int) -> dict:
    return {"impl": impl, "format": fmt_name, "shape": f"{B}x{L}", "B": B, "L": L, "Hq": cfg.hq, "Hkv": cfg.hkv,
            "D": cfg.d, "block_size": bs, "blocks_read": nblocks,
            "bytes": {"q": q_bytes, "o": q_bytes, "kv": kv_bytes, "total": 2 * q_bytes + kv_bytes}}


def kv_bytes_of(plan, B: int, L: int, cfg: Config, bs: int) -> tuple[int, int]:
    fmt = plan.layers[0]
    nblocks = B * -(-L // bs)
    per_block = fmt.k.block_bytes(cfg.hkv, cfg.d, bs) + fmt.v.block_bytes(cfg.hkv, cfg.d, bs)
    return nblocks, nblocks * per_block


def finish(row: dict, t: dict, copy_gbps) -> dict:
    row.update(t)
    row["GBps"] = bw(row["bytes"]["total"], t["us"])
    row["pct_copy"] = pct(row["GBps"], copy_gbps)
    return row


def kvq_impls(layer, group: int) -> dict:
    """kvq's decode kernels that serve this layer: name -> paged_decode."""
    impls = {"kvq-triton": tri_decode.paged_decode}
    try:
        from kvq.attention.cuda import decode8
    except ImportError:
        return impls
    if decode8.unavailable_reason() is None and decode8.unsupported_reason(layer, group, torch.bfloat16) is None:
        impls["kvq-cuda"] = decode8.paged_decode
    return impls


def run_kvq_format(fmt_name, shapes, smallest, cfg, device, timer, res, copy_gbps) -> None:
    bs = block_size_for(fmt_name, cfg)
    nq = blocks_needed(shapes, bs)
    t_fill = time.perf_counter()
    plan, pool, layer, bs = build_filled_pool(fmt_name, cfg, nq, device)
    log(f"  {fmt_name}: pool of {nq} blocks (bs={bs}) filled in {time.perf_counter() - t_fill:.1f}s")
    sm_scale = 1.0 / math.sqrt(cfg.d)
    for impl, decode in kvq_impls(layer, cfg.hq // cfg.hkv).items():
        for B, L in shapes:
            nblocks, kv_bytes = kv_bytes_of(plan, B, L, cfg, bs)
            row = decode_row(impl, fmt_name, B, L, cfg, bs, B * cfg.hq * cfg.d * 2, kv_bytes, nblocks)
            try:
                tables, lens = make_tables(B, L, bs, nq, device)
                q = make_q(B, L, cfg, device)

                def fn():
                    return decode(q, layer, tables, lens, sm_scale, max_seq_len=L, has_hp=False)

                t_first = time.perf_counter()
                out = fn()
                timer.sync()
                row["first_call_s"] = time.perf_counter() - t_first
                rows = check_rows(B)
                ref = reference_rows(q, layer, tables, lens, rows, sm_scale)
                row["check"] = {"rows": rows, **compare(out[rows], ref)}
                if (B, L) == smallest:
                    plens = partial_lens(L)
                    idx = torch.tensor(rows[:1] * 2 if len(rows) == 1 else rows, device=device)
                    pl = torch.tensor(plens, dtype=torch.int32, device=device)
                    po = decode(q[idx], layer, tables[idx], pl, sm_scale, max_seq_len=max(plens), has_hp=False)
                    pr = ref_attn.paged_decode(q[idx].float(), layer, tables[idx], pl, sm_scale)
                    row["check_partial"] = {"lens": plens, **compare(po, pr)}
                del out
                finish(row, timer(fn, cfg.iters, cfg.warmup), copy_gbps)
                log(f"  {impl} {fmt_name:20s} {B}x{L}: {row['us']:8.1f} us {row['GBps']:7.0f} GB/s "
                    f"({row['pct_copy'] or 0:.0f}% copy) err {row['check']['rel_l2']:.1e}")
            except Exception as e:
                row["error"] = err_str(e)
                log(f"  {impl} {fmt_name} {B}x{L} FAILED: {row['error']}")
            res.add("decode", row)
    del pool
    layer = None  # the timed closures refer to it
    free(device)


# -- baselines -----------------------------------------------------------------------------------------
def gather_dense(data: torch.Tensor, tables: torch.Tensor, L: int) -> torch.Tensor:
    """Pages [N, H, bs, D] + tables [B, nb] -> contiguous [B, H, L, D]."""
    B, nb = tables.shape
    _, H, bs, D = data.shape
    x = data[tables.long()]  # [B, nb, H, bs, D]
    return x.permute(0, 2, 1, 3, 4).reshape(B, H, nb * bs, D)[:, :, :L].contiguous()


def sdpa_route(q, layer, tables, lens, L, sm_scale, state):
    """torch SDPA on dense contiguous bf16 K/V, GQA without materializing repeated heads."""
    kd = gather_dense(layer.k["data"], tables, L)
    vd = gather_dense(layer.v["data"], tables, L)
    q4 = q.unsqueeze(2)  # [B, Hq, 1, D]

    def fn():
        return F.scaled_dot_product_attention(q4, kd, vd, scale=sm_scale, enable_gqa=True).squeeze(2)

    info = {"gqa": "enable_gqa=True", "kv_bytes_dense": kd.numel() * kd.element_size() * 2}

    def partial(idx, plens):
        outs = []
        for j, n in zip(idx.tolist(), plens):
            outs.append(F.scaled_dot_product_attention(q4[j:j + 1], kd[j:j + 1, :, :n], vd[j:j + 1, :, :n],
                                                       scale=sm_scale, enable_gqa=True).squeeze(2))
        return torch.cat(outs)

    return fn, partial, info, [kd, vd]


def _csr(tables: torch.Tensor, lens: list[int], bs: int):
    nbs = [-(-n // bs) for n in lens]
    dev = tables.device
    indptr = torch.tensor([0] + list(_cumsum(nbs)), dtype=torch.int32, device=dev)
    indices = torch.cat([tables[i, :nb] for i, nb in enumerate(nbs)]).to(torch.int32).contiguous()
    last = torch.tensor([n - (nb - 1) * bs for n, nb in zip(lens, nbs)], dtype=torch.int32, device=dev)
    return indptr, indices, last


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def fi_tc_route(q, layer, tables, lens, L, sm_scale, state):
    """FlashInfer BatchDecodeWithPagedKVCacheWrapper, tensor cores, HND pages read from kvq's pool."""
    fi = state["flashinfer"]
    kc, vc = layer.k["data"], layer.v["data"]  # [N, Hkv, bs, D] == FlashInfer's HND
    B, Hq, D = q.shape
    H, bs = kc.shape[1], kc.shape[2]
    if "ws_tc" not in state:
        state["ws_tc"] = torch.zeros(128 * MiB, dtype=torch.uint8, device=q.device)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(state["ws_tc"], "HND", use_tensor_cores=True)

    def plan(tab, lens_list):
        indptr, indices, last = _csr(tab, lens_list, bs)
        wrapper.plan(indptr, indices, last, Hq, H, D, bs, q_data_type=q.dtype, kv_data_type=kc.dtype,
                     sm_scale=sm_scale)

    def partial(idx, plens):
        plan(tables[idx], plens)
        qi = q[idx].contiguous()
        o = torch.empty_like(qi)
        wrapper.run(qi, (kc, vc), out=o)
        plan(tables, [L] * B)  # back to the timed problem
        return o

    plan(tables, [L] * B)
    out = torch.empty_like(q)

    def fn():
        return wrapper.run(q, (kc, vc), out=out)

    return fn, partial, {"kv_layout": "HND", "use_tensor_cores": True, "kv_dtype": str(kc.dtype)}, [wrapper]


def fi_xqa_route(q, layer, tables, lens, L, sm_scale, state):
    """FlashInfer's XQA decode (flashinfer.decode.xqa_batch_decode_with_kv_cache), HND pages of kvq's pool."""
    from flashinfer.decode import xqa_batch_decode_with_kv_cache as xqa

    kc, vc = layer.k["data"], layer.v["data"]
    if "ws_xqa" not in state:  # semaphores live at its start: must be zero before first use
        state["ws_xqa"] = torch.zeros(256 * MiB, dtype=torch.uint8, device=q.device)
    ws = state["ws_xqa"]
    out = torch.empty_like(q)
    tables = tables.contiguous()

    def fn():
        return xqa(q, (kc, vc), ws, tables, lens, L, bmm1_scale=sm_scale, bmm2_scale=1.0, out=out,
                   kv_layout="HND")

    def partial(idx, plens):
        qi = q[idx].contiguous()
        o = torch.empty_like(qi)
        pl = torch.tensor(plens, dtype=torch.int32, device=q.device)
        xqa(qi, (kc, vc), ws, tables[idx].contiguous(), pl, max(plens), bmm1_scale=sm_scale, bmm2_scale=1.0,
            out=o, kv_layout="HND")
        return o

    return fn, partial, {"kv_layout": "HND", "kv_dtype": str(kc.dtype)}, []


BASELINES = {
    # pool format -> [(impl name, route builder, needs flashinfer)]
    "bfloat16": [("torch-sdpa", sdpa_route, False), ("flashinfer-tc", fi_tc_route, True)],
    "fp8_e4m3": [("flashinfer-tc", fi_tc_route, True), ("flashinfer-xqa", fi_xqa_route, True)],
}


def run_baselines(shapes, smallest, cfg, device, timer, res, copy_gbps, use_flashinfer: bool) -> None:
    state: dict = {}
    fi_error = None
    if not use_flashinfer:
        fi_error = "skipped (--no-flashinfer)"
    else:
        try:
            t = time.perf_counter()
            import flashinfer

            state["flashinfer"] = flashinfer
            res.doc["env"]["flashinfer"] = getattr(flashinfer, "__version__", res.doc["env"].get("flashinfer"))
            res.save()
            log(f"imported flashinfer {res.doc['env']['flashinfer']} in {time.perf_counter() - t:.1f}s")
        except Exception as e:
            fi_error = f"flashinfer not importable: {err_str(e)}"
            log(fi_error)
    sm_scale = 1.0 / math.sqrt(cfg.d)
    dead: dict[str, str] = {}
    worked: set[str] = set()
    for pool_fmt, routes in BASELINES.items():
        bs = block_size_for(pool_fmt, cfg)
        nq = blocks_needed(shapes, bs)
        try:
            plan, pool, layer, bs = build_filled_pool(pool_fmt, cfg, nq, device)
        except Exception as e:
            res.add("errors", {"phase": f"baseline pool {pool_fmt}", "error": err_str(e)})
            log(f"baseline pool {pool_fmt} FAILED: {err_str(e)}")
            continue
        for B, L in shapes:
            nblocks, kv_bytes = kv_bytes_of(plan, B, L, cfg, bs)
            try:
                tables, lens = make_tables(B, L, bs, nq, device)  # the same layout kvq was timed on
                q = make_q(B, L, cfg, device)
                rows = check_rows(B)
                ref_out = reference_rows(q, layer, tables, lens, rows, sm_scale)
                kvq_out = tri_decode.paged_decode(q, layer, tables, lens, sm_scale, max_seq_len=L, has_hp=False)
            except Exception as e:
                res.add("errors", {"phase": f"baseline setup {pool_fmt} {B}x{L}", "error": err_str(e)})
                log(f"baseline setup {pool_fmt} {B}x{L} FAILED: {err_str(e)}")
                continue
            for impl, builder, needs_fi in routes:
                row = decode_row(impl, pool_fmt, B, L, cfg, bs, B * cfg.hq * cfg.d * 2, kv_bytes, nblocks)
                key = f"{impl}:{pool_fmt}"
                if needs_fi and fi_error:
                    row["error"] = fi_error
                    res.add("decode", row)
                    continue
                if key in dead:  # failed before ever succeeding (e.g. JIT build): don't pay for it again
                    row["error"] = f"skipped, failed at an earlier shape: {dead[key]}"
                    res.add("decode", row)
                    continue
                keep = []
                try:
                    t_first = time.perf_counter()
                    fn, partial, info, keep = builder(q, layer, tables, lens, L, sm_scale, state)
                    row.update(info)
                    if "kv_bytes_dense" in info:
                        row["bytes"]["kv"] = info["kv_bytes_dense"]
                        row["bytes"]["total"] = 2 * row["bytes"]["q"] + info["kv_bytes_dense"]
                    out = fn()
                    timer.sync()
                    row["first_call_s"] = time.perf_counter() - t_first  # includes FlashInfer's JIT
                    row["check"] = {"rows": rows, **compare(out[rows], ref_out)}
                    row["vs_kvq"] = compare(out, kvq_out)
                    if (B, L) == smallest:
                        plens = partial_lens(L)
                        idx = torch.tensor(rows[:1] * 2 if len(rows) == 1 else rows, device=device)
                        pl = torch.tensor(plens, dtype=torch.int32, device=device)
                        pr = ref_attn.paged_decode(q[idx].float(), layer, tables[idx], pl, sm_scale)
                        row["check_partial"] = {"lens": plens, **compare(partial(idx, plens), pr)}
                    del out
                    finish(row, timer(fn, cfg.iters, cfg.warmup), copy_gbps)
                    log(f"  {impl:14s} {pool_fmt:9s} {B}x{L}: {row['us']:8.1f} us {row['GBps']:7.0f} GB/s "
                        f"({row['pct_copy'] or 0:.0f}% copy) err {row['check']['rel_l2']:.1e} "
                        f"(first call {row['first_call_s']:.1f}s)")
                    worked.add(key)
                except Exception as e:
                    row["error"] = err_str(e)
                    if key not in worked:
                        dead[key] = row["error"][:300]
                    log(f"  {impl} {pool_fmt} {B}x{L} FAILED: {row['error']}")
                res.add("decode", row)
                del keep
            del tables, lens, q, kvq_out, ref_out
            free(device)
        del pool, layer
        free(device)


# -- report --------------------------------------------------------------------------------------------
def _fmt(x, spec):
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return format(x, spec)
    width = spec.split(".")[0]
    return format("-", ">" + width) if width.isdigit() else "-"


def _flag(row) -> str:
    if row.get("error"):
        return "ERROR"
    bad = [k for k in ("check", "check_partial") if k in row and not row[k].get("ok", False)]
    return "! " + ",".join(bad) if bad else ""


def print_table(doc: dict) -> None:
    copy = doc.get("copy") or {}
    print(f"\ncopy bandwidth: {_fmt(copy.get('GBps'), '.0f')} GB/s (read + write, "
          f"{_fmt((copy.get('bytes') or 0) / 2**30 / 2, '.2f')} GiB copied)")
    w = doc.get("write", [])
    if w:
        print("\nTriton write_kv (quantize-on-store)")
        print(f"{'format':22s} {'bs':>3s} {'T':>6s} {'us':>9s} {'GB/s':>7s} {'%copy':>6s}  check")
        for r in w:
            chk = r.get("check", {})
            status = "ERROR " + r["error"][:60] if r.get("error") else ("ok" if chk.get("ok") else f"! {chk}")
            print(f"{r['format']:22s} {r.get('block_size', 0):3d} {r.get('T', 0):6d} {_fmt(r.get('us'), '9.1f')} "
                  f"{_fmt(r.get('GBps'), '7.0f')} {_fmt(r.get('pct_copy'), '6.1f')}  {status}")
            c = r.get("cuda")
            if c:  # the same write with the CUDA block seal (seal.cu)
                ok = "ok" if c.get("check", {}).get("ok") else f"! {c.get('check')}"
                print(f"{'  + CUDA seal':22s} {'':3s} {'':6s} {_fmt(c.get('us'), '9.1f')} "
                      f"{_fmt(c.get('GBps'), '7.0f')} {_fmt(c.get('pct_copy'), '6.1f')}  {ok}")
    rows = doc.get("decode", [])
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    for s in shapes:
        print(f"\npaged decode {s}  (Hq={rows[0]['Hq']}, Hkv={rows[0]['Hkv']}, D={rows[0]['D']})")
        print(f"{'impl':15s} {'format':20s} {'bs':>3s} {'us':>9s} {'GB/s':>7s} {'%copy':>6s} {'rel_err':>8s}  flag")
        for r in rows:
            if r["shape"] != s:
                continue
            err = r.get("check", {}).get("rel_l2")
            line = (f"{r['impl']:15s} {r['format']:20s} {r['block_size']:3d} {_fmt(r.get('us'), '9.1f')} "
                    f"{_fmt(r.get('GBps'), '7.0f')} {_fmt(r.get('pct_copy'), '6.1f')} {_fmt(err, '8.1e')}  "
                    f"{_flag(r)}")
            if r.get("error"):
                line += " " + r["error"][:90]
            print(line)


def plot(doc: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        log(f"WARNING: no plot ({type(e).__name__}: {e}); install matplotlib for {path.name}")
        return
    rows = [r for r in doc.get("decode", []) if r.get("GBps")]
    writes = [r for r in doc.get("write", []) if r.get("GBps")]
    if not rows and not writes:
        log("WARNING: nothing to plot")
        return
    copy = (doc.get("copy") or {}).get("GBps")
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    series = list(dict.fromkeys((r["impl"], r["format"]) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(16, 7), gridspec_kw={"width_ratios": [3, 1]})
    ax = axes[0]
    width = 0.8 / max(1, len(series))
    cmap = plt.get_cmap("tab20")
    for j, (impl, fmt) in enumerate(series):
        xs, ys = [], []
        for i, s in enumerate(shapes):
            r = next((r for r in rows if r["shape"] == s and r["impl"] == impl and r["format"] == fmt), None)
            if r:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(r["GBps"])
        hatch = "" if impl == "kvq-triton" else "//"
        ax.bar(xs, ys, width, label=f"{impl}: {fmt}", color=cmap(j % 20), hatch=hatch, edgecolor="black",
               linewidth=0.3)
    if copy:
        ax.axhline(copy, color="red", linestyle="--", linewidth=1.2, label=f"copy bandwidth {copy:.0f} GB/s")
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([f"B×L = {s}" for s in shapes])
    ax.set_ylabel("achieved GB/s (Q + O + K/V bytes read)")
    env = doc.get("env", {})
    ax.set_title(f"paged decode, Hq={doc['config']['hq']} Hkv={doc['config']['hkv']} D={doc['config']['d']} "
                 f"({env.get('gpu') or env.get('device')})")
    ax.legend(fontsize=7, ncol=4, loc="upper left", bbox_to_anchor=(0, -0.08))
    ax2 = axes[1]
    if writes:
        ax2.barh([r["format"] for r in writes], [r["GBps"] for r in writes], color="tab:blue")
        if copy:
            ax2.axvline(copy, color="red", linestyle="--", linewidth=1.2)
        ax2.invert_yaxis()
    ax2.set_xlabel("GB/s")
    ax2.set_title(f"Triton write_kv, T={doc['config']['write_tokens']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"plot: {path}")


# -- main ----------------------------------------------------------------------------------------------
def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        b, sep, l_ = item.partition("x")
        if not sep or not b.isdigit() or not l_.isdigit() or int(b) < 1 or int(l_) < 1:
            raise SystemExit(f"bad shape {item!r}: expected BxL, e.g. 64x4096")
        out.append((int(b), int(l_)))
    if not out:
        raise SystemExit("no shapes")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help=f"tiny shapes ({SMOKE_SHAPES}, Hq=4, Hkv=2, D=64), 2 iterations: checks every code path")
    ap.add_argument("--shapes", default=None, help=f"comma-separated BxL (default {DEFAULT_SHAPES})")
    ap.add_argument("--formats", default=DEFAULT_FORMATS, help="comma-separated kvq format names")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per measurement (default 30; smoke 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs before timing (default 5; smoke 1)")
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "bench_decode.json"), help="JSON path")
    ap.add_argument("--no-flashinfer", action="store_true", help="skip the FlashInfer baselines")
    ap.add_argument("--no-baselines", action="store_true", help="skip all baselines (FlashInfer and SDPA)")
    ap.add_argument("--no-write", action="store_true", help="skip the write_kv throughput")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode kernels (and their baselines)")
    args = ap.parse_args(argv)

    base = dict(SMOKE if args.smoke else FULL)
    if args.iters is not None:
        base["iters"] = max(1, args.iters)
    if args.warmup is not None:
        base["warmup"] = max(0, args.warmup)
    cfg = Config(**base)
    shapes = parse_shapes(args.shapes or (SMOKE_SHAPES if args.smoke else DEFAULT_SHAPES))
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for f in formats:
        try:
            resolve_kv(f)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    smallest = min(shapes, key=lambda s: (s[1], s[0]))
    device = torch.device("cuda" if HAS_CUDA else "cpu")
    if device.type == "cpu" and not args.smoke:
        log("WARNING: no CUDA device: Triton runs under its CPU interpreter; use --smoke")

    out_path = Path(args.out)
    doc = {"benchmark": "kvq paged decode + write_kv", "argv": sys.argv, "env": environment(device),
           "config": {**asdict(cfg), "shapes": [f"{b}x{n}" for b, n in shapes], "formats": formats,
                      "smallest_shape": f"{smallest[0]}x{smallest[1]}", "sleep_cycles": SLEEP_CYCLES,
                      "flag_rel_err": FLAG_REL_ERR, "smoke": args.smoke},
           "notes": NOTES, "copy": None, "write": [], "decode": [], "errors": []}
    res = Results(out_path, doc)
    log(f"device {doc['env'].get('gpu') or device}; torch {torch.__version__}, triton {triton.__version__}, "
        f"interpret={doc['env']['triton_interpret']}; shapes {doc['config']['shapes']}; {len(formats)} formats; "
        f"results -> {out_path}")

    timer = Timer(device, cfg.flush_bytes)
    copy_gbps = measure_copy(cfg, device, timer, res)

    if not args.no_write:
        log(f"write_kv throughput, T={cfg.write_tokens} tokens, H={cfg.hkv}, D={cfg.d}")
        for f in formats:
            try:
                row = measure_write(f, cfg, device, timer, copy_gbps)
                log(f"  write {f:20s}: {row['us']:8.1f} us {row['GBps']:7.0f} GB/s "
                    f"check {'ok' if row['check'].get('ok') else row['check']}")
            except Exception as e:
                row = {"format": f, "error": err_str(e)}
                log(f"  write {f} FAILED: {row['error']}")
                free(device)
            res.add("write", row)

    if not args.no_decode:
        log("kvq paged decode")
    for f in formats if not args.no_decode else []:
        try:
            run_kvq_format(f, shapes, smallest, cfg, device, timer, res, copy_gbps)
        except Exception as e:
            res.add("errors", {"phase": f"kvq {f}", "error": err_str(e)})
            log(f"  kvq {f} FAILED: {err_str(e)}")
            free(device)

    if not args.no_baselines and not args.no_decode:
        log("baselines (same data, same page layout)")
        try:
            run_baselines(shapes, smallest, cfg, device, timer, res, copy_gbps, not args.no_flashinfer)
        except Exception as e:
            res.add("errors", {"phase": "baselines", "error": err_str(e)})
            log(f"baselines FAILED: {err_str(e)}")

    res.doc["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    res.doc["wall_s"] = round(time.perf_counter() - T0, 1)
    res.save()
    try:
        plot(res.doc, out_path.with_suffix(".png"))
    except Exception as e:
        log(f"WARNING: plot failed: {err_str(e)}")
    print_table(res.doc)
    log(f"done in {time.perf_counter() - T0:.0f}s; JSON {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
