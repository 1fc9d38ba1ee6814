#!/usr/bin/env python3
"""End-to-end generation throughput and latency: kvq's engine per KV format vs HF transformers.

For each KV format, one kvq engine (dummy-weight model at real shapes, bf16
weights, pool sized from --gpu-memory-utilization, CUDA graphs for decode) serves,
for each workload (input/output tokens) and concurrency c, a wave of c requests
submitted at once (random token-id prompts, ignore_eos, exactly `output` new
tokens each).  Recorded per run: output tokens/s over the wave's wall time,
TTFT and TPOT p50/p95 (per request: first token - arrival; mean inter-token
time after the first), the mean decode-only step time, preemptions, and the
pool capacity (blocks, tokens) of the format.  The bytes roofline of a decode
step (weights + the batch's KV at the measured copy bandwidth) is printed
beside TPOT.

In the same run (--hf) HF transformers' `generate` with a static cache and SDPA
on the same model shapes (greedy, min_new_tokens = max_new_tokens), and HF's
continuous batching `generate_batch` where it runs.

Usage (GPU machine):
    python benchmarks/bench_engine.py --formats bfloat16,fp8_e4m3 --hf
    python benchmarks/bench_engine.py --formats int8_per_token_head,int4_kivi   # merges into the same JSON
    python benchmarks/bench_engine.py --model llama-3.1-8b --formats bfloat16 --workloads 32768x1,131071x1 \
        --concurrency 1 --ttft-floor   # one long prompt's TTFT against its floor (benchmarks/ttft_floor.py)
    python benchmarks/bench_engine.py --smoke   # tiny model and workloads (any device)

The JSON (docs/results/bench_engine.json) is rewritten after every result and
merged with what an earlier invocation wrote, keyed by (system, format, workload,
concurrency).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gc_pauses import GcPauses  # noqa: E402
from benchmarks.jit_compiles import JitCompiles, allocator_counts, counts_since  # noqa: E402

SMOKE_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=4096, hidden_size=256,
                    intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=4096,
                    tie_word_embeddings=False, torch_dtype="bfloat16")


def pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def copy_bandwidth(device) -> float | None:
    if device.type != "cuda":
        return None
    x = torch.empty(1 << 31, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ts = []
    for _ in range(8):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * (1 << 31) / statistics.median(ts)


class Results:
    def __init__(self, path: Path, meta: dict):
        self.path = path
        old = json.loads(path.read_text()) if path.exists() else {}
        self.data = {"meta": {**old.get("meta", {}), **meta}, "runs": old.get("runs", []),
                     "capacity": old.get("capacity", {}), "scenarios": old.get("scenarios", [])}

    def add(self, run: dict) -> None:
        key = (run["system"], run["kv_cache_dtype"], run["input_len"], run["output_len"], run["concurrency"])
        self.data["runs"] = [r for r in self.data["runs"] if (r["system"], r["kv_cache_dtype"], r["input_len"],
                             r["output_len"], r["concurrency"]) != key] + [run]
        self.save()

    def add_scenario(self, run: dict) -> None:
        key = (run["system"], run["kv_cache_dtype"], run["scenario"])
        self.data["scenarios"] = [r for r in self.data.get("scenarios", [])
                                  if (r["system"], r["kv_cache_dtype"], r["scenario"]) != key] + [run]
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2))


def tree_commit() -> str:
    """The commit the timed code came from: ``KVQ_COMMIT`` when set (a copied tree whose git state is
    not its own, as on the device machine), else git's HEAD, "-dirty" with uncommitted changes."""
    import os
    import subprocess

    if os.environ.get("KVQ_COMMIT"):
        return os.environ["KVQ_COMMIT"]
    git = ["git", "-C", str(ROOT)]
    try:
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + ("-dirty" if dirty else "")


def roofline_step_s(weight_bytes: int, kv_bytes_per_token: float, batch: int, ctx: int, bw: float | None):
    if not bw:
        return None
    return (weight_bytes + kv_bytes_per_token * batch * ctx) / bw


