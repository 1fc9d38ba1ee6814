"""A prefill engine's export of prompts' KV as a KV connector (kvq.engine.connector).

A request added with a ``kv_transfer`` (where its KV goes: a receiver's tag) runs with
``max_tokens=1``; in the step that samples its first token, after its forward and before its blocks
are freed, the connector hands the sequence's block table to its :class:`KVExporter`, whose result
(where the receiver's bytes wait to be read, or the exception that stopped it) rides on that
request's :class:`~kvq.engine.outputs.RequestOutput` as ``kv_transfer``.

:class:`~kvq.transfer.peer.PrefillExporter` implements :class:`KVExporter` over NIXL staging
blocks; ``kvq calibrate`` implements one that keeps the K and V it reads.
"""

from __future__ import annotations

import abc
import logging
from typing import Sequence

from kvq.cache.block_manager import BlockRef
from kvq.engine.connector import ConnectorContext, KVConnector

logger = logging.getLogger("kvq")


class KVExporter(abc.ABC):
    """A prefill engine's sink for finished prompts' KV.  Called on the engine thread."""

    @abc.abstractmethod
    def export(self, request_id: int, pool, table: Sequence[BlockRef], num_tokens: int, tag) -> object:
        """Copy (cast) the first ``num_tokens`` tokens that ``table`` holds in ``pool`` to wherever
        the receiver ``tag`` (what the request was added with) reads them; the blocks are freed right
        after this returns.  -> an object carried on the request's output (an exception object when
        the export failed: the request still finishes)."""


class KVExportConnector(KVConnector):
    """A prefill engine's connector to its :class:`KVExporter` (module docstring)."""

    name = "kv_export"

    def __init__(self, ctx: ConnectorContext, exporter: KVExporter):
        self.block_manager, self.pool, self.exporter = ctx.block_manager, ctx.pool, exporter
        self.tags: dict[int, object] = {}  # request id -> receiver tag, until the request ends

    def add_request(self, seq, kv_transfer) -> bool:
        if kv_transfer is None:
            return False
        if seq.params.max_tokens != 1:
            raise ValueError("an exported request is prefill only: max_tokens must be 1")
        self.tags[seq.seq_id] = kv_transfer
        return True

    def sampled(self, seqs) -> dict[int, object]:
        return {seq.seq_id: self._export(seq, self.tags[seq.seq_id]) for seq in seqs if seq.seq_id in self.tags}

    def _export(self, seq, tag) -> object:
        sid = seq.seq_id
        try:
            return self.exporter.export(sid, self.pool, self.block_manager.block_table(sid), seq.num_tokens, tag)
        except Exception as e:  # noqa: BLE001 - the request reports it; the engine goes on
            logger.warning("kvq: exporting the KV of request %d failed: %s: %s", sid, type(e).__name__, e)
            return e

    def request_finished(self, seq_id: int) -> None:
        self.tags.pop(seq_id, None)

    def issue(self, ops) -> None:
        """Nothing to issue: the export copies inside :meth:`sampled`, on the engine thread."""
