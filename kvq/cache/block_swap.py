"""Request-level swap for :class:`~kvq.cache.block_manager.BlockManager`: a preempted sequence's
blocks move to the host tier and back (:class:`SwapOp`, run by the caller)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from kvq.cache.block_allocator import NoFreeBlocksError
from kvq.cache.block_types import BlockRef, SeqBlocks, SeqId, SwapOp
from kvq.cache.host_tier import host_pool_of
from kvq.cache.window import POOLS


class SwapMixin:
    """Swap out / in (state set up by BlockManager.__init__)."""

    # -- swap (request-level, to the host tier) ---------------------------------------------
    @staticmethod
    def _count(table: Sequence[BlockRef]) -> dict[str, int]:
        """Blocks of each host pool the table takes (a lower tier's block takes a host q block)."""
        need = {"q": 0, "hp": 0}
        for ref in table:
            need[host_pool_of(ref.pool)] += 1
        return need

    def _host_of(self, pool: str):
        """The host allocator that holds blocks of device pool ``pool`` (every q pool's: the host q pool)."""
        return self._host[host_pool_of(pool)]

    def can_swap_out(self, seq_id: SeqId) -> bool:
        """Whether the host tier has a block for every block of the sequence (its budget)."""
        table = self._seq(seq_id).table
        if seq_id in self._loading:  # its prefix is not on the device yet
            return False
        need = self._count(table)
        return all(need[p] <= self._host[p].num_free for p in POOLS)

    def swap_out(self, seq_id: SeqId) -> SwapOp:
        """Park a sequence in the host tier: host blocks are taken for each of its blocks (the
        budget is checked first: :class:`NoFreeBlocksError` with nothing changed), the returned op
        copies them, and only then are its device blocks released (computed full blocks stay in
        the prefix cache).  The op must run before the step's forward, like every op (module
        docstring): a released block may be reused by a later call of the same step.  Its tokens,
        lazy-sealing state and hashes stay as they were."""
        seq = self._seq(seq_id)
        if not self.can_swap_out(seq_id):
            need = self._count(seq.table)
            raise NoFreeBlocksError(f"cannot swap {seq_id!r} out: needs {need['q']} q and {need['hp']} hp host "
                                    f"blocks, {self._host['q'].num_free} and {self._host['hp'].num_free} free")
        self._register_computed(seq)
        del self._seqs[seq_id]
        self._swapped[seq_id] = seq
        return self._move(seq_id, seq, self._alloc.__getitem__, self._host_of, "out")

    def _move(self, seq_id: SeqId, seq: SeqBlocks, src, dst, direction: str) -> SwapOp:
        """Give every block of ``seq`` a block of the same pool on the other side (``src`` / ``dst``: a
        device or host pool name -> its allocator), release the ``src`` ones (tail first) and return the
        copy between them.  The table keeps each block's pool, so a swapped-in block returns to its tier."""
        pairs: dict[str, list[tuple[int, int]]] = {"q": [], "hp": []}
        table = []
        with self._tentative():
            try:
                for ref in seq.table:
                    b = dst(ref.pool).allocate()
                    pairs.setdefault(ref.pool, []).append((ref.block_id, b))
                    table.append(BlockRef(ref.pool, b))
            except NoFreeBlocksError:  # all or nothing: give back what was taken, the source stays as it was
                for ref in reversed(table):
                    dst(ref.pool).free(ref.block_id)
                raise
        for ref in reversed(seq.table):
            src(ref.pool).free(ref.block_id)
            if direction == "out" and self.arena is not None and ref.pool != "hp":  # the op reads it this step
                self.arena.touch(self._alloc[ref.pool].slab_of(ref.block_id))
        seq.table = table
        tiers = tuple((p, tuple(pairs[p])) for p in self.pools[2:] if pairs.get(p))
        return SwapOp(seq_id, direction, tuple(pairs["q"]), tuple(pairs["hp"]), tiers)

    def can_swap_in(self, seq_id: SeqId) -> bool:
        """Whether the device pools have a private block for every block of a swapped sequence
        (prefix-cache hits are not reused: it may need more blocks than it released).  A tiered
        arena's tiers share its slabs: the check takes the blocks and gives them back, which may
        evict cached blocks and return slabs to the arena's reserve, so a True may not hold for a
        later call: :meth:`swap_in` does not ask it, it takes the blocks all or nothing."""
        seq = self._swapped[seq_id]
        need: dict[str, int] = {}
        for ref in seq.table:
            need[ref.pool] = need.get(ref.pool, 0) + 1
        if self.arena is None or set(need) <= {"hp"}:
            return all(n <= self._alloc[p].num_free for p, n in need.items())
        if need.get("hp", 0) > self._alloc["hp"].num_free:
            return False
        taken: list[tuple[str, int]] = []
        with self.arena.tentative(keep=False):  # a trial: undone whatever it finds
            try:
                for p, n in need.items():
                    if p != "hp":
                        for _ in range(n):
                            taken.append((p, self._alloc[p].allocate()))
                return True
            except NoFreeBlocksError:
                return False
            finally:
                for p, b in reversed(taken):
                    self._alloc[p].free(b)

    def swap_in(self, seq_id: SeqId) -> SwapOp:
        """Bring a swapped sequence back into fresh device blocks (whole table, so a mirror
        rebuilds it) and release its host blocks; the op copies host -> device first.  All or
        nothing: where the device pools cannot hold every block, :class:`NoFreeBlocksError` and the
        sequence stays swapped (a tiered arena may have evicted cached blocks on the way)."""
        if seq_id not in self._swapped:
            raise KeyError(f"sequence {seq_id!r} is not swapped")
        seq = self._swapped[seq_id]
        need = self._count(seq.table)
        if need["hp"] > self._alloc["hp"].num_free or (self.arena is None and need["q"] > self._alloc["q"].num_free):
            self._cannot_swap_in(seq_id, need)
        try:
            op = self._move(seq_id, seq, self._host_of, self._alloc.__getitem__, "in")
        except NoFreeBlocksError:
            self._cannot_swap_in(seq_id, need)
        del self._swapped[seq_id]
        seq.changed = seq.num_registered = 0
        self._seqs[seq_id] = seq
        self._landing.add(seq)  # registered for prefix reuse from the next step on, once the copy has run
        return op

    def _cannot_swap_in(self, seq_id: SeqId, need: dict[str, int]) -> NoReturn:
        raise NoFreeBlocksError(f"cannot swap {seq_id!r} in: needs {need['q']} q (any tier) and {need['hp']} hp "
                                f"blocks, {self.num_free_blocks('q')} and {self.num_free_blocks('hp')} free")

    def drop(self, seq_id: SeqId) -> None:
        """Free a sequence whose device blocks hold no valid KV (a swap-in whose copy failed): its own
        blocks leave the prefix index (one sealed or demoted from them in the step holds none either),
        and nothing of it is registered again or offered to the CPU tier."""
        seq = self._seq(seq_id)
        self.forget_blocks(r for r in seq.table if self._alloc[r.pool].refcount(r.block_id) == 1)
        seq.num_computed = seq.num_registered = 0
        self.free(seq_id)

    def forget_blocks(self, refs) -> None:
        """Take device blocks out of the prefix index, used or cached (their content was lost)."""
        for ref in refs:
            self._alloc[ref.pool].forget(ref.block_id)
