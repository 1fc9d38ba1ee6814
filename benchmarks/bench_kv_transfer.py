#!/usr/bin/env python3
"""KV transfer between a bf16 sender and a receiver in its own KV format: cast cost and wire bandwidth.

For every receiver format (``--formats``) and prompt length (``--tokens``), on the model shape of
``--model`` (only the shape is read: no weights):

1. **Cast**: :meth:`kvq.transfer.convert.SenderCast.cast` of ``n`` tokens from a bf16 sender pool
   (random K/V, table ``q 0..``) into a staging pool of the receiver's plan (default windows; the
   receiver's sinks and recent window stay bf16 hp blocks), with the receiver's write kernels: the
   Triton backend's on CUDA, the torch reference on the CPU.  Median of ``--repeats`` after one warm-up.
2. **NIXL**: the receiver pulls every staged block (all layers, K and V, every plane, hp blocks too)
   with :meth:`kvq.transfer.nixl_transport.NixlTransport.read_blocks`: two agents in one process
   ("bench-src" registers the staging pool, "bench-dst" a receiver pool of the same plan), one
   transfer per repeat.  Destination blocks are a random permutation of the receiver's block ids
   (``scattered``: about one NIXL descriptor per block and pool tensor, as a real block table gives)
   and, always, the identity (``contiguous``: one descriptor per pool tensor).  The time runs from the
   ``read_blocks`` call (descriptor lists built, transfer posted) to the handle settling (polled in a
   tight loop); ``nixl_post_ms`` is the posting alone.  The first transfer of each layout is checked byte
   for byte.  A NIXL failure (e.g. UCX without a VRAM transport) is recorded in the row, not raised.
3. **Copy baseline**: the same blocks moved by the device itself: per pool tensor
   ``dst.index_copy_(0, dst_ids, src.index_select(0, src_ids))`` (FP8 viewed as bytes), same layout.

GB/s = bytes moved (``handle.nbytes``: the receiver-format wire bytes, sidecars and hp blocks
included) / median seconds, 1 GB = 10^9 bytes; the copy baseline uses the same bytes (not read +
written).  ``bf16_bytes`` is what the sender's bf16 blocks of the same tokens take; ``wire_ratio`` =
bf16_bytes / wire_bytes.

Reproduce (on the GPU machine, one H200: VRAM to VRAM within one device)::

    make bench-kv-transfer        # bash scripts/gpu.sh bench-kv-transfer
    # CPU smoke:
    OMP_NUM_THREADS=1 python benchmarks/bench_kv_transfer.py --model default --tokens 64,256 --repeats 2 \\
        --formats bfloat16,int8,int4_kivi --out /tmp/bkt.json

Writes ``docs/results/bench_kv_transfer_<device type>.json`` (rewritten after every row).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvq.attention.backends import select_backend  # noqa: E402
from kvq.cache.block_manager import BlockRef  # noqa: E402
from kvq.cache.plan import CachePlan, KVCacheConfig  # noqa: E402
from kvq.cache.pool import KVPool  # noqa: E402
from kvq.formats import fp8  # noqa: E402
from kvq.models.source import model_shape, resolve_model  # noqa: E402
from kvq.transfer.convert import SenderCast, receiver_table  # noqa: E402

DEFAULT_FORMATS = "bfloat16,fp8_e4m3,int8,int4_kivi,int2_kivi"
DEFAULT_TOKENS = {"cuda": "1024,8192,32768", "cpu": "256,1024"}
POOLS = ("q", "hp")
WAIT_S = 60.0
NOTES = {
    "cuda": "one GPU: NIXL moves VRAM to VRAM within one device over UCX (cuda_ipc or cuda_copy); "
            "the two-GPU run needs nvidia-h200-x2",
    "cpu": "CPU: NIXL moves DRAM to DRAM between two agents of one process over UCX",
}


# -- timing -----------------------------------------------------------------------------------------
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_seconds(fn, dev: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones, the device
    synchronized before and after each."""
    times = []
    for _ in range(warmup + repeats):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t)
    return _median(times[warmup:])


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# -- pools ------------------------------------------------------------------------------------------
def fill_random(pool: KVPool, seed: int) -> None:
    """Random values in every pool tensor: normal for float dtypes, any byte for the others."""
    g = torch.Generator(device=pool.device).manual_seed(seed)
    for layer in pool.layers:
        for t in layer.tensors():
            if t.dtype.is_floating_point and not fp8.is_fp8(t.dtype):
                t.normal_(generator=g)
            else:
                b = fp8.as_bytes(t)
                b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=pool.device, generator=g))


