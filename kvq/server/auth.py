"""API-key authentication: ``Authorization: Bearer <key>`` on the protected paths.

Protected: ``/v1`` and everything under it (unknown routes too, so they cannot be
probed), and ``/metrics`` and ``/status`` unless ``public_metrics``.  ``/health``
and anything else stay open.  The key is compared as SHA-256 digests with
``hmac.compare_digest``: constant time, and its length is not revealed either.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.responses import JSONResponse

from kvq.server.protocol import error_body


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeyAuth:
    """Pure ASGI middleware (nothing of the request is read before the check)."""

    def __init__(self, app, api_key: str, public_metrics: bool = False):
        self.app = app
        self.digest = _digest(api_key.encode())
        self.public_metrics = public_metrics

    def protects(self, path: str) -> bool:
        if path == "/v1" or path.startswith(("/v1/", "/kv/")):
            return True
        return not self.public_metrics and path.rstrip("/") in ("/metrics", "/status")

    def authorized(self, scope) -> bool:
        value = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(_digest(token.strip()), self.digest)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.protects(scope["path"]) and not self.authorized(scope):
            has = any(k == b"authorization" for k, _ in scope["headers"])
            msg = "incorrect API key provided" if has else \
                "no API key provided: send it as the header 'Authorization: Bearer <key>'"
            response = JSONResponse(error_body(msg, "invalid_request_error", None, "invalid_api_key"), 401,
                                    headers={"WWW-Authenticate": "Bearer", "Connection": "close"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
