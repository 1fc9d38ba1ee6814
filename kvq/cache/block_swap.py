"""Request-level swap for :class:`~kvq.cache.block_manager.BlockManager`: a preempted sequence's
blocks move to the host tier and back (:class:`SwapOp`, run by the caller)."""

from __future__ import annotations

from collections.abc import Sequence

from kvq.cache.block_allocator import NoFreeBlocksError
from kvq.cache.block_types import BlockRef, SeqBlocks, SeqId, SwapOp
from kvq.cache.window import POOLS


class SwapMixin:
    """Swap out / in (state set up by BlockManager.__init__)."""

    # -- swap (request-level, to the host tier) ---------------------------------------------
    @staticmethod
    def _count(table: Sequence[BlockRef]) -> dict[str, int]:
        need = {"q": 0, "hp": 0}
        for ref in table:
            need[ref.pool] += 1
        return need

    def can_swap_out(self, seq_id: SeqId) -> bool:
        """Whether the host tier has a block for every block of the sequence (its budget)."""
        table = self._seq(seq_id).table
        if seq_id in self._loading:  # its prefix is not on the device yet
            return False
        if any(r.pool not in POOLS for r in table):  # a lower tier's block: the host tier holds none (yet)
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
        return self._move(seq_id, seq, self._alloc, self._host, "out")

    def _move(self, seq_id: SeqId, seq: SeqBlocks, src: dict, dst: dict, direction: str) -> SwapOp:
        """Give every block of ``seq`` a block of the same pool in ``dst`` (device or host allocators),
        release the ``src`` ones (tail first) and return the copy between them."""
        pairs: dict[str, list[tuple[int, int]]] = {"q": [], "hp": []}
        table = []
        for ref in seq.table:
            b = dst[ref.pool].allocate()
            pairs[ref.pool].append((ref.block_id, b))
            table.append(BlockRef(ref.pool, b))
        for ref in reversed(seq.table):
            src[ref.pool].free(ref.block_id)
        seq.table = table
        return SwapOp(seq_id, direction, tuple(pairs["q"]), tuple(pairs["hp"]))

    def can_swap_in(self, seq_id: SeqId) -> bool:
        """Whether the device pools have a private block for every block of a swapped sequence
        (prefix-cache hits are not reused: it may need more blocks than it released)."""
        seq = self._swapped[seq_id]
        need = self._count(seq.table)
        return all(need[p] <= self._alloc[p].num_free for p in POOLS)

    def swap_in(self, seq_id: SeqId) -> SwapOp:
        """Bring a swapped sequence back into fresh device blocks (whole table, so a mirror
        rebuilds it) and release its host blocks; the op copies host -> device first."""
        if seq_id not in self._swapped:
            raise KeyError(f"sequence {seq_id!r} is not swapped")
        if not self.can_swap_in(seq_id):
            need = self._count(self._swapped[seq_id].table)
            raise NoFreeBlocksError(f"cannot swap {seq_id!r} in: needs {need['q']} q and {need['hp']} hp blocks, "
                                    f"{self.num_free_blocks('q')} and {self.num_free_blocks('hp')} free")
        seq = self._swapped.pop(seq_id)
        op = self._move(seq_id, seq, self._host, self._alloc, "in")
        seq.changed = seq.num_registered = 0
        self._seqs[seq_id] = seq
        self._landing.add(seq)  # registered for prefix reuse from the next step on, once the copy has run
        return op

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
