"""Chaos soak of `kvq serve` (issue 32): a mixed load with faults on a schedule, counting what is lost.

    python benchmarks/soak.py [--duration 150] [--max-requests 2000] [--phases ...] [-- <kvq serve flags>]

It starts `kvq serve` processes itself (loopback only: every server binds 127.0.0.1 and every request
goes there), drives them with a real HTTP client (httpx: streaming and JSON, completions and chat,
n > 1, stop strings, short and long prompts, logprobs and echo, clients that leave mid-stream or
mid-request, a few deliberately invalid bodies, bursts over the admission limit) and injects one
fault per phase, each phase bounded in time and in requests (preempt and host_faults run on, 30 s at
most, until their fault has happened: a slow machine sends fewer requests in the same time):

    phase        server(s)                                  fault
    mixed        main                                       none (the baseline; a burst over the queue limit)
    sigterm      main                                       SIGTERM under load: the drain, then a restart on the
                                                            same port (with the next phase's flags)
    preempt      main: KV pool too small (--small-pool),    preemption (distinct long prompts)
                 host tier with failing copies
    host_faults  the same server                            host-tier copies failing (KVQ_FAULT_HOST_COPY;
                                                            prompts sharing prefixes: the CPU prefix tier works)
    elastic      main: fp8_e4m3 with an int4_kivi tier      the pool forces demotion (--kv-cache-tiers, pressure),
                 (pressure), the small pool, swap with      then preemption by swap, whose copies fail (a failed
                 failing host copies                        swap copy recomputes its request)
    nixl         prefill + decode (--kv-fallback local)     SIGKILL of the prefill peer while fills are pending
    tp           --tensor-parallel-size 2 (gloo on the CPU) SIGKILL of rank 1: the server must exit non-zero
                                                            within --distributed-timeout

Every request ends in exactly one category (:func:`classify`): completed; a clear error (an HTTP
error status with OpenAI's error body, or a stream that ends with finish_reason "abort" or an error
event and then ``data: [DONE]``); left by its client on purpose; refused while its server was down on
purpose (connection refused after a SIGTERM or a fatal fault); or lost (anything else: a stream cut
without [DONE], a reset, a timeout, a malformed answer, a 5xx or an error event outside a shutdown).
After each phase's traffic the servers settle and ``/status?check=1`` counts leaked KV blocks.

The exit status is 1 when anything is lost or leaked, a 5xx came outside a shutdown, an injected
fault did not happen (no preemption, no failed copy, ...), the drained server did not exit 0, or the
tensor-parallel server did not exit non-zero within its timeout.  The JSON (``--out``, default
docs/results/soak_cpu.json) holds the machine, the commit, the flags, per-phase counts and evidence.
benchmarks/README.md ("Chaos soak") explains how to read it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("mixed", "sigterm", "preempt", "host_faults", "elastic", "nixl", "tp")
#: each phase's share of --duration and --max-requests
WEIGHTS = {"mixed": 1.0, "sigterm": 1.5, "preempt": 1.0, "host_faults": 1.0, "elastic": 1.0, "nixl": 1.5, "tp": 1.0}
#: flags every soak server gets first (the passthrough flags after `--` override them)
BASE_SERVER_ARGS = ("--max-model-len", "512", "--max-num-seqs", "4", "--max-queue-len", "8",
                    "--shutdown-timeout", "3")
STOPS = (".", " the", "\n", ",")
MiB = 2 ** 20


# -- outcomes ---------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What came back for one request (filled by :func:`execute`)."""

    status: int | None = None  # HTTP status, None if no response arrived
    body: object = None  # a non-streamed response's JSON (or its text when it is not JSON)
    done: bool = False  # a stream's `data: [DONE]`
    chunks: int = 0
    finish: dict = field(default_factory=dict)  # choice index -> finish_reason
    text: dict = field(default_factory=dict)  # choice index -> streamed text
    error_event: dict | None = None  # a stream's {"error": {...}} event
    transport: str | None = None  # exception class when the exchange failed: ConnectError, ReadError, ...
    left: bool = False  # the client closed the request itself (planned)
    t_start: float = 0.0
    t_end: float = 0.0


CATEGORIES = ("completed", "clear_error", "client_left", "refused_down", "lost")


