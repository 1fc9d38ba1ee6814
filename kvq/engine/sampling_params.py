"""Per-request sampling and stopping parameters (vLLM's names and meanings).

A frozen value object: validated once when built, then read by the scheduler
(``max_tokens``, ``stop_token_ids``, ``ignore_eos``), the sampler
(``temperature``, ``top_p``, ``top_k``, ``seed``, ``logprobs``), the engine's
detokenizer (``stop`` strings) and its prompt scoring (``prompt_logprobs``). Pure Python: no torch here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvq.engine.errors import RequestError

GREEDY_EPS = 1e-5  # temperature below this samples greedily (vLLM's _SAMPLING_EPS; kvq.engine.sampler agrees)
MAX_LOGPROBS = 20  # most top logprobs a request may ask for


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    max_tokens      output tokens to generate at most (>= 1); reaching it finishes with "length".  A request
                    that only scores its prompt (OpenAI echo, max_tokens 0) asks for 1 and drops the token
    temperature     finite, >= 0; below ``GREEDY_EPS`` the sampler takes the argmax (see :attr:`greedy`)
    top_p           nucleus mass in (0, 1]; 1 disables it
    top_k           keep the k most likely tokens; 0 or -1 disables it
    seed            per-request generator seed, or None for the engine's shared generator
    stop            strings that end the output when they appear in the detokenized text
                    (the engine checks them); a str or any iterable of str is accepted
    stop_token_ids  token ids that end the output (the scheduler checks them); the id is kept
                    in the output and reported as ``Sequence.stop_reason``
    ignore_eos      keep generating past the model's EOS token
    logprobs        number of top logprobs to return per output token, in [0, 20], or None
    prompt_logprobs number of top logprobs to return per prompt token, in [0, 20], or None (off):
                    the logprob of each prompt token given those before it (None for the first),
                    in ``RequestOutput.prompt_logprobs`` (kvq.engine.prompt_logprobs); such a
                    request never reuses cached prefix blocks, so every position is computed
    n               parallel samples per prompt; only 1 is supported
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        # Normalise containers first (frozen: through object.__setattr__), then validate.
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        elif stop is None:
            stop = ()
        elif isinstance(stop, Iterable):
            stop = tuple(stop)
        else:
            raise RequestError(f"stop must be a str or a list of str, got {type(stop).__name__}", "stop")
        object.__setattr__(self, "stop", stop)
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif _is_int(ids):
            ids = (ids,)
        elif isinstance(ids, Iterable) and not isinstance(ids, (str, bytes)):
            ids = tuple(ids)
        else:
            raise RequestError(f"stop_token_ids must be a list of ints, got {type(ids).__name__}", "stop_token_ids")
        object.__setattr__(self, "stop_token_ids", ids)
        self._validate()

    def _validate(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}", "max_tokens")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature < math.inf:  # rejects NaN and infinity too
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise RequestError(f"top_k must be an int >= -1 (0 or -1 disable it), got {self.top_k!r}", "top_k")
        if self.seed is not None and not _is_int(self.seed):
            raise RequestError(f"seed must be an int or None, got {self.seed!r}", "seed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop strings must be non-empty str, got {s!r}", "stop")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise RequestError(f"stop_token_ids must be ints >= 0, got {t!r}", "stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
                               "logprobs")
        k = self.prompt_logprobs
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
            raise RequestError(f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {k!r}",
                               "prompt_logprobs")
        if self.n != 1:
            raise RequestError(f"n={self.n!r} is not supported; valid values: 1", "n")

    @property
    def greedy(self) -> bool:
        """True when the sampler takes the argmax: temperature 0 (or below ``GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS
