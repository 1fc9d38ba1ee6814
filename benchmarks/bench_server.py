#!/usr/bin/env python3
"""Load test of `kvq serve`: many concurrent streaming clients, some disconnecting mid-stream.

Each request streams ``/v1/completions`` with a random token-id prompt of
``--input-len`` tokens (works for dummy-weight models, which have no tokenizer),
``max_tokens=--output-len``, ``ignore_eos`` and ``return_token_ids``, so every
completed response must carry exactly ``--output-len`` tokens.  A share
(``--disconnect-fraction``) of the clients closes its stream after a random
number of tokens.  Afterwards the server's ``/status?check=1`` runs the block
manager's and scheduler's integrity checks on the engine thread and reports
blocks still in use with no request left (leaked blocks).

Reported (printed, and saved as JSON): requests/s and output tokens/s over the
wall time, TTFT / TPOT / ITL p50 and p95 of completed requests (client side:
TTFT from sending the request to the first token chunk), errors (non-200,
error events, malformed responses, time-outs), HTTP 5xx, leaked blocks, the
server's KV format, backend and pool, and its Prometheus counters (these include the warm-up requests).

Usage::

    python benchmarks/bench_server.py --url http://127.0.0.1:8000 [load options]
    python benchmarks/bench_server.py --spawn [load options] -- [kvq serve options]

``--spawn`` starts ``python -m kvq.cli serve`` itself on a free loopback port,
as a separate process (a client in the server's process would share its GIL
with the engine thread and distort TTFT), waits for ``/health``, runs a short
warm-up (Triton compiles its kernels on first use), the load, and stops it.
Exit code 1 if any error, 5xx or leaked block was seen.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvq.server.loadgen import LoadSpec, run_load  # noqa: E402 (after the path)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--spawn", action="store_true", help="start `kvq serve` with the options after `--`")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32, help="clients streaming at once")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--disconnect-fraction", type=float, default=0.1, help="share of clients that leave mid-stream")
    p.add_argument("--time-limit", type=float, default=480.0, help="seconds for the whole load (then: errors)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests before the load (default: "
                   "min(concurrency, 8); 0 for none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for a spawned server")
    p.add_argument("--label", default=None, help="free text stored in the JSON (e.g. 'H200, dummy Llama-3-8B')")
    p.add_argument("--out", default=None, help="JSON path (default docs/results/server_<model>_<kv>_<device>.json)")
    args = p.parse_args(argv)
    if serve_args and not args.spawn:
        p.error("options after `--` are for a spawned server: add --spawn")
    return args, serve_args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(serve_args: list[str], timeout: float, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvq.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--uvicorn-log-level", "warning", *serve_args]
    print("[bench] spawning:", " ".join(cmd), f"(log: {log_path})", file=sys.stderr, flush=True)
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the child
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"[bench] the server exited with code {proc.returncode}; see {log_path}:\n"
                             + log_path.read_text()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"[bench] the server did not answer /health within {timeout:.0f} s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown; the engine thread stops with the app
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def prometheus_counters(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    keep = ("kvq_requests_total", "kvq_request_finished_total", "kvq_num_preemptions_total",
            "kvq_generation_tokens_total", "kvq_prompt_tokens_total", "kvq_engine_steps_total",
            "kvq_engine_recoveries_total")
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name in keep:
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                                if s.labels else "")
                out[key] = s.value
    return out


def main(argv: list[str] | None = None) -> int:
    args, serve_args = parse_args(sys.argv[1:] if argv is None else argv)
    spec = LoadSpec(num_requests=args.num_requests, concurrency=args.concurrency, input_len=args.input_len,
                    output_len=args.output_len, disconnect_fraction=args.disconnect_fraction,
                    time_limit_s=args.time_limit, seed=args.seed)
    proc, url = None, args.url
    if args.spawn:
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvq_serve_{os.getpid()}.log"
        proc, url = spawn(serve_args, args.startup_timeout, log_path)
    try:
        warm = min(args.concurrency, 8) if args.warmup is None else args.warmup
        if warm:
            w = asyncio.run(run_load(url, LoadSpec(num_requests=warm, concurrency=warm, input_len=args.input_len,
                                                   output_len=args.output_len, disconnect_fraction=0.0,
                                                   time_limit_s=args.time_limit, seed=args.seed + 1)))
            print(f"[bench] warm-up: {warm} requests in {w['wall_s']} s, errors {w['errors']}", file=sys.stderr)
        res = asyncio.run(run_load(url, spec))
        res["prometheus"] = prometheus_counters(url)
    finally:
        if proc is not None:
            stop(proc)
    res["meta"] = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
                   "python": platform.python_version(), "label": args.label, "warmup_requests": warm,
                   "command": shlex.join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
                   "serve_args": serve_args if args.spawn else None, "url": None if args.spawn else url}
    srv = res["server"]
    out = Path(args.out) if args.out else ROOT / "docs" / "results" / (
        f"server_{Path(str(srv['model'])).name}_{srv['kv_cache_dtype'].get('k')}_{str(srv['device']).split(':')[0]}"
        ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: res[k] for k in ("requests", "completed", "disconnected", "errors", "http_5xx",
                                         "requests_per_s", "output_tokens_per_s", "ttft_ms", "tpot_ms", "itl_ms",
                                         "integrity_ok", "leaked_blocks")}, indent=2))
    print(f"[bench] saved {out}", file=sys.stderr)
    ok = res["errors"] == 0 and res["http_5xx"] == 0 and res["leaked_blocks"] == 0 and res["integrity_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