# -- kvq ------------------------------------------------------------------------------------------
def run_kvq_wave(engine, vocab: int, c: int, inp: int, out: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return run_prompts(engine, [torch.randint(0, vocab, (inp,), generator=g).tolist() for _ in range(c)], out)[0]


def step_stats(times: list[float]) -> dict:
    """Decode-step times -> mean, median, p90, max (a mean far above the median: rare long steps)."""
    if not times:
        return {"decode_steps": 0, "decode_step_mean_s": None}
    t = sorted(times)
    return {"decode_steps": len(t), "decode_step_mean_s": sum(t) / len(t), "decode_step_p50_s": t[len(t) // 2],
            "decode_step_p90_s": t[int(0.9 * (len(t) - 1))], "decode_step_max_s": t[-1]}


def other_step_stats(times: list[float]) -> dict:
    """Times of the step calls that were not pure decode steps (prefill chunks, with or without
    decodes beside them) -> count, total, mean, max: where TTFT goes."""
    if not times:
        return {"other_steps": 0, "other_step_total_s": 0.0}
    return {"other_steps": len(times), "other_step_total_s": sum(times), "other_step_mean_s": sum(times) / len(times),
            "other_step_max_s": max(times),
            # in order, for a few (a long prompt's chunks: where its time to first token goes)
            **({"other_step_s": [round(t, 4) for t in times]} if len(times) <= 64 else {})}


def run_prompts(engine, prompts: list[list[int]], out: int) -> tuple[dict, list]:
    """Submit every prompt at once (greedy, ignore_eos, exactly ``out`` tokens each), step until all have
    finished; -> (throughput, TTFT, TPOT and preemptions of the wave; the RequestOutputs in order)."""
    from kvq.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0)
    steps_before = engine.runner.graph_steps
    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp) for p in prompts]
    done, step_times, other_times = {}, [], []
    alloc = allocator_counts()
    with GcPauses() as gcp, JitCompiles() as jit:
        while engine.has_unfinished():
            ts = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - ts
            if outs and all(len(o.outputs[0].token_ids) > 1 for o in outs) \
                    and len(outs) == engine.scheduler.num_running:
                step_times.append(dt)
            else:
                other_times.append(dt)
            for o in outs:
                if o.finished:
                    done[o.request_id] = o
    wall = time.perf_counter() - t0
    outs = [done[i] for i in ids]
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    assert all(len(o.outputs[0].token_ids) == out for o in outs), "every request must produce exactly `out` tokens"
    ttft = [o.metrics["ttft"] for o in outs]
    tpot = [o.metrics["tpot"] for o in outs]
    return {
        "wall_s": wall, "output_tokens": ntok, "output_tok_per_s": ntok / wall,
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
        "tpot_p50_s": pct(tpot, 0.5), "tpot_p95_s": pct(tpot, 0.95),
        **step_stats(step_times),
        "graph_steps": engine.runner.graph_steps - steps_before,
        "preemptions": sum(o.metrics["num_preemptions"] for o in outs),
        **other_step_stats(other_times), **gcp.record(), **jit.record(), **counts_since(alloc),
    }, outs


