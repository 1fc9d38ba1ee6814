"""HTTP pieces every route of the server shares: OpenAI-style error responses and a JSON body read with
its size and time bounds (kvq.server.app and kvq.server.kv_routes both use them)."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from kvq.server.protocol import ApiError, error_body

CLOSE_AFTER = (401, 408, 413, 415)  # refused before the body was read: close rather than drain it


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def error_response(status: int, message: str, type: str, code: str | None = None,
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status,
                        headers={"Connection": "close"} if status in CLOSE_AFTER else None)


def api_error_response(e: ApiError) -> JSONResponse:
    return error_response(e.status, e.message, e.type, e.code, e.param)


async def read_json_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The body, checked as it arrives: JSON media type (415), at most ``max_bytes`` whatever
    Content-Length says (413), complete within ``timeout`` seconds (408); ClientGone if the client left."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"the body must be JSON sent with 'Content-Type: application/json' (got "
                       f"{media or 'no Content-Type'!r})", code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the body is {int(declared)} bytes; this server accepts at most {max_bytes} "
                       "(--max-request-bytes)", code="request_too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise ApiError(413, f"the body is over {max_bytes} bytes, the most this server accepts "
                                   "(--max-request-bytes)", code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the body was not complete within {timeout:g} s ({size} bytes arrived; "
                       "--timeout-body)", code="request_timeout") from None
    except ClientDisconnect:
        raise ClientGone(f"after {size} bytes of the body") from None
    return b"".join(chunks)