def block_counts(plan: CachePlan, n: int) -> dict[str, int]:
    """q and hp blocks the receiver holds for a prompt of ``n`` tokens."""
    table = receiver_table(plan, n)
    return {p: sum(r.pool == p for r in table) for p in POOLS}


def pool_tensors(pool: KVPool, kind: str) -> list[torch.Tensor]:
    """Every tensor of the q or hp pool, all layers, K and V, as bytes where FP8."""
    out = []
    for layer in pool.layers:
        for role in ("k", "v"):
            ts = layer.planes(role).values() if kind == "q" else (layer.hp(role),)
            out += [fp8.as_bytes(t) for t in ts]
    return out


def layouts(counts: dict[str, int], scatter: bool, seed: int) -> dict[str, dict[str, list[tuple[int, int]]]]:
    """(receiver block, staged block) pairs per pool: ``contiguous`` (identity) and, with ``scatter``,
    ``scattered`` (a random permutation of the receiver's block ids)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    if scatter:
        out["scattered"] = {p: list(zip(torch.randperm(c, generator=g).tolist(), range(c))) for p, c in counts.items()}
    out["contiguous"] = {p: [(i, i) for i in range(c)] for p, c in counts.items()}
    return out


def id_tensors(pairs: dict[str, list[tuple[int, int]]], dev: torch.device) -> dict[str, tuple[torch.Tensor, ...]]:
    """``{pool: (dst ids, src ids)}`` as int64 tensors on ``dev``."""
    return {p: tuple(torch.tensor([x[j] for x in ps], dtype=torch.int64, device=dev) for j in (0, 1))
            for p, ps in pairs.items() if ps}


def copy_blocks(src: KVPool, dst: KVPool, ids: dict[str, tuple[torch.Tensor, ...]]) -> None:
    """The baseline: every staged block into the receiver pool by the device's own gather/scatter."""
    for p, (dst_ids, src_ids) in ids.items():
        for a, b in zip(pool_tensors(src, p), pool_tensors(dst, p)):
            b.index_copy_(0, dst_ids, a.index_select(0, src_ids))


def same_blocks(src: KVPool, dst: KVPool, ids: dict[str, tuple[torch.Tensor, ...]]) -> bool:
    """Whether every destination block holds its source block's bytes."""
    return all(torch.equal(b.index_select(0, d), a.index_select(0, s))
               for p, (d, s) in ids.items() for a, b in zip(pool_tensors(src, p), pool_tensors(dst, p)))


def zero_pool(pool: KVPool) -> None:
    for p in POOLS:
        for t in pool_tensors(pool, p):
            t.zero_()


# -- the measured steps -----------------------------------------------------------------------------
def write_kernels(plan: CachePlan, dev: torch.device):
    """The receiver's write kernels: Triton on CUDA, the torch reference elsewhere (name, module)."""
    name = "triton" if dev.type == "cuda" else "torch"
    backend, _ = select_backend(name, plan, dev, torch.bfloat16)
    return name, backend.kernels()


def measure_cast(sender: KVPool, plan: CachePlan, n: int, staging: KVPool, kernels, repeats: int) -> float:
    """Median seconds of casting ``n`` sender tokens into ``staging`` (block ids 0.. of each pool)."""
    table = [BlockRef("q", i) for i in range(sender.num_q_blocks)]
    ids = {"q": list(range(staging.num_q_blocks)), "hp": list(range(staging.num_hp_blocks))}
    cast = SenderCast(plan, kernels=kernels)
    return median_seconds(lambda: cast.cast(sender, table, n, into=staging, ids=ids), sender.device, repeats)


def _settle(handle, timeout: float = WAIT_S) -> None:
    """Poll ``handle`` until it settles (no naps: ``wait`` sleeps up to 1 ms between polls)."""
    deadline = time.monotonic() + timeout
    while (state := handle.poll()) == "pending":
        if time.monotonic() > deadline:
            handle.cancel()
            raise TimeoutError(f"{handle.op} of {handle.nbytes} bytes: not done after {timeout:g} s")
    if state == "failed":
        raise handle.error


