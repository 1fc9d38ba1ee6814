"""Where a decode step's time goes (GPU machine): device kernels vs host work.

Builds the engine on a dummy-weight model, starts a wave of requests, lets the
prefill finish, then profiles N pure decode steps twice: with torch.profiler
(device time per kernel family, the step's wall time, and the device's idle time between
kernels: how much, in gaps of what length, after and before which kernels) and with cProfile
(the host-side Python functions).  Not a benchmark: it steers the engine work.

    python scripts/profile_engine.py --kv-cache-dtype bfloat16 --concurrency 1,64
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from kvq.cache.plan import KVCacheConfig
from kvq.engine.llm_engine import EngineConfig, LLMEngine
from kvq.engine.sampling_params import SamplingParams


def kernel_gaps(spans: list[tuple[float, float, str]]) -> tuple[float, float, list[tuple[float, str, str]]]:
    """Device kernels ``(start, end, name)`` (any unit) -> (busy, span, gaps): the time some kernel
    ran (overlapping kernels counted once), first start to last end, and every idle gap as
    ``(length, kernel before, kernel after)`` in time order.  What the step spends outside its
    kernels: many short gaps are launch latency between kernels, a few long ones a device that
    waited for the host."""
    if not spans:
        return 0.0, 0.0, []
    spans = sorted(spans)
    busy, gaps = 0.0, []
    start, end, name = spans[0]
    for s, e, n in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append((s - end, name, n))
            start, end, name = s, e, n
        elif e >= end:
            end, name = e, n
    busy += end - start
    return busy, end - spans[0][0], gaps


def print_gaps(prof, steps: int, rows: int) -> None:
    """The profiled steps' device idle time: total, by gap length, and the longest gaps."""
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    busy, span, gaps = kernel_gaps(spans)
    bins = {"< 5 us": 0.0, "5-50 us": 0.0, ">= 50 us": 0.0}
    for g, _, _ in gaps:
        bins["< 5 us" if g < 5 else "5-50 us" if g < 50 else ">= 50 us"] += g
    print(f"  device busy {busy / steps / 1e3:.2f} ms/step of {span / steps / 1e3:.2f} ms; idle "
          f"{(span - busy) / steps / 1e3:.2f} ms/step in {len(gaps) / steps:.0f} gaps/step ("
          + ", ".join(f"{k}: {v / steps / 1e3:.2f} ms" for k, v in bins.items()) + ")")
    for g, before, after in sorted(gaps, reverse=True)[:rows]:
        print(f"    gap {g:8.1f} us  after {before[:50]}  before {after[:50]}")


def decode_steps(engine, n):
    for _ in range(n):
        engine.step()
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--kv-cache-dtype", default="bfloat16", help="a format spec: a name, windows or tiers")
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--output-len", type=int, default=None,
                    help="max_tokens per request (default: enough that all c sequences run when profiled)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="default: the engine's (on with CUDA)")
    ap.add_argument("--host", action="store_true", help="also cProfile the host side")
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--prefill", action="store_true", help="profile the wave's prefill steps instead of decode")
    ap.add_argument("--trace", default=None, help="also write the profiled decode steps' Chrome trace to this file")
    ap.add_argument("--advance", type=int, default=0,
                    help="decode steps run before the profiled ones, so that contexts grow (and a pool too small "
                         "for the wave preempts) as in bench_engine's long runs")
    args = ap.parse_args()
    concs = [int(c) for c in args.concurrency.split(",")]
    # a format spec as bench_engine and kvq eval take it: a name, windows or tiers (fp8_e4m3>int4_kivi@256)
    eng = LLMEngine(EngineConfig(model=args.model, load_format="dummy",
                                 kv_cache=KVCacheConfig().with_spec(args.kv_cache_dtype),
                                 max_num_seqs=max(concs), max_num_batched_tokens=8192, progress=False,
                                 enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling))
    vocab = eng.model.config.vocab_size
    if args.prefill:  # one prompt of the profiled length first: its kernels compile outside the profile
        eng.add_request(torch.randint(0, vocab, (args.input_len,)).tolist(), SamplingParams(max_tokens=2))
        while eng.has_unfinished():
            eng.step()
        torch.cuda.synchronize()
    for c in concs:
        # long enough that the first sequences still run when the last prompt's prefill ends (decode
        # goes first, so they decode through the whole prefill phase): the profiled steps see all c
        prefill_steps = -(-c * args.input_len // 8192)
        sp = SamplingParams(max_tokens=args.output_len or 4 * args.steps + 8 + 2 * prefill_steps + args.advance,
                            ignore_eos=True)
        for _ in range(c):
            eng.add_request(torch.randint(0, vocab, (args.input_len,)).tolist(), sp)
        def prefill_pending():
            seqs = eng.scheduler._seqs.values()
            return eng.scheduler.num_waiting or any(len(s.output_token_ids) == 0 for s in seqs)

        if args.prefill:
            steps, t = 0, time.perf_counter()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                while prefill_pending():
                    eng.step()
                    steps += 1
                torch.cuda.synchronize()
            wall = time.perf_counter() - t
            dev = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
            print(f"\n=== {args.kv_cache_dtype} c={c} prefill: {steps} steps, wall {wall * 1e3:.1f} ms (profiled), "
                  f"device kernels {dev:.1f} ms")
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:args.rows]:
                print(f"  {e.self_device_time_total / 1e3:8.2f} ms  {e.count:6d} calls  {e.key[:70]}")
            while eng.has_unfinished():
                eng.step()
            continue
        while prefill_pending():
            eng.step()
        decode_steps(eng, 3 + args.advance)
        t = time.perf_counter()
        decode_steps(eng, args.steps)
        wall = (time.perf_counter() - t) / args.steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            decode_steps(eng, args.steps)
        dev = sum(e.self_device_time_total for e in prof.key_averages()) / args.steps / 1e3
        live = [s for s in eng.scheduler._seqs.values() if not s.is_finished]
        ctx = [len(s.prompt_token_ids) + len(s.output_token_ids) for s in live]
        print(f"\n=== {args.kv_cache_dtype} c={c}: wall {wall * 1e3:.2f} ms/step, device kernels {dev:.2f} ms/step, "
              f"graph steps {eng.runner.graph_steps}, {eng.scheduler.num_running} sequences running of {len(live)} "
              f"unfinished, {sum(ctx)} tokens of context (mean {sum(ctx) / max(1, len(ctx)):.0f})")
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:args.rows]
        for e in rows:
            print(f"  {e.self_device_time_total / args.steps / 1e3:7.3f} ms/step  "
                  f"{e.count / args.steps:6.1f} calls/step"
                  f"  {e.key[:70]}")
        print_gaps(prof, args.steps, 10)
        if args.trace:
            prof.export_chrome_trace(args.trace)
        if not args.host:
            while eng.has_unfinished():
                eng.step()
            continue
        pr = cProfile.Profile()
        pr.enable()
        decode_steps(eng, args.steps)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
        print(s.getvalue()[:6000])
        while eng.has_unfinished():
            eng.step()


if __name__ == "__main__":
    main()
