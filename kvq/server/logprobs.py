"""OpenAI logprobs objects from the engine's per-token entries.

The engine gives, per token, ``{"token_id", "logprob", "top": [(id, logprob), ...]}``
(``None`` for a prompt's first token, which has nothing before it).  Two shapes go
out:

* ``/v1/completions`` (the legacy shape, which lm-evaluation-harness reads):
  ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one item per
  token; ``top_logprobs`` maps each alternative's text to its logprob (the sampled
  token among them, as OpenAI does), and ``text_offset`` is each token's character
  offset in the choice's text (prompt first when ``echo`` is on).
* ``/v1/chat/completions``: ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.

A token's text is its own decoding (``tokenizer.decode([id])``), so the texts of a
choice's tokens concatenate to its text except where a character spans tokens.
"""

from __future__ import annotations

import math


def token_text(tokenizer, token_id: int) -> str:
    """A token's own text; ``token_id:N`` (vLLM's spelling) for a model without a tokenizer."""
    return f"token_id:{token_id}" if tokenizer is None else tokenizer.decode([token_id])


def _finite(x: float | None) -> float | None:
    """JSON has no -inf: a logprob that underflowed is sent as the most negative float."""
    if x is None or math.isfinite(x):
        return x
    return -3.4028234663852886e38 if x < 0 else x


def completion_logprobs(entries: list[dict | None], tokenizer, offset: int = 0) -> dict:
    """The completions ``logprobs`` object of ``entries``; ``offset``: the first token's text offset."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        if e is None:  # a prompt's first token: text only
            continue
        text = token_text(tokenizer, e["token_id"])
        tokens.append(text)
        lps.append(_finite(e["logprob"]))
        top = {token_text(tokenizer, i): _finite(lp) for i, lp in e.get("top") or ()}
        if top:
            top.setdefault(text, _finite(e["logprob"]))
        tops.append(top or None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(prompt_ids: list[int], entries: list[dict | None], tokenizer) -> dict:
    """Completions ``logprobs`` of an echoed prompt: every prompt token (the first with a null
    logprob, as OpenAI and vLLM send it), then nothing else; join with :func:`merge`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for tid, e in zip(prompt_ids, entries):
        text = token_text(tokenizer, tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if e is None else _finite(e["logprob"]))
        top = None if e is None else {token_text(tokenizer, i): _finite(lp) for i, lp in e.get("top") or ()}
        out["top_logprobs"].append(top or None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def merge(a: dict, b: dict) -> dict:
    """Completions logprobs of ``a``'s tokens followed by ``b``'s (offsets of ``b`` already shifted)."""
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(entries: list[dict], tokenizer, top_k: int) -> dict:
    """The chat ``logprobs`` object of output ``entries``, ``top_k`` alternatives each."""
    def item(tid: int, lp: float) -> dict:
        text = token_text(tokenizer, tid)
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}

    content = []
    for e in entries:
        c = item(e["token_id"], e["logprob"])
        c["top_logprobs"] = [item(i, lp) for i, lp in (e.get("top") or ())[:top_k]]
        content.append(c)
    return {"content": content}
