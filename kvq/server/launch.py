"""Building a server, binding its socket, running it with kvq's shutdown (:class:`Server`), and running
one in a background thread (tests, benchmarks).

Shutdown (docs/server.md, "Shutdown and draining")::

    SIGTERM / first SIGINT -> drain: new requests and /health get 503 (Retry-After); running ones go on
      -> all done, or --shutdown-timeout passed -> engine.abort_all(): each stream's last chunk has
         finish_reason "abort" then [DONE], a JSON request gets 503; their blocks are freed
      -> uvicorn closes the listener and the connections (they are idle by now) -> exit status 0
    SIGINT while draining -> the deadline is now (exit status 130); any signal after that: exit at once
    the executor failed (a tensor-parallel rank died: its ``failure``) -> the same drain, cut at once;
      exit status 1, so a supervisor restarts the server rather than a balancer seeing 503s for ever
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import threading
import time

import uvicorn

from kvq.engine.llm_engine import EngineConfig, LLMEngine
from kvq.server.async_engine import AsyncEngine
from kvq.server.metrics import ServerMetrics
from kvq.server.options import KVRoleOptions, ServerOptions
from kvq.server.signal_guard import SignalGuard

log = logging.getLogger("uvicorn.error")
FINAL_EVENTS_S = 5.0  # after abort_all: how long the ended requests have to send their last events
GRACEFUL_S = 5.0  # then uvicorn's own wait for responses still being written (a client not reading)


def build_server(config: EngineConfig, served_model_names: list[str] | None = None, max_queue_len: int = 256,
                 options: ServerOptions | None = None, kv: KVRoleOptions | None = None):
    """(app, async_engine) for ``config``: the engine is loaded here, its thread starts with the app.
    ``kv``: the server's part in prefill/decode disaggregation; a decode server shakes hands with
    its prefill peer here (TransferIncompatible or PeerUnavailable when it cannot)."""
    from kvq.server.app import build_app

    engine = LLMEngine(config)
    metrics = ServerMetrics()
    async_engine = AsyncEngine(engine, max_queue_len=max_queue_len, events=metrics.events)
    metrics.watch(async_engine)
    kv = kv or KVRoleOptions()
    exporter = client = None
    if kv.role == "prefill":
        from kvq.transfer.peer import PrefillExporter

        exporter = PrefillExporter(engine, kv.staging_tokens or 4 * engine.max_model_len)
    elif kv.role == "decode":
        from kvq.transfer.peer import PrefillClient, peer_api_key

        client = PrefillClient(engine, kv.peer, fallback=kv.fallback, timeout_s=kv.timeout_s, verify=kv.verify,
                               api_key=peer_api_key(options.api_key if options else None),
                               connect_timeout_s=kv.connect_timeout_s, on_result=metrics.kv_result)
        # the engine reaches its peer through a KV connector (kvq.connectors.remote_prefill)
        engine.add_connector("remote_prefill", peer=client)
    if exporter is not None:  # (kvq.connectors.kv_export)
        engine.add_connector("kv_export", exporter=exporter)
    app = build_app(async_engine, metrics, served_model_names or [config.model], options,
                    kv_peer=exporter or client)
    return app, async_engine


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening), or ValueError saying why not: called before
    the model loads, so a port in use is reported at once."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT port may be reused
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        hint = "; another process is listening there: stop it or pick another --port" \
            if e.errno == errno.EADDRINUSE else ""
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    return sock


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 0, log_level: str = "info"):
    """uvicorn's config for ``app`` with its options' connection timeouts (h11, with the header deadline)."""
    from kvq.server.connection import header_deadline_protocol

    options: ServerOptions = app.state.options
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          timeout_graceful_shutdown=GRACEFUL_S, timeout_keep_alive=options.timeout_keep_alive,
                          http=header_deadline_protocol(options.timeout_headers))


class Server(uvicorn.Server):
    """uvicorn, with kvq's shutdown in place of its own (which waits a fixed 5 s, cancels what is left
    mid-response, then raises the signal again, so the process dies by it): SIGTERM or SIGINT start
    the drain (module docstring), run as a task of the server's loop; :attr:`exit_code` is 0 after a
    drain, 128 + SIGINT after one cut short by a second SIGINT."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "info"):
        super().__init__(uvicorn_config(app, host, port, log_level))
        self.engine: AsyncEngine = app.state.engine
        self.shutdown_timeout = app.state.options.shutdown_timeout
        self.signals: list[int] = []
        self.exit_code = 0
        self._requested = False  # plain flags: set by a signal handler or another thread, read on the loop
        self._cut = False
        self._drain: asyncio.Task | None = None
        self.failure: str | None = None  # why the engine cannot go on (executor_failure), once seen
        self.guard: SignalGuard | None = None  # while kvq's handlers are installed (capture_signals)

    def request_shutdown(self, cut: bool = False) -> None:
        """Start the drain (any thread); ``cut``: end the running requests now, not at the deadline."""
        self._cut = self._cut or cut
        self._requested = True

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.guard = SignalGuard(self.handle_exit)
        try:
            yield
        finally:
            self.guard = None  # and unlike uvicorn, no signal is raised again: a drained server exits with status 0
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler: flags only (it may interrupt the loop anywhere); the drain task logs."""
        self.signals.append(sig)
        if len(self.signals) == 1:
            self.request_shutdown()
        elif self._cut:  # a third signal, or one after the cut: the user insists
            os.write(2, f"[kvq serve] {signal.Signals(sig).name} again: exiting now\n".encode())
            os._exit(128 + sig)
        elif sig == signal.SIGINT:
            self.exit_code = 128 + sig
            self.request_shutdown(cut=True)

    async def on_tick(self, counter: int) -> bool:
        if self.guard is not None:
            self.guard.check()
        if self.failure is None and (failure := executor_failure(self.engine)):
            self.failure = failure
            log.error("%s: the server stops (exit status 1); running requests end now", failure)
            self.exit_code = 1
            self.request_shutdown(cut=True)
        if self._requested and self._drain is None:
            self._drain = asyncio.create_task(self.drain())
        return await super().on_tick(counter)

    async def drain(self) -> None:
        """Refuse new work, wait for the running requests (up to the timeout, or until cut), end those
        left, give them FINAL_EVENTS_S to send their last events, then let uvicorn shut down."""
        engine, loop = self.engine, asyncio.get_running_loop()
        try:
            engine.begin_drain()
            why = "the engine failed" if self.failure else signal.Signals(self.signals[0]).name if self.signals \
                else "shutdown requested"
            if engine.num_live and not self._cut:
                log.info("%s: draining %d running sequences for up to %g s (--shutdown-timeout); new requests "
                         "and /health get 503%s", why, engine.num_live, self.shutdown_timeout,
                         "; Ctrl-C again ends them now" if self.signals else "")
            else:
                log.info("%s: shutting down", why)
            start = loop.time()
            deadline = start + self.shutdown_timeout
            while engine.num_live and not self._cut and loop.time() < deadline:
                await asyncio.sleep(0.05)
            if engine.num_live:
                cause = f"--shutdown-timeout {self.shutdown_timeout:g} s" if not self._cut else \
                    self.failure if self.failure else "a second SIGINT" if len(self.signals) > 1 else "cut short"
                log.warning("ending %d sequences still running after %.1f s (%s): finish_reason \"abort\" "
                            "or HTTP 503", engine.num_live, loop.time() - start, cause)
                engine.abort_all(f"the server is shutting down: the request was still running at its "
                                 f"deadline ({cause}); retry on another replica")
                end = loop.time() + FINAL_EVENTS_S
                while engine.num_live and loop.time() < end:
                    await asyncio.sleep(0.02)
            elif loop.time() > start + 0.05:
                log.info("drained in %.1f s", loop.time() - start)
        finally:
            self.should_exit = True


def executor_failure(engine: AsyncEngine) -> str | None:
    """Why the engine's executor cannot go on though the engine thread runs (a tensor-parallel rank
    died or hung: kvq.parallel.executor's ``failure``), or None; the one-process executor has none."""
    return engine.engine.executor.failure


class ServerThread:
    """:class:`Server` serving ``app`` on ``host`` from a daemon thread; ``port=0`` picks a free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.server = Server(app, host, port, log_level)
        self.host = host
        self.thread = threading.Thread(target=self.server.run, name="kvq-uvicorn", daemon=True)

    def start(self, timeout: float = 60.0) -> str:
        """Start serving; returns the base URL (``http://host:port``)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        """Drain (running requests get the server's shutdown timeout) and stop."""
        self.server.request_shutdown()
        self.thread.join(timeout)