def is_openai_error(obj) -> bool:
    """OpenAI's error body: {"error": {"message": str, "type": str, ...}}."""
    err = obj.get("error") if isinstance(obj, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and bool(err["message"]) \
        and isinstance(err.get("type"), str)


def classify(out: Outcome, *, expected_choices: int = 1, stop: tuple = (), want_logprobs: bool = False,
             expect_invalid: bool = False, in_shutdown: bool = False) -> tuple[str, str]:
    """(category, detail) of one request; categories in :data:`CATEGORIES`.

    ``in_shutdown``: the server that answered was being stopped on purpose (SIGTERM sent, or a fault
    that ends it injected) before the request ended; only then are a refused connection and a 5xx
    other than 503 expected endings rather than losses.  A 503 with its error body and a stream's
    error event then [DONE] are clear endings either way; outside a shutdown they are also counted
    as server errors (:meth:`PhaseResult.record`), which fail the soak."""
    if out.left:
        return "client_left", "the client left"
    if out.status is None:
        if out.transport == "ConnectError" and in_shutdown:
            return "refused_down", "connection refused: the server was down on purpose"
        return "lost", f"no response: {out.transport or 'unknown'}"
    if out.status != 200:
        if not is_openai_error(out.body):
            return "lost", f"HTTP {out.status} without an OpenAI error body"
        if out.status >= 500 and out.status != 503 and not in_shutdown:  # (503: "not now", said clearly)
            return "lost", f"HTTP {out.status} outside a shutdown: {out.body['error']['message'][:160]}"
        if out.status == 400 and not expect_invalid:
            return "clear_error", "HTTP 400 (unexpected: the soak meant this request to be valid)"
        return "clear_error", f"HTTP {out.status} {out.body['error'].get('code') or out.body['error']['type']}"
    if expect_invalid:
        return "lost", "an invalid request was answered 200"
    if isinstance(out.body, dict) and "choices" in out.body:  # a JSON answer
        choices = out.body["choices"]
        if len(choices) != expected_choices:
            return "lost", f"{len(choices)} choices, expected {expected_choices}"
        for c in choices:
            if c.get("finish_reason") not in ("stop", "length"):
                return "lost", f"JSON choice with finish_reason {c.get('finish_reason')!r}"
            text = c.get("text") if "text" in c else (c.get("message") or {}).get("content") or ""
            if any(s in text for s in stop):
                return "lost", "a stop string in the text"
            if want_logprobs and c.get("logprobs") is None:
                return "lost", "logprobs asked for and missing"
        if not isinstance(out.body.get("usage"), dict):
            return "lost", "no usage"
        return "completed", "ok"
    if out.body is not None:
        return "lost", "HTTP 200 with a body that is not an answer"
    # a stream
    if not out.done:
        return "lost", f"stream cut without [DONE] after {out.chunks} chunks ({out.transport or 'closed'})"
    if out.error_event is not None:  # (outside a shutdown it is also counted as a 5xx: PhaseResult.record)
        return "clear_error", "error event then [DONE]"
    missing = [i for i in range(expected_choices) if i not in out.finish]
    if missing:
        return "lost", f"[DONE] before choice {missing[0]} had a finish_reason"
    if any(r == "abort" for r in out.finish.values()):
        return "clear_error", 'finish_reason "abort" then [DONE]'
    if any(r not in ("stop", "length") for r in out.finish.values()):
        return "lost", f"finish_reason {sorted(set(out.finish.values()))}"
    if any(s in t for t in out.text.values() for s in stop):
        return "lost", "a stop string in the streamed text"
    return "completed", "ok"


# -- the load ---------------------------------------------------------------------------------------
@dataclass
class Plan:
    """One request the soak sends."""

    route: str  # "completions" or "chat"
    body: dict
    expected_choices: int = 1
    stop: tuple = ()
    want_logprobs: bool = False  # checked on JSON answers
    invalid: bool = False  # sent to get a 400
    leave_after_chunks: int | None = None  # a stream whose client leaves after this many chunks
    leave_after_s: float | None = None  # a JSON request whose client leaves after this long

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


class Mix:
    """Seeded request mix.  ``kind``: "mixed" (everything), "long" (distinct long prompts, longer outputs:
    preemption), "shared" (prompts that start with one of ``num_prefixes`` prefixes in turn, short
    outputs: the CPU prefix tier; the prefixes together must not fit the small pool)."""

    def __init__(self, seed: int, long_chars: tuple[int, int], prefix_chars: int = 320, num_prefixes: int = 8):
        self.rng = random.Random(seed)
        text = (ROOT / "kvq/data/reference_prose.txt").read_text()
        self.words = text.split()
        self.long_chars = long_chars
        self.prefixes = [self.passage(prefix_chars) for _ in range(num_prefixes)]
        self.turn = 0

    def passage(self, chars: int) -> str:
        i = self.rng.randrange(len(self.words) - 400)
        out, n = [], 0
        for w in self.words[i:]:
            if n + len(w) + 1 > chars:
                break
            out.append(w)
            n += len(w) + 1
        return " ".join(out)

    def plan(self, kind: str, model: str) -> Plan:
        r = self.rng
        long = kind == "long" or r.random() < 0.3
        if kind == "shared":  # the prefixes in turn: by a prefix's next turn the others have pushed it out of a
            self.turn += 1    # small device pool, so its blocks come back from the CPU prefix tier
            prompt = self.prefixes[self.turn % len(self.prefixes)] + " " + self.passage(r.randint(20, 60))
        elif long:
            prompt = self.passage(r.randint(*self.long_chars))
        else:
            prompt = self.passage(r.randint(30, 160))
        chat = r.random() < 0.4
        stream = r.random() < 0.55
        n = 1 if r.random() < 0.75 else r.choice((2, 3))
        max_tokens = r.randint(16, 40) if kind == "long" else r.randint(2, 8) if kind == "shared" \
            else r.randint(4, 20)
        body: dict = {"model": model, "max_tokens": max_tokens, "n": n, "stream": stream}
        if r.random() < 0.5:
            body["temperature"] = 0.0
        else:
            body.update(temperature=0.8, seed=r.randrange(1000))
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        plan = Plan("chat" if chat else "completions", body, expected_choices=n)
        if r.random() < 0.3:
            plan.stop = tuple(r.sample(STOPS, r.randint(1, 2)))
            body["stop"] = list(plan.stop)
        if r.random() < 0.2:
            plan.want_logprobs = True
            if chat:
                body.update(logprobs=True, top_logprobs=2)
            else:
                body["logprobs"] = 2
                if not stream and r.random() < 0.3:  # lm-evaluation-harness's loglikelihood call
                    body.update(echo=True, max_tokens=1)
                    body.pop("stop", None)  # (the echoed prompt may hold one)
                    plan.stop = ()
        if stream and r.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if kind == "mixed" and r.random() < 0.03:  # a deliberate 400
            plan.invalid = True
            body["max_tokens"] = 0
        elif stream and r.random() < 0.15:
            plan.leave_after_chunks = r.randint(1, 4)
        elif not stream and r.random() < 0.05:
            plan.leave_after_s = r.uniform(0.2, 1.0)
        return plan


async def execute(client: httpx.AsyncClient, url: str, plan: Plan) -> Outcome:
    """Send ``plan`` to the server at ``url`` and record what comes back; never raises for the
    server's behaviour (a transport failure is recorded in ``transport``)."""
    path = "/v1/chat/completions" if plan.route == "chat" else "/v1/completions"
    out = Outcome(t_start=time.monotonic())
    try:
        if plan.stream:
            await _stream(client, url + path, plan, out)
        else:
            coro = client.post(url + path, json=plan.body)
            if plan.leave_after_s is not None:
                try:
                    r = await asyncio.wait_for(coro, plan.leave_after_s)
                except asyncio.TimeoutError:
                    out.left = True
                    return out
            else:
                r = await coro
            out.status = r.status_code
            try:
                out.body = r.json()
            except ValueError:
                out.body = r.text[:500]
    except (httpx.HTTPError, httpx.StreamError) as e:
        out.transport = type(e).__name__
    finally:
        out.t_end = time.monotonic()
    return out


async def _stream(client: httpx.AsyncClient, url: str, plan: Plan, out: Outcome) -> None:
    async with client.stream("POST", url, json=plan.body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            raw = await r.aread()
            try:
                out.body = json.loads(raw)
            except ValueError:
                out.body = raw[:500].decode(errors="replace")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out.done = True
                return
            try:
                obj = json.loads(data)
            except ValueError:
                out.transport = "malformed event"  # (and no [DONE] yet: lost)
                return
            if "error" in obj:
                out.error_event = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj)}
                continue
            out.chunks += 1
            for c in obj.get("choices", []):
                i = c.get("index", 0)
                piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                out.text[i] = out.text.get(i, "") + (piece or "")
                if c.get("finish_reason"):
                    out.finish[i] = c["finish_reason"]
            if plan.leave_after_chunks is not None and out.chunks >= plan.leave_after_chunks \
                    and len(out.finish) < plan.expected_choices:
                out.left = True
                return  # leaving the context closes the connection mid-stream


# -- servers ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree_rss(pid: int) -> int | None:
    """Resident bytes of ``pid`` and its children (tensor-parallel ranks): psutil, else /proc."""
    try:
        import psutil

        p = psutil.Process(pid)
        return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - the process is gone
        return None
    total = 0
    for q in [pid, *child_pids(pid)]:
        try:
            for line in Path(f"/proc/{q}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total or None


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc: no psutil needed)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, ValueError):
                pass
    return out


def tp_rank_pids(pid: int) -> list[int]:
    """The tensor-parallel ranks a `kvq serve` process spawned (multiprocessing spawn children)."""
    ranks = []
    for c in child_pids(pid):
        try:
            cmd = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmd:
            ranks.append(c)
    return sorted(ranks)


