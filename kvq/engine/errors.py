"""The error a refused request raises: its message speaks of what the caller sent, never of the
engine's own ids or counters, and ``param`` names the request field it is about (OpenAI's
``param``: "prompt", "max_tokens", "temperature", ...), so the server's 400 can name it."""

from __future__ import annotations


class RequestError(ValueError):
    """A request kvq refuses (a ValueError: callers that catch ValueError keep working)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def at(self, label: str) -> "RequestError":
        """The same error about one prompt of several, ``label`` naming it ("prompt 2", "prompt[2]")."""
        return RequestError(f"{label}: {self}", self.param)


def request_error(e: ValueError, label: str | None) -> RequestError:
    """``e`` as a RequestError (its param kept), prefixed with ``label`` when there is one."""
    err = e if isinstance(e, RequestError) else RequestError(str(e), getattr(e, "param", None))
    return err.at(label) if label else err
