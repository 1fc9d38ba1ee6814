"""A serving wave under memory pressure, simulated on the CPU: preemptions and steps per KV configuration.

The engine is real (scheduler, block manager, arena, demotions, seals) on a tiny dummy Llama whose
forward is stubbed (bench_host_step.py's), so nothing here measures speed: it counts what the
scheduler does when ``--concurrency`` requests of ``--input-len`` + ``--output-len`` tokens arrive at
once into a pool that holds what an H100's fp8_e4m3 pool held per request at 384 requests
(863904 tokens, session 36's bench_engine run), in the tiny model's bytes.  Use it to see whether a
configuration preempts before spending device time on it (issue 45).

    python benchmarks/sim_pressure.py --concurrency 48 --configs 'fp8_e4m3,fp8_e4m3>int4_kivi,int4_kivi'
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's kvq, whatever is installed

import torch  # noqa: E402

from benchmarks.bench_host_step import TINY  # noqa: E402

#: An H100's fp8_e4m3 pool at 384 requests of 1024 + 2048 tokens (dummy Llama-3-8B, session 36).
H100_FP8_TOKENS_AT_384 = 863904


def simulate(spec: str, concurrency: int, input_len: int, output_len: int, model_dir: str,
             h100_requests: int = 384) -> dict:
    from kvq.cache.plan import KVCacheConfig
    from kvq.engine.llm_engine import EngineConfig, LLMEngine
    from kvq.engine.sampling_params import SamplingParams

    fp8_token_bytes = 2 * TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * TINY["head_dim"]
    # the H100's pool shared by h100_requests requests: the same bytes per request here
    memory = int(H100_FP8_TOKENS_AT_384 * concurrency / h100_requests * fp8_token_bytes)
    eng = LLMEngine(EngineConfig(model=model_dir, load_format="dummy", device="cpu", dtype="bfloat16",
                                 kv_cache=KVCacheConfig().with_spec(spec), max_num_seqs=concurrency,
                                 max_num_batched_tokens=8192, kv_cache_memory=memory, progress=False))
    vocab = TINY["vocab_size"]

    def stub(ids, positions, pool, meta, kernels, rows):  # the forward pass, minus the arithmetic
        logits = torch.zeros(rows.shape[0], vocab)
        logits[torch.arange(rows.shape[0]), (ids[rows] * 7 + 13) % (vocab - 300) + 300] = 1.0
        return logits

    eng.runner.model = stub
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    for _ in range(concurrency):
        eng.add_request(torch.randint(0, vocab, (input_len,), generator=g).tolist(), params)
    t0, steps, preempted, running = time.perf_counter(), 0, 0, []
    while eng.has_unfinished():
        running.append(len(eng.scheduler._running))
        preempted += sum(o.metrics.get("num_preemptions", 0) for o in eng.step() if o.finished)
        steps += 1
    pool = eng.info["kv_pool"]
    return {"config": spec, "concurrency": concurrency, "h100_requests": h100_requests, "input_len": input_len,
            "output_len": output_len,
            "steps": steps, "preemptions": preempted, "running_max": max(running),
            "running_mean": sum(running) / len(running), "pool_q_blocks": pool["q_blocks"],
            "pool_hp_blocks": pool["hp_blocks"], "wall_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=2048)
    ap.add_argument("--h100-requests", type=int, default=384,
                    help="the pool per request is the H100's (52.7 GB of KV) shared by this many requests")
    ap.add_argument("--configs", default="fp8_e4m3,fp8_e4m3>int4_kivi,int4_kivi",
                    help="format specs as bench_engine.py takes them, comma-separated")
    ap.add_argument("--out", default=None, help="write the rows here as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model_dir = tempfile.mkdtemp(prefix="kvq-sim-")
    # bf16, as the GPU's model: the high-precision windows take the GPU's share of the pool
    (Path(model_dir) / "config.json").write_text(json.dumps({**TINY, "torch_dtype": "bfloat16"}))
    rows = []
    for spec in args.configs.split(","):
        r = simulate(spec, args.concurrency, args.input_len, args.output_len, model_dir, args.h100_requests)
        rows.append(r)
        print(f"{spec:28s} c={r['concurrency']}: {r['steps']} steps, {r['preemptions']} preemptions, running "
              f"max {r['running_max']} mean {r['running_mean']:.1f}; pool {r['pool_q_blocks']} + "
              f"{r['pool_hp_blocks']} hp blocks [{r['wall_s']:.0f} s]", flush=True)
    if args.out:  # rows of earlier runs with other settings are kept
        out = Path(args.out)
        old = json.loads(out.read_text())["rows"] if out.is_file() else []
        key = lambda r: (r["config"], r["concurrency"], r.get("h100_requests", 384), r["input_len"], r["output_len"])  # noqa: E731
        new = {key(r) for r in rows}
        out.write_text(json.dumps({"rows": [r for r in old if key(r) not in new] + rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
