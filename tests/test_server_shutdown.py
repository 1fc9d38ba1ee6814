"""`kvq serve` shutting down as a real process (docs/server.md, "Shutdown and draining"): SIGTERM and
SIGINT drain (503 for new requests and /health, running requests finish, those still running at
--shutdown-timeout end with finish_reason "abort" and [DONE], kvq_server_draining 1), exit status 0 and
no traceback; --shutdown-timeout 0; a second SIGINT; a signal while the model loads, and at the first
moment kvq's code can catch one; HEAD /health and /v1/models; --max-logprobs.

Each test starts its own server on the default model (CPU, one torch thread, a small pool) on a free
loopback port and stops it in a finally block."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

PROMPT = "The capital of France is"
SHORT = 6  # tokens of a request that finishes within the drain's timeout
LONG = 300  # tokens of one that cannot (ignore_eos: it runs to max_tokens)
FLAGS = ["--kv-cache-memory", "64MiB", "--max-num-seqs", "8", "--max-model-len", "512", "--threads", "1",
         "--uvicorn-log-level", "info"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`kvq serve` as a subprocess; its stdout+stderr in a file (read with :meth:`log`)."""

    def __init__(self, tmp_path, *flags: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"serve-{self.port}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvq.cli", "serve", "--port", str(self.port), *FLAGS,
                                          *flags], stdout=f, stderr=subprocess.STDOUT, env=env)
        self.started = time.monotonic()

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"not ready in {timeout} s:\n{self.log()}")

    def wait_exit(self, timeout: float) -> tuple[int, float]:
        """(exit status, seconds waited)."""
        t = time.monotonic()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {timeout} s later:\n{self.log()}") from None
        return code, time.monotonic() - t

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Stream:
    """One streaming completion read on a thread: every SSE data line, in order."""

    def __init__(self, url: str, max_tokens: int):
        self.events: list = []
        self.error: BaseException | None = None
        body = {"model": "default", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def chunks(self) -> int:
        return sum(1 for e in self.events if isinstance(e, dict) and e["choices"])

    def text(self) -> str:
        return "".join(c["text"] for e in self.events if isinstance(e, dict) for c in e["choices"])

    def finish_reason(self) -> str | None:
        reasons = [c["finish_reason"] for e in self.events if isinstance(e, dict) for c in e["choices"]
                   if c["finish_reason"] is not None]
        assert len(reasons) == 1, self.events
        return reasons[0]

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None, repr(self.error)


def _complete(url: str, max_tokens: int) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": PROMPT, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _assert_ended(stream: Stream, reason: str) -> None:
    """The stream's last events: a chunk with ``reason``, the usage chunk, then [DONE]."""
    assert stream.events[-1] == "[DONE]", stream.events[-3:]
    assert stream.events[-2]["usage"]["completion_tokens"] >= 1, stream.events[-2]
    assert stream.finish_reason() == reason, stream.events[-3:]
    assert [c["finish_reason"] for c in stream.events[-3]["choices"]] == [reason]


def _assert_clean_exit(server: Serve, code: int, expected: int = 0) -> None:
    log = server.log()
    assert code == expected, log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


def _drain_case(tmp_path, sig: int) -> None:
    """2 short streams finish within the timeout with their full text; 6 long ones end "abort", and a
    long JSON request queued behind them (--max-num-seqs 8) gets 503; while the server drains a new
    request and /health get 503 with Retry-After; exit status 0."""
    timeout = 5.0
    server = Serve(tmp_path, "--shutdown-timeout", str(timeout))
    try:
        server.wait_ready()
        reference = _complete(server.url, SHORT)  # the same greedy request, not interrupted
        streams = [Stream(server.url, SHORT if i < 2 else LONG) for i in range(8)]
        _until(lambda: all(s.chunks() >= 1 for s in streams[2:]), 60, "the long streams did not start")
        queued: list = []
        waiting = threading.Thread(target=lambda: queued.append(httpx.post(
            server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True},
            timeout=60)), daemon=True)
        waiting.start()
        _until(lambda: httpx.get(server.url + "/status").json()["requests"]["live_requests"] == 9, 10, "not queued")
        server.proc.send_signal(sig)
        sent = time.monotonic()
        _until(lambda: httpx.get(server.url + "/health", timeout=5).status_code == 503, 3, "/health stayed 200")
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r
        assert r.json()["error"]["code"] == "server_shutdown", r.text
        r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "5" and r.headers["connection"] == "close"
        assert r.json()["error"]["type"] == "service_unavailable" and r.json()["error"]["code"] == "server_shutdown"
        assert httpx.head(server.url + "/health").status_code == 503
        assert re.search(r"^kvq_server_draining 1\.0$", httpx.get(server.url + "/metrics").text, re.M)
        code, waited = server.wait_exit(timeout + 15)
        for s in streams:
            s.join(5)
        for s in streams[:2]:
            _assert_ended(s, "length")
            assert s.text() == reference
        for s in streams[2:]:
            _assert_ended(s, "abort")
            assert s.chunks() < LONG
        waiting.join(5)
        assert queued[0].status_code == 503 and queued[0].headers["retry-after"] == "5", queued
        error = queued[0].json()["error"]
        assert error["code"] == "server_shutdown" and "--shutdown-timeout 5 s" in error["message"], error
        # the drain waited for the timeout (the long streams were running), then ended them at once
        assert timeout - 0.5 < time.monotonic() - sent < timeout + 10, time.monotonic() - sent
        _assert_clean_exit(server, code)
        assert "ending 7 sequences still running" in server.log(), server.log()
    finally:
        server.stop()