def measure_nixl(staging: KVPool, receiver: KVPool, plans: dict, dev: torch.device, repeats: int) -> dict:
    """Per layout: NIXL READ of every staged block into ``receiver`` (median ms, GB/s, posting ms,
    descriptors, checked bytes); ``{"error": ...}`` if NIXL cannot do it."""
    from kvq.transfer.nixl_transport import NixlTransport

    src = dst = None
    try:
        src, dst = NixlTransport("bench-src", device=dev), NixlTransport("bench-dst", device=dev)
        src.register_pool(staging)
        dst.register_pool(receiver)
        peer = dst.connect(src.descriptor)
        out = {}
        for name, (pairs, ids) in plans.items():
            posts, handles = [], []

            def read():
                t = time.perf_counter()
                h = dst.read_blocks(peer, q_pairs=pairs["q"], hp_pairs=pairs["hp"])
                posts.append(time.perf_counter() - t)
                _settle(h)
                handles.append(h)

            zero_pool(receiver)
            _sync(dev)
            read()  # the warm-up, checked
            verified = same_blocks(staging, receiver, ids)
            secs = median_seconds(read, dev, repeats, warmup=0)
            h = handles[-1]
            out[name] = {"nixl_ms": secs * 1e3, "nixl_gbps": _gbps(h.nbytes, secs), "nixl_bytes": h.nbytes,
                         "nixl_post_ms": _median(posts[1:]) * 1e3, "nixl_descriptors": h.num_descriptors,
                         "nixl_verified": verified}
        return out
    except Exception as e:  # noqa: BLE001 - recorded in the row: one format's failure must not end the run
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        for t in (dst, src):
            if t is not None:
                t.close()


def measure_copy(staging: KVPool, receiver: KVPool, ids: dict, nbytes: int, dev: torch.device, repeats: int) -> dict:
    secs = median_seconds(lambda: copy_blocks(staging, receiver, ids), dev, repeats)
    return {"copy_ms": secs * 1e3, "copy_gbps": _gbps(nbytes, secs)}