@dataclass(frozen=True)
class ServerSpec:
    """How one `kvq serve` is started: its flags after the base and passthrough ones, its environment."""

    role: str
    args: tuple = ()
    env: tuple = ()  # (name, value) pairs


class ServerProc:
    """One `kvq serve` process, its log, its URL and what the soak did to it."""

    def __init__(self, name: str, spec: ServerSpec, port: int, cmd: list[str], log_path: Path):
        self.name, self.spec, self.port, self.cmd, self.log_path = name, spec, port, cmd, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.started_at = self.ready_at = self.stopping_at = self.exited_at = None
        self.model = "default"
        self.max_live: int | None = None
        self.stop_code: int | None = 0  # after the soak's SIGTERM: its exit status (None: it had to be killed)
        self.stop_s: float | None = None  # and how long it took to exit

    def start(self) -> None:
        env = {**os.environ, **dict(self.spec.env)}
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONFAULTHANDLER"] = "1"  # a server that hangs is sent SIGABRT first: every thread's stack, logged
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.started_at = time.monotonic()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_code(self) -> int | None:
        code = self.proc.poll() if self.proc else None
        if code is not None and self.exited_at is None:
            self.exited_at = time.monotonic()
        return code

    def in_shutdown(self, t: float) -> bool:
        return self.stopping_at is not None and self.stopping_at <= t

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    async def wait_ready(self, client: httpx.AsyncClient, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.exit_code() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} while starting; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if (await client.get(self.url + "/health", timeout=2)).status_code == 200:
                    models = (await client.get(self.url + "/v1/models")).json()["data"]
                    self.model = models[0]["id"]
                    self.max_live = (await client.get(self.url + "/status")).json()["max_live_requests"]
                    self.ready_at = time.monotonic()
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.name} did not answer /health within {timeout:.0f} s; log {self.log_path}")

    async def wait_exit(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.exit_code() is not None:
                return self.proc.returncode
            await asyncio.sleep(0.01)
        return None

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill_all(self, dump: bool = False) -> None:
        """SIGKILL the process and its process group (its session: this soak started it); ``dump``:
        SIGABRT first, so that the log shows where every thread of a hung server was."""
        if self.proc is None:
            return
        if dump and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGABRT)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.exit_code()


