"""A swap copy that failed (kvq.connectors.swap): the scheduler recomputes its request instead of failing
the step (issue 45's chaos-soak fault)."""

from __future__ import annotations

from dataclasses import replace

from kvq.cache.block_manager import BlockRef, SwapOp
from kvq.engine.scheduling import SchedulerOutput
from kvq.engine.sequence import SeqStatus


class SwapFailuresMixin:
    """``swap_failed`` of :class:`~kvq.engine.scheduler.Scheduler`."""

    def swap_failed(self, ops, output: SchedulerOutput) -> SchedulerOutput:
        """Swap copies of ``output``'s step failed (kvq.connectors.swap): their sequences lost their KV and
        are recomputed instead, wherever the step left them: swapped (out, or in and out again: the host
        copy is lost), or running (in: the device blocks hold nothing; its item leaves the step).  ->
        the output to run instead of ``output`` (for the forward and :meth:`update`): without those items,
        and without ops (they ran: call it after them, before the forward; ``ops`` may be empty)."""
        bm, gone = self.block_manager, set()
        lost = {op.seq_id for op in ops if op.direction == "in"}
        # device blocks a failed swap-in should have filled, and those a swap-out of the same sequence read
        # back in the step (seals of them included): whatever prefix index holds them must forget them
        bm.forget_blocks(BlockRef(pool, d) for op in ops if op.direction == "in"
                         for pool, pairs in op.pools() for _, d in pairs)
        bm.forget_blocks(BlockRef(pool, d) for op in output.ops
                         if isinstance(op, SwapOp) and op.direction == "out" and op.seq_id in lost
                         for pool, pairs in op.pools() for d, _ in pairs)
        for sid in dict.fromkeys(op.seq_id for op in ops):
            seq = self._seqs.get(sid)
            if seq is None:  # finished meanwhile
                continue
            self.num_swap_failures += 1
            if seq.status is SeqStatus.SWAPPED:
                bm.free(sid)  # its host blocks
                self._swapped.remove(seq)
                del self._swapped_from[sid]
                seq.status = SeqStatus.WAITING
                seq.num_computed_tokens = seq.num_scheduled_tokens = 0
                self._insort(self._waiting, seq)
                self._released.append(sid)
            elif seq.is_running:
                item = next((x for x in output.scheduled if x.seq_id == sid), None)
                if item is not None:
                    gone.add(sid)
                    seq.num_pending -= item.sample  # taken for this step, which will not run it
                self._requeue(seq, drop=True)
        kept = tuple(x for x in output.scheduled if x.seq_id not in gone)
        new = replace(output, scheduled=kept, num_batched_tokens=sum(x.num_new_tokens for x in kept), ops=())
        i = next((i for i, (out, _) in enumerate(self._inflight) if out is output), None)
        if i is not None:
            if kept:
                self._inflight[i] = (new, {k: v for k, v in self._inflight[i][1].items() if k not in gone})
            else:
                del self._inflight[i]
        return new
