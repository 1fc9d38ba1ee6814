"""The block manager's invariants, checked (tests and debugging; never on the hot path)."""

from __future__ import annotations

from kvq.cache.host_tier import host_pool_of
from kvq.cache.window import POOLS, block_state


def check_block_manager(bm) -> None:
    """Raise AssertionError naming the first broken invariant of ``bm`` (a BlockManager).

    Both pools are internally consistent; every block's refcount equals the
    number of table entries that reference it; each table has one entry per
    logical block, in the pool :func:`block_state` dictates (at
    ``num_settled`` for blocks starting before it, else at the length); a
    block holding a hash holds exactly that sequence's tokens and hash.
    """
    for a in bm._alloc.values():
        a.check_integrity()
    if bm.arena is not None:
        bm.arena.check_integrity()
    refs = {p: [0] * a.num_blocks for p, a in bm._alloc.items()}
    q_pools = set(bm._alloc) - {"hp"}
    bs = bm.block_size
    for sid, seq in bm._seqs.items():
        n = len(seq.tokens)
        if len(seq.table) != -(-n // bs):
            raise AssertionError(f"seq {sid!r}: {len(seq.table)} blocks for {n} tokens")
        if not (0 <= seq.num_settled <= n and 0 <= seq.num_computed <= n):
            raise AssertionError(f"seq {sid!r}: num_settled/num_computed outside [0, {n}]")
        if any(r.pool not in q_pools for r in seq.table[bm.policy.sink_blocks:seq.seal_from]):
            raise AssertionError(f"seq {sid!r}: an hp block below seal_from={seq.seal_from}")
        load = bm._loading.get(sid)
        loaded = range(load.request.hit.start, load.request.hit.end) if load is not None else range(0)
        for i, ref in enumerate(seq.table):
            refs[ref.pool][ref.block_id] += 1
            at = seq.num_settled if i * bs < seq.num_settled else n
            if ("q" if ref.pool in q_pools else ref.pool) != block_state(i, at, bm.policy):
                raise AssertionError(f"seq {sid!r}: block {i} is in {ref.pool}, rule says "
                                     f"{block_state(i, at, bm.policy)} at n={at}")
            if ref.pool not in ("q", "hp") and (i < bm.policy.sink_blocks or
                                                (i + 1) * bs > seq.num_computed and i not in loaded):
                raise AssertionError(f"seq {sid!r}: block {i} is in {ref.pool} but is a sink or not computed "
                                     "(nor loaded as stored from the CPU prefix tier)")
            stored = bm._alloc[ref.pool].block_tokens(ref.block_id)
            if stored is not None and stored != tuple(bm._block_tokens(seq.tokens, i)):
                raise AssertionError(f"seq {sid!r}: block {i} ({ref}) holds other tokens")
            if stored is not None and i < len(seq.hashes) and \
                    bm._alloc[ref.pool].block_hash(ref.block_id) != seq.hashes[i]:
                raise AssertionError(f"seq {sid!r}: block {i} ({ref}) holds another hash")
    for op in bm._stores.values():  # a store holds its device blocks until it ends
        for r in op.requests:
            refs[r.pool][r.device_block] += 1
    for blocks in bm._quarantine.values():
        for ref in blocks:
            refs[ref.pool][ref.block_id] += 1
    if bm._quarantine.keys() - bm._loads.keys():
        raise AssertionError("quarantined blocks of a load that is not outstanding")
    for ticket, blocks in bm._remote_quarantine.items():
        if ticket not in bm._remote:
            raise AssertionError("quarantined blocks of a remote fill that is not outstanding")
        for ref in blocks:
            refs[ref.pool][ref.block_id] += 1
    for sid, op in bm._remote_of.items():
        if sid not in bm._seqs or bm._remote.get(op.ticket) is not op:
            raise AssertionError(f"seq {sid!r} waits for a remote fill that is not outstanding")
        if tuple(bm._seqs[sid].table) != op.table or bm._seqs[sid].num_computed:
            raise AssertionError(f"seq {sid!r}: its table or progress disagrees with its remote fill")
    for sid, op in bm._loading.items():
        if sid not in bm._seqs or bm._loads.get(op.request.ticket) is not op:
            raise AssertionError(f"seq {sid!r} waits for a load that is not outstanding")
        seq = bm._seqs[sid]
        hit = op.request.hit
        if seq.num_computed != hit.start * bs or [(r.pool, r.block_id) for r in seq.table[hit.start:hit.end]] != \
                [(b.pool, d) for b, d in zip(hit.blocks, op.request.device_blocks)]:
            raise AssertionError(f"seq {sid!r}: its table or progress disagrees with its load")
    if bm.host_tier is not None:
        bm.host_tier.check_integrity()
    host_refs = {p: [0] * bm._host[p].num_blocks for p in POOLS}
    for sid, seq in bm._swapped.items():
        if sid in bm._seqs:
            raise AssertionError(f"seq {sid!r} is both on the device and swapped")
        for ref in seq.table:
            host_refs[host_pool_of(ref.pool)][ref.block_id] += 1  # a lower tier in a host q block
    for pool, counts in host_refs.items():
        bm._host[pool].check_integrity()
        for bid, c in enumerate(counts):
            if bm._host[pool].refcount(bid) != c:
                raise AssertionError(f"host {pool} block {bid}: refcount {bm._host[pool].refcount(bid)} "
                                     f"but {c} swapped table references")
    for pool, counts in refs.items():
        for bid, c in enumerate(counts):
            rc = bm._alloc[pool].refcount(bid)
            if rc != c:
                raise AssertionError(f"{pool} block {bid}: refcount {rc} but {c} table references")