async def scrape(client: httpx.AsyncClient, url: str) -> dict:
    """{(metric, ((label, value), ...)): value} from a server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get(url + "/metrics")).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(m: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in m.items() if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))


# -- phases -----------------------------------------------------------------------------------------
@dataclass
class PhaseResult:
    name: str
    duration_s: float
    max_requests: int
    sent: int = 0
    sent_while_down: int = 0  # connections refused while the server was down on purpose
    started_at: float = 0.0  # time.monotonic() when the phase's load began
    accepted: int = 0  # answered with an HTTP status
    counts: dict = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    status_counts: dict = field(default_factory=dict)
    by_server: dict = field(default_factory=dict)  # server -> category -> count
    clear_error_kinds: dict = field(default_factory=dict)
    server_errors_outside_shutdown: int = 0  # 5xx or error events outside a shutdown
    server_errors_in_shutdown: int = 0
    unexpected_400: int = 0
    lost_examples: list = field(default_factory=list)
    wall_s: float = 0.0
    leaked_blocks: int | None = None  # in use after the load, after one more engine step
    idle_held_blocks: int = 0  # in use after the load, before that step
    integrity_ok: bool | None = None
    leak_checked: list = field(default_factory=list)  # servers checked
    rss_mib: dict = field(default_factory=dict)  # server -> {start, peak, growth}
    evidence: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    skipped: str | None = None

    def record(self, plan: Plan, out: Outcome, proc: ServerProc) -> str:
        in_shutdown = proc.in_shutdown(out.t_end)
        cat, detail = classify(out, expected_choices=plan.expected_choices, stop=plan.stop,
                               want_logprobs=plan.want_logprobs and not plan.stream, expect_invalid=plan.invalid,
                               in_shutdown=in_shutdown)
        self.counts[cat] += 1
        mine = self.by_server.setdefault(proc.name, dict.fromkeys(CATEGORIES, 0))
        mine[cat] += 1
        if out.status is not None:
            self.accepted += 1
            self.status_counts[str(out.status)] = self.status_counts.get(str(out.status), 0) + 1
        if cat == "clear_error":
            self.clear_error_kinds[detail] = self.clear_error_kinds.get(detail, 0) + 1
            if "unexpected" in detail:
                self.unexpected_400 += 1
        server_error = (out.status or 0) >= 500 or out.error_event is not None
        if server_error:
            if in_shutdown:
                self.server_errors_in_shutdown += 1
            else:
                self.server_errors_outside_shutdown += 1
        if cat == "lost" and len(self.lost_examples) < 10:
            self.lost_examples.append({"server": proc.name, "route": plan.route, "stream": plan.stream,
                                       "n": plan.expected_choices, "detail": detail,
                                       "t": round(out.t_end - proc.started_at, 2)})
        return cat


class Soak:
    """Runs the phases (module docstring) against servers it starts, stops and breaks."""

    def __init__(self, args: argparse.Namespace, passthrough: list[str]):
        self.args, self.passthrough = args, passthrough
        self.mix = Mix(args.seed, (args.long_chars[0], args.long_chars[1]))
        self.logdir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvq-soak-"))
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.servers: dict[str, ServerProc] = {}  # slot -> the process serving it now
        self.all_procs: list[ServerProc] = []
        self.ports = {slot: free_port() for slot in ("main", "prefill", "decode", "tp")}
        self.results: list[PhaseResult] = []
        self.deadline = time.monotonic() + args.time_limit
        self.client: httpx.AsyncClient | None = None
        self.starting: dict[str, asyncio.Task] = {}  # slot -> its server starting in the background
        self.retiring: list[asyncio.Task] = []  # graceful stops of servers no later phase uses
        self.completions: list[tuple[str, float]] = []  # (server, end time) of each completed request
        self.rss: dict[str, list[int]] = {}  # server -> [RSS at phase start, peak], this phase

    # -- servers -------------------------------------------------------------------------------------
    def spec(self, phase: str) -> dict[str, ServerSpec]:
        """slot -> spec of the servers ``phase`` uses."""
        a = self.args
        if phase in ("mixed", "sigterm"):
            return {"main": ServerSpec("main", ("--kv-cache-memory", a.pool))}
        if phase in ("preempt", "host_faults"):
            # small chunks: admission reserves a prompt's first chunk only, so more prompts start than
            # the pool can finish together, and their later chunks and decodes preempt
            return {"main": ServerSpec("pressure", ("--kv-cache-memory", a.small_pool, "--max-num-batched-tokens",
                                                    "128", "--cpu-offload-gb", str(a.cpu_offload_gb)),
                                       (("KVQ_FAULT_HOST_COPY", a.host_fault_rates),))}
        if phase == "elastic":
            flags = ("--kv-cache-memory", a.elastic_pool, "--max-num-batched-tokens", "128", "--kv-cache-dtype",
                     "fp8_e4m3", "--kv-cache-tiers", "int4_kivi", "--kv-sink-tokens", "0", "--kv-residual-tokens", "0",
                     "--preemption-mode", "swap", "--cpu-offload-gb", str(a.cpu_offload_gb))
            return {"main": ServerSpec("elastic", flags, (("KVQ_FAULT_HOST_COPY", a.host_fault_rates),))}
        if phase == "nixl":
            prefill = f"http://127.0.0.1:{self.ports['prefill']}"
            return {"prefill": ServerSpec("prefill", ("--kv-cache-memory", a.pool, "--kv-role", "prefill")),
                    "decode": ServerSpec("decode", ("--kv-cache-memory", a.pool, "--kv-role", "decode",
                                                    "--kv-peer", prefill, "--kv-fallback", "local",
                                                    "--kv-transfer-timeout", str(a.kv_transfer_timeout)))}
        if phase == "tp":
            return {"tp": ServerSpec("tp", ("--kv-cache-memory", a.pool, "--tensor-parallel-size", "2",
                                            "--distributed-timeout", str(a.distributed_timeout)))}
        raise ValueError(phase)

    def new_proc(self, slot: str, spec: ServerSpec) -> ServerProc:
        n = sum(p.name.split("#")[0] == slot for p in self.all_procs)
        name = slot if n == 0 else f"{slot}#{n + 1}"
        cmd = [sys.executable, "-m", "kvq.cli", "serve", *BASE_SERVER_ARGS, *self.passthrough, *spec.args,
               "--host", "127.0.0.1", "--port", str(self.ports[slot]), "--uvicorn-log-level",
               self.args.server_log_level]
        proc = ServerProc(name, spec, self.ports[slot], cmd, self.logdir / f"{name.replace('#', '-')}.log")
        self.all_procs.append(proc)
        return proc

    def prestart(self, phase: str, keep: dict | None = None) -> None:
        """Start ``phase``'s servers in the background, except on slots in ``keep`` (in use now)."""
        for slot, spec in self.spec(phase).items():
            cur = self.servers.get(slot)
            if (keep and slot in keep) or slot in self.starting or \
                    (cur is not None and cur.spec == spec and cur.exit_code() is None):
                continue
            self.starting[slot] = asyncio.ensure_future(self._start(slot, spec))

    async def _start(self, slot: str, spec: ServerSpec) -> ServerProc:
        old = self.servers.pop(slot, None)
        if old is not None:  # another spec on this slot: a graceful stop first
            await self.stop(old)
        proc = self.new_proc(slot, spec)
        proc.start()
        await proc.wait_ready(self.client, max(1.0, min(self.args.startup_timeout, self.deadline - time.monotonic())))
        self.servers[slot] = proc
        return proc

    async def ensure(self, phase: str) -> dict[str, ServerProc]:
        """``phase``'s servers, started (or waited for) now."""
        self.prestart(phase)
        out = {}
        for slot in self.spec(phase):
            if slot in self.starting:
                try:
                    await self.starting[slot]
                finally:
                    self.starting.pop(slot, None)
            out[slot] = self.servers[slot]
        return out

    def retire(self, later: list[str]) -> None:
        """Stop (gracefully, in the background) the servers no phase in ``later`` uses."""
        needed = {slot for ph in later for slot in self.spec(ph)}
        for slot in [s for s in self.servers if s not in needed]:
            self.retiring.append(asyncio.ensure_future(self.stop(self.servers.pop(slot))))

    def shutdown_timeout(self) -> float:
        args = [*BASE_SERVER_ARGS, *self.passthrough]
        i = len(args) - 1 - args[::-1].index("--shutdown-timeout")
        return float(args[i + 1])

    async def stop(self, proc: ServerProc) -> int | None:
        """SIGTERM and wait for the drain; SIGKILL if it does not end."""
        if proc.exit_code() is not None:
            return proc.proc.returncode
        proc.stopping_at = proc.stopping_at or time.monotonic()
        proc.signal(signal.SIGTERM)
        code = await proc.wait_exit(self.shutdown_timeout() + 30)
        proc.stop_s = round(time.monotonic() - proc.stopping_at, 2)
        if code is None:
            proc.kill_all(dump=True)
        proc.stop_code = code
        return code

    # -- load ----------------------------------------------------------------------------------------
    def record(self, res: PhaseResult, plan: Plan, out: Outcome, proc: ServerProc) -> None:
        if res.record(plan, out, proc) == "completed":
            self.completions.append((proc.name, out.t_end))

    def completed(self, server: str, after: float = 0.0) -> int:
        """Requests ``server`` completed, those that ended after ``after`` only."""
        return sum(1 for name, t in self.completions if name == server and t > after)

    def down_allowance(self, res: PhaseResult) -> int:
        """Requests of a phase that may be refused while its server is down on purpose (they count toward
        its cap): enough to show the refusals, not so many that nothing is left for the restarted server."""
        return max(self.args.concurrency, res.max_requests // 20)

    async def at_progress(self, res: PhaseResult, frac: float) -> None:
        """Wait until ``frac`` of the phase has passed: of its duration, or of its request cap, whichever
        comes first (on a fast machine the cap ends a phase long before its duration)."""
        while time.monotonic() < res.started_at + frac * res.duration_s and res.sent < frac * res.max_requests:
            await asyncio.sleep(0.02)

    async def drive(self, res: PhaseResult, slot: str, kind: str, until: dict) -> None:
        """``--concurrency`` clients sending to ``slot``'s current server until ``until["t"]`` (a fault may
        move it), ``until["stop"]`` or the phase's request cap; a client whose server is down waits a little
        (and once the phase's :meth:`down_allowance` is spent, waits without sending)."""
        async def client_loop() -> None:
            while time.monotonic() < until["t"] and res.sent < res.max_requests and not until.get("stop"):
                proc = self.servers.get(slot)
                if proc is None or (proc.exit_code() is not None and res.sent_while_down >= self.down_allowance(res)):
                    await asyncio.sleep(0.05)  # (being replaced)
                    continue
                plan = self.mix.plan(kind, proc.model)
                res.sent += 1
                out = await execute(self.client, proc.url, plan)
                self.record(res, plan, out, proc)
                if out.status is None and not out.left:  # the server is down: wait for it as a client would
                    res.sent_while_down += 1
                    await asyncio.sleep(random.uniform(0.5, 1.0))
                elif out.status in (429, 503):  # (Retry-After): no hot loop against a full or stopping server
                    await asyncio.sleep(random.uniform(0.2, 0.5))

        await asyncio.gather(*(client_loop() for _ in range(self.args.concurrency)))

    async def burst(self, res: PhaseResult, proc: ServerProc, extra: int = 4) -> int:
        """More short streams at once than the server admits (--max-num-seqs + --max-queue-len, plus
        ``extra``): some must get 429.  -> how many did."""
        k = min((proc.max_live or 8) + extra, res.max_requests - res.sent)
        if k <= 0:
            return 0
        plans = [Plan("completions", {"model": proc.model, "prompt": self.mix.passage(60), "max_tokens": 8,
                                      "stream": True, "temperature": 0.0}) for _ in range(k)]
        res.sent += k
        outs = await asyncio.gather(*(execute(self.client, proc.url, p) for p in plans))
        for p, o in zip(plans, outs):
            self.record(res, p, o, proc)
        return sum(o.status == 429 for o in outs)

    async def status(self, proc: ServerProc, **params) -> dict:
        return (await self.client.get(proc.url + "/status", params=params)).json()

    async def settle(self, res: PhaseResult, proc: ServerProc) -> None:
        """Wait until the server has no request and no transfer left (60 s at most)."""
        deadline, st = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            st = await self.status(proc)
            r, kv = st["requests"], st.get("kv_transfer", {})
            if r["running"] + r["waiting"] + r["live_requests"] == 0 and not kv.get("pending") \
                    and not kv.get("staged_transfers"):
                return
            await asyncio.sleep(0.1)
        res.failures.append(f"{proc.name}: requests still live 60 s after the load ended: {st.get('requests')}")

    async def blocks_in_use(self, proc: ServerProc) -> tuple[int, dict]:
        """(blocks referenced with no request left, the check's record): ``/status?check=1`` (the block
        manager's and scheduler's integrity checks, leaked blocks) and the pools' gauges after it."""
        integ = (await self.status(proc, check=1)).get("integrity", {})
        st = await self.status(proc)
        blocks = st["kv_blocks"]
        # a tiered cache's q pools share one arena: a tier's free blocks depend on the others' (and exclude
        # the demotion reserve), so only its used count says what is held
        unshared = [b for p, b in blocks.items() if not (st.get("kv_tiers") and p.startswith("q"))]
        n = max(integ.get("leaked_blocks") or 0, sum(b["used"] for b in blocks.values()),
                sum(b["total"] - b["free"] for b in unshared))
        return n, {"server": proc.name, "blocks_in_use": n, "integrity_ok": integ.get("ok"),
                   "integrity_error": integ.get("error"), "kv_blocks": blocks}

    async def settle_and_check(self, res: PhaseResult, proc: ServerProc) -> None:
        """After the load: settle, then count the blocks still in use.  Blocks held while the engine
        idles are counted (``idle_held_blocks``), then one small request makes the engine step: what
        is still in use after it is leaked (``leaked_blocks``).  (A request aborted while the engine
        idles leaves its CPU prefix tier store queued, its blocks held, until the next step issues it:
        benchmarks/README.md, "Chaos soak".)"""
        await self.settle(res, proc)
        held, first = await self.blocks_in_use(proc)
        record = {**first, "idle_held_blocks": held}
        leaked = held
        if held:
            probe = Plan("completions", {"model": proc.model, "prompt": "Hello", "max_tokens": 1, "stream": False})
            out = await execute(self.client, proc.url, probe)
            if classify(out, in_shutdown=False)[0] != "completed":
                res.failures.append(f"{proc.name}: the probe request after the load failed: {out.status} {out.body}")
            await self.settle(res, proc)
            leaked, after = await self.blocks_in_use(proc)
            record.update(after_probe=after)
        record["leaked_blocks"] = leaked
        res.idle_held_blocks += held
        res.leaked_blocks = (res.leaked_blocks or 0) + leaked
        res.integrity_ok = bool(first["integrity_ok"]) and res.integrity_ok is not False
        res.leak_checked.append(record)

    async def sample_rss(self) -> None:
        while True:
            for p in self.all_procs:
                if p.ready_at is not None and p.exit_code() is None:
                    rss = process_tree_rss(p.pid) or 0
                    first_peak = self.rss.setdefault(p.name, [rss, rss])
                    first_peak[1] = max(first_peak[1], rss)
            await asyncio.sleep(0.25)

    # -- phases --------------------------------------------------------------------------------------
    async def run_phase(self, res: PhaseResult, later: list[str]) -> None:
        procs = await self.ensure(res.name)
        before = {slot: await scrape(self.client, p.url) for slot, p in procs.items()}
        for ph in later[:self.args.prestart]:  # the next phases' servers start while this one runs
            self.prestart(ph, keep={**procs, **{s: None for p2 in later[:later.index(ph)] for s in self.spec(p2)}})
        self.rss = {}
        sampler = asyncio.ensure_future(self.sample_rss())
        t0 = res.started_at = time.monotonic()
        until = {"t": t0 + res.duration_s}
        try:
            await getattr(self, f"phase_{res.name}")(res, procs, until, before, later[0] if later else None)
        finally:
            sampler.cancel()
            res.wall_s = round(time.monotonic() - t0, 2)
            served = set(res.by_server) | {p.name for p in procs.values()}
            res.rss_mib = {name: {"start": round(a / MiB, 1), "peak": round(b / MiB, 1),
                                  "growth": round((b - a) / MiB, 1)}
                           for name, (a, b) in self.rss.items() if name in served}

    async def phase_mixed(self, res, procs, until, before, nxt) -> None:
        main = procs["main"]
        load = asyncio.ensure_future(self.drive(res, "main", "mixed", until))
        await self.at_progress(res, 0.3)
        res.evidence["burst_429"] = await self.burst(res, main)
        await load
        await self.settle_and_check(res, main)
        res.evidence.update(http_429=res.status_counts.get("429", 0), client_left=res.counts["client_left"])
        if res.evidence["http_429"] == 0:
            res.failures.append("no request got 429: the load never went over the admission limit")

    async def phase_sigterm(self, res, procs, until, before, nxt) -> None:
        old, ev = procs["main"], res.evidence
        until["t"] = float("inf")  # the clients go on through the drain and the restart (set below)
        load = asyncio.ensure_future(self.drive(res, "main", "mixed", until))
        await self.at_progress(res, 0.2)
        burst = asyncio.ensure_future(self.burst(res, old))
        await self.at_progress(res, 0.45)
        ev["live_at_sigterm"] = (await self.status(old))["requests"]["live_requests"]
        old.stopping_at = time.monotonic()
        old.signal(signal.SIGTERM)
        code = await old.wait_exit(self.shutdown_timeout() + 30)
        ev.update(exit_code=code, drain_s=round(time.monotonic() - old.stopping_at, 2))
        if code is None:
            old.kill_all(dump=True)
            res.failures.append("the server did not exit within --shutdown-timeout + 30 s of SIGTERM")
        elif code != 0:
            res.failures.append(f"the drained server exited with status {code}, expected 0")
        # the restart, on the same port (clients keep their URL), with the next phase's flags if it uses
        # this slot (a rolling update), else the same ones
        spec = self.spec(nxt).get("main", old.spec) if nxt else old.spec
        t = time.monotonic()
        new = self.new_proc("main", spec)
        new.start()
        await new.wait_ready(self.client, self.args.startup_timeout)
        self.servers["main"] = new
        ev.update(restart_s=round(time.monotonic() - t, 2), restarted_as=spec.role)
        until["t"] = time.monotonic() + max(res.duration_s * 0.3, 2.0)
        await load
        ev["burst_429"] = await burst
        await self.settle_and_check(res, new)
        ev.update(aborted_streams=res.clear_error_kinds.get('finish_reason "abort" then [DONE]', 0),
                  http_503=res.status_counts.get("503", 0), completed_after_restart=self.completed(new.name))
        if ev["completed_after_restart"] == 0:
            res.failures.append("no request completed on the restarted server")

    async def drive_until_seen(self, res: PhaseResult, slot: str, kind: str, until: dict, seen) -> None:
        """:meth:`drive`, with the phase's end moved on (1 s at a time, 30 s past it at most) while the
        fault it is there to cause has not happened yet (``await seen()`` false): a slow machine sends
        fewer requests in the phase's time, too few to fill a small pool or to meet a 50% copy failure."""
        load = asyncio.ensure_future(self.drive(res, slot, kind, until))
        cap = until["t"] + 30.0
        while not load.done():
            await asyncio.sleep(0.25)
            if until["t"] - 0.5 <= time.monotonic() and until["t"] < cap and res.sent < res.max_requests \
                    and not await seen():
                until["t"] = min(until["t"] + 1.0, cap)
        await load

    async def phase_preempt(self, res, procs, until, before, nxt) -> None:
        main, b = procs["main"], before["main"]

        async def preemptions() -> tuple[int, int]:
            m = await scrape(self.client, main.url)
            return (int(metric(m, "kvq_num_preemptions_total") - metric(b, "kvq_num_preemptions_total")),
                    int(metric(m, "kvq_requests_swapped_total") - metric(b, "kvq_requests_swapped_total")))

        async def seen() -> bool:
            return sum(await preemptions()) > 0

        await self.drive_until_seen(res, "main", "long", until, seen)
        await self.settle_and_check(res, main)
        recompute, swapped = await preemptions()
        n = recompute + swapped  # (--preemption-mode swap: preempted requests go to the host tier)
        res.evidence.update(preemptions=n, recompute=recompute, swapped=swapped,
                            pool_blocks=(await self.status(main))["kv_pool"].get("q_blocks"))
        if n <= 0:
            res.failures.append("no preemption: the pool was not too small for the load (--small-pool)")

    async def phase_host_faults(self, res, procs, until, before, nxt) -> None:
        main, b = procs["main"], before["main"]

        async def counts() -> dict:
            m = await scrape(self.client, main.url)
            return {k: int(metric(m, f"kvq_kv_cpu_{k}_total") - metric(b, f"kvq_kv_cpu_{k}_total"))
                    for k in ("offload_failed", "reload_failed", "offload_blocks", "reload_blocks", "tier_hits")}

        async def seen() -> bool:
            c = await counts()
            return c["offload_failed"] + c["reload_failed"] > 0 and c["offload_blocks"] > 0

        await self.drive_until_seen(res, "main", "shared", until, seen)
        await self.settle_and_check(res, main)
        ev = await counts()
        res.evidence.update(ev, tier_stats=(await self.status(main))["cpu_offload"]["prefix_tier_stats"])
        if ev["offload_failed"] + ev["reload_failed"] == 0:
            res.failures.append("no host-tier copy failed (KVQ_FAULT_HOST_COPY)")
        if ev["offload_blocks"] == 0:  # (hits and reloads depend on the timing: reported, not required)
            res.failures.append("the CPU prefix tier stored nothing")

    async def phase_elastic(self, res, procs, until, before, nxt) -> None:
        main, b = procs["main"], before["main"]

        async def counts() -> dict:
            m = await scrape(self.client, main.url)
            return {k: int(metric(m, name) - metric(b, name)) for k, name in (
                ("demotions", "kvq_kv_pressure_demotions_total"), ("preemptions", "kvq_num_preemptions_total"),
                ("swapped", "kvq_requests_swapped_total"), ("swap_failures", "kvq_swap_failures_total"))}

        async def seen() -> bool:
            c = await counts()
            return c["demotions"] > 0 and c["swap_failures"] > 0

        await self.drive_until_seen(res, "main", "long", until, seen)
        await self.settle_and_check(res, main)
        ev = await counts()
        st = await self.status(main)
        res.evidence.update(ev, tiers=(st.get("kv_tiers") or {}).get("tiers"))
        if ev["demotions"] == 0:
            res.failures.append("no block was demoted: the pool did not force it (--elastic-pool)")
        if ev["swap_failures"] == 0:  # (the pool must outgrow the lowest tier too, and a copy must fail)
            res.failures.append("no swap copy failed (KVQ_FAULT_HOST_COPY, --elastic-pool)")

    async def phase_nixl(self, res, procs, until, before, nxt) -> None:
        prefill, decode = procs["prefill"], procs["decode"]
        until["t"] = float("inf")  # (set after the kill)
        load = asyncio.ensure_future(self.drive(res, "decode", "mixed", until))
        # the kill: at 35% of the phase, once a fill has completed, mid-transfer (while the decode
        # server waits on fills); 30 s past the phase's end at most (a slow first fill on a busy machine)
        t0 = time.monotonic()
        pending = 0
        while time.monotonic() < t0 + res.duration_s + 30:
            kv = (await self.status(decode))["kv_transfer"]
            pending = kv.get("pending") or 0
            if (time.monotonic() > t0 + 0.35 * res.duration_s or res.sent >= 0.35 * res.max_requests) \
                    and kv["fills"]["filled"] and pending:
                break
            await asyncio.sleep(0.01)
        at_kill = await scrape(self.client, decode.url)
        prefill.stopping_at = time.monotonic()
        prefill.signal(signal.SIGKILL)
        filled_before = (await self.status(decode))["kv_transfer"]["fills"]["filled"]
        await prefill.wait_exit(10)
        self.servers.pop("prefill", None)
        until["t"] = time.monotonic() + max(res.duration_s * 0.4, 3.0)
        await load
        await self.settle_and_check(res, decode)
        m = await scrape(self.client, decode.url)

        def failed(a: dict, b: dict) -> dict:
            return {r: n for r in ("peer_unreachable", "peer_error", "transfer_error", "timeout", "checksum",
                                   "bad_reply", "aborted")
                    if (n := int(metric(b, "kvq_kv_transfer_failed_total", reason=r)
                                 - metric(a, "kvq_kv_transfer_failed_total", reason=r)))}

        after = failed(at_kill, m)
        res.evidence.update(fills_pending_at_kill=pending, filled_before_kill=filled_before,
                            fills=(await self.status(decode))["kv_transfer"]["fills"],
                            transfer_failures_before_kill=failed(before["decode"], at_kill),
                            transfer_failures_after_kill=after,
                            completed_after_kill=self.completed(decode.name, after=prefill.stopping_at))
        if filled_before == 0:
            res.failures.append("no KV transfer completed before the peer was killed")
        if sum(after.values()) == 0:
            res.failures.append("no transfer failed after the peer was killed")
        if res.evidence["completed_after_kill"] == 0:
            res.failures.append("no request completed on the decode server after its peer died")

    async def phase_tp(self, res, procs, until, before, nxt) -> None:
        tp, ev = procs["tp"], res.evidence
        timeout = self.args.distributed_timeout
        until["t"] = float("inf")  # the clients go on until the server is gone
        load = asyncio.ensure_future(self.drive(res, "tp", "mixed", until))
        # the kill: at 40% of the phase, once the server has completed a request (within the phase)
        t0 = time.monotonic()
        while time.monotonic() < t0 + res.duration_s and \
                ((time.monotonic() < t0 + 0.4 * res.duration_s and res.sent < 0.4 * res.max_requests)
                 or not self.completed(tp.name)):
            await asyncio.sleep(0.05)
        ranks = tp_rank_pids(tp.pid)
        if not ranks:
            until["stop"] = True
            await load
            res.failures.append("no tensor-parallel rank process found")
            return
        tp.stopping_at = time.monotonic()
        os.kill(ranks[0], signal.SIGKILL)
        killed = time.monotonic()
        code = await tp.wait_exit(timeout + 30)
        exit_s = round(time.monotonic() - killed, 2) if code is not None else None
        if code is None:
            tp.kill_all(dump=True)
        until["stop"] = True
        self.servers.pop("tp", None)
        await load
        reported = re.search(r"tensor parallel: a rank failed: rank 1 \(pid \d+\) was killed by SIGKILL",
                             tp.log_tail(50000)) is not None
        ev.update(rank_pid=ranks[0], exit_code=code, death_to_exit_s=exit_s, distributed_timeout_s=timeout,
                  loss_reported_in_log=reported)
        if code is None:
            res.failures.append("the server did not exit within --distributed-timeout + 30 s after its rank died")
        elif code == 0:
            res.failures.append("the server exited 0 after losing a rank")
        elif exit_s > timeout:
            res.failures.append(f"the server took {exit_s} s to exit, over --distributed-timeout {timeout} s")
        if not reported:
            res.failures.append("the server's log does not name the dead rank")

    # -- the run -------------------------------------------------------------------------------------
    async def run(self) -> dict:
        a = self.args
        total_w = sum(WEIGHTS[p] for p in a.phases)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)  # a connection per request
        async with httpx.AsyncClient(timeout=httpx.Timeout(a.request_timeout, connect=5.0), limits=limits,
                                     trust_env=False) as self.client:
            try:
                for i, name in enumerate(a.phases):
                    later = [p for p in a.phases[i + 1:] if p != "nixl" or _has_nixl()]
                    w = WEIGHTS[name] / total_w
                    res = PhaseResult(name, round(a.duration * w, 2), max(1, int(a.max_requests * w)))
                    self.results.append(res)
                    if name == "nixl" and not _has_nixl():
                        res.skipped = "nixl is not installed"
                        continue
                    if time.monotonic() > self.deadline:
                        res.skipped = "--time-limit reached"
                        res.failures.append(res.skipped)
                        continue
                    print(f"[soak] phase {name}: {res.duration_s:g} s of load, at most {res.max_requests} requests",
                          file=sys.stderr, flush=True)
                    try:
                        await asyncio.wait_for(self.run_phase(res, later), max(1.0, self.deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        res.failures.append("--time-limit reached during the phase")
                    except RuntimeError as e:  # a server that would not start
                        res.failures.append(str(e)[:2000])
                    self.retire(later)
                    self.report_line(res)
            finally:
                for task in self.starting.values():
                    task.cancel()
                for p in self.all_procs:
                    if p.proc is not None and p.exit_code() is None and p.stopping_at is None:
                        self.retiring.append(asyncio.ensure_future(self.stop(p)))
                await asyncio.gather(*self.retiring, return_exceptions=True)
        return self.summary()

    def report_line(self, res: PhaseResult) -> None:
        c = res.counts
        print(f"[soak] {res.name}: sent {res.sent}, completed {c['completed']}, clear errors {c['clear_error']}, "
              f"left {c['client_left']}, refused {c['refused_down']}, lost {c['lost']}, leaked {res.leaked_blocks}; "
              f"{'ok' if not res.failures else 'FAILED: ' + '; '.join(res.failures)}", file=sys.stderr, flush=True)

    def summary(self) -> dict:
        phases, failures = [], []
        for r in self.results:
            for what, bad in (("lost", r.counts["lost"]), ("leaked blocks", r.leaked_blocks or 0),
                              ("5xx outside shutdown", r.server_errors_outside_shutdown),
                              ("unexpected 400", r.unexpected_400)):
                if bad:
                    r.failures.append(f"{what}: {bad}")
            if r.integrity_ok is False:
                r.failures.append("integrity check failed")
            phases.append({**asdict(r), "ok": not r.failures and not r.skipped})
            failures += [f"{r.name}: {f}" for f in r.failures]
        # every server the soak stopped with SIGTERM (not one it broke on purpose) must have exited 0
        stops = {p.name: p.proc.returncode for p in self.all_procs if p.proc is not None}
        stop_s = {p.name: p.stop_s for p in self.all_procs if p.stop_s is not None}
        failures += [f"{p.name}: exit status {p.stop_code} after SIGTERM (expected 0; None: killed after 30 s)"
                     for p in self.all_procs if p.stop_code != 0]
        tp = next((r for r in self.results if r.name == "tp"), None)
        rss = [g["growth"] for r in self.results for g in r.rss_mib.values()]
        total = {k: sum(r.counts[k] for r in self.results) for k in CATEGORIES}
        return {
            "phases": phases,
            "total": {"sent": sum(r.sent for r in self.results), "accepted": sum(r.accepted for r in self.results),
                      **total, "leaked_blocks": sum(r.leaked_blocks or 0 for r in self.results),
                      "idle_held_blocks": sum(r.idle_held_blocks for r in self.results),
                      "server_errors_outside_shutdown": sum(r.server_errors_outside_shutdown for r in self.results),
                      "server_errors_in_shutdown": sum(r.server_errors_in_shutdown for r in self.results),
                      "peak_rss_growth_mib": max(rss) if rss else None,
                      "tp_death_to_exit_s": tp.evidence.get("death_to_exit_s") if tp else None},
            "server_exit_codes": stops,
            "server_stop_s": stop_s,  # SIGTERM (the soak's own, after a phase) to exit
            "ok": not failures,
            "failures": failures,
            "server_logs": str(self.logdir),
        }


def _has_nixl() -> bool:
    import importlib.util

    return importlib.util.find_spec("nixl") is not None


# -- report -----------------------------------------------------------------------------------------
def evidence_text(r: dict) -> str:
    e = r["evidence"]
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    name = r["name"]
    if name == "mixed":
        return f"429 x{e.get('http_429')}, {e.get('client_left')} clients left"
    if name == "sigterm":
        return (f"exit {e.get('exit_code')} after {e.get('drain_s')} s ({e.get('live_at_sigterm')} live), "
                f"{e.get('aborted_streams')} streams abort+[DONE], 503 x{e.get('http_503')}; restart "
                f"{e.get('restart_s')} s, {e.get('completed_after_restart')} completed after")
    if name == "preempt":
        return f"{e.get('preemptions')} preemptions ({e.get('pool_blocks')}-block pool)"
    if name == "host_faults":
        return (f"copies failed: {e.get('offload_failed')} stores, {e.get('reload_failed')} loads; "
                f"{e.get('offload_blocks')} blocks stored, {e.get('reload_blocks')} reloaded")
    if name == "elastic":
        return (f"{e.get('demotions')} blocks demoted under pressure; {e.get('preemptions')} preemptions "
                f"({e.get('swapped')} swapped, {e.get('swap_failures')} swap copies failed: recomputed)")
    if name == "nixl":
        return (f"peer SIGKILLed with {e.get('fills_pending_at_kill')} fills pending ({e.get('filled_before_kill')} "
                f"filled before); failed fills after: {e.get('transfer_failures_after_kill')}; "
                f"{e.get('completed_after_kill')} completed after")
    if name == "tp":
        return (f"rank SIGKILLed: exit {e.get('exit_code')} in {e.get('death_to_exit_s')} s (timeout "
                f"{e.get('distributed_timeout_s')} s), loss logged: {e.get('loss_reported_in_log')}")
    return ""


def table(report: dict) -> str:
    head = ("phase", "sent", "accepted", "completed", "clear err", "left", "refused", "lost", "5xx out",
            "leaked", "idle-held", "RSS +MiB", "fault evidence")
    rows = []
    for r in report["phases"]:
        c = r["counts"]
        growth = max((g["growth"] for g in r["rss_mib"].values()), default=None)
        rows.append((r["name"], r["sent"], r["accepted"], c["completed"], c["clear_error"], c["client_left"],
                     c["refused_down"], c["lost"], r["server_errors_outside_shutdown"],
                     "-" if r["leaked_blocks"] is None else r["leaked_blocks"],
                     "-" if r["leaked_blocks"] is None else r["idle_held_blocks"], "-" if growth is None else growth,
                     evidence_text(r)))
    t = report["total"]
    rows.append(("total", t["sent"], t["accepted"], t["completed"], t["clear_error"], t["client_left"],
                  t["refused_down"], t["lost"], t["server_errors_outside_shutdown"], t["leaked_blocks"],
                  t["idle_held_blocks"], t["peak_rss_growth_mib"],
                  f"TP rank death -> exit {t['tp_death_to_exit_s']} s"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    widths[-1] = 0
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in (head, *rows)]
    return "\n".join(lines)


def machine(passthrough: list[str]) -> dict:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (OSError, ValueError):
        pass
    return info


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = []
    if "--" in argv:
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                epilog="flags after `--` go to every `kvq serve` the soak starts (e.g. "
                                       "-- --kv-cache-dtype int4_kivi)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {', '.join(PHASES)}, "
                   "run in this order")
    p.add_argument("--duration", type=float, default=150.0, help="seconds of load over all phases, split by "
                   "weight (starting servers is not counted; --time-limit bounds the whole run)")
    p.add_argument("--max-requests", type=int, default=5000, help="requests over all phases, split by weight")
    p.add_argument("--time-limit", type=float, default=None, help="wall-clock bound of the whole run, servers' "
                   "starts included (default: --duration + 300 s); reaching it fails the run")
    p.add_argument("--concurrency", type=int, default=6, help="clients sending at once (default 6; a burst per "
                   "mixed/sigterm phase goes over the admission limit)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds a request may take (default 120)")
    p.add_argument("--pool", default="64MiB", help="--kv-cache-memory of the ordinary servers (default 64MiB)")
    p.add_argument("--small-pool", default="14MiB", help="--kv-cache-memory of the preempt/host_faults server: "
                   "too small for the load (default 14MiB: 40 bf16 blocks of SmolLM2)")
    p.add_argument("--cpu-offload-gb", type=float, default=0.05, help="the host tier of that server (default 0.05)")
    p.add_argument("--elastic-pool", default="4MiB", help="--kv-cache-memory of the elastic server (fp8_e4m3 with "
                   "an int4_kivi tier, no bf16 windows): small enough that demotion, then swap, must happen "
                   "(default 4MiB)")
    p.add_argument("--host-fault-rates", default="store=0.3,load=0.5,seed=1",
                   help="KVQ_FAULT_HOST_COPY of that server (kvq/cache/host_faults.py)")
    p.add_argument("--kv-transfer-timeout", type=float, default=15.0, help="the decode server's (default 15)")
    p.add_argument("--distributed-timeout", type=float, default=20.0,
                   help="the tensor-parallel server's --distributed-timeout: its exit after a rank's death must "
                   "come within it (default 20)")
    p.add_argument("--long-chars", type=int, nargs=2, default=(700, 1100), metavar=("MIN", "MAX"),
                   help="characters of a long prompt (default 700 1100: under 400 tokens, for --max-model-len 512)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds a server may take to start")
    p.add_argument("--prestart", type=int, default=1, metavar="N",
                   help="start the servers of the next N phases while a phase runs (default 1; 0: each phase "
                   "starts its own when it begins)")
    p.add_argument("--server-log-level", default="warning", help="the servers' --uvicorn-log-level (default "
                   "warning; info also logs every request)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="server logs (default: a new temporary folder)")
    p.add_argument("--out", default=str(ROOT / "docs/results/soak_cpu.json"), help="the JSON report")
    p.add_argument("--label", default=None, help="a note stored in the JSON")
    args = p.parse_args(argv)
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    bad = [x for x in args.phases if x not in PHASES]
    if bad or not args.phases:
        p.error(f"--phases: unknown {bad}; valid: {', '.join(PHASES)}")
    if any(f in passthrough for f in ("--host", "--port")):
        p.error("the soak picks --host (127.0.0.1) and --port itself")
    if args.time_limit is None:
        args.time_limit = args.duration + 300.0
    if args.duration <= 0 or args.max_requests < 1 or args.concurrency < 1:
        p.error("--duration, --max-requests and --concurrency must be positive")
    return args, passthrough


def main(argv: list[str] | None = None) -> int:
    args, passthrough = parse_args(argv)
    t0 = time.monotonic()
    soak = Soak(args, passthrough)
    try:
        report = asyncio.run(soak.run())
    finally:
        for p in soak.all_procs:  # whatever happened: no server outlives the soak
            if p.proc is not None and p.proc.poll() is None:
                p.kill_all()
    report = {"meta": {"label": args.label, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                       "machine": machine(passthrough), "argv": sys.argv[1:] if argv is None else argv,
                       "flags": {k: v for k, v in vars(args).items() if k not in ("out", "log_dir")},
                       "server_base_args": list(BASE_SERVER_ARGS), "server_passthrough_args": passthrough,
                       "wall_s": round(time.monotonic() - t0, 1)}, **report}
    print(table(report))
    print(f"[soak] {'OK' if report['ok'] else 'FAILED'} in {report['meta']['wall_s']} s; server logs in "
          f"{report['server_logs']}" + "".join(f"\n  - {f}" for f in report["failures"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"[soak] wrote {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
