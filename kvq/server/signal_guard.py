"""Keeping kvq's SIGINT/SIGTERM handlers in place while the server runs.

Python installs a handler with ``sigaction``; a native library loaded later (a transfer backend's
transport layer, say) can install its own for the same signal with another ``sigaction`` call, and
Python is never told: ``signal.getsignal`` still names kvq's handler while the process would die of
the signal (exit status -15) without a drain.  :class:`SignalGuard` reads the handler the kernel
holds (``sigaction`` through ctypes, Linux and macOS), remembers it once Python has installed kvq's,
and :meth:`SignalGuard.check` (kvq.server.launch calls it on every uvicorn tick, 10 times a second,
on the main thread) installs kvq's again where it changed, naming the signal in one warning.

Where the handler cannot be read (another OS, no C library), the guard does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import signal

log = logging.getLogger("uvicorn.error")
# struct sigaction begins with the handler's address on Linux (glibc, musl) and macOS; the rest
# (mask, flags) is larger on Linux than on macOS: 256 bytes hold either
_SIGACTION_BYTES = 256


def _libc():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        return lib
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def os_handler(sig: int) -> int | None:
    """The address of the handler the kernel holds for ``sig`` (0 = default, 1 = ignore), or None
    where it cannot be read."""
    if _LIBC is None:
        return None
    buf = ctypes.create_string_buffer(_SIGACTION_BYTES)
    if _LIBC.sigaction(sig, None, buf) != 0:
        return None
    return ctypes.c_void_p.from_buffer(buf).value or 0


class SignalGuard:
    """Re-installs ``handler`` for ``signals`` whenever the kernel's handler is no longer the one
    Python installed for it (module docstring).  Main thread only (``signal.signal``)."""

    def __init__(self, handler, signals=(signal.SIGINT, signal.SIGTERM)):
        self.handler = handler
        self.expected = {sig: os_handler(sig) for sig in signals}  # after Python installed ``handler``
        self.restored: dict[int, int] = {}  # signal -> times it was put back

    def check(self) -> list[int]:
        """Put kvq's handler back wherever it was replaced; -> the signals put back now."""
        fixed = []
        for sig, want in self.expected.items():
            now = os_handler(sig)
            if want is None or now is None or now == want:
                continue
            signal.signal(sig, self.handler)
            self.expected[sig] = os_handler(sig)
            self.restored[sig] = self.restored.get(sig, 0) + 1
            fixed.append(sig)
            if self.restored[sig] == 1:
                log.warning("a library replaced kvq's %s handler (a native one, not Python's): put back, so %s "
                            "still drains the server", signal.Signals(sig).name, signal.Signals(sig).name)
        return fixed
