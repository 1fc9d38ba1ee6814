"""Blocks filled from outside the device, for :class:`~kvq.cache.block_manager.BlockManager`: a
prefill peer's fill of a whole prompt (:class:`RemoteLoadOp`) and the CPU prefix tier's stores and
loads (:class:`HostStoreOp`, :class:`HostLoadOp`), each issued by the caller and reported back."""

from __future__ import annotations

from collections.abc import Sequence

from kvq.cache.block_allocator import NoFreeBlocksError
from kvq.cache.block_types import BlockRef, HostOp, HostStoreOp, RemoteLoadOp, SeqBlocks, SeqId
from kvq.cache.window import block_state


class LoadsMixin:
    """Remote fills and CPU-prefix-tier copies (state set up by BlockManager.__init__)."""

    # -- remote fills (prefill on a peer server) ----------------------------------------------
    def can_allocate_remote(self, num_tokens: int) -> bool:
        """Whether :meth:`allocate_remote` of ``num_tokens`` tokens would succeed now."""
        return self.can_allocate(num_tokens)

    def allocate_remote(self, seq_id: SeqId, token_ids: Sequence[int]) -> RemoteLoadOp:
        """Reserve a whole prompt's blocks for a fill from a peer (:class:`RemoteLoadOp`): no prefix
        hit (the peer sends every block, laid out as this side's rule lays out ``len(token_ids)``
        tokens), ``num_computed`` 0 until :meth:`remote_done` reports the fill complete."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence id {seq_id!r} already has blocks")
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("a prompt needs at least one token")
        plan = self._plan_prompt(token_ids, use_cache=False)
        if not plan.ok:
            raise NoFreeBlocksError(f"prompt of {len(token_ids)} tokens for {seq_id!r} does not fit: "
                                    f"q free {self.num_free_blocks('q')}, hp free {self.num_free_blocks('hp')}")
        n, table = len(token_ids), []
        for i in range(-(-n // self.block_size)):
            pool = block_state(i, n, self.policy)
            table.append(BlockRef(pool, self._alloc[pool].allocate()))
        self._seqs[seq_id] = SeqBlocks(token_ids, table, 0, [], self.policy.sink_blocks)
        op = RemoteLoadOp(seq_id, self._next_remote, tuple(table), n)
        self._next_remote += 1
        self._remote[op.ticket] = self._remote_of[seq_id] = op
        return op

    def remote_state(self, seq_id: SeqId) -> str | None:
        """"loading" while the sequence waits for its remote fill, else None."""
        self._seq(seq_id)
        return "loading" if seq_id in self._remote_of else None

    def remote_done(self, op: RemoteLoadOp, ok: bool) -> bool:
        """A remote fill has ended (``ok``: every block holds the peer's bytes, checked; else it failed
        or was cancelled, and nothing writes its blocks any more).  -> True when its sequence still
        waits for it: with ``ok`` its prompt is computed now (full blocks join the prefix cache);
        without, the caller frees or retries it.  False for a fill whose sequence was freed
        meanwhile: its blocks are released now."""
        if self._remote.get(op.ticket) is not op:
            raise ValueError(f"{op!r} is not an outstanding remote fill")
        del self._remote[op.ticket]
        for ref in self._remote_quarantine.pop(op.ticket, ()):
            self._alloc[ref.pool].free(ref.block_id)
        if self._remote_of.get(op.seq_id) is not op:
            return False
        del self._remote_of[op.seq_id]
        if ok:
            seq = self._seqs[op.seq_id]
            seq.num_computed = op.num_tokens
            self._register_computed(seq)
        return True

    # -- the CPU prefix tier ----------------------------------------------------------------
    @property
    def num_host_ops_queued(self) -> int:
        """Stores and loads decided but not yet taken by :meth:`take_host_ops`."""
        return len(self._host_ops)

    def take_host_ops(self) -> list[HostOp]:
        """Stores and loads of the CPU prefix tier decided since the last call, to issue (in any
        order, after the step's ops) and then report with :meth:`host_copy_done`."""
        ops, self._host_ops = self._host_ops, []
        return ops

    def load_state(self, seq_id: SeqId) -> str | None:
        """"loading" while the sequence's host load is outstanding, "failed" once it failed (free
        the sequence and compute it again), None when it has no load left (it may run)."""
        self._seq(seq_id)
        if seq_id in self._loading:
            return "loading"
        return "failed" if seq_id in self._failed_loads else None

    def abandon_load(self, seq_id: SeqId) -> None:
        """Give up waiting for a sequence's load (a timeout): the tier unpins its host blocks and the
        sequence is freed, its destination blocks kept out of use until the copy reports its end."""
        op = self._loading.get(seq_id)
        if op is None:
            raise ValueError(f"sequence {seq_id!r} has no outstanding load")
        self.host_tier.load_timed_out(op.request)
        self._unpinned.add(op.request.ticket)
        self.free(seq_id)

    def host_copy_done(self, op: HostOp, ok: bool = True) -> bool:
        """A store or load has ended (its copy completed, or ``ok=False``: it failed or was never
        issued; a failed copy must not still be running).  Stores: the host copies become loadable
        (or are dropped) and the device blocks are released.  Loads: the sequence's prefix is
        computed (or the sequence is marked failed: :meth:`load_state`).  -> False for a load whose
        sequence no longer waits for it (timed out, freed): its bytes went unused."""
        if isinstance(op, HostStoreOp):
            if self._stores.get(op.requests[0].ticket) is not op:
                raise ValueError(f"{op!r} is not an outstanding store")
            del self._stores[op.requests[0].ticket]
            for r in op.requests:
                (self.host_tier.store_done if ok else self.host_tier.store_failed)(r)
                self._alloc[r.pool].free(r.device_block)
            return True
        ticket = op.request.ticket
        if self._loads.get(ticket) is not op:
            raise ValueError(f"{op!r} is not an outstanding load")
        del self._loads[ticket]
        if ticket in self._unpinned:
            self._unpinned.discard(ticket)
        else:
            (self.host_tier.load_done if ok else self.host_tier.load_failed)(op.request)
        for ref in self._quarantine.pop(ticket, ()):
            self._alloc[ref.pool].free(ref.block_id)
        if self._loading.get(op.seq_id) is not op:
            return False  # the sequence was freed meanwhile
        del self._loading[op.seq_id]
        if not ok:
            self._failed_loads.add(op.seq_id)
            return False
        seq = self._seqs[op.seq_id]
        seq.num_computed = max(seq.num_computed, op.request.hit.end * self.block_size)
        self._register_computed(seq)
        return True

    def _offer(self, seq: SeqBlocks, held: set[BlockRef]) -> None:
        """Offer a freed sequence's registered full blocks to the CPU prefix tier (one store op)."""
        reqs = []
        for i in range(seq.num_registered):
            ref = seq.table[i]
            if ref in held:  # a lower tier's block is kept as stored, tagged with its tier
                continue
            r = self.host_tier.offer(ref.pool, seq.hashes[i], self._block_tokens(seq.tokens, i), ref.block_id)
            if r is not None:
                self._alloc[ref.pool].incref(ref.block_id)  # held until the copy has read it
                reqs.append(r)
        if reqs:
            op = self._stores[reqs[0].ticket] = HostStoreOp(tuple(reqs))
            self._host_ops.append(op)
