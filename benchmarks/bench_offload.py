#!/usr/bin/env python3
"""What keeping KV in host memory costs and saves (docs/offload.md), beside its plain baselines.

1. ``copies``: copy bandwidth per format: ``HostKVPool.store`` / ``load`` of N blocks (every plane
   of every layer, scales and zero points included, gathered by block id) against one plain pinned
   copy of the same number of bytes, device -> host and host -> device.
2. ``pressure``: the engine under memory pressure: a wave of c requests whose KV does not fit the
   device pool, served per mode (``--modes``): ``recompute`` (no host memory: a preempted request
   is prefilled again), ``swap`` (``preemption_mode="swap"``: a preempted request's blocks wait in
   host memory; no prefix tier) and ``tier`` (recompute preemption, the whole host budget a CPU
   prefix tier: the full blocks of preempted and finished requests are stored there, so the prefix
   of a preempted request loads back instead of being prefilled again where the device dropped
   it).  Per run: output tokens/s, TTFT and TPOT p50/p95, preemptions, swaps out/in, fallbacks, TTFT
   and TPOT p50 of the requests preempted at least once (swapped, in swap mode, unless it fell back)
   against those never preempted, device prefix-cache hits, and the host offload counters (stores,
   reloads, their GB/s, tier hits, evictions, failures; all 0 without a tier).
3. ``multi_turn``: prefix reuse across turns.  U users (``--users``) each send turn 1 (a distinct
   random prompt of --turn-input-len tokens, --turn-output-len greedy tokens, ignore_eos), all at
   once; then all turn-2 requests at once: turn-1 prompt + its output + --turn-new-tokens new
   tokens.  The device pool (--kv-cache-memory) holds a fraction of the users' turn-1 KV
   (``pool_tokens`` vs ``turn1_tokens``), so most turn-2 prompts miss the device prefix cache:
   ``recompute`` (no host memory) prefills them again, ``tier`` (--cpu-offload-gb of CPU prefix
   tier) loads their blocks from host.  Per mode: each turn's TTFT and TPOT p50/p95, wall time and
   tokens/s, the turn-2 device prefix-cache hit blocks and lookup misses per pool beside the blocks
   turn 2 could reuse at most (``reusable_blocks``), and the host offload counters of each turn; the
   tier row adds its turn-2 TTFT and wall time as a ratio of the recompute row's.

Host offload counters are ``engine.host_offload_stats()`` differenced over the measured wave (its
``tier_num_*`` occupancy gauges as they stand at the end); their GB/s divide bytes by the seconds
from issue to observed completion, which the engine polls once a step: a lower bound of the copy
rate, which the ``copies`` section measures alone.

Usage (GPU machine):
    python benchmarks/bench_offload.py --formats bfloat16,fp8_e4m3,int8_per_token_head,int4_kivi
    python benchmarks/bench_offload.py --sections multi_turn --modes recompute,tier --users 64
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

from bench_engine import SMOKE_CONFIG, pct, run_prompts  # noqa: E402

DEFAULT_OUT = str(ROOT / "docs/results/bench_offload.json")
SECTIONS = ("copies", "pressure", "multi_turn")
MODES = ("recompute", "swap", "tier")
MULTI_TURN_MODES = ("recompute", "tier")  # swap has no bearing on a prefix that a finished request left


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


# -- engines, waves, counters ---------------------------------------------------------------------
def mode_fields(mode: str, cpu_offload_gb: float) -> dict:
    """EngineConfig fields of a mode: recompute (no host memory), swap (request-level swap, no prefix
    tier), tier (recompute preemption; the whole host budget is the CPU prefix tier)."""
    return {"preemption_mode": "swap" if mode == "swap" else "recompute",
            "cpu_offload_gb": 0.0 if mode == "recompute" else cpu_offload_gb, "cpu_prefix_cache": mode == "tier"}


def build_engine(args, model: str, fmt: str, mode: str):
    from kvq.engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(
        model=model, load_format="dummy", kv_cache_dtype=fmt, max_num_seqs=args.concurrency,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
        progress=False, enable_prefix_caching=True, **mode_fields(mode, args.cpu_offload_gb)))


def release() -> None:
    """After ``del engine``: an engine on CUDA froze what it built (gc.freeze), so a reference cycle
    in it would outlive it, holding its weights and pinned host pool, unless unfrozen first."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` random token-id prompts: the ones bench_engine.run_kvq_wave draws for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_wave(engine, prompts: list[list[int]], out: int) -> tuple[dict, list]:
    """bench_engine.run_prompts, plus the number of requests and the TTFT / TPOT p50 of those preempted
    at least once against the others."""
    summary, outs = run_prompts(engine, prompts, out)
    pre = [o.metrics for o in outs if o.metrics["num_preemptions"] > 0]
    rest = [o.metrics for o in outs if o.metrics["num_preemptions"] == 0]
    return {
        "requests": len(outs), **summary,
        "requests_preempted": len(pre),
        "ttft_p50_s_preempted": pct([m["ttft"] for m in pre], 0.5),
        "ttft_p50_s_not_preempted": pct([m["ttft"] for m in rest], 0.5),
        "tpot_p50_s_preempted": pct([m["tpot"] for m in pre], 0.5),
        "tpot_p50_s_not_preempted": pct([m["tpot"] for m in rest], 0.5),
    }, outs


