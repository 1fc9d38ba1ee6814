"""The CPU prefix tier as a KV connector (kvq.engine.connector): full, computed device blocks are
stored into host memory when their request ends, and a later prompt that shares their prefix loads them
back instead of computing them (docs/offload.md).  The block manager and the scheduler decide (the
scheduler side); this connector issues each store and load on the host pool's copy stream after the
step's forward, polls their ends without a host sync and reports each to the scheduler."""

from __future__ import annotations

import logging
import time

from kvq.cache.block_manager import HostStoreOp
from kvq.engine.connector import ConnectorContext, KVConnector

logger = logging.getLogger("kvq")

#: Counters kept by the connector (the tier keeps its own: :meth:`CPUPrefixTierConnector.stats`).
HOST_STAT_KEYS = ("stored_blocks", "stored_bytes", "store_seconds", "reloaded_blocks", "reloaded_bytes",
                  "reload_seconds", "store_failed", "load_failed", "reloads_discarded")


def offload_stats(counters: dict, scheduler, block_manager) -> dict:
    """The tier's counters as the server reports them: the connector's, the scheduler's (load
    timeouts and failures, requests loaded) and the tier's own (hits, evictions, ...), summed over
    its two pools."""
    out = dict(counters)
    s = scheduler
    out.update(load_timeouts=s.num_load_timeouts, loads_abandoned_for_failure=s.num_load_failures,
               requests_loaded=s.num_host_loads)
    tier = block_manager.host_tier
    for key in ("hits", "misses", "evictions", "replaced", "rejected", "stores", "store_failures"):
        out[f"tier_{key}"] = sum(getattr(tier.stats(p), key) for p in ("q", "hp")) if tier else 0
    for key in ("num_loadable", "num_used"):
        out[f"tier_{key}_blocks"] = sum(getattr(tier.stats(p), key) for p in ("q", "hp")) if tier else 0
    return out


class CPUPrefixTierConnector(KVConnector):
    """The CPU prefix tier (module docstring) over ``ctx``'s pool and host pool: idle without a host
    pool (the block manager then decides no copies)."""

    name = "cpu_prefix_tier"

    def __init__(self, ctx: ConnectorContext):
        self.scheduler, self.block_manager = ctx.scheduler, ctx.block_manager
        self.pool, self.host_pool = ctx.pool, ctx.host_pool
        self.inflight: list[tuple] = []  # (op, handle, issue time) of the copies in flight
        self.counters = dict.fromkeys(HOST_STAT_KEYS, 0)

    def after_forward(self, sched) -> None:
        self.issue(sched.host_ops)  # on the copy stream, after this step's forward

    def end_step(self) -> None:
        self.issue(self.scheduler.take_host_ops())  # the finished requests' blocks, stored now
        self.poll_copies()  # (on the CPU they are done: their device blocks are free again now)

    def issue(self, ops) -> None:
        """Start the tier's stores and loads on the host pool's copy stream; their ends are polled."""
        for op in ops:
            store = isinstance(op, HostStoreOp)
            copy = self.host_pool.store if store else self.host_pool.load
            try:
                handle = copy(self.pool, op.pairs("q"), op.pairs("hp"), op.tier_pairs())
            except Exception:  # nothing lost: a store's blocks stay on the device, a load's prompt is computed
                logger.exception("kvq: a CPU prefix tier %s of %d blocks failed", "store" if store else "load",
                                 op.num_blocks)
                self.host_pool.synchronize()  # whatever it queued has finished before its blocks are reused
                self.counters["store_failed" if store else "load_failed"] += 1
                self.scheduler.host_copy_done(op, ok=False)
                continue
            self.inflight.append((op, handle, time.perf_counter()))

    def has_pending(self) -> bool:
        """Stores in flight, or decided while no step ran (an abort of the last running request):
        the engine keeps stepping until they are issued and done, so their device blocks come back.
        Loads are not pending work here: their sequences wait in the scheduler, which times them out."""
        return self.block_manager.num_host_ops_queued > 0 or any(isinstance(op, HostStoreOp)
                                                                 for op, _, _ in self.inflight)

    def poll(self, wait: bool = False) -> list:
        if wait:  # only for stores: a load that hangs must reach the scheduler's timeout, not block here
            for op, handle, _ in self.inflight:
                if isinstance(op, HostStoreOp):
                    handle.synchronize()
        self.poll_copies()
        return []  # a loaded prefix is computed by a later step like any other

    def poll_copies(self, wait: bool = False) -> int:
        """Report the tier's copies that have completed (all of them, waiting, with ``wait``) to the
        scheduler; -> how many are still in flight.  Every step polls first (no host sync)."""
        if not self.inflight:  # the common case, twice a step: nothing to look at
            return 0
        left = []
        now = time.perf_counter()
        for op, handle, t0 in self.inflight:
            if wait:
                handle.synchronize()
            elif not handle.done():
                left.append((op, handle, t0))
                continue
            n = self.counters
            if not self.scheduler.host_copy_done(op):  # a load that ended after its request gave up on it
                n["reloads_discarded"] += 1
                continue
            kind = "stored" if isinstance(op, HostStoreOp) else "reloaded"
            n[f"{kind}_blocks"] += op.num_blocks
            hp = len(op.pairs("hp"))  # a lower tier's block takes a host q block, like a resident one
            q = op.num_blocks - hp
            n[f"{kind}_bytes"] += q * self.host_pool.bytes_per_q_block + hp * self.host_pool.bytes_per_hp_block
            n["store_seconds" if kind == "stored" else "reload_seconds"] += now - t0
        self.inflight = left
        return len(left)

    def stats(self) -> dict:
        """Counters of the CPU prefix tier: blocks and bytes stored and reloaded, seconds from issue
        to observed completion, failures, timeouts, and the tier's own counters (:func:`offload_stats`)."""
        return offload_stats(self.counters, self.scheduler, self.block_manager)