def measure_row(shape, fmt: str, n: int, args, dev: torch.device) -> dict:
    """One (format, tokens) row: bytes, cast, NIXL and copy per layout."""
    plan = KVCacheConfig(dtype=fmt).plan(shape)
    sender_plan = KVCacheConfig(dtype="bfloat16").plan(shape)
    counts = block_counts(plan, n)
    sender_blocks = -(-n // sender_plan.block_size)
    sender = KVPool.create(sender_plan, sender_blocks, 0, dev)
    fill_random(sender, seed=n)
    staging = KVPool.create(plan, counts["q"], counts["hp"], dev)
    receiver = KVPool.create(plan, counts["q"], counts["hp"], dev)
    kernels_name, kernels = write_kernels(plan, dev)
    wire, bf16 = staging.expected_nbytes(), sender_blocks * sender_plan.bytes_per_block
    plan_info = {k: v for k, v in plan.describe().items() if k != "per_layer"}
    row = {"format": fmt, "plan": plan_info, "tokens": n, "q_blocks": counts["q"], "hp_blocks": counts["hp"],
           "block_size": plan.block_size, "wire_bytes": wire, "bf16_bytes": bf16, "wire_ratio": bf16 / wire,
           "kernels": kernels_name}
    row["cast_ms"] = measure_cast(sender, plan, n, staging, kernels, args.repeats) * 1e3
    plans = {name: (pairs, id_tensors(pairs, dev)) for name, pairs in layouts(counts, args.scatter, n).items()}
    nixl = measure_nixl(staging, receiver, plans, dev, args.repeats)
    if "error" in nixl:
        row["nixl_error"] = nixl["error"]
    row["layouts"] = {name: {**nixl.get(name, {}), **measure_copy(staging, receiver, ids, wire, dev, args.repeats)}
                      for name, (_, ids) in plans.items()}
    return row


# -- report -----------------------------------------------------------------------------------------
HEADER = (f"{'format':<11} {'tokens':>6} {'layout':<10} {'wire MB':>8} {'bf16 MB':>8} {'ratio':>5} {'cast ms':>8} "
          f"{'NIXL ms':>8} {'GB/s':>7} {'copy ms':>8} {'GB/s':>7}")


def table_lines(row: dict) -> list[str]:
    if "error" in row:
        return [f"{row['format']:<11} {row['tokens']:>6} error: {row['error']}"]
    out = []
    for name, r in row["layouts"].items():
        nixl = (f"{r['nixl_ms']:>8.3f} {r['nixl_gbps']:>7.2f}" + ("" if r["nixl_verified"] else " (BYTES DIFFER)")
                if "nixl_ms" in r else f"{'-':>8} {'-':>7}")
        out.append(f"{row['format']:<11} {row['tokens']:>6} {name:<10} {row['wire_bytes'] / 1e6:>8.2f} "
                   f"{row['bf16_bytes'] / 1e6:>8.2f} {row['wire_ratio']:>5.2f} {row['cast_ms']:>8.3f} {nixl} "
                   f"{r['copy_ms']:>8.3f} {r['copy_gbps']:>7.2f}")
    if "nixl_error" in row:
        out.append(f"{'':<11} {'':>6} NIXL error: {row['nixl_error']}")
    return out


def machine_info(dev: torch.device) -> dict:
    try:
        nixl_version = importlib.metadata.version("nixl")
    except importlib.metadata.PackageNotFoundError:
        nixl_version = None
    info = {"torch": torch.__version__, "device": str(dev), "nixl": nixl_version, "python": platform.python_version(),
            "platform": platform.platform(), "torch_threads": torch.get_num_threads()}
    if dev.type == "cuda":
        info.update(device_name=torch.cuda.get_device_name(dev), cuda=torch.version.cuda,
                    device_count=torch.cuda.device_count())
    else:
        info["device_name"] = platform.processor() or platform.machine()
    return info


def save(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


# -- main -------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Module docstring: what is measured, and how GB/s is counted.")
    ap.add_argument("--formats", default=DEFAULT_FORMATS,
                    help=f"receiver KV formats, comma-separated (default {DEFAULT_FORMATS})")
    ap.add_argument("--tokens", default=None,
                    help=f"prompt lengths, comma-separated (default {DEFAULT_TOKENS['cuda']} on CUDA, "
                         f"{DEFAULT_TOKENS['cpu']} on the CPU)")
    ap.add_argument("--model", default="llama-3-8b",
                    help="model whose KV shape is used: a shipped config, 'default' or a model folder; no weights "
                         "are read (default llama-3-8b)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed repeats per measurement, median reported, after 1 warm-up (default 5)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu (default auto)")
    ap.add_argument("--out", default=None,
                    help="JSON results (default docs/results/bench_kv_transfer_<device type>.json)")
    ap.add_argument("--scatter", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure scattered destination blocks (a random permutation of the receiver's "
                         "block ids); contiguous blocks are always measured (default on)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # not two INFO lines per agent made
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    tokens = [int(t) for t in (args.tokens or DEFAULT_TOKENS.get(dev.type, DEFAULT_TOKENS["cpu"])).split(",")]
    out = Path(args.out or ROOT / f"docs/results/bench_kv_transfer_{dev.type}.json")
    shape = model_shape(resolve_model(args.model))
    result = {"benchmark": "kv_transfer", "date": _dt.datetime.now().isoformat(timespec="seconds"),
              "machine": machine_info(dev), "args": {**vars(args), "device": str(dev), "tokens": tokens,
                                                     "formats": formats},
              "model_shape": {k: getattr(shape, k) for k in ("name", "num_layers", "num_kv_heads", "head_dim",
                                                             "dtype")},
              "note": NOTES.get(dev.type, ""), "rows": []}
    print(f"kv transfer on {result['machine']['device_name']} ({dev}), model shape {shape.name}: "
          f"{shape.num_layers} layers x {shape.num_kv_heads} KV heads x {shape.head_dim}; nixl "
          f"{result['machine']['nixl']}", flush=True)
    lines = []
    for fmt in formats:
        for n in tokens:
            print(f"[{fmt} x {n} tokens] ...", flush=True)
            try:
                row = measure_row(shape, fmt, n, args, dev)
            except Exception as e:  # noqa: BLE001 - recorded: one row's failure (e.g. out of memory) must not end the run
                traceback.print_exc()
                row = {"format": fmt, "tokens": n, "error": f"{type(e).__name__}: {e}"}
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            result["rows"].append(row)
            save(out, result)
            lines += table_lines(row)
            print("\n".join(table_lines(row)), flush=True)
    print("\n" + HEADER + "\n" + "\n".join(lines))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