def test_sigterm_drains_then_ends_the_rest_with_abort(tmp_path):
    _drain_case(tmp_path, signal.SIGTERM)


def test_sigint_drains_like_sigterm(tmp_path):
    _drain_case(tmp_path, signal.SIGINT)


def test_shutdown_timeout_0_ends_streams_at_once_and_a_second_sigint_cuts_a_drain(tmp_path):
    """--shutdown-timeout 0: open streams end "abort" + [DONE] within a second or two, exit 0.  Then a
    server with a long timeout: a second SIGINT ends its streams at once, exit status 130."""
    for flags, signals, expected in ((["--shutdown-timeout", "0"], [signal.SIGTERM], 0),
                                     (["--shutdown-timeout", "60"], [signal.SIGINT, signal.SIGINT], 130)):
        server = Serve(tmp_path, *flags)
        try:
            server.wait_ready()
            streams = [Stream(server.url, LONG) for _ in range(4)]
            _until(lambda: all(s.chunks() >= 2 for s in streams), 60, "the streams did not start")
            for sig in signals:
                server.proc.send_signal(sig)
                time.sleep(0.5)
            code, waited = server.wait_exit(10)
            assert waited < 5, waited
            for s in streams:
                s.join(5)
                _assert_ended(s, "abort")
            _assert_clean_exit(server, code, expected)
        finally:
            server.stop()


