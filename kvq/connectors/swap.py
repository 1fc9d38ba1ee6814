"""Request-level swap's copies as a KV connector (kvq.engine.connector): the worker side only.

The scheduler preempts a sequence into the block manager's host tier (``swap_out``) and brings it
back (``swap_in``); each returns a :class:`~kvq.cache.block_types.SwapOp` among the step's cache ops,
which every worker's runner runs in order before the forward (:func:`kvq.cache.step.apply_ops`),
handing each run of swap ops to this connector.  It copies them on the host pool's copy stream and
makes the compute stream wait for them (no host sync): a block swapped out is copied before a later
op or write of the step reuses it, one swapped in is there before it is read.  Nothing stays in
flight, so there is nothing to poll.  A copy that fails fails its sequence only: the engine takes
the failed ops (:meth:`SwapConnector.take_failed`) before the forward and the scheduler recomputes
those sequences (a swap-in's step leaves them out).
"""

from __future__ import annotations

import logging

from kvq.engine.connector import ConnectorContext, KVConnector

log = logging.getLogger("kvq")


class SwapConnector(KVConnector):
    """Swap's copies between ``ctx``'s device pool and host pool (module docstring)."""

    name = "swap"

    def __init__(self, ctx: ConnectorContext):
        if ctx.host_pool is None:
            raise ValueError("the swap connector needs a host pool (preemption_mode='swap' needs cpu_offload_gb)")
        self.pool, self.host_pool = ctx.pool, ctx.host_pool
        self.counters = {"swapped_out_blocks": 0, "swapped_in_blocks": 0, "failed_copies": 0}
        self._failed: list = []

    def issue(self, ops) -> None:
        """Copy each op's blocks; an op whose copy fails is kept for :meth:`take_failed` (its sequence is
        recomputed: kvq.engine.scheduler.Scheduler.swap_failed) and the others go on."""
        for op in ops:
            copy = self.host_pool.store if op.direction == "out" else self.host_pool.load
            try:
                copy(self.pool, op.q, op.hp, op.tiers).wait()
            except RuntimeError as e:  # an injected fault (kvq.cache.host_faults) or a failed copy
                log.warning("swap-%s copy of request %s failed (%s): it is recomputed", op.direction, op.seq_id, e)
                self.counters["failed_copies"] += 1
                self._failed.append(op)
                continue
            self.counters[f"swapped_{op.direction}_blocks"] += op.num_blocks

    def take_failed(self) -> list:
        """The swap ops whose copy failed since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def stats(self) -> dict:
        """Blocks copied out to the host and back in, and copies that failed."""
        return dict(self.counters)
