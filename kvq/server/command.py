"""`kvq serve`: the OpenAI-compatible HTTP server (docs/server.md)."""

from __future__ import annotations

import argparse
import sys

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def register(sub) -> None:
    from kvq.cli import add_engine_args, add_kv_args

    p = sub.add_parser("serve", help="serve the engine over HTTP (OpenAI-compatible API)",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics "
                       "and /status over HTTP, with the paged, quantized KV cache.  Flags follow vLLM's names.")
    p.add_argument("--model", default=None, help="'default', a shipped config (e.g. llama-3-8b with --load-format "
                   "dummy), a .gguf file or an HF model folder (default: default)")
    add_kv_args(p)
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use in requests (default: the --model value)")
    g.add_argument("--max-queue-len", type=int, default=256,
                   help="requests queued beyond --max-num-seqs before new ones get HTTP 429 (default 256)")
    g.add_argument("--uvicorn-log-level", default="info", help=f"uvicorn's log level: {', '.join(LOG_LEVELS)}")
    p.set_defaults(func=cmd_serve)


def check_server_args(args: argparse.Namespace) -> None:
    """Raise ValueError (exit code 2) for server flags that cannot work, before the model loads."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue_len < 0:
        raise ValueError(f"--max-queue-len must be >= 0, got {args.max_queue_len}")
    if args.uvicorn_log_level not in LOG_LEVELS:
        raise ValueError(f"unknown --uvicorn-log-level {args.uvicorn_log_level!r}; valid: {', '.join(LOG_LEVELS)}")
    if args.served_model_name is not None and any(not n.strip() for n in args.served_model_name):
        raise ValueError("--served-model-name: names must be non-empty")


def cmd_serve(args: argparse.Namespace) -> int:
    from kvq.cli import engine_config_from_args

    check_server_args(args)
    import uvicorn

    from kvq.server.launch import build_server

    config = engine_config_from_args(args)
    app, engine = build_server(config, args.served_model_name, args.max_queue_len)
    info = engine.engine.info
    names = ", ".join(args.served_model_name or [config.model])
    print(f"[kvq serve] {info['model']} as {names} on {info['device']} ({info['dtype']}); KV "
          f"{info['kv_cache_dtype']['k']}/{info['kv_cache_dtype']['v']}, block {info['block_size']}, pool "
          f"{info['kv_pool']['q_blocks']} blocks = {info['kv_pool']['tokens']} tokens; attention "
          f"{info['attention_backend']['resolved']}; http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5)
    return 0
