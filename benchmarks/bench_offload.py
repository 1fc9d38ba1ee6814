#!/usr/bin/env python3
"""What swapping KV to host memory costs (docs/offload.md), beside its plain baselines.

1. Copy bandwidth per format: ``HostKVPool.store`` / ``load`` of N blocks (every plane of
   every layer, scales and zero points included, gathered by block id) against one plain
   pinned copy of the same number of bytes, device -> host and host -> device.
2. The engine under memory pressure: a wave of c requests whose KV does not fit the device
   pool, served with ``preemption_mode="recompute"`` and ``"swap"``: output tokens/s, TTFT
   and TPOT p50/p95, preemptions, swaps out/in, fallbacks.

Usage (GPU machine):
    python benchmarks/bench_offload.py --formats bfloat16,fp8_e4m3,int8_per_token_head,int4_kivi
    python benchmarks/bench_offload.py --smoke     # tiny model and sizes (any device, CI-sized)

Writes docs/results/bench_offload.json (rewritten after every row).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_engine import SMOKE_CONFIG, run_kvq_wave  # noqa: E402

DEFAULT_OUT = str(ROOT / "docs/results/bench_offload.json")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median_seconds(fn, dev: torch.device, iters: int) -> float:
    times = []
    for _ in range(iters + 1):  # the first call warms up
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[len(times[1:]) // 2]


def bench_copies(args, out: dict, shape, fmt: str, dev: torch.device) -> None:
    from kvq.cache.host_pool import HostKVPool
    from kvq.cache.plan import KVCacheConfig
    from kvq.cache.pool import KVPool

    plan = KVCacheConfig(dtype=fmt).plan(shape)
    n = args.blocks
    pool = KVPool.create(plan, 2 * n, 0, dev)
    host = HostKVPool.create(pool, n, 0)
    g = torch.Generator().manual_seed(0)
    src = torch.randperm(2 * n, generator=g)[:n].tolist()  # scattered device blocks, as a real table has
    pairs_out = list(zip(src, range(n)))
    pairs_in = list(zip(range(n), src))
    nbytes = n * host.bytes_per_q_block
    store = _median_seconds(lambda: host.store(pool, pairs_out).synchronize(), dev, args.iters)
    load = _median_seconds(lambda: host.load(pool, pairs_in).synchronize(), dev, args.iters)
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    d2h = _median_seconds(lambda: flat_host.copy_(flat_dev, non_blocking=True), dev, args.iters)
    h2d = _median_seconds(lambda: flat_dev.copy_(flat_host, non_blocking=True), dev, args.iters)
    row = {"kv_cache_dtype": fmt, "blocks": n, "bytes": nbytes, "bytes_per_block": host.bytes_per_q_block,
           "tokens": n * plan.block_size, "pinned": host.pinned,
           "store_GBps": nbytes / store / 1e9, "load_GBps": nbytes / load / 1e9,
           "plain_d2h_GBps": nbytes / d2h / 1e9, "plain_h2d_GBps": nbytes / h2d / 1e9,
           "store_s": store, "load_s": load}
    out["copies"].append(row)
    print(f"[copy {fmt}] {n} blocks = {nbytes / 2**20:.1f} MiB ({row['tokens']} tokens): store "
          f"{row['store_GBps']:.1f} GB/s, load {row['load_GBps']:.1f} GB/s; plain pinned copy "
          f"{row['plain_d2h_GBps']:.1f} / {row['plain_h2d_GBps']:.1f} GB/s", flush=True)


def bench_pressure(args, out: dict, model: str, fmt: str, mode: str) -> None:
    from kvq.engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(
        model=model, load_format="dummy", kv_cache_dtype=fmt, max_num_seqs=args.concurrency,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
        progress=False, preemption_mode=mode, cpu_offload_gb=args.cpu_offload_gb if mode == "swap" else 0.0))
    vocab = engine.model.config.vocab_size
    run_kvq_wave(engine, vocab, 2, args.input_len, 4, seed=0)  # warm-up
    s = engine.scheduler
    before = (s.num_swapped_out, s.num_swapped_in, s.num_swap_fallbacks)
    r = run_kvq_wave(engine, vocab, args.concurrency, args.input_len, args.output_len, seed=1)
    r.update(kv_cache_dtype=fmt, preemption_mode=mode, concurrency=args.concurrency, input_len=args.input_len,
             output_len=args.output_len, pool_tokens=engine.info["kv_pool"]["tokens"],
             cpu_offload=engine.info["cpu_offload"],
             swapped_out=s.num_swapped_out - before[0], swapped_in=s.num_swapped_in - before[1],
             swap_fallbacks=s.num_swap_fallbacks - before[2])
    out["pressure"].append(r)
    print(f"[pressure {fmt} {mode}] c={args.concurrency} {args.input_len}/{args.output_len} in a pool of "
          f"{r['pool_tokens']} tokens: {r['output_tok_per_s']:.0f} tok/s, TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms, "
          f"TPOT p50 {r['tpot_p50_s'] * 1e3:.1f} ms p95 {r['tpot_p95_s'] * 1e3:.1f} ms, preemptions "
          f"{r['preemptions']}, swaps {r['swapped_out']}/{r['swapped_in']}, fallbacks {r['swap_fallbacks']}",
          flush=True)
    del engine
    gc.collect()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3-8b", help="shipped config or HF folder (dummy weights)")
    p.add_argument("--formats", default="bfloat16,fp8_e4m3,int8_per_token_head,int4_kivi")
    p.add_argument("--blocks", type=int, default=4096, help="blocks per copy (4096 x 16 = 64K tokens)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--kv-cache-memory", default="4GiB", help="device pool, small enough to force preemption")
    p.add_argument("--cpu-offload-gb", type=float, default=32.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes")
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    model = args.model
    if args.smoke:
        tmp = tempfile.mkdtemp()
        (Path(tmp) / "config.json").write_text(json.dumps(SMOKE_CONFIG))
        model, args.blocks, args.iters = tmp, 64, 2
        args.concurrency, args.input_len, args.output_len = 8, 16, 48  # outputs outgrow the pool
        args.kv_cache_memory, args.cpu_offload_gb, args.max_num_batched_tokens = "384KiB", 0.01, 64
        if args.out == DEFAULT_OUT:
            args.out = str(Path(tempfile.mkdtemp()) / "bench_offload_smoke.json")
    from kvq.models.source import model_shape, resolve_model

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = model_shape(resolve_model(model))
    out = {"meta": {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    "device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu",
                    "torch": torch.__version__, "model": "smoke" if args.smoke else model,
                    "argv": sys.argv[1:] if argv is None else argv},
           "copies": [], "pressure": []}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    for fmt in args.formats.split(","):
        bench_copies(args, out, shape, fmt, dev)
        path.write_text(json.dumps(out, indent=1) + "\n")
    for fmt in args.formats.split(","):
        for mode in ("recompute", "swap"):
            bench_pressure(args, out, model, fmt, mode)
            path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
