"""The HTTP connection layer: uvicorn's h11 protocol with a deadline for request headers.

uvicorn times out only a kept-alive connection that has gone quiet after a
response (``timeout_keep_alive``); a client that connects and sends nothing,
or sends half its headers, would hold the connection forever.  Here a
request's headers must be complete within ``timeout_headers`` seconds of the
connection opening, or of the first byte of a later request on a kept-alive
connection; otherwise the connection is closed (nothing has reached the app).
The body's own deadline is the app's (kvq/server/app.py: 408).

Headers are parsed by h11, whose limit (uvicorn's ``h11_max_incomplete_event_size``,
16 KiB) bounds them; an unparsable request gets a 400 in OpenAI's error shape.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvq.server.protocol import error_body


class _HeaderDeadlineH11(H11Protocol):
    timeout_headers: float  # set on the subclass made by header_deadline_protocol()
    _header_timer = None  # asyncio.TimerHandle while a request's headers are awaited

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.timeout_headers, self._headers_late)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._header_timer is None:  # a new request's first bytes
            self._header_timer = self.loop.call_later(self.timeout_headers, self._headers_late)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are in (or the connection is done)
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # bytes of a pipelined next request already buffered: its headers' deadline runs from now
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0] and self._header_timer is None \
                and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.timeout_headers, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's reply to an unparsable request, in OpenAI's error shape."""
        body = json.dumps(error_body(f"invalid HTTP request: {msg}", "invalid_request_error", None,
                                     "invalid_http_request")).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a response was already under way: just close
            pass
        self.transport.close()


def header_deadline_protocol(timeout_headers: float) -> type[H11Protocol]:
    """The protocol class to pass as uvicorn's ``http``."""
    return type("KvqH11Protocol", (_HeaderDeadlineH11,), {"timeout_headers": float(timeout_headers)})
