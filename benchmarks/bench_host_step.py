"""Host time of one engine decode step, measured on the CPU with the model stubbed out.

What the GPU waits for between two decode steps when the host is the bottleneck
(issue 11): scheduling, the runner's metadata (token ids, positions, slots,
block tables, their tensors), sampling-parameter tensors, the scheduler's
update and the per-request outputs.  The engine is real (scheduler, block
manager, runner, sampler, outputs) on a tiny dummy Llama; only the model's
forward is replaced by a stub that returns zero logits, so nothing here waits
for arithmetic.  ``--concurrency`` sequences with ``--prompt``-token prompts are
prefilled (through the stub) and then timed over ``--steps`` pure decode steps.

    python benchmarks/bench_host_step.py                       # 256 sequences x 1024 tokens
    python benchmarks/bench_host_step.py --label after --out docs/results/host_step_cpu.json

The JSON keeps one entry per label, so "before" and "after" a change sit side by
side in the same file (run this script from an older checkout, with ``--out``
pointing here, for "before").  The breakdown is a mean per step and includes
garbage-collector pauses; the step's median does not.  CPU numbers on a shared
2-core machine: compare labels measured in the same session.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's kvq, whatever is installed

import torch  # noqa: E402

from benchmarks.gc_pauses import GcPauses  # noqa: E402
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=4096, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=False,
            torch_dtype="float32")


class _Timed:
    """Wraps a bound method and sums its wall time."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.total += time.perf_counter() - t


def build(concurrency: int, prompt: int, steps: int, kv_cache_dtype: str, freeze_gc: bool = False,
          stop: bool = False, tiers: dict | None = None, memory_fraction: float = 1.0):
    from kvq.engine.llm_engine import EngineConfig, LLMEngine
    from kvq.engine.sampling_params import SamplingParams

    tmp = tempfile.mkdtemp(prefix="kvq-host-")
    (Path(tmp) / "config.json").write_text(json.dumps(TINY))
    # early sequences decode while later ones prefill (decode first): room for that and the timed steps
    extra = -(-concurrency * prompt // 8192) + steps + 16
    tokens = concurrency * (prompt + extra + 32)
    eng = LLMEngine(EngineConfig(model=tmp, load_format="dummy", device="cpu", kv_cache_dtype=kv_cache_dtype,
                                 max_num_seqs=concurrency, max_num_batched_tokens=max(8192, concurrency),
                                 kv_cache_memory=int((tokens * 2 * 2 * 32 * 4 * 2 + (64 << 20)) * memory_fraction),
                                 progress=False,
                                 enable_prefix_caching=False, **({"freeze_gc": True} if freeze_gc else {}),
                                 **(tiers or {})))
    vocab = TINY["vocab_size"]

    def stub(ids, positions, pool, meta, kernels, rows):  # the forward pass, minus the arithmetic
        logits = torch.zeros(rows.shape[0], vocab)  # greedy next token: a function of the last one, so
        nxt = (ids[rows] * 7 + 13) % (vocab - 300) + 300  # outputs vary and avoid special tokens
        logits[torch.arange(rows.shape[0]), nxt] = 1.0
        return logits

    eng.runner.model = stub
    if stop:  # detokenize every step (the default model's tokenizer) for a stop string that never matches
        from kvq.models.loader import load_tokenizer

        eng.tokenizer = load_tokenizer("default")
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=extra + 16, ignore_eos=True, temperature=0.0,
                            stop=["<never in this output>"] if stop else None)
    for _ in range(concurrency):
        eng.add_request(torch.randint(0, vocab, (prompt,), generator=g).tolist(), params)
    while any(len(s.output_token_ids) == 0 for s in eng.scheduler._seqs.values()) or eng.scheduler.num_waiting:
        eng.step()
    return eng


def _time_pressure(bm) -> list[dict]:
    """Per pressure event of a tiered manager (make_room that moved blocks or rescanned): its ms, the
    demotions it made and the ms of its scan of the running sequences' blocks (0: a kept scan)."""
    events: list[dict] = []
    if getattr(bm, "tiers", None) is None or not hasattr(bm, "_rescan"):
        return events
    make_room, rescan, scan = bm.make_room, bm._rescan, [0.0]

    def timed_rescan():
        t = time.perf_counter()
        rescan()
        scan[0] += time.perf_counter() - t

    def timed_make_room(need, headroom=None):
        scan[0] = 0.0
        t = time.perf_counter()
        ops = make_room(need, headroom)
        if ops or scan[0]:
            events.append({"ms": round((time.perf_counter() - t) * 1e3, 3), "demotions": len(ops),
                           "scan_ms": round(scan[0] * 1e3, 3)})
        return ops

    bm.make_room, bm._rescan = timed_make_room, timed_rescan
    return events


