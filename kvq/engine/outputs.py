"""What the engine hands back per request and step (vLLM's shapes: a RequestOutput holding CompletionOutputs)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


class TokenIds(Sequence):
    """The first ``n`` entries of a list that only grows: an unfinished request's output token ids as
    of one step, without copying them.  ``engine.step()`` hands back an output per running request
    and step, so copying (list(...)) would cost O(length) per request per step -- at 512 requests
    and 2K tokens each, a million ints a step and garbage-collector pauses that outlasted the GPU's
    step (docs/engine.md).  The engine only appends to the list, so the view never changes.  It reads
    like a list (len, indexing, slices, iteration, == with a list or tuple); ``list(v)`` copies it.
    A finished request's output holds a real list."""

    __slots__ = ("_ids", "_n")

    def __init__(self, ids: list[int], n: int):
        self._ids, self._n = ids, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            return self._ids[start:stop] if step == 1 else self._ids[:self._n][i]
        n = self._n
        if not -n <= i < n:
            raise IndexError("token index out of range")
        return self._ids[i % n]

    def __iter__(self):
        return itertools.islice(self._ids, self._n)

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, TokenIds)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._ids[:self._n])


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int] | TokenIds  # TokenIds (a view) while the request runs, a list once finished
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[dict] | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: tuple[int, ...]  # shared by every output of the request (not copied per step)
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # the request failed (a KV transfer without fallback): finish_reason "abort"
    kv_transfer: object | None = None  # what a KV connector carries for the request (a prefill engine's export)
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first, then
    # {"token_id", "logprob", "top": [(id, logprob), ...k]} (kvq.engine.prompt_logprobs); else None
    prompt_logprobs: list[dict | None] | None = None
