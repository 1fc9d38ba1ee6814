"""Disaggregated serving against colocated serving, per decode format, on one machine.

Starts a prefill server (``--prefill-format``, default bfloat16, ``--kv-role prefill``) and, per
format of ``--formats``, a decode server (``--kv-role decode --kv-peer`` the prefill server) and
a colocated server of that format, all in this process on loopback (each its own NIXL agent,
pools on ``--device``).  Sends the same greedy requests to both and checks the texts are equal;
records each request's latency on both, the transfer counters and failures, and saves JSON.

    python scripts/disagg_check.py --device cuda --formats int4_kivi,fp8_e4m3,int8
    (on the device machine: bash scripts/gpu.sh disagg-check ...)

Exit code 1 when any text differs or any transfer failed.  On one GPU the three servers share
it: the latencies say what the transfer costs, not what disaggregation saves (that needs the
prefill and decode servers on different GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import httpx
import torch

from kvq.engine.llm_engine import EngineConfig
from kvq.server.launch import ServerThread, build_server
from kvq.server.options import KVRoleOptions

BASE = ("The history of the city begins with a small settlement on the river, where traders from the north "
        "met farmers from the south. ")


def prompts(n: int, lengths: list[int]) -> list[str]:
    """``n`` prompts of roughly each of ``lengths`` words (distinct openings, no shared prefix)."""
    out = []
    for i in range(n):
        words = (BASE * (1 + lengths[i % len(lengths)] // 20)).split()[:lengths[i % len(lengths)]]
        out.append(f"Story {i}: " + " ".join(words))
    return out


def start(fmt: str, args, kv: KVRoleOptions | None = None):
    cfg = EngineConfig(kv_cache_dtype=fmt, device=args.device, kv_cache_memory=args.kv_cache_memory,
                       max_model_len=args.max_model_len, max_num_seqs=8, progress=False, enforce_eager=True)
    app, engine = build_server(cfg, ["default"], kv=kv)
    thread = ServerThread(app)
    return thread, thread.start()


def ask(url: str, prompt: str, max_tokens: int) -> tuple[str, float]:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0}, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["text"], time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--formats", default="int4_kivi,fp8_e4m3,int8", help="decode formats, comma-separated")
    ap.add_argument("--prefill-format", default="bfloat16",
                    help="the prefill server's format, or 'same' (each decode format: the texts must then be "
                    "equal; with another format the prefill attends over exact keys where a colocated "
                    "server's prompt reads them quantized, so greedy texts may part)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--lengths", default="20,300,1500", help="prompt lengths in words, cycled")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--out", default=None, help="JSON path (default docs/results/disagg_check_<device>.json)")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    lengths = [int(x) for x in args.lengths.split(",")]
    work = prompts(args.num_prompts, lengths)
    same = args.prefill_format == "same"
    pt = None
    rows, ok = [], True
    try:
        for fmt in args.formats.split(","):
            if pt is None or same:
                if pt is not None:
                    pt.stop()
                pt, purl = start(fmt if same else args.prefill_format, args, KVRoleOptions(role="prefill"))
            dt, durl = start(fmt, args, KVRoleOptions(role="decode", peer=purl, fallback="fail"))
            ct, curl = start(fmt, args)
            try:
                for p in work:
                    ask(durl, p, 1), ask(curl, p, 1)  # warm-up (and the prefix caches: compare like with like)
                reqs = []
                for i, p in enumerate(work):
                    (a, ta), (b, tb) = ask(durl, p, args.max_tokens), ask(curl, p, args.max_tokens)
                    reqs.append({"prompt_words": len(p.split()), "equal": a == b, "disagg_s": round(ta, 4),
                                 "colocated_s": round(tb, 4)})
                    ok &= a == b
                    print(f"{fmt:>12} prompt {i} ({len(p.split())} words): equal={a == b} disagg {ta:.3f} s, "
                          f"colocated {tb:.3f} s", flush=True)
                kv = httpx.get(durl + "/status").json()["kv_transfer"]
                ok &= kv["fills"]["failed"] == 0
                rows.append({"format": fmt, "prefill_format": fmt if same else args.prefill_format,
                             "requests": reqs, "fills": kv["fills"],
                             "wire_layers": kv["negotiated"]["wire_layers"][0]})
            finally:
                dt.stop()
                ct.stop()
    finally:
        if pt is not None:
            pt.stop()
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    tag = "same" if same else args.prefill_format
    out = Path(args.out or f"docs/results/disagg_check_{tag}_{args.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": dev, "torch": torch.__version__, "args": vars(args), "all_equal": ok,
                               "note": "prefill, decode and colocated servers in one process on one device",
                               "pid": os.getpid(), "rows": rows}, indent=1))
    print(f"all equal and no failed transfer: {ok}; saved {out}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