def _recorded(run, **fields) -> dict:
    """``run()``, or its exception recorded as the result (with ``fields``), not hidden."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        return {**fields, "error": f"{type(e).__name__}: {e}"}


def _alloc(r: dict) -> str:
    a = r.get("allocator")
    return f", alloc retries {a['alloc_retries']} mallocs {a['cuda_mallocs']}" if a else ""


def _ms(v: float | None) -> str:
    return f"{1e3 * v:.1f}" if v is not None else "-"


def run_scenario(engine, vocab: int, sc, seed: int, floor) -> dict:
    """Serve a scenario (benchmarks/scenarios.py): each request is added when its arrival time has
    passed (its TTFT counts from that arrival), greedy, ignore_eos, exactly its output length;
    ``floor(contexts)``: the floor of a decode step over those contexts, or None.  -> tok/s,
    TTFT/TPOT p50/p99, preemptions, peak running sequences, decode-step mean and its floor."""
    from kvq.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    reqs = sc.requests
    prompts = [torch.randint(0, vocab, (r.input_len,), generator=g).tolist() for r in reqs]
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
    done, nxt, peak = {}, 0, 0
    contexts, step_times, other_times = [], [], []
    steps_before = engine.runner.graph_steps
    t0 = time.monotonic()
    last_end = None  # when the previous step call returned, if it was a decode step
    alloc = allocator_counts()
    with GcPauses() as gcp, JitCompiles() as jit:
        while nxt < len(order) or engine.has_unfinished():
            now = time.monotonic() - t0
            while nxt < len(order) and reqs[order[nxt]].arrival_s <= now:
                r = reqs[order[nxt]]
                sp = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
                rid = engine.add_request(prompts[order[nxt]], sp)
                engine.scheduler.get(rid).arrival_time = t0 + r.arrival_s  # queued since its arrival
                nxt += 1
            if not engine.has_unfinished():
                time.sleep(min(0.002, max(0.0, reqs[order[nxt]].arrival_s - now)))
                last_end = None
                continue
            peak = max(peak, engine.scheduler.num_running)
            ts = time.perf_counter()
            outs = engine.step()
            end = time.perf_counter()
            # a decode step's time: from the previous decode step's return to this one's (with asynchronous
            # scheduling the host's work between calls overlaps the device's step, so the call alone is less)
            decode = len(outs) == engine.scheduler.num_running and all(len(o.outputs[0].token_ids) > 1 for o in outs)
            if outs and decode:
                if last_end is not None:
                    step_times.append(end - last_end)
                    contexts.append([len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs])
                last_end = end
            else:
                last_end = None
                other_times.append(end - ts)
            for o in outs:
                if o.finished:
                    done[o.request_id] = o
    wall = time.monotonic() - t0
    outs = list(done.values())
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    assert len(outs) == len(reqs) and ntok == sum(r.output_len for r in reqs), "every request must finish in full"
    ttft = [o.metrics["ttft"] for o in outs]
    tpot = [o.metrics["tpot"] for o in outs]
    stats = step_stats(step_times)
    step, n = stats["decode_step_mean_s"], stats["decode_steps"]
    fl = sum(floor(c) for c in contexts) / n if n and floor is not None else None
    return {
        "scenario": sc.name, "description": sc.description, "requests": len(reqs),
        "input_tokens": sum(r.input_len for r in reqs), "wall_s": wall, "output_tokens": ntok,
        "output_tok_per_s": ntok / wall,
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
        "tpot_p50_s": pct(tpot, 0.5), "tpot_p99_s": pct(tpot, 0.99),
        "preemptions": sum(o.metrics["num_preemptions"] for o in outs), "peak_running": peak,
        **stats, "decode_step_floor_s": fl,
        "step_over_floor": step / fl if step and fl else None,
        "graph_steps": engine.runner.graph_steps - steps_before, **other_step_stats(other_times), **gcp.record(),
        **jit.record(), **counts_since(alloc),
    }


def demotions(engine) -> dict:
    """Blocks a tiered cache moved down so far, by destination tier and under pressure (cumulative over the
    engine's runs, warm-up included); empty untiered."""
    bm = engine.block_manager
    if bm.arena is None:
        return {}
    clock = engine.runner.demote_clock
    return {"demotions_by_tier": list(bm.num_demotions[1:]), "pressure_demotions": engine.scheduler.num_demotions,
            "pressure_scans": bm.num_scans,  # walks of the running sequences' blocks (whole or ahead, in slices)
            "demotion_s": round(clock.seconds, 4) if clock is not None else 0.0}


def prefill_backend(info: dict) -> str | None:
    """The prefill attention kernel the engine says it runs (kvq.attention.backends.select_prefill)."""
    return info["attention_backend"].get("prefill")


def measure_ttft_floors(args, cfg: dict, workloads, concs, device, max_len: int) -> dict:
    """prompt length -> benchmarks/ttft_floor.py's floor, for the concurrency-1 rows to be run (those whose
    prompt + output fit ``max_len`` positions); measured before any engine takes the device's memory."""
    from benchmarks.ttft_floor import PrefillShape, ttft_floor

    shape, floors = PrefillShape.from_hf(cfg), {}
    for inp in sorted({inp for inp, out in workloads
                       if 1 in concs and (inp, 1) not in args.skip and inp + out <= max_len}):
        t = time.perf_counter()
        fl = floors[inp] = ttft_floor(shape, inp, args.max_num_batched_tokens, device)
        ran = {k: float(f"{r['tflops']:.3g}") if "tflops" in r else "error" for k, r in fl["attention"].items()}
        print(f"TTFT floor {inp} tokens: {fl['ttft_floor_s'] or 0:.3f} s = GEMMs {fl['gemm_s'] or 0:.3f} s "
              f"({fl['gemm_tflops'] or 0:.0f} TFLOP/s) + attention {fl['attention_s'] or 0:.3f} s "
              f"({fl['attention_kernel']}, TFLOP/s per kernel {ran}) [{time.perf_counter() - t:.0f}s]", flush=True)
        if fl["gemm_sequence"]:
            sq = fl["gemm_sequence"]
            print(f"  the prompt's {sq['gemms']} GEMMs back to back: {sq['s']:.3f} s ({sq['tflops']:.0f} TFLOP/s); "
                  f"with them, floor {fl['ttft_floor_sequence_s'] or 0:.3f} s", flush=True)
    return floors


def bench_kvq(args, res: Results, model: str, fmt: str, workloads, concs, bw, weight_bytes,
              async_scheduling: bool | None = None, scenarios=(), gemm_flops_per_token: float = 0.0,
              ttft_floors: dict | None = None) -> None:
    from kvq.cache.plan import KVCacheConfig
    from kvq.engine.llm_engine import EngineConfig, LLMEngine

    t0 = time.perf_counter()
    extra = {"prefill_backend": args.prefill_backend} if args.prefill_backend else {}
    # a format spec as kvq eval takes it: a name, windows (fp8_e4m3:r128:s4) or tiers (fp8_e4m3>int4_kivi)
    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", kv_cache=KVCacheConfig().with_spec(fmt),
                                    max_num_seqs=max([*concs, args.max_num_seqs or 0]) if not scenarios
                                    else args.max_num_seqs or 1024, max_num_batched_tokens=args.max_num_batched_tokens,
                                    gpu_memory_utilization=args.gpu_memory_utilization, progress=False,
                                    kv_cache_memory=args.kv_cache_memory, enforce_eager=args.enforce_eager,
                                    async_scheduling=async_scheduling,
                                    tensor_parallel_size=args.tensor_parallel_size, **extra))
    info = engine.info
    prefill = prefill_backend(info)
    plan = engine.full_plan  # every rank's heads (under tensor parallelism engine.plan is rank 0's)
    system = "kvq-async" if engine.async_scheduling else "kvq"  # asynchronous scheduling is the default on CUDA
    if args.tensor_parallel_size > 1:
        system += f"-tp{args.tensor_parallel_size}"
    res.data["capacity"][fmt] = {"q_blocks": info["kv_pool"]["q_blocks"], "hp_blocks": info["kv_pool"]["hp_blocks"],
                                 "tokens": info["kv_pool"]["tokens"], "pool_bytes": info["kv_pool"]["bytes"],
                                 "bytes_per_token": plan.bytes_per_token, "block_size": plan.block_size,
                                 "k": info["kv_cache_dtype"]["k"], "v": info["kv_cache_dtype"]["v"],
                                 "backend": info["attention_backend"], "cuda_graphs": info["cuda_graphs"],
                                 "engine_start_s": time.perf_counter() - t0,
                                 "tensor_parallel": info["tensor_parallel"],
                                 **({"prefill_backend": prefill} if prefill else {})}
    res.save()
    print(f"[{system} {fmt}] pool {info['kv_pool']['q_blocks']} blocks = {info['kv_pool']['tokens']} tokens "
          f"({info['kv_pool']['bytes'] / 2**30:.1f} GiB), backend {info['attention_backend']['resolved']}, "
          f"graphs {info['cuda_graphs']}", flush=True)
    vocab = engine.model.config.vocab_size
    tiers = {"kv_cache_tiers": plan.tier_names()[1:]} if plan.tiers else {}  # elastic precision (issue 45)
    # warm-up: kernels compile and cuBLAS picks its algorithms outside the timings; enough requests to fill
    # two whole prefill steps (mixed with decodes) for each workload's prompt length: the second splits a
    # prompt, whose later chunk reads a past (through its tiers, where an age under the prompt length moved
    # it down in between; otherwise that read compiled in the timed run: 0.6 s of TTFT, H100)
    for inp, _ in workloads:
        n = min(max(concs), 2 * -(-args.max_num_batched_tokens // inp) + 1)
        warm_out = min(4, engine.max_model_len - inp)  # a prompt at the context's end: fewer new tokens
        if warm_out >= 1:  # (a failure is the timed run's to record)
            _recorded(functools.partial(run_kvq_wave, engine, vocab, n, inp, warm_out, seed=0))
    if scenarios:
        for inp in sorted({min(r.input_len, args.max_num_batched_tokens) for sc in scenarios for r in sc.requests[:1]}):
            run_kvq_wave(engine, vocab, min(8, -(-args.max_num_batched_tokens // inp) + 1), inp, 4, seed=0)
    from benchmarks.scenarios import StepFloor

    floor = StepFloor(plan, weight_bytes, gemm_flops_per_token, bw) if bw else None
    if scenarios:
        for sc in scenarios:
            t = time.perf_counter()
            r = _recorded(functools.partial(run_scenario, engine, vocab, sc, seed=17, floor=floor), scenario=sc.name)
            res.add_scenario({"system": system, "kv_cache_dtype": fmt, **tiers, "commit": args.commit, **r,
                              **demotions(engine)})
            if "error" in r:
                print(f"[{system} {fmt}] {sc.name}: {r['error']}", flush=True)
            else:
                print(f"[{system} {fmt}] {sc.name}: {r['output_tok_per_s']:.0f} tok/s, TTFT p50/p99 "
                      f"{r['ttft_p50_s']:.2f}/{r['ttft_p99_s']:.2f} s, TPOT p50/p99 {_ms(r['tpot_p50_s'])}/"
                      f"{_ms(r['tpot_p99_s'])} ms, step {_ms(r['decode_step_mean_s'])} ms (floor "
                      f"{_ms(r['decode_step_floor_s'])}), preempt {r['preemptions']}, peak running "
                      f"{r['peak_running']} [{time.perf_counter() - t:.0f}s]", flush=True)
    for inp, out in workloads:
        for c in concs:
            if (inp, c) in args.skip:
                continue
            t = time.perf_counter()
            if args.gc_off:
                gc.disable()
            try:
                r = _recorded(functools.partial(run_kvq_wave, engine, vocab, c, inp, out, seed=c * 7 + inp))
            finally:
                gc.enable()
            r["gc_off"] = args.gc_off
            ctx = inp + out // 2
            r["roofline_step_s"] = roofline_step_s(weight_bytes, plan.bytes_per_token, c, ctx, bw)
            # the floor with the GEMMs' compute term and the hp window blocks (c sequences at ctx)
            fl, step = floor([ctx] * c) if floor else None, r.get("decode_step_mean_s")
            r["decode_step_floor_s"], r["step_over_floor"] = fl, step / fl if fl and step else None
            if prefill:
                r["prefill_backend"] = prefill
            tf = (ttft_floors or {}).get(inp) if c == 1 else None
            if tf is not None:
                r["ttft_floor_s"], r["ttft_floor"] = tf["ttft_floor_s"], tf
                r["ttft_x_floor"] = (r["ttft_p50_s"] / tf["ttft_floor_s"]
                                     if r.get("ttft_p50_s") and tf["ttft_floor_s"] else None)
            run = {"system": system, "kv_cache_dtype": fmt, **tiers, "input_len": inp, "output_len": out,
                   "concurrency": c, "commit": args.commit, **r, **demotions(engine)}
            res.add(run)
            if "error" in r:
                print(f"[{system} {fmt}] {inp}/{out} c={c}: {r['error']}", flush=True)
            else:
                x_floor = f" ({r['ttft_x_floor']:.2f}x floor)" if r.get("ttft_x_floor") else ""
                print(f"[{system} {fmt}] {inp}/{out} c={c}: {r['output_tok_per_s']:.0f} tok/s, TTFT p50 "
                      f"{r['ttft_p50_s'] * 1e3:.0f} ms{x_floor}, TPOT p50 {_ms(r['tpot_p50_s'])} ms "
                      f"(roofline {1e3 * (r['roofline_step_s'] or 0):.2f} ms, floor "
                      f"{1e3 * (r['decode_step_floor_s'] or 0):.2f} ms), "
                      f"step {1e3 * (r['decode_step_mean_s'] or 0):.2f} ms (p50 "
                      f"{1e3 * (r.get('decode_step_p50_s') or 0):.2f}, max "
                      f"{1e3 * (r.get('decode_step_max_s') or 0):.0f})"
                      f", preempt {r['preemptions']}, gc {r['gc_collections']} {r['gc_pause_s']:.2f} s, other steps "
                      f"{r['other_steps']} {r['other_step_total_s']:.1f} s (max {_ms(r.get('other_step_max_s'))} ms)"
                      f", jit {r['jit_compiles']} {r['jit_compile_s']:.1f} s{_alloc(r)} "
                      f"[{time.perf_counter() - t:.0f}s]",
                      flush=True)
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


# -- HF transformers ------------------------------------------------------------------------------
def build_hf(model_dir: Path, device):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        m = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    return m.eval()


def bench_hf(args, res: Results, model_dir: Path, workloads, concs, device) -> None:
    import transformers

    t0 = time.perf_counter()
    model = build_hf(model_dir, device)
    res.data["meta"]["hf_build_s"] = time.perf_counter() - t0
    vocab = model.config.vocab_size
    for inp, out in workloads:
        for c in ([int(x) for x in args.hf_concurrency.split(",")] if args.hf_concurrency else concs):
            if c > args.hf_max_concurrency or (inp, c) in args.skip:
                continue
            g = torch.Generator().manual_seed(c * 7 + inp)
            ids = torch.randint(0, vocab, (c, inp), generator=g).to(device)
            gen = transformers.GenerationConfig(max_new_tokens=out, min_new_tokens=out, do_sample=False,
                                                cache_implementation="static", eos_token_id=None, pad_token_id=0,
                                                disable_compile=args.hf_eager)
            run = {"system": "hf_generate_static_eager" if args.hf_eager else "hf_generate_static",
                   "kv_cache_dtype": "bfloat16", "input_len": inp, "output_len": out,
                   "concurrency": c}
            try:
                with torch.inference_mode():
                    # warm-up: the same call once, so that torch.compile's graphs for these shapes (batch,
                    # static cache length) exist before the timed call
                    model.generate(ids, generation_config=gen, attention_mask=torch.ones_like(ids))
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    y = model.generate(ids, generation_config=gen, attention_mask=torch.ones_like(ids))
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - t
                n = (y.shape[1] - inp) * c
                run.update(wall_s=wall, output_tokens=n, output_tok_per_s=n / wall, tpot_mean_s=wall / out)
                print(f"[hf generate static] {inp}/{out} c={c}: {n / wall:.0f} tok/s ({wall:.1f}s)", flush=True)
            except Exception as e:
                traceback.print_exc()
                run["error"] = f"{type(e).__name__}: {e}"
            res.add(run)
    if args.hf_batch:
        inp, out = workloads[0]
        c, out_b = args.hf_batch_concurrency, args.hf_batch_output
        g = torch.Generator().manual_seed(11)
        prompts = [torch.randint(0, vocab, (inp,), generator=g).tolist() for _ in range(c)]
        run = {"system": "hf_generate_batch", "kv_cache_dtype": "bfloat16", "input_len": inp, "output_len": out_b,
               "concurrency": c}
        try:
            gen = transformers.GenerationConfig(max_new_tokens=out_b, min_new_tokens=out_b, do_sample=False,
                                                eos_token_id=-1, pad_token_id=0, max_batch_tokens=2048,
                                                num_blocks=4096, block_size=128)
            with torch.inference_mode():
                t = time.perf_counter()
                outs = model.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
            n = sum(len(o.generated_tokens) for o in outs.values())
            run.update(wall_s=wall, output_tokens=n, output_tok_per_s=n / wall)
            print(f"[hf generate_batch] {inp}/{out_b} c={c}: {n / wall:.0f} tok/s ({wall:.1f}s)", flush=True)
        except Exception as e:
            traceback.print_exc()
            run["error"] = f"{type(e).__name__}: {e}"
        res.add(run)
    del model
    gc.collect()
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3-8b", help="shipped config or HF folder (dummy weights)")
    p.add_argument("--formats", default="bfloat16,fp8_e4m3,int8_per_token_head,int4_kivi")
    p.add_argument("--workloads", default="1024x256,8192x256", help="INPUTxOUTPUT,...")
    p.add_argument("--concurrency", default="1,8,64,256")
    p.add_argument("--skip", default="8192x256", help="INPUTxCONC pairs not run (8K x 256: the prefill alone "
                   "takes minutes of device time)")
    p.add_argument("--hf", action="store_true", help="also run HF transformers generate (static cache, SDPA)")
    p.add_argument("--hf-max-concurrency", type=int, default=64)
    p.add_argument("--hf-concurrency", default=None, help="concurrencies for HF (default: --concurrency)")
    p.add_argument("--hf-eager", action="store_true", help="HF generate without its automatic torch.compile "
                   "of the static-cache decode (disable_compile=True); recorded as hf_generate_static_eager")
    p.add_argument("--hf-batch", action="store_true", help="also run HF generate_batch (continuous batching)")
    p.add_argument("--hf-batch-concurrency", type=int, default=64)
    p.add_argument("--hf-batch-output", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--gc-off", action="store_true", help="diagnostic: Python's garbage collector disabled during "
                   "each timed wave (what its pauses cost; recorded as gc_off)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (GPUs) the engine is split over; the pool of each holds kv_cache_memory / "
                        "gpu_memory_utilization's share of its own GPU")
    p.add_argument("--scheduling", default="default", help="default (the engine's: async on CUDA), sync, async, "
                   "or a list such as sync,async (one engine each, per format; recorded as systems kvq and "
                   "kvq-async)")
    p.add_argument("--scenarios", default=None,
                   help="capacity-bound loads instead of the waves: decode_heavy, prefill_heavy, mixed (comma-"
                        "separated; benchmarks/scenarios.py), written to --out (default docs/results/"
                        "bench_capacity.json)")
    p.add_argument("--scenario-scale", type=float, default=1.0, help="fraction of each scenario's requests")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="engine's running-sequence limit (default: the largest concurrency; 1024 with --scenarios)")
    p.add_argument("--ttft-floor", action="store_true",
                   help="rows at concurrency 1 also get ttft_floor_s (benchmarks/ttft_floor.py: the prompt's GEMM "
                        "FLOPs at the cuBLAS rate + its causal attention FLOPs at the fastest library kernel's "
                        "rate, measured in this process before the engines start), the rates, and ttft_x_floor")
    p.add_argument("--prefill-backend", default=None,
                   help="the engine's prefill attention kernel: auto, flashinfer or triton (--prefill-backend of "
                        "kvq generate/serve)")
    p.add_argument("--smoke", action="store_true", help="tiny model and workloads")
    p.add_argument("--out", default=None, help="JSON (default docs/results/bench_engine.json, or "
                   "docs/results/bench_capacity.json with --scenarios)")
    args = p.parse_args(argv)
    from benchmarks.scenarios import scenario, shrink

    try:
        scenarios = [scenario(n, args.scenario_scale) for n in args.scenarios.split(",") if n] if args.scenarios \
            else []
    except ValueError as e:
        p.error(str(e))
    args.skip = {tuple(int(x) for x in s.split("x")) for s in args.skip.split(",") if s}
    if args.ttft_floor and args.tensor_parallel_size > 1:
        p.error("--ttft-floor is the floor of one GPU; run it with --tensor-parallel-size 1")
    workloads = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
    concs = [int(c) for c in args.concurrency.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tmp = None
    model = args.model
    if args.smoke:
        tmp = tempfile.mkdtemp()
        (Path(tmp) / "config.json").write_text(json.dumps(SMOKE_CONFIG))
        model = tmp
        workloads, concs = [(64, 8)], [1, 4]
        args.kv_cache_memory = args.kv_cache_memory or "64MiB"
        args.out = args.out or str(Path(tempfile.mkdtemp()) / "bench_engine_smoke.json")
        args.max_num_batched_tokens = 256
        scenarios = [shrink(sc, 96, 16) for sc in scenarios]
        args.max_num_seqs = args.max_num_seqs or 64
    from kvq.models.source import model_shape, resolve_model

    src = resolve_model(model)
    shape = model_shape(src)
    cfg = json.loads((Path(src.path) / "config.json").read_text()) if Path(src.path).is_dir() else {}
    if args.ttft_floor and not cfg:
        p.error(f"--ttft-floor needs the model's config.json (a shipped config or an HF folder), not {model!r}")
    h, inter = cfg.get("hidden_size"), cfg.get("intermediate_size")
    L, V = cfg.get("num_hidden_layers"), cfg.get("vocab_size")
    heads, kvh = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    hd = cfg.get("head_dim") or (h // heads)
    params = L * (h * hd * (heads + 2 * kvh) + heads * hd * h + 3 * h * inter + 2 * h) + 2 * V * h + h
    weight_bytes = 2 * params
    gemm_flops = 2 * (params - V * h)  # per token: every matmul (the embedding is a lookup)
    bw = copy_bandwidth(device)
    ttft_floors = None
    if args.ttft_floor and not scenarios:
        ttft_floors = measure_ttft_floors(args, cfg, workloads, concs, device, shape.max_position_embeddings)
    import transformers

    args.commit = tree_commit()
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "model": model if not args.smoke else "smoke",
            "model_shape": {"layers": shape.num_layers, "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim},
            "weight_bytes": weight_bytes, "copy_bandwidth_Bps": bw,
            "method": "wave of c requests submitted at once; random token prompts; ignore_eos; greedy; kvq warmed up "
                      "by a wave filling a prefill step per prompt length, HF by the same generate call"}
    args.out = args.out or str(ROOT / "docs/results" / ("bench_capacity.json" if scenarios else "bench_engine.json"))
    res = Results(Path(args.out), meta)
    print(f"device {meta['device']}, copy bandwidth {bw / 1e9 if bw else 0:.0f} GB/s, "
          f"weights {weight_bytes / 1e9:.2f} GB",
          flush=True)
    if args.hf:
        bench_hf(args, res, Path(src.path), workloads, concs, device)
    modes = {"default": None, "sync": False, "async": True}
    chosen = args.scheduling.split(",")
    bad = [m for m in chosen if m not in modes]
    if bad:
        p.error(f"--scheduling: unknown {bad}; valid choices: {', '.join(modes)} (or a comma-separated list)")
    if scenarios:
        workloads = []  # the scenarios replace the waves
    for fmt in [f for f in args.formats.split(",") if f]:
        for mode in chosen:
            bench_kvq(args, res, model, fmt, workloads, concs, bw, weight_bytes, async_scheduling=modes[mode],
                      scenarios=scenarios, gemm_flops_per_token=gemm_flops, ttft_floors=ttft_floors)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
