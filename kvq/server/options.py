"""What the server enforces at its HTTP edge, as one value: auth, browser exposure, request limits, timeouts.

Built from ``kvq serve``'s flags (kvq/server/command.py) and validated here, before
the model loads.  docs/server.md lists every limit and the status code it gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvq.engine.sampling_params import MAX_LOGPROBS

DEFAULT_MAX_N = 16
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


@dataclass(frozen=True)
class ServerOptions:
    """``api_key``: None serves everyone; otherwise ``Authorization: Bearer <key>`` is required on
    ``/v1/*``, and on ``/metrics`` and ``/status`` unless ``public_metrics`` (``/health`` is always open).

    ``allowed_origins``: browser origins answered with CORS headers (empty: none; ``"*"``: any).
    ``enable_docs``: serve ``/docs``, ``/redoc`` and ``/openapi.json``.

    ``max_n``: the largest ``n``.  ``max_logprobs``: the most top logprobs per token a request may ask
    for (completions' ``logprobs``, chat's ``top_logprobs``; vLLM's ``--max-logprobs``), at most the
    engine's ``MAX_LOGPROBS``.  ``max_request_bytes``: the largest request body (413 beyond).
    ``timeout_keep_alive``: an idle kept-alive connection is closed after this many seconds.
    ``timeout_headers``: a request's headers must be complete this many seconds after the connection
    opened or the request's first byte arrived, else the connection is closed.  ``timeout_body``: the
    body must be complete this many seconds after its headers (408 otherwise).

    ``shutdown_timeout``: on SIGTERM (or a first SIGINT) the server drains: new requests get 503, and
    running ones have this many seconds to finish before they are ended (0: at once; docs/server.md,
    "Shutdown and draining").
    """

    api_key: str | None = None
    public_metrics: bool = False
    allowed_origins: tuple[str, ...] = ()
    enable_docs: bool = False
    max_n: int = DEFAULT_MAX_N
    max_logprobs: int = MAX_LOGPROBS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    timeout_keep_alive: float = 5.0
    timeout_headers: float = 10.0
    timeout_body: float = 30.0
    shutdown_timeout: float = 20.0

    def __post_init__(self):
        if self.api_key is not None and (not self.api_key.strip() or self.api_key != self.api_key.strip()):
            raise ValueError("--api-key / KVQ_API_KEY must be non-empty, without surrounding whitespace")
        if self.max_n < 1:
            raise ValueError(f"--max-n must be >= 1, got {self.max_n}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) \
                or not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs must be an integer in [0, {MAX_LOGPROBS}] (the engine returns at most "
                             f"{MAX_LOGPROBS} top logprobs per token), got {self.max_logprobs!r}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be at least 1KiB, got {self.max_request_bytes}")
        for name in ("timeout_keep_alive", "timeout_headers", "timeout_body"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
        if not (math.isfinite(self.shutdown_timeout) and self.shutdown_timeout >= 0):
            raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0 (0: end running requests at "
                             f"once), got {self.shutdown_timeout}")
        for origin in self.allowed_origins:
            if origin != "*" and (not origin.startswith(("http://", "https://")) or origin.endswith("/")):
                raise ValueError(f"--allowed-origins: {origin!r} is not an origin; write e.g. https://example.com "
                                 "(scheme and host, no path), or * for any")


@dataclass(frozen=True)
class KVRoleOptions:
    """Prefill/decode disaggregation (docs/transfer.md).  ``role``: "both" (one server does both,
    no transfer), "prefill" (serves /kv/* to decode servers; still serves the OpenAI API) or
    "decode" (every prompt is prefilled by ``peer``, the prefill server's URL).  ``fallback``: on a
    failed transfer prefill here ("local") or fail the request ("fail").  ``timeout_s``: a transfer
    (prefill on the peer + read) that takes longer fails.  ``staging_tokens``: a prefill server's
    staging per decode format (None: 4 x max_model_len).  ``verify``: check each chunk's CRC-32
    over the received bytes."""

    role: str = "both"
    peer: str | None = None
    fallback: str = "local"
    timeout_s: float = 30.0
    staging_tokens: int | None = None
    verify: bool = True
    connect_timeout_s: float = 30.0

    def __post_init__(self):
        from kvq.transfer.peer import FALLBACKS, KV_ROLES

        if self.role not in KV_ROLES:
            raise ValueError(f"unknown --kv-role {self.role!r}; valid: {', '.join(KV_ROLES)}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"unknown --kv-fallback {self.fallback!r}; valid: {', '.join(FALLBACKS)}")
        if self.role == "decode" and not self.peer:
            raise ValueError("--kv-role decode needs --kv-peer URL (the prefill server, e.g. http://10.0.0.2:8000)")
        if self.role != "decode" and self.peer:
            raise ValueError(f"--kv-peer only applies to --kv-role decode (this server is {self.role!r})")
        if self.peer and not self.peer.startswith(("http://", "https://")):
            raise ValueError(f"--kv-peer must be an http:// or https:// URL, got {self.peer!r}")
        for name in ("timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--kv-transfer-timeout must be a positive number of seconds, got {value}")
        if self.staging_tokens is not None and self.role != "prefill":
            raise ValueError(f"--kv-staging-tokens only applies to --kv-role prefill (this server is {self.role!r})")
        if not self.verify and self.role != "decode":
            raise ValueError(f"--no-kv-verify only applies to --kv-role decode (this server is {self.role!r})")
        if self.staging_tokens is not None and self.staging_tokens < 1:
            raise ValueError(f"--kv-staging-tokens must be >= 1, got {self.staging_tokens}")
