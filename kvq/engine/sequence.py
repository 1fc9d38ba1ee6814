"""One request's tokens, progress and timings, as the scheduler sees them.

Life cycle (the scheduler moves it; nothing else should set ``status``)::

    WAITING --admit--> PREFILL --last prompt chunk sampled--> DECODE --stop--> FINISHED
       ^                  |                                      |
       +----preempt-------+--------------------------------------+      (abort: any state -> FINISHED)
                          |                                      |
                          +--swap out--> SWAPPED <--swap out------+
                                            |
                          resume (before admissions) back to the state it left

SWAPPED (``preemption_mode="swap"``): its KV waits in the block manager's host
tier with every counter kept; it resumes before any new admission.

LOADING (the CPU prefix tier): admitted with a prefix hit that the device no
longer holds but host memory does; its blocks are reserved and the hit's blocks
copy in from the host while other sequences run.  When the copy has completed
it becomes PREFILL and computes the rest of its prompt; when the copy fails or
times out it goes back to WAITING and computes the whole prompt::

    WAITING --admit, hit in host memory--> LOADING --copy done--> PREFILL
       ^                                      |
       +------copy failed or timed out--------+

Token accounting. ``prompt_token_ids`` never changes; sampled tokens go to
``output_token_ids``. ``num_computed_tokens`` counts the leading tokens of
``all_token_ids`` whose KV is in the cache. The work left for a running
sequence is always ``all_token_ids[num_computed_tokens:]``:

* PREFILL: the rest of the effective prompt (``num_computed_tokens < num_tokens``);
* DECODE: exactly the last sampled token (``num_computed_tokens == num_tokens - 1``).

The scheduler runs ahead of the results under asynchronous scheduling (a step
is scheduled while the previous one still runs): ``num_scheduled_tokens``
counts the tokens whose KV is computed or being computed (``>=
num_computed_tokens``), and ``num_pending`` the sampled tokens not yet known
(a step that samples this sequence is in flight).  The sequence's tokens
*as scheduled* are ``num_tokens + num_pending``; a pending token's id reaches
the forward on the device, from the previous step's sampler.

Preemption by recompute drops the KV (``num_computed_tokens = 0``) and keeps
every token; on re-admission the *effective prompt* is ``all_token_ids``
(prompt + outputs so far), whose prefill ends by sampling the next output, so a
preempted request produces the same tokens it would have without preemption.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence as _Seq
from typing import Literal

from kvq.engine.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # no KV in the cache; queued for (re-)admission
    PREFILL = "prefill"  # blocks for the effective prompt reserved; prompt partially computed
    DECODE = "decode"  # prompt computed; one new token per step
    FINISHED = "finished"  # blocks released; finish_reason says why
    SWAPPED = "swapped"  # KV parked in the host tier (request-level swap); state kept
    LOADING = "loading"  # admitted; blocks reserved; its prefix loads from the CPU prefix tier first


class Sequence:
    """A request: its tokens, scheduling state and per-token timings.

    Times are whatever clock the caller uses (``time.monotonic`` by default);
    only differences between them mean anything.
    """

    def __init__(self, seq_id: int, prompt_token_ids: _Seq[int], params: SamplingParams | None = None,
                 arrival_time: float | None = None):
        self.seq_id = seq_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.prompt_ids: tuple[int, ...] = tuple(self.prompt_token_ids)  # the same, shared with every output
        self.output_token_ids: list[int] = []
        self.params = params if params is not None else SamplingParams()
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0  # computed or in flight
        self.num_pending = 0  # sampled tokens of in-flight steps, not yet appended
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []  # one wall time per output token, when it was appended
        self._itls: list[float] = []  # gaps between consecutive token_times
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that matched
        self.num_preemptions = 0

    # -- tokens -----------------------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs (a new list): the effective prompt after a preemption."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (a decode reads one)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def is_running(self) -> bool:
        """Holds blocks in the cache: PREFILL, DECODE or LOADING."""
        return self.status in (SeqStatus.PREFILL, SeqStatus.DECODE, SeqStatus.LOADING)

    def append_token(self, token_id: int, now: float) -> None:
        """Record a sampled token and when it arrived."""
        self.output_token_ids.append(token_id)
        if self.token_times:
            self._itls.append(now - self.token_times[-1])
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now

    # -- timings ----------------------------------------------------------------------------
    def ttft(self) -> float | None:
        """Time to first token (from arrival), or None before it."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def itls(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive output tokens (kept as tokens
        arrive; the list itself is returned, so callers must not modify it)."""
        return self._itls

    def tpot(self) -> float | None:
        """Mean time per output token after the first, or None with fewer than two tokens."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) >= 2 else None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"finish={self.finish_reason!r})")
