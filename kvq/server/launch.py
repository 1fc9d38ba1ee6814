"""Building a server, binding its socket, and running one in a background thread (tests, benchmarks)."""

from __future__ import annotations

import errno
import socket
import threading
import time

from kvq.engine.llm_engine import EngineConfig, LLMEngine
from kvq.server.async_engine import AsyncEngine
from kvq.server.metrics import ServerMetrics
from kvq.server.options import KVRoleOptions, ServerOptions


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
    import uvicorn

    from kvq.server.connection import header_deadline_protocol

    options: ServerOptions = app.state.options
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5,
                          timeout_keep_alive=options.timeout_keep_alive,
                          http=header_deadline_protocol(options.timeout_headers))


class ServerThread:
    """uvicorn serving ``app`` on ``host`` from a daemon thread; ``port=0`` picks a free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.server = uvicorn.Server(uvicorn_config(app, host, port, log_level))
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
        self.server.should_exit = True
        self.thread.join(timeout)