def counters(engine) -> dict:
    """What the engine counts across requests, now: swaps, the device prefix cache per pool (hit_blocks:
    blocks a prompt reused; lookup_misses: prompts whose cached prefix stopped short of their last
    full block), and ``engine.host_offload_stats()``."""
    s, bm = engine.scheduler, engine.block_manager
    return {"swap": {"swapped_out": s.num_swapped_out, "swapped_in": s.num_swapped_in,
                     "swap_fallbacks": s.num_swap_fallbacks},
            "device_prefix": {p: {"hit_blocks": bm.allocator(p).num_hits, "lookup_misses": bm.allocator(p).num_misses}
                              for p in ("q", "hp")},
            "host_offload": engine.host_offload_stats()}


def delta(after: dict, before: dict) -> dict:
    """``after - before`` for every number of a (nested) dict of counters; gauges (``*num_*``, as the
    tier's ``tier_num_used_blocks``) and other values as they are in ``after``."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, dict):
            out[k] = delta(v, b or {})
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(b, (int, float)) \
                and "num_" not in k:
            out[k] = v - b
        else:
            out[k] = v
    return out


def offload_delta(after: dict, before: dict) -> dict:
    """The host offload counters between two :func:`counters` snapshots, with the GB/s of the stores
    and reloads (bytes over the seconds the engine timed them)."""
    d = delta(after["host_offload"], before["host_offload"])
    for what, nbytes, secs in (("store", "stored_bytes", "store_seconds"),
                               ("reload", "reloaded_bytes", "reload_seconds")):
        if d.get(secs):
            d[f"{what}_GBps"] = d.get(nbytes, 0) / d[secs] / 1e9
    return d


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _tier_line(engine, h: dict) -> str:
    if not engine.info["cpu_offload"].get("prefix_tier", {}).get("bytes"):
        return ""
    return (f"; CPU prefix tier: stored {h['stored_blocks']} blocks ({h.get('store_GBps', 0):.1f} GB/s), "
            f"reloaded {h['reloaded_blocks']} ({h.get('reload_GBps', 0):.1f} GB/s) for {h['requests_loaded']} "
            f"requests, evictions {h['tier_evictions']}, rejected {h['tier_rejected']}, failed stores/loads "
            f"{h['store_failed']}/{h['load_failed']}, timeouts {h['load_timeouts']}")


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
    engine = build_engine(args, model, fmt, mode)
    vocab = engine.model.config.vocab_size
    run_wave(engine, random_prompts(vocab, 2, args.input_len, seed=0), 4)  # warm-up
    before = counters(engine)
    r, _ = run_wave(engine, random_prompts(vocab, args.concurrency, args.input_len, seed=1), args.output_len)
    after = counters(engine)
    r.update(kv_cache_dtype=fmt, mode=mode, preemption_mode=engine.info["preemption_mode"],
             concurrency=args.concurrency, input_len=args.input_len, output_len=args.output_len,
             pool_tokens=engine.info["kv_pool"]["tokens"], cpu_offload=engine.info["cpu_offload"],
             **delta(after["swap"], before["swap"]),
             device_prefix=delta(after["device_prefix"], before["device_prefix"]),
             host_offload=offload_delta(after, before))
    out["pressure"].append(r)
    print(f"[pressure {fmt} {mode}] c={args.concurrency} {args.input_len}/{args.output_len} in a pool of "
          f"{r['pool_tokens']} tokens: {r['output_tok_per_s']:.0f} tok/s, TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms, "
          f"TPOT p50 {r['tpot_p50_s'] * 1e3:.1f} ms p95 {r['tpot_p95_s'] * 1e3:.1f} ms, preemptions "
          f"{r['preemptions']}, swaps {r['swapped_out']}/{r['swapped_in']}, fallbacks {r['swap_fallbacks']}; "
          f"TPOT p50 of the {r['requests_preempted']} preempted {_ms(r['tpot_p50_s_preempted'])} ms vs "
          f"{_ms(r['tpot_p50_s_not_preempted'])} ms never preempted{_tier_line(engine, r['host_offload'])}", flush=True)
    del engine
    release()


def bench_multi_turn(args, out: dict, model: str, fmt: str, mode: str) -> None:
    engine = build_engine(args, model, fmt, mode)
    vocab, bs = engine.model.config.vocab_size, engine.plan.block_size
    users, inp, outlen, new = args.users, args.turn_input_len, args.turn_output_len, args.turn_new_tokens
    run_wave(engine, random_prompts(vocab, 2, inp, seed=0), 4)  # warm-up
    first = random_prompts(vocab, users, inp, seed=2)
    c0 = counters(engine)
    turn1, outs = run_wave(engine, first, outlen)
    c1 = counters(engine)
    second = [p + list(o.outputs[0].token_ids) + x
              for p, o, x in zip(first, outs, random_prompts(vocab, users, new, seed=3))]
    turn2, _ = run_wave(engine, second, outlen)
    c2 = counters(engine)
    r = {"kv_cache_dtype": fmt, "mode": mode, "preemption_mode": engine.info["preemption_mode"], "users": users,
         "input_len": inp, "output_len": outlen, "new_tokens": new, "block_size": bs,
         "pool_tokens": engine.info["kv_pool"]["tokens"], "turn1_tokens": users * (inp + outlen),
         # every full block of turn 1's computed KV (its last output token is never written)
         "reusable_blocks": users * ((inp + outlen - 1) // bs),
         "cpu_offload": engine.info["cpu_offload"], "turn1": turn1, "turn2": turn2,
         "device_prefix_turn2": delta(c2["device_prefix"], c1["device_prefix"]),
         "swap_turn2": delta(c2["swap"], c1["swap"]),
         "host_offload_turn1": offload_delta(c1, c0), "host_offload_turn2": offload_delta(c2, c1)}
    base = next((x for x in out["multi_turn"] if x["kv_cache_dtype"] == fmt and x["mode"] == "recompute"), None)
    if mode != "recompute" and base is not None:
        r["turn2_vs_recompute"] = {k: turn2[k] / base["turn2"][k] if base["turn2"][k] else None
                                   for k in ("ttft_p50_s", "ttft_p95_s", "wall_s")}
    out["multi_turn"].append(r)
    hits = sum(p["hit_blocks"] for p in r["device_prefix_turn2"].values())
    print(f"[multi_turn {fmt} {mode}] {users} users, {inp}+{outlen} then +{new}+{outlen}, pool {r['pool_tokens']} "
          f"tokens for {r['turn1_tokens']} of turn 1: turn 1 TTFT p50 {_ms(turn1['ttft_p50_s'])} ms, "
          f"{turn1['wall_s']:.2f} s; turn 2 TTFT p50 {_ms(turn2['ttft_p50_s'])} ms p95 {_ms(turn2['ttft_p95_s'])} "
          f"ms, TPOT p50 {_ms(turn2['tpot_p50_s'])} ms, {turn2['wall_s']:.2f} s, preemptions {turn2['preemptions']}; "
          f"device prefix hits {hits} of {r['reusable_blocks']} reusable blocks"
          f"{_tier_line(engine, r['host_offload_turn2'])}", flush=True)
    if "turn2_vs_recompute" in r:
        v = r["turn2_vs_recompute"]
        print(f"[multi_turn {fmt}] {mode} / recompute, turn 2: TTFT p50 x{v['ttft_p50_s'] or 0:.2f}, "
              f"p95 x{v['ttft_p95_s'] or 0:.2f}, wall x{v['wall_s'] or 0:.2f}", flush=True)
    del engine
    release()


def _choice(p, name: str, value: str, valid: tuple) -> list[str]:
    chosen = [x for x in value.split(",") if x]
    bad = [x for x in chosen if x not in valid]
    if bad or not chosen:
        p.error(f"--{name}: unknown {bad}; valid: {', '.join(valid)} (a comma-separated list)")
    return chosen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3-8b", help="shipped config or HF folder (dummy weights)")
    p.add_argument("--formats", default="bfloat16,fp8_e4m3,int8_per_token_head,int4_kivi")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"of {', '.join(SECTIONS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}: the pressure runs; "
                   f"multi_turn runs those of {', '.join(MULTI_TURN_MODES)} among them")
    p.add_argument("--blocks", type=int, default=4096, help="blocks per copy (4096 x 16 = 64K tokens)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=64, help="the pressure wave; max_num_seqs of every engine")
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--users", type=int, default=96, help="multi_turn: users, each sending two turns")
    p.add_argument("--turn-input-len", type=int, default=None, help="multi_turn: turn-1 prompt (default --input-len)")
    p.add_argument("--turn-output-len", type=int, default=64, help="multi_turn: output tokens of each turn")
    p.add_argument("--turn-new-tokens", type=int, default=64, help="multi_turn: new prompt tokens of turn 2")
    p.add_argument("--kv-cache-memory", default="4GiB", help="device pool, small enough to force preemption "
                   "(pressure) and to drop most users' turn-1 prefixes (multi_turn)")
    p.add_argument("--cpu-offload-gb", type=float, default=32.0, help="host memory of swap and tier runs (the "
                   "tier holds every user's turn 1 at the defaults: 96 x 2112 tokens = 25 GiB in bf16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes")
    p.add_argument("--out", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    sections = _choice(p, "sections", args.sections, SECTIONS)
    modes = _choice(p, "modes", args.modes, MODES)
    model = args.model
    if args.smoke:
        tmp = tempfile.mkdtemp()
        (Path(tmp) / "config.json").write_text(json.dumps(SMOKE_CONFIG))
        model, args.blocks, args.iters = tmp, 64, 2
        args.concurrency, args.input_len, args.output_len = 8, 16, 48  # outputs outgrow the pool
        args.kv_cache_memory, args.cpu_offload_gb, args.max_num_batched_tokens = "384KiB", 0.01, 64
        # 16 users x 80 tokens of turn 1 against a pool of 384 tokens (bf16; int4_kivi's blocks are 32)
        args.users, args.turn_input_len, args.turn_output_len, args.turn_new_tokens = 16, 64, 16, 16
        if args.out == DEFAULT_OUT:
            args.out = str(Path(tempfile.mkdtemp()) / "bench_offload_smoke.json")
    if args.turn_input_len is None:
        args.turn_input_len = args.input_len
    from kvq.models.source import model_shape, resolve_model

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = model_shape(resolve_model(model))
    formats = [f for f in args.formats.split(",") if f]
    out = {"meta": {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    "device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu",
                    "torch": torch.__version__, "model": "smoke" if args.smoke else model,
                    "argv": sys.argv[1:] if argv is None else argv},
           "copies": [], "pressure": [], "multi_turn": []}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        path.write_text(json.dumps(out, indent=1) + "\n")

    runs = {"copies": [(fmt, None) for fmt in formats],
            "pressure": [(fmt, m) for fmt in formats for m in modes],
            "multi_turn": [(fmt, m) for fmt in formats for m in modes if m in MULTI_TURN_MODES]}
    for section in SECTIONS:
        if section not in sections:
            continue
        for fmt, mode in runs[section]:
            if section == "copies":
                bench_copies(args, out, shape, fmt, dev)
            elif section == "pressure":
                bench_pressure(args, out, model, fmt, mode)
            else:
                bench_multi_turn(args, out, model, fmt, mode)
            save()
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
