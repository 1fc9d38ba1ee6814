"""`kvq serve`: the OpenAI-compatible HTTP server (docs/server.md).

Signals: while the server starts (the model loading), SIGINT or SIGTERM stop it within
``STOP_GRACE_S`` with one line on stderr and exit status 128 + the signal (130, 143); once it serves,
kvq.server.launch.Server drains on them (exit status 0, or 130 when a second SIGINT cut the drain).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import sys
import threading

from kvq.engine.sampling_params import MAX_LOGPROBS
from kvq.server.options import DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BYTES, KVRoleOptions, ServerOptions

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
API_KEY_ENV = "KVQ_API_KEY"
STOP_GRACE_S = 2.0  # a signal while starting: if unwinding takes longer (a library holding on), exit anyway


def register(sub) -> None:
    from kvq.engine.args import add_engine_args, add_kv_args

    p = sub.add_parser("serve", help="serve the engine over HTTP (OpenAI-compatible API)",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics "
                       "and /status over HTTP, with the paged, quantized KV cache.  Flags follow vLLM's names.")
    p.add_argument("--model", default=None, help="'default', a shipped config (e.g. llama-3-8b with --load-format "
                   "dummy), a .gguf file or an HF model folder (default: default)")
    add_kv_args(p)
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000); checked before the model loads")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use in requests (default: the --model value)")
    g.add_argument("--max-queue-len", type=int, default=256,
                   help="requests queued beyond --max-num-seqs before new ones get HTTP 429 (default 256)")
    g.add_argument("--uvicorn-log-level", default="info", help=f"uvicorn's log level: {', '.join(LOG_LEVELS)}")
    g.add_argument("--shutdown-timeout", type=float, default=20.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C the server drains: new requests and /health get HTTP 503 (with "
                   "Retry-After), running requests have this many seconds to finish, then each still running ends "
                   "(a stream with finish_reason \"abort\" and [DONE], a JSON request with 503) and the server "
                   "exits with status 0 (default 20, inside Kubernetes' 30 s grace period; 0: end them at once). "
                   "A second Ctrl-C ends them at once (exit status 130). While the model loads, SIGINT or "
                   "SIGTERM exit at once (status 130 or 143)")
    s = p.add_argument_group("security and limits")
    s.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on /v1/*, /metrics and "
                   f"/status (/health stays open); default ${API_KEY_ENV}, which keeps the key out of `ps`")
    s.add_argument("--public-metrics", action="store_true",
                   help="with an API key, still serve /metrics and /status without one (e.g. for a scraper)")
    s.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="browser origins allowed by CORS, e.g. https://app.example.com, or * (default: none)")
    s.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json (default off)")
    s.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                   help=f"the largest n (choices per prompt) a request may ask for (default {DEFAULT_MAX_N})")
    s.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, metavar="K",
                   help=f"the most logprobs per token a request may ask for: completions' logprobs and chat's "
                   f"top_logprobs above it get HTTP 400 (default {MAX_LOGPROBS}, also the most allowed)")
    s.add_argument("--max-request-bytes", default=str(DEFAULT_MAX_REQUEST_BYTES),
                   help="the largest request body, e.g. 8MiB; larger gets HTTP 413 (default 8MiB)")
    s.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle kept-alive connection stays open (default 5)")
    s.add_argument("--timeout-headers", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers, from opening or the request's first "
                   "byte; then it is closed (default 10)")
    s.add_argument("--timeout-body", type=float, default=30.0,
                   help="seconds a request's body has to arrive after its headers; then HTTP 408 (default 30)")
    d = p.add_argument_group("prefill/decode disaggregation (docs/transfer.md)")
    d.add_argument("--kv-role", default="both", help="both (default: this server prefills and decodes), prefill "
                   "(also serves /kv/* so decode servers pull prompts' KV from it, cast into their own KV "
                   "format) or decode (every prompt is prefilled by --kv-peer and its KV pulled over NIXL)")
    d.add_argument("--kv-peer", default=None, metavar="URL",
                   help="with --kv-role decode: the prefill server, e.g. http://10.0.0.2:8000 (its API key: "
                   "$KVQ_KV_PEER_API_KEY, else this server's --api-key)")
    d.add_argument("--kv-fallback", default="local", help="when a transfer fails: local (default: prefill the "
                   "request here) or fail (the request fails with an error)")
    d.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds a transfer (the peer's prefill and the read) may take before it fails (default 30)")
    d.add_argument("--kv-staging-tokens", type=int, default=None,
                   help="with --kv-role prefill: tokens of staged KV per decode format awaiting their reader "
                   "(default 4 x --max-model-len)")
    d.add_argument("--no-kv-verify", dest="kv_verify", action="store_false",
                   help="with --kv-role decode: do not check each chunk's CRC-32 over the received bytes")
    p.set_defaults(func=cmd_serve)


def options_from_args(args: argparse.Namespace) -> ServerOptions:
    """The server options of ``args`` (ValueError: exit code 2); the key falls back to $KVQ_API_KEY."""
    from kvq.units import parse_bytes

    api_key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    if args.public_metrics and api_key is None:
        raise ValueError(f"--public-metrics only means something with --api-key (or ${API_KEY_ENV})")
    try:
        max_request_bytes = parse_bytes(args.max_request_bytes)
    except ValueError as e:
        raise ValueError(f"--max-request-bytes: {e}") from None
    return ServerOptions(api_key=api_key, public_metrics=args.public_metrics,
                         allowed_origins=tuple(args.allowed_origins or ()), enable_docs=args.enable_docs,
                         max_n=args.max_n, max_logprobs=args.max_logprobs, max_request_bytes=max_request_bytes,
                         timeout_keep_alive=args.timeout_keep_alive, timeout_headers=args.timeout_headers,
                         timeout_body=args.timeout_body, shutdown_timeout=args.shutdown_timeout)


def kv_options_from_args(args: argparse.Namespace) -> KVRoleOptions:
    """The disaggregation flags (ValueError: exit code 2)."""
    if args.kv_role != "both" and str(args.kv_scales).startswith("warmup"):
        raise ValueError(f"--kv-scales {args.kv_scales} re-encodes the cache when its scales freeze, which a KV "
                         f"transfer peer would not see: use a scales file (`kvq calibrate`) with --kv-role {args.kv_role}")  # noqa: E501
    if args.kv_role != "both" and args.tensor_parallel_size > 1:
        raise ValueError(f"--kv-role {args.kv_role} with --tensor-parallel-size {args.tensor_parallel_size} is not "
                         "supported yet: KV transfer reads one rank's pool (valid: --kv-role both, or one rank)")
    return KVRoleOptions(role=args.kv_role, peer=args.kv_peer, fallback=args.kv_fallback,
                         timeout_s=args.kv_transfer_timeout, staging_tokens=args.kv_staging_tokens,
                         verify=args.kv_verify)


def check_server_args(args: argparse.Namespace) -> ServerOptions:
    """Raise ValueError (exit code 2) for server flags that cannot work, before the model loads."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue_len < 0:
        raise ValueError(f"--max-queue-len must be >= 0, got {args.max_queue_len}")
    if args.uvicorn_log_level not in LOG_LEVELS:
        raise ValueError(f"unknown --uvicorn-log-level {args.uvicorn_log_level!r}; valid: {', '.join(LOG_LEVELS)}")
    if args.served_model_name is not None and any(not n.strip() for n in args.served_model_name):
        raise ValueError("--served-model-name: names must be non-empty")
    return options_from_args(args)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM before the server serves (a KeyboardInterrupt, so code that re-raises those
    passes it on): exit status 128 + ``signum``."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop_starting(signum: int, frame) -> None:
    code = 128 + signum
    tqdm = sys.modules.get("tqdm")
    bar = tqdm is not None and bool(getattr(tqdm.tqdm, "_instances", None))  # a loading bar ends its line first
    print(f"{chr(10) if bar else ''}[kvq serve] {signal.Signals(signum).name} while starting: stopped (exit status "
          f"{code})", file=sys.stderr, flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal does not wait for the unwinding
        signal.signal(sig, lambda *_: os._exit(code))
    watchdog = threading.Timer(STOP_GRACE_S, os._exit, (code,))  # nor does a library that swallows the first
    watchdog.daemon = True
    watchdog.start()
    raise Interrupted(signum)


@contextlib.contextmanager
def _signals_while_starting():
    """SIGINT/SIGTERM stop the startup (:func:`_stop_starting`); the previous handlers come back after.
    uvicorn's part (kvq.server.launch.Server) installs its own while it serves."""
    if threading.current_thread() is not threading.main_thread():  # cmd_serve called from a thread (tests)
        yield
        return
    previous = {sig: signal.signal(sig, _stop_starting) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        with _signals_while_starting():
            return _serve(args)
    except Interrupted as e:
        return 128 + e.signum


def _serve(args: argparse.Namespace) -> int:
    from kvq.engine.args import engine_config_from_args

    options = check_server_args(args)
    kv = kv_options_from_args(args)
    config = engine_config_from_args(args)
    from kvq.server.launch import bind_socket

    sock = bind_socket(args.host, args.port)  # a port in use is an error now, not after the model loaded
    try:
        from kvq.server.launch import Server, build_server

        from kvq.transfer.describe import TransferIncompatible
        from kvq.transfer.peer import PeerUnavailable

        try:
            app, engine = build_server(config, args.served_model_name, args.max_queue_len, options, kv)
        except (TransferIncompatible, PeerUnavailable) as e:
            raise ValueError(f"--kv-peer {kv.peer}: {e}") from None
        info = engine.engine.info
        names = ", ".join(args.served_model_name or [config.model])
        port = sock.getsockname()[1]
        print(f"[kvq serve] {info['model']} as {names} on {info['device']} ({info['dtype']}); KV "
              f"{info['kv_cache_dtype']['k']}/{info['kv_cache_dtype']['v']}{engine.engine.describe_tiers()}, block "
              f"{info['block_size']}, pool "
              f"{info['kv_pool']['q_blocks']} blocks = {info['kv_pool']['tokens']} tokens; attention "
              f"{info['attention_backend']['resolved']}; http://{args.host}:{port}; API key "
              f"{'required' if options.api_key else 'off'}", file=sys.stderr, flush=True)
        if options.api_key is None and not _is_loopback(args.host):
            print(f"[kvq serve] warning: listening on {args.host} without an API key: anyone who can reach it can "
                  f"use it (--api-key or ${API_KEY_ENV})", file=sys.stderr, flush=True)
        server = Server(app, args.host, port, args.uvicorn_log_level)
        server.run(sockets=[sock])
        return server.exit_code
    finally:
        sock.close()
