"""A bounded load test against a running server: many concurrent streaming clients, some of which
disconnect mid-stream, then the server's own integrity check.

Used by ``tests/test_server.py`` (small, on the CPU) and ``benchmarks/bench_server.py``
(any size, e.g. the dummy Llama-3-8B on an H200).  Every request streams
``/v1/completions`` with a token-id prompt (so it works for dummy-weight models
without a tokenizer), ``ignore_eos`` and ``return_token_ids``, so a completed
response must carry exactly ``output_len`` tokens and ``finish_reason
"length"``; anything else is counted as malformed.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class LoadSpec:
    num_requests: int = 24
    concurrency: int = 8
    input_len: int = 32
    output_len: int = 16
    disconnect_fraction: float = 0.25  # share of clients that close their stream after a few tokens
    time_limit_s: float = 120.0
    model: str | None = None  # None: the server's first served name
    seed: int = 0
    token_id_range: tuple[int, int] = (100, 1000)  # prompt ids are drawn from here (inside any vocabulary)

    def __post_init__(self):
        if self.num_requests < 1 or self.concurrency < 1 or self.input_len < 1 or self.output_len < 2:
            raise ValueError("num_requests, concurrency, input_len >= 1 and output_len >= 2 are needed")
        if not 0 <= self.disconnect_fraction <= 1:
            raise ValueError(f"disconnect_fraction must be in [0, 1], got {self.disconnect_fraction}")


@dataclass
class RequestRecord:
    index: int
    status: int | None = None
    disconnect_after: int | None = None  # planned: close after this many tokens
    disconnected: bool = False
    done: bool = False  # saw data: [DONE]
    tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    start: float = 0.0
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (self.tokens - 1) if len(t) >= 2 and self.tokens > 1 else None


def _body(spec: LoadSpec, model: str, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": spec.output_len, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}


async def _one(client, url: str, body: dict, rec: RequestRecord) -> None:
    rec.start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        rec.status = r.status_code
        if r.status_code != 200:
            rec.error = (await r.aread()).decode(errors="replace")[:500]
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                rec.done = True
                return
            obj = json.loads(data)
            if "error" in obj:
                rec.error = obj["error"].get("message", str(obj))
                continue
            if obj.get("usage"):
                rec.usage = obj["usage"]
            for ch in obj.get("choices", []):
                n = len(ch.get("token_ids") or [])
                if n:
                    now = time.perf_counter()
                    rec.token_times.extend([now] * n)
                    rec.tokens += n
                rec.finish_reason = ch.get("finish_reason") or rec.finish_reason
            if rec.disconnect_after is not None and rec.tokens >= rec.disconnect_after:
                rec.disconnected = True
                return  # leaving the context closes the connection mid-stream


def malformed(rec: RequestRecord, spec: LoadSpec) -> str | None:
    """Why a completed (not disconnected) 200 response is wrong, or None."""
    if rec.error:
        return f"error event: {rec.error}"
    if not rec.done:
        return "no [DONE]"
    if rec.finish_reason != "length":
        return f"finish_reason {rec.finish_reason!r}, expected 'length'"
    if rec.tokens != spec.output_len:
        return f"{rec.tokens} tokens streamed, expected {spec.output_len}"
    want = {"prompt_tokens": spec.input_len, "completion_tokens": spec.output_len,
            "total_tokens": spec.input_len + spec.output_len}
    if rec.usage != want:
        return f"usage {rec.usage}, expected {want}"
    return None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


async def wait_idle(client, url: str, timeout: float = 60.0) -> dict:
    """Poll /status until no request is live, then run its integrity check; the check's JSON."""
    deadline = time.monotonic() + timeout
    while True:
        st = (await client.get(f"{url}/status")).json()
        r = st["requests"]
        if r["running"] + r["waiting"] + r["live_requests"] == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    return (await client.get(f"{url}/status", params={"check": 1})).json()


async def run_load(url: str, spec: LoadSpec) -> dict:
    """Run ``spec`` against the server at ``url``; a JSON-able summary (see benchmarks/bench_server.py)."""
    import httpx

    rng = random.Random(spec.seed)
    lo, hi = spec.token_id_range
    prompts = [[rng.randrange(lo, hi) for _ in range(spec.input_len)] for _ in range(spec.num_requests)]
    leaving = set(rng.sample(range(spec.num_requests), round(spec.num_requests * spec.disconnect_fraction)))
    records = [RequestRecord(i, disconnect_after=rng.randint(1, spec.output_len - 1) if i in leaving else None)
               for i in range(spec.num_requests)]
    limits = httpx.Limits(max_connections=spec.concurrency + 4, max_keepalive_connections=spec.concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(spec.time_limit_s), limits=limits) as client:
        model = spec.model or (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(spec.concurrency)

        async def worker(rec: RequestRecord) -> None:
            async with sem:
                try:
                    await _one(client, url, _body(spec, model, prompts[rec.index]), rec)
                except (httpx.HTTPError, json.JSONDecodeError) as e:
                    rec.error = f"{type(e).__name__}: {e}"

        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(worker(r)) for r in records]
        _, pending = await asyncio.wait(tasks, timeout=spec.time_limit_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - t0
        status = await wait_idle(client, url)
    return summarize(spec, records, wall, status, timed_out=len(pending))


def summarize(spec: LoadSpec, records: list[RequestRecord], wall: float, status: dict, timed_out: int) -> dict:
    completed = [r for r in records if r.status == 200 and not r.disconnected]
    bad = {r.index: why for r in completed if (why := malformed(r, spec))}
    good = [r for r in completed if r.index not in bad]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    ttft = [r.ttft for r in good if r.ttft is not None]
    tpot = [r.tpot for r in good if r.tpot is not None]
    itl = [b - a for r in good for a, b in zip(r.token_times, r.token_times[1:]) if b > a]
    integrity = status.get("integrity", {})
    def ms(x):
        return None if x is None else round(1000 * x, 3)

    return {
        "spec": asdict(spec),
        "wall_s": round(wall, 3),
        "requests": len(records),
        "completed": len(good),
        "disconnected": sum(r.disconnected for r in records),
        "malformed": bad,
        "http_status": statuses,
        "http_5xx": sum(1 for r in records if r.status is not None and r.status >= 500),
        "errors": sum(1 for r in records if r.error or r.status != 200) + len(bad),
        "error_samples": [r.error for r in records if r.error][:5],
        "timed_out": timed_out,
        "requests_per_s": round(len(good) / wall, 3),
        "output_tokens_per_s": round(sum(r.tokens for r in records) / wall, 2),
        "ttft_ms": {"p50": ms(_pct(ttft, 50)), "p95": ms(_pct(ttft, 95))},
        "tpot_ms": {"p50": ms(_pct(tpot, 50)), "p95": ms(_pct(tpot, 95))},
        "itl_ms": {"p50": ms(_pct(itl, 50)), "p95": ms(_pct(itl, 95))},
        "integrity_ok": integrity.get("ok"),
        "integrity_error": integrity.get("error"),
        "leaked_blocks": integrity.get("leaked_blocks"),
        "server": {k: status.get(k) for k in ("model", "device", "dtype", "block_size", "max_model_len",
                                              "attention_backend", "kv_pool")}
                  | {"kv_cache_dtype": {k: v for k, v in (status.get("kv_cache_dtype") or {}).items()
                                        if k != "per_layer"}},
    }