def test_in_process_stop_drains_and_frees_every_block():
    """ServerThread.stop drains too: streams still running at the timeout end "abort" + [DONE], the
    engine aborted them (no block left in use, the abort counted) and the engine thread stopped."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvq.engine.llm_engine import EngineConfig
    from kvq.server.launch import ServerThread, build_server
    from kvq.server.options import ServerOptions

    config = EngineConfig(kv_cache_memory="64MiB", max_num_seqs=4, max_model_len=512, progress=False)
    app, engine = build_server(config, ["default"], options=ServerOptions(shutdown_timeout=0.5))
    thread = ServerThread(app)
    url = thread.start()

    def draining() -> float:
        return next(m.value for f in text_string_to_metric_families(app.state.metrics.render().decode())
                    for m in f.samples if m.name == "kvq_server_draining")

    try:
        streams = [Stream(url, LONG) for _ in range(3)]
        _until(lambda: all(s.chunks() >= 2 for s in streams), 60, "the streams did not start")
        assert draining() == 0
        t = time.monotonic()
        thread.stop()
        assert draining() == 1
        assert not thread.thread.is_alive() and time.monotonic() - t < 5
        for s in streams:
            s.join(5)
            _assert_ended(s, "abort")
        assert not engine.alive and engine.num_live == 0
        assert engine._integrity()["leaked_blocks"] == 0  # the engine thread has stopped: safe to read here
        samples = {(m.name, m.labels.get("outcome") or m.labels.get("finished_reason")): m.value
                   for f in text_string_to_metric_families(app.state.metrics.render().decode()) for m in f.samples}
        assert samples[("kvq_requests_total", "abort")] == 3
        assert samples[("kvq_request_finished_total", "abort")] == 3
    finally:  # stopped already unless an assertion failed above
        thread.server.should_exit = True
        thread.thread.join(30)


def test_sigint_while_loading_exits_130_without_a_traceback(tmp_path):
    server = Serve(tmp_path)
    try:
        time.sleep(1.5)
        with pytest.raises(httpx.TransportError):  # not serving yet: the signal lands in the startup
            httpx.get(server.url + "/health", timeout=1)
        server.proc.send_signal(signal.SIGINT)
        code, waited = server.wait_exit(5)
        assert waited < 5
        _assert_clean_exit(server, code, 130)
        assert re.search(r"^\[kvq serve\] SIGINT while starting: stopped \(exit status 130\)$", server.log(),
                         re.M), server.log()
    finally:
        server.stop()


def test_a_signal_during_the_triton_import_is_delivered_after_it():
    """Ctrl-C that lands while triton's native module starts (which aborted the server with exit -6) is held
    back and delivered as a KeyboardInterrupt once the import is done (kvq.attention.backends._import_triton)."""
    code = ("import builtins, os, signal, sys\n"
            # as in a terminal: a process started with SIGINT ignored (by whoever started the test's worker, or a
            # shell's background job) keeps ignoring it, which _import_triton respects
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "import kvq.attention.backends as b\n"
            "real = builtins.__import__\n"
            "def imp(name, *a, **k):\n"
            "    if name == 'triton' and 'triton' not in sys.modules:\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = imp\n"
            "try:\n"
            "    b._import_triton()\n"
            "except KeyboardInterrupt:\n"
            "    print('interrupted after the import:', 'triton' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "interrupted after the import: True" in r.stdout, (r.returncode, r.stdout, r.stderr)


def _caught(pid: int) -> int:
    """The signals process ``pid`` has handlers for (Linux: SigCgt in /proc/PID/status), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (FileNotFoundError, ProcessLookupError):
        return 0


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/PID/status (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_as_soon_as_kvq_can_catch_one(tmp_path, sig):
    """Python catches SIGINT from its own start, SIGTERM never: the first moment the process catches
    SIGTERM is the first moment kvq's code runs (kvq.cli.main installs its start-up handlers as its
    first line, before numpy, torch or the parser load).  A signal then, or at any later moment of
    the start-up, ends it within a second or two: exit status 128 + the signal, one line, no traceback."""
    server = Serve(tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not _caught(server.proc.pid) & (1 << (signal.SIGTERM - 1)):
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log()
            time.sleep(0.001)
        server.proc.send_signal(sig)
        code, _ = server.wait_exit(5)
        log = server.log()
        assert code == 128 + sig and "Traceback" not in log, log
        assert log.strip().splitlines()[-1] == f"[kvq serve] {signal.Signals(sig).name} while starting: stopped " \
                                               f"(exit status {128 + sig})", log
    finally:
        server.stop()


def test_main_catches_signals_before_anything_heavy_loads():
    """As a program, kvq.cli.main holds SIGINT and SIGTERM from its first line: before it builds the
    parser (whose imports bring numpy; the command's, torch), and importing kvq.cli loads neither."""
    code = ("import signal, sys\nimport kvq.cli\nassert 'numpy' not in sys.modules and 'torch' not in sys.modules\n"
            "seen = {}\ndef parser():\n    seen.update((s, signal.getsignal(s)) for s in (signal.SIGINT, "
            "signal.SIGTERM))\n    raise SystemExit(0)\nkvq.cli.build_parser = parser\nsys.argv = ['kvq', 'serve']\n"
            "try:\n    kvq.cli.main()\nexcept SystemExit:\n    pass\n"
            "assert all(h is kvq.cli._stop_starting for h in seen.values()) and len(seen) == 2, seen\n"
            "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


def test_head_health_and_models_and_max_logprobs(tmp_path, capsys):
    from kvq.cli import main

    for bad, why in (("-1", "must be a number of seconds >= 0"), ("soon", "invalid float value"),
                     ("nan", "must be a number of seconds >= 0")):
        # before the model loads (a missing model: a server that took the flag would fail on it, not hang)
        assert main(["serve", "--port", "0", "--model", "/nonexistent/m.gguf", "--shutdown-timeout", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvq: error: ") and "--shutdown-timeout" in err and why in err, err
    server = Serve(tmp_path, "--shutdown-timeout", "3", "--max-logprobs", "5")
    try:
        server.wait_ready()
        base = {"model": "default", "max_tokens": 1, "temperature": 0}
        ok = httpx.post(server.url + "/v1/completions", json={**base, "prompt": PROMPT, "logprobs": 5}, timeout=30)
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 5, ok.text
        for route, body, param in (
                ("completions", {"prompt": PROMPT, "logprobs": 6}, "logprobs"),
                ("completions", {"prompt": PROMPT, "logprobs": 6, "echo": True, "max_tokens": 0}, "logprobs"),
                ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                                      "top_logprobs": 6}, "top_logprobs")):
            r = httpx.post(server.url + "/v1/" + route, json={**base, **body}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert f"{param} is 6; this server returns at most 5" in r.json()["error"]["message"], r.text
            assert "(--max-logprobs 5)" in r.json()["error"]["message"], r.text
        for path in ("/health", "/v1/models"):
            get, head = httpx.get(server.url + path), httpx.head(server.url + path)
            assert get.status_code == head.status_code == 200 and head.content == b"", head
            assert head.headers["content-type"] == "application/json"
        assert httpx.get(server.url + "/status").json()["draining"] is False
        server.proc.send_signal(signal.SIGTERM)  # nothing running: it exits at once
        code, waited = server.wait_exit(10)
        assert waited < 5, waited
        _assert_clean_exit(server, code)
    finally:
        server.stop()


def test_a_failed_executor_ends_requests_as_a_shutdown(monkeypatch):
    """A step that fails because the executor cannot go on (a tensor-parallel rank died: as
    kvq.parallel.worker does, the step records the group's ``failure``, then raises) is not recovered
    from: the running stream ends "abort" + [DONE], the running JSON request gets 503 server_shutdown
    naming the failure (before: a 500 "the engine failed during a step"), and the server stops with
    exit status 1."""
    from kvq.engine.executor import Executor
    from kvq.engine.llm_engine import EngineConfig
    from kvq.server.launch import ServerThread, build_server
    from kvq.server.options import ServerOptions

    config = EngineConfig(kv_cache_memory="64MiB", max_num_seqs=4, max_model_len=512, progress=False)
    app, engine = build_server(config, ["default"], options=ServerOptions(shutdown_timeout=20))
    thread = ServerThread(app)
    url = thread.start()
    dead = "tensor parallel: a rank failed: rank 1 (pid 4242) was killed by SIGKILL"
    kill, failed = threading.Event(), threading.Event()
    monkeypatch.setattr(Executor, "failure", property(lambda self: dead if failed.is_set() else None))
    runner = engine.engine.runner
    real = runner.execute

    def execute(*a, **k):
        if kill.is_set():
            failed.set()
            raise RuntimeError(f"{dead}; the engine is shut down")
        return real(*a, **k)

    monkeypatch.setattr(runner, "execute", execute)
    try:
        stream = Stream(url, LONG)
        answers: list = []
        waiting = threading.Thread(target=lambda: answers.append(httpx.post(
            url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}, timeout=60)),
            daemon=True)
        waiting.start()
        _until(lambda: stream.chunks() >= 2 and engine.num_live == 2, 60, "the requests did not start")
        kill.set()
        stream.join(20)
        _assert_ended(stream, "abort")
        waiting.join(20)
        r = answers[0]
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown", r.text
        assert r.json()["error"]["message"].startswith(dead), r.text
        thread.thread.join(30)
        assert not thread.thread.is_alive() and thread.server.exit_code == 1
    finally:
        thread.server.should_exit = True
        thread.thread.join(30)


_CLOBBER = """
import ctypes, os, sys, threading, time
import httpx
from kvq.cli import main

URL, FLAG = sys.argv[1], sys.argv[2]

def clobber():  # once the server serves: a native library installs its own SIGTERM handler (here: the default)
    while True:
        try:
            if httpx.get(URL + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    libc = ctypes.CDLL(None)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(15, None)
    open(FLAG, "w").close()

threading.Thread(target=clobber, daemon=True).start()
sys.argv = ["kvq", *sys.argv[3:]]
sys.exit(main())
"""


def test_sigterm_drains_after_a_native_library_replaced_the_handler(tmp_path):
    """A native library (a transfer backend's transport layer, say) that installs its own SIGTERM handler
    after kvq serve installed its drain: the process would die of the signal (exit status -15, no drain,
    streams cut).  kvq.server.signal_guard puts kvq's handler back within a tick and says so once: the
    drain runs and the server exits 0."""
    port = _free_port()
    url, flag, log_path = f"http://127.0.0.1:{port}", tmp_path / "clobbered", tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", _CLOBBER, url, str(flag), "serve", "--port", str(port), *FLAGS,
                                 "--shutdown-timeout", "5"], stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        _until(lambda: flag.exists() or proc.poll() is not None, 120, f"not started:\n{log_path.read_text()}")
        assert proc.poll() is None, log_path.read_text()
        stream = Stream(url, SHORT)
        time.sleep(0.5)  # a few uvicorn ticks
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        log = log_path.read_text()
        assert code == 0, log
        assert "a library replaced kvq's SIGTERM handler" in log and "Traceback" not in log, log
        stream.join(10)
        assert stream.events[-1] == "[DONE]", stream.events[-3:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
