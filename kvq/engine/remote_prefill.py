"""The engine's two hooks for prefill/decode disaggregation (tensor-free contracts).

A *decode* engine hands each request's prompt to a peer that prefills it: the
scheduler admits the request as LOADING with its whole prompt reserved
(:class:`~kvq.cache.block_manager.RemoteLoadOp`), the engine passes the op to its
:class:`RemotePrefill` (``start``), and every step collects ended fills
(``poll``) into :meth:`Scheduler.remote_done`: the prompt is computed, the
peer's first token is the first output, decoding continues here.

A *prefill* engine runs requests marked for export with ``max_tokens=1``; in the
step that samples a request's first token, after its forward and before its
blocks are freed, the engine hands the sequence's block table to its
:class:`KVExporter`, whose result (where the receiver's bytes wait to be read)
rides on that request's :class:`~kvq.engine.llm_engine.RequestOutput`.

:mod:`kvq.transfer.peer` implements both over HTTP + NIXL.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

from kvq.cache.block_manager import BlockRef, RemoteLoadOp
from kvq.engine.sampling_params import SamplingParams

#: Why a fill failed (the ``reason`` label of ``kvq_kv_transfer_failed_total``).
FAILURE_REASONS = ("peer_unreachable", "peer_error", "transfer_error", "timeout", "checksum",
                   "bad_reply", "aborted")


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
    """A decode engine's source of prefilled KV.  Driven from the engine thread only."""

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


class KVExporter(abc.ABC):
    """A prefill engine's sink for finished prompts' KV.  Called on the engine thread."""

    @abc.abstractmethod
    def export(self, request_id: int, pool, table: Sequence[BlockRef], num_tokens: int, tag) -> object:
        """Copy (cast) the first ``num_tokens`` tokens that ``table`` holds in ``pool`` to wherever
        the receiver ``tag`` (what the request was added with) reads them; the blocks are freed right
        after this returns.  -> an object carried on the request's output (an exception object when
        the export failed: the request still finishes)."""
