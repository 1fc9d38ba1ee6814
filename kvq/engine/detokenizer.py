"""Incremental detokenization and stop strings.

Decoding a request's whole output every step costs O(length) per step, so
O(length^2) per request.  :class:`IncrementalDetokenizer` decodes a bounded
window instead (the scheme of HF's streamers and vLLM): the text of tokens
``[prefix, read)`` is already emitted; decoding ``[prefix, end)`` and taking
what follows the ``[prefix, read)`` text gives the new characters.  A
window ending in an incomplete UTF-8 sequence (U+FFFD) waits for the next
token.  Both decodes start at the same token, so a tokenizer's handling of a
leading space cancels, and the concatenated deltas equal one decode of the
whole output.

Stop strings are searched only where a new match can be: the new text and the
``len(stop) - 1`` characters before it.  As before this module existed, the
first stop string in the request's list that occurs wins, and the text is cut
where it starts, so a cut can remove up to ``len(stop) - 1`` characters of
text already returned: a client that streams holds those back until they
cannot begin a stop string (the server does, kvq.server.protocol).
"""

from __future__ import annotations

from typing import Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.stop_hit: str | None = None  # the stop string that cut the text
        self._prefix = 0  # tokens [prefix, read) are decoded and emitted
        self._read = 0
        self._look_back = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: Sequence[int]) -> str:
        """Append tokens; return the text they completed (maybe ''); after a stop-string cut,
        what remains of it (the cut may also shorten earlier text, see the module docstring)."""
        if self.stop_hit is not None:
            return ""
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self._prefix:self._read])
        window = self._decode(self.ids[self._prefix:])
        if len(window) < len(before) or window.endswith("\ufffd"):
            return ""  # a character still incomplete: wait for more tokens
        # complete (maybe empty: skipped special tokens): emit and move the window on, so its
        # length stays bounded whatever the tokens are
        delta = window[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        start = max(0, len(self.text) - self._look_back)
        self.text += delta
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx >= 0:
                emitted = len(self.text) - len(delta)
                self.text = self.text[:idx]
                self.stop_hit = s
                return self.text[emitted:] if idx > emitted else ""
        return delta