def measure(eng, steps: int) -> dict:
    parts = {"schedule": (eng.scheduler, "schedule"), "runner": (eng.runner, "execute"),
             "sampler": (eng, "sampler"), "update": (eng.scheduler, "update"), "outputs": (eng, "_output"),
             "detokenize": (eng, "_check_stop_strings")}
    timers = {}
    for name, (obj, attr) in parts.items():
        timers[name] = _Timed(getattr(obj, attr))
        setattr(obj, attr, timers[name])
    events = _time_pressure(eng.block_manager)
    for _ in range(3):
        eng.step()
    for t in timers.values():
        t.total = 0.0
    events.clear()
    per_step = []
    outs = None
    with GcPauses() as pauses:
        for _ in range(steps):
            t = time.perf_counter()
            outs = eng.step()  # held until the next step returns, as a caller holds them
            per_step.append((time.perf_counter() - t) * 1e3)
            assert len(outs) == len(eng.scheduler._seqs), "every running sequence decodes each step"
    n = len(eng.scheduler._seqs)
    q = statistics.quantiles(per_step, n=10)
    return {"sequences": n, "steps": steps, "ms_per_step": {"mean": statistics.fmean(per_step),
                                                            "median": statistics.median(per_step), "p90": q[-1],
                                                            "min": min(per_step), "max": max(per_step)},
            **pauses.record(), "pressure_events": events,
            "breakdown_ms_per_step": {k: t.total * 1e3 / steps for k, t in timers.items()},
            "samples_ms": [round(x, 3) for x in per_step]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (pinned: the machine is shared)")
    ap.add_argument("--freeze-gc", action="store_true", help="the engine's gc.freeze() (its default on CUDA)")
    ap.add_argument("--stop", action="store_true", help="a stop string per request: detokenize every step")
    ap.add_argument("--kv-cache-tiers", default=None, help="elastic precision: lower tiers (issue 45)")
    ap.add_argument("--kv-tier-age", default=None, help="with --kv-cache-tiers: tokens behind the head (age policy)")
    ap.add_argument("--kv-tier-policy", default=None, help="with --kv-cache-tiers: age, pressure or both")
    ap.add_argument("--memory-fraction", type=float, default=1.0,
                    help="the KV pool's bytes times this (below 1 with tiers: pressure demotes blocks as the "
                         "sequences grow)")
    ap.add_argument("--label", default="current")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "host_step_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kw = {"freeze_gc": True} if args.freeze_gc else {}  # an older engine has no such option
    if args.stop:
        kw["stop"] = True
    if args.kv_cache_tiers:  # the age rule demotes blocks at appends: its host cost shows in schedule/update
        kw["tiers"] = {"kv_cache_tiers": args.kv_cache_tiers, "kv_tier_age": args.kv_tier_age,
                       "kv_tier_policy": args.kv_tier_policy}
    eng = build(args.concurrency, args.prompt, args.steps, args.kv_cache_dtype, memory_fraction=args.memory_fraction,
                **kw)
    res = measure(eng, args.steps)
    res.update(label=args.label, concurrency=args.concurrency, prompt=args.prompt, kv_cache_dtype=args.kv_cache_dtype,
               kv_cache_tiers=args.kv_cache_tiers, kv_tier_age=args.kv_tier_age, kv_tier_policy=args.kv_tier_policy,
               memory_fraction=args.memory_fraction,
               preemptions=sum(s.num_preemptions for s in eng.scheduler._seqs.values()),
               demotions=list(eng.block_manager.num_demotions),
               freeze_gc=args.freeze_gc, stop_strings=args.stop,
               date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               machine={"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "torch_threads": args.threads, "python": platform.python_version(),
                        "torch": torch.__version__})
    path = Path(args.out)
    doc = json.loads(path.read_text()) if path.exists() else {"benchmark": "host time per decode step", "runs": {}}
    doc["runs"][args.label] = res
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    b = res["breakdown_ms_per_step"]
    print(f"[{args.label}] {res['sequences']} sequences x {args.prompt} prompt tokens, {args.kv_cache_dtype}: "
          f"{res['ms_per_step']['median']:.2f} ms per decode step (median of {args.steps}; mean "
          f"{res['ms_per_step']['mean']:.2f}, max {res['ms_per_step']['max']:.1f}; GC {res['gc_pause_s']:.2f} s in "
          f"{res['gc_collections']} collections); "
          + ", ".join(f"{k} {v:.2f}" for k, v in b.items()))
    for e in res["pressure_events"]:
        print(f"  pressure event: {e['ms']:.1f} ms, {e['demotions']} demotions, scan {e['scan_ms']:.1f} ms")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
