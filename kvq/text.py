"""Real natural-language text for fixtures and evaluation, with nothing downloaded.

The source is the prose of the Python language reference that CPython ships in
``pydoc_data.topics`` (what ``help("assert")`` prints).  Every CPython install
has it, under the PSF license.  Indented blocks (code, grammar), tables and
heading underlines are dropped, so what is left is English paragraphs.

The output is deterministic for a given CPython version; the module's text
differs slightly between Python releases, so fixtures record which one they
were built with (:data:`TEXT_SOURCE`).
"""

from __future__ import annotations

import re
import sys

TEXT_SOURCE = (
    f"Python {sys.version_info.major}.{sys.version_info.minor} language reference prose "
    f"(pydoc_data.topics, PSF license), indented code/grammar blocks dropped"
)

_UNDERLINE = re.compile(r"^\s*([*=\-~^+#])\1{2,}\s*$")  # "*****", "=====" under headings


def _prose(topic_text: str) -> str:
    """One topic's text without indented blocks, heading underlines or blank runs."""
    kept: list[str] = []
    for line in topic_text.splitlines():
        line = line.rstrip()
        if line.startswith(("   ", "+-", "+=", "|")) or _UNDERLINE.match(line):  # code, grammar, tables
            continue
        if not line and (not kept or not kept[-1]):
            continue  # collapse runs of blank lines (and drop leading ones)
        kept.append(line)
    while kept and not kept[-1]:
        kept.pop()
    return "\n".join(kept)


def reference_text(min_chars: int | None = None) -> str:
    """The prose of every topic in sorted-key order, paragraphs separated by blank lines.

    With ``min_chars``, whole topics are appended only until the text is at least
    that long (a ValueError if all of them together are shorter).
    """
    from pydoc_data.topics import topics  # stdlib; imported lazily (0.5 MB of text)

    parts: list[str] = []
    length = 0
    for key in sorted(topics):
        prose = _prose(topics[key])
        if not prose:
            continue
        parts.append(prose)
        length += len(prose) + 2
        if min_chars is not None and length >= min_chars:
            break
    text = "\n\n".join(parts)
    if min_chars is not None and len(text) < min_chars:
        raise ValueError(f"the reference text has only {len(text)} characters, fewer than min_chars={min_chars}")
    return text
