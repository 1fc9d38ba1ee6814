"""A decode engine's prefill peer as a KV connector (kvq.engine.connector): every request's prompt is
prefilled elsewhere and its KV lands in blocks reserved here.

The scheduler side: the connector ``loads_prompts``, so the scheduler admits each request as LOADING
with its whole prompt reserved (:class:`~kvq.cache.block_manager.RemoteLoadOp`, in the step's
``remote_ops``).  The worker side: before the step's forward the connector hands each op to its
transport (a :class:`RemotePrefill`, ``start``); every step it collects the ended fills (``poll``)
into :meth:`Scheduler.remote_done <kvq.engine.scheduler_loads.LoadsMixin.remote_done>`: the prompt
is computed, the peer's first token is the first output (a :class:`ConnectorOutput`), decoding
continues here.  A failed fill is prefilled here (``fallback``) or fails its request.

:class:`~kvq.transfer.peer.PrefillClient` implements :class:`RemotePrefill` over HTTP + NIXL; a
second transport implements the same three methods.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import Sequence

from kvq.cache.block_manager import RemoteLoadOp
from kvq.engine.connector import ConnectorContext, ConnectorOutput, KVConnector
from kvq.engine.sampling_params import SamplingParams

logger = logging.getLogger("kvq")

#: Why a fill failed (the ``reason`` label of ``kvq_kv_transfer_failed_total``).
FAILURE_REASONS = ("peer_unreachable", "peer_error", "transfer_error", "timeout", "checksum",
                   "bad_reply", "aborted")
#: The connector's counters before any fill (a server's ``/status`` "fills").
FILL_STATS = {"filled": 0, "failed": 0, "discarded": 0, "bytes": 0, "seconds": 0.0}
#: How long an engine with nothing but fills to wait for waits for one, per step (not spinning).
IDLE_WAIT_S = 0.005


@dataclass(frozen=True)
class RemoteResult:
    """One ended fill: ``first_token`` on success (every block holds the peer's bytes, checked),
    else ``None`` with ``reason`` (one of :data:`FAILURE_REASONS`) and ``error`` (for the user).
    ``logprobs``: the first token's logprobs row when the request asked for them."""

    op: RemoteLoadOp
    first_token: int | None
    reason: str | None = None
    error: str | None = None
    logprobs: dict | None = None
    nbytes: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if (self.first_token is None) != (self.reason is not None):
            raise ValueError("a RemoteResult has a first token or a failure reason, not both")
        if self.reason is not None and self.reason not in FAILURE_REASONS:
            raise ValueError(f"unknown failure reason {self.reason!r}; valid: {', '.join(FAILURE_REASONS)}")


class RemotePrefill(abc.ABC):
    """The transport of a decode engine's prefilled KV.  Driven from the engine thread only."""

    #: on a failed fill, prefill the request here (True) or fail it (False)
    fallback: bool = True

    @abc.abstractmethod
    def start(self, op: RemoteLoadOp, token_ids: Sequence[int], params: SamplingParams) -> None:
        """Begin filling ``op``'s blocks with the KV of ``token_ids``; must not block on the peer."""

    @abc.abstractmethod
    def poll(self, timeout: float = 0.0) -> list[RemoteResult]:
        """Fills that ended since the last call (waiting up to ``timeout`` s for the first one).
        A fill is reported only once nothing writes its blocks any more."""

    @abc.abstractmethod
    def num_pending(self) -> int:
        """Fills started and not yet reported by :meth:`poll`."""


class RemotePrefillConnector(KVConnector):
    """A decode engine's connector to its prefill peer (module docstring); ``peer``: the transport."""

    name = "remote_prefill"
    loads_prompts = True

    def __init__(self, ctx: ConnectorContext, peer: RemotePrefill):
        self.scheduler, self.peer = ctx.scheduler, peer
        self.counters = dict(FILL_STATS)

    def before_forward(self, sched) -> None:
        self.issue(sched.remote_ops)

    def issue(self, ops) -> None:
        for op in ops:
            seq = self.scheduler.get(op.seq_id)
            self.peer.start(op, seq.prompt_ids, seq.params)

    def poll(self, wait: bool = False) -> list[ConnectorOutput]:
        """Hand ended fills to the scheduler -> the requests whose first token arrived (or that
        failed without fallback)."""
        out = []
        for r in self.peer.poll(IDLE_WAIT_S if wait else 0.0):
            o = self._result(r)
            if o is not None:
                out.append(o)
        return out

    def _result(self, r: RemoteResult) -> ConnectorOutput | None:
        st = self.counters
        seq = self.scheduler.remote_done(r.op, r.first_token, fallback=self.peer.fallback)
        if seq is None:  # the request was aborted or preempted while the fill ran
            st["discarded"] += 1
            return None
        if r.first_token is None:
            st["failed"] += 1
            logger.warning("kvq: KV transfer for request %d failed (%s): %s; %s", seq.seq_id, r.reason, r.error,
                           "prefilling it here" if not seq.is_finished else "the request fails")
            if not seq.is_finished:
                return None
            return ConnectorOutput(seq, error=f"KV transfer from the prefill peer failed ({r.reason}): {r.error}")
        st["filled"] += 1
        st["bytes"] += r.nbytes
        st["seconds"] += r.seconds
        return ConnectorOutput(seq, logprobs=r.logprobs)

    def has_pending(self) -> bool:
        """Fills in flight (one of an aborted request still holds its blocks until it ends)."""
        return self.peer.num_pending() > 0

    def stats(self) -> dict:
        """Fills filled, failed and discarded, their bytes and seconds."""
        return dict(self.counters)
