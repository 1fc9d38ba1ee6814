"""One byte arena for the blocks of every tier (elastic precision, :mod:`kvq.cache.tiers`).

The arena is cut into *slabs* of equal bytes.  A slab belongs to at most one tier at a time
and holds ``per_slab[t]`` blocks of it; a tier takes a free slab when its own are full and
gives a slab back as soon as none of its blocks is in use or cached, so demoting blocks to a
smaller tier frees memory that any tier can use (e.g. five 8-bit blocks of fp8_e4m3 in the
bytes of eight int4_kivi blocks).  Tensor-free: :class:`ArenaLayout` says where a tier's
block lies (kvq.cache.pool views each tier's planes over one tensor per layer), the
allocators hand out ids.

Layout.  Tier ``t``'s block ``b`` of layer ``l`` starts at byte ``b * stride(t, l)``: slab
``b // per_slab[t]`` holds it, and ``per_slab[t] * stride(t, l)`` is the slab's bytes in
layer ``l`` for every tier, so each tier sees its planes as ordinary block-indexed tensors
whose block stride is its padded block bytes.  Inside a block the planes of K, then V, lie
one after the other, each at a multiple of :data:`ALIGN` bytes.

Allocation (:class:`TierAllocator`, a :class:`~kvq.cache.block_allocator.BlockAllocator` with
the same contract per tier) takes, in order: a free block of a slab the tier holds (the
fullest slab first, so the others can empty), a free slab of the arena (never the last
``reserve_slabs`` unless the caller demotes: demotion needs room to start), the tier's own
least recently used cached block, and last a slab of another tier that holds only cached
blocks (evicted).  ``num_free`` counts exactly what that order can give.

Bytes a tier did not write.  A block's rows past its sequence's end are never written, and kernels
read whole rows of 16 or 32 tokens, masking the scores of those past the end: a masked row's value
still enters the sum as 0 x value, which is NaN where the stale bytes decode to NaN or infinity.  In a
slab another tier wrote they may (an int4_kivi byte read as fp8_e4m3: 0x7f and 0xff are NaN; a code
word read as an f16 scale).  So a slab handed to a tier other than the one whose bytes it holds is
*wiped* (zeroed) first: :meth:`Arena.take_wipes` lists them for the engine, which zeroes them
before anything of the step reads or writes the cache (``WipeOp``, kvq.cache.step.apply_ops).  For
that order to be safe nothing of the step may touch the slab's old bytes: a slab the step reads or
writes (a demotion's or a swap-out's source freed from it, :meth:`Arena.touch`; a block handed out
or hit in it, :meth:`Arena.hand`: an op or the forward writes or reads it, even if its sequence is
preempted later in the step) and that leaves its tier or becomes idle in the step goes to another
tier only from the next step on.  Blocks freed by requests that ended or were preempted are read by
nothing of the step, so their slabs go at once.  (A fresh arena is zeros; a slab returning to the
tier that wrote it keeps that tier's bytes, whose stale rows are codes of real K/V, finite.)
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

from kvq.cache.block_allocator import BlockAllocator, NoFreeBlocksError

#: Byte alignment of every plane and block stride in the arena (16: vector loads, any dtype).
ALIGN = 16
#: Most blocks of the resident tier per slab, and the largest share of a slab a tier may leave
#: unused before a larger slab is preferred (:func:`plan_arena`).
MAX_PER_SLAB = 16
MAX_WASTE = 1 / 16


def _up(x: int, a: int) -> int:
    return -(-x // a) * a


def plane_offsets(fmt, num_kv_heads: int, head_dim: int, block_size: int) -> tuple[list[tuple[str, object, int]], int]:
    """``([(role, plane, byte offset)], block bytes)``: a :class:`~kvq.formats.spec.KVFormat`'s
    planes inside one arena block, K's then V's, each aligned to :data:`ALIGN`."""
    out, off = [], 0
    for role, tf in (("k", fmt.k), ("v", fmt.v)):
        for plane in tf.planes(num_kv_heads, head_dim, block_size):
            out.append((role, plane, off))
            off += _up(plane.nbytes, ALIGN)
    return out, off


@dataclass(frozen=True)
class ArenaLayout:
    """How slabs hold each tier's blocks (module docstring)."""

    per_slab: tuple[int, ...]  # blocks of tier t in one slab
    slab_bytes: tuple[int, ...]  # bytes of one slab in each layer
    block_bytes: tuple[tuple[int, ...], ...]  # [tier][layer]: a block's aligned bytes

    def stride(self, tier: int, layer: int) -> int:
        """Bytes from one block of ``tier`` to the next in ``layer``."""
        return self.slab_bytes[layer] // self.per_slab[tier]

    @property
    def bytes_per_slab(self) -> int:
        """One slab across all layers."""
        return sum(self.slab_bytes)

    def waste(self, tier: int) -> float:
        """Share of a slab of ``tier`` that holds no block (padding and the rest after the last block)."""
        return 1 - self.per_slab[tier] * sum(self.block_bytes[tier]) / self.bytes_per_slab

    def slabs_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_slab


def _layout(per: Sequence[int], B: Sequence[Sequence[int]], align: int) -> ArenaLayout:
    """The layout of ``per[t]`` blocks of tier ``t`` a slab over aligned block bytes ``B[t][l]``."""
    unit = math.lcm(*per) * align
    slab = tuple(_up(max(per[t] * B[t][i] for t in range(len(B))), unit) for i in range(len(B[0])))
    return ArenaLayout(tuple(per), slab, tuple(tuple(row) for row in B))


def _aligned(block_bytes: Sequence[Sequence[int]], align: int) -> list[tuple[int, ...]]:
    B = [tuple(_up(b, align) for b in row) for row in block_bytes]
    if not B or any(len(row) != len(B[0]) for row in B):
        raise ValueError("block_bytes needs one row per tier, one entry per layer")
    return B


def plan_arena(block_bytes: Sequence[Sequence[int]], align: int = ALIGN, max_per_slab: int = MAX_PER_SLAB,
               max_waste: float = MAX_WASTE) -> ArenaLayout:
    """The layout for tiers whose blocks take ``block_bytes[t][l]`` bytes in layer ``l`` (tier 0
    the largest): the fewest resident blocks per slab that leave every tier at most
    ``max_waste`` of a slab unused, else the least wasteful up to ``max_per_slab``."""
    return plan_arena_shared([block_bytes], align, max_per_slab, max_waste)[0]


def plan_arena_shared(pools: Sequence[Sequence[Sequence[int]]], align: int = ALIGN, max_per_slab: int = MAX_PER_SLAB,
                      max_waste: float = MAX_WASTE) -> list[ArenaLayout]:
    """:func:`plan_arena` for several pools that must hold the same blocks per slab (tensor parallel
    ranks: one scheduler's block ids name the same slab on each rank, whose heads differ): the
    fewest resident blocks per slab whose worst waste over every pool and tier is at most
    ``max_waste``, else the least wasteful; -> one layout a pool."""
    Bs = [_aligned(b, align) for b in pools]
    total = [sum(row) for row in Bs[0]]
    best = None
    for n0 in range(1, max_per_slab + 1):
        per = [n0] + [max(1, n0 * total[0] // total[t]) for t in range(1, len(total))]
        layouts = [_layout(per, B, align) for B in Bs]
        worst = max(lay.waste(t) for lay in layouts for t in range(len(per)))
        if best is None or worst < best[0] - 1e-12:
            best = (worst, layouts)
        if worst <= max_waste:
            break
    return best[1]


def arena_layout(plan) -> ArenaLayout:
    """The layout of a :class:`~kvq.cache.plan.CachePlan` with tiers (with the blocks per slab it is
    given, ``plan.arena_per_slab``: a tensor parallel rank's, shared by every rank)."""
    m = plan.model
    B = [[plane_offsets(plan.tier_layers(t)[i], m.num_kv_heads, m.head_dim, plan.block_size)[1]
          for i in range(m.num_layers)] for t in range(plan.num_tiers + 1)]
    if plan.arena_per_slab:
        return _layout(plan.arena_per_slab, _aligned(B, ALIGN), ALIGN)
    return plan_arena(B)


class Arena:
    """The slabs, their owners, and one :class:`TierAllocator` per tier (module docstring)."""

    def __init__(self, per_slab: Sequence[int], num_slabs: int, block_size: int, enable_prefix_caching: bool = True,
                 reserve_slabs: int = 0):
        if not isinstance(num_slabs, int) or num_slabs < 0:
            raise ValueError(f"arena: num_slabs must be an int >= 0, got {num_slabs!r}")
        if not per_slab or any(not isinstance(n, int) or n < 1 for n in per_slab):
            raise ValueError(f"arena: per_slab must be ints >= 1, got {per_slab!r}")
        self.per_slab = tuple(per_slab)
        self.num_slabs = num_slabs
        self.reserve_slabs = max(0, int(reserve_slabs))
        self.owner: list[int | None] = [None] * num_slabs
        self.written: list[int | None] = [None] * num_slabs  # the tier whose bytes a slab holds (None: zeros)
        self._unowned: list[int] = list(range(num_slabs - 1, -1, -1))  # a stack: slab 0 handed out first
        T = len(self.per_slab)
        # the step each slab last left its tier or became idle in: until the next step it goes to its
        # writer's tier only (module docstring); counted by writer (free) and by owner (idle)
        self._step = 0
        self._stamp = [-1] * num_slabs
        self._new_free = [0] * T
        self._new_idle = [0] * T
        # slabs where a demotion freed its source this step: no demotion's destination may land there
        # before the next step (the step's demotions read their sources while they write); the free
        # ones counted by writer
        self._touched: set[int] = set()
        self._touched_free = [0] * T
        self._wipes: list[int] = []  # slabs handed to a tier other than their writer's, to zero
        self._log: list[tuple[int, int | None, int]] | None = None  # (slab, written, stamp) in tentative()
        # slabs where this step handed out a block (ops or the forward write it; a prefix hit is read): with
        # the touched ones, what a release or an idle slab of this step keeps from other tiers until the next
        self._handed: set[int] = set()
        self._log_handed: list[int] = []
        self.tiers = [TierAllocator(self, t, n, block_size, enable_prefix_caching) for t, n in enumerate(per_slab)]

    # -- slabs --------------------------------------------------------------------------------
    @property
    def num_unowned(self) -> int:
        return len(self._unowned)

    @property
    def num_idle(self) -> int:
        """Slabs a tier holds with cached blocks only (any tier may take one, evicting them)."""
        return sum(len(t._idle) for t in self.tiers)

    def slabs_of(self, tier: int) -> int:
        return sum(1 for o in self.owner if o == tier)

    def begin_step(self) -> None:
        """A new step: the slabs this one's demotions freed sources in may take demoted blocks again, and
        those that left a tier in it may go to any tier."""
        self._step += 1
        self._touched.clear()
        self._handed.clear()
        for counts in (self._new_free, self._new_idle, self._touched_free):
            counts[:] = [0] * len(counts)

    def touch(self, slab: int) -> None:
        """A demotion (or a swap-out) freed its source in ``slab``, which the step reads: no demotion's
        destination lands there this step, nor does another tier take it."""
        if slab in self._touched:
            return
        self._count(slab, -1)
        self._touched.add(slab)
        o = self.owner[slab]
        if o is None or slab in self.tiers[o]._idle:  # released or idle already (free before touch)
            self._note(slab)
            self._stamp[slab] = self._step
        self._count(slab, +1)

    def take_wipes(self) -> tuple[int, ...]:
        """The slabs handed to a tier other than their writer's since the last call, to zero before the
        step that takes them reads or writes the cache (module docstring)."""
        out, self._wipes = tuple(dict.fromkeys(self._wipes)), []
        return out

    @contextmanager
    def tentative(self, keep: bool = True):
        """A tentative allocation: blocks taken inside that may all be given back.  Left by an exception
        (after the caller gave everything back), or with ``keep=False`` (a trial), it is undone
        (:meth:`_rollback`); else it stands."""
        assert self._log is None, "arena: a tentative allocation is already open"
        self._log, self._log_handed, mark = [], [], len(self._wipes)
        try:
            yield
        except BaseException:
            self._rollback(mark)
            raise
        if keep:
            self._log = None
        else:
            self._rollback(mark)

    def _rollback(self, mark: int) -> None:
        """Every block taken since :meth:`tentative` began was given back: the slabs it granted hold the
        bytes they held, and those it released or idled were read or written by nothing, so none needs
        a wipe nor waits for the next step because of it (a cached block evicted on the way stays
        evicted)."""
        log, self._log = self._log, None
        slabs = list(dict.fromkeys(s for s, _, _ in log))
        for s in slabs:
            self._count(s, -1)
        for s, w, st in reversed(log):
            self.written[s], self._stamp[s] = w, st
        for s in slabs:
            self._count(s, +1)
        self._handed.difference_update(self._log_handed)
        del self._wipes[mark:]

    def _count(self, s: int, sign: int) -> None:
        """Add (``sign`` 1) or take out (-1) slab ``s``'s share of the step's counters."""
        if self._stamp[s] != self._step:
            return
        o, w = self.owner[s], self.written[s]
        if o is None:
            self._new_free[w] += sign
            if s in self._touched:
                self._touched_free[w] += sign
        elif s in self.tiers[o]._idle:
            self._new_idle[o] += sign

    def hand(self, s: int) -> None:
        """A block of slab ``s`` was handed out (or revived by a prefix hit) in this step."""
        if s not in self._handed:
            self._handed.add(s)
            if self._log is not None:
                self._log_handed.append(s)

    def _read_now(self, s: int) -> bool:
        """Whether the step reads or writes slab ``s``'s bytes (module docstring)."""
        return s in self._touched or s in self._handed

    def _note(self, s: int) -> None:
        if self._log is not None:
            self._log.append((s, self.written[s], self._stamp[s]))

    def grantable(self, reserve_ok: bool, demotion: bool = False, tier: int | None = None) -> int:
        """Free slabs ``tier`` may take now (the reserve only for demotion; not those another tier left
        in this step; a demotion's destination not where the step's demotions freed a source); without
        ``tier`` the free slabs any tier may take by the next step."""
        n = max(0, len(self._unowned) - (0 if reserve_ok else self.reserve_slabs))
        if tier is None:
            return n
        # (counters: a pressure event asks this for each of ~10^3 moves)
        blocked = sum(self._new_free) - self._new_free[tier] + (self._touched_free[tier] if demotion else 0)
        return min(n, len(self._unowned) - blocked) if blocked else n

    def reclaimable(self, tier: int, demotion: bool = False) -> int:
        """Slabs of other tiers that hold only cached blocks (evictable), but for those that became idle
        in this step.  (``demotion``: the same; a slab where a demotion freed its source is one of them.)"""
        return sum(len(t._idle) - self._new_idle[t.tier] for t in self.tiers if t.tier != tier)

    def _free_for(self, s: int, tier: int, demotion: bool) -> bool:
        if self._stamp[s] != self._step:
            return True
        return self.written[s] == tier and not (demotion and s in self._touched)

    def _grant(self, tier: int, reserve_ok: bool, demotion: bool = False) -> int | None:
        if self.grantable(reserve_ok, demotion, tier):
            i = len(self._unowned) - 1
            while not self._free_for(self._unowned[i], tier, demotion):
                i -= 1
            self._count(self._unowned[i], -1)
            s = self._unowned.pop(i)
        else:
            victims = [(t, s) for t in self.tiers if t.tier != tier for s in t._idle if self._stamp[s] != self._step]
            if not victims:
                return None
            s = victims[0][0]._surrender(victims[0][1])
        self.owner[s] = tier
        if self.written[s] not in (None, tier):
            self._wipes.append(s)
        self._note(s)
        self.written[s] = tier
        return s

    def _release(self, slab: int) -> None:
        self.owner[slab] = None
        self._unowned.append(slab)
        self._note(slab)
        if self._read_now(slab):
            self._stamp[slab] = self._step
        self._count(slab, +1)

    def _idle_changed(self, slab: int, tier: int, idle: bool) -> None:
        """Slab ``slab`` of ``tier`` became idle (``idle``) or left idle (in use again, released or
        surrendered)."""
        if idle:
            self._note(slab)
            if self._read_now(slab):
                self._stamp[slab] = self._step
            if self._stamp[slab] == self._step:
                self._new_idle[tier] += 1
        elif self._stamp[slab] == self._step:
            self._new_idle[tier] -= 1

    def check_integrity(self) -> None:
        owned = {s for s, o in enumerate(self.owner) if o is not None}
        if owned & set(self._unowned) or len(owned) + len(self._unowned) != self.num_slabs:
            raise AssertionError("arena: slabs are neither owned nor free, or both")
        if len(set(self._unowned)) != len(self._unowned):
            raise AssertionError("arena: a slab is free twice")
        T, now = len(self.per_slab), self._step
        by = lambda pick: [sum(1 for s in pick if self.written[s] == t) for t in range(T)]  # noqa: E731
        if self._new_free != by([s for s in self._unowned if self._stamp[s] == now]):
            raise AssertionError("arena: the counts of free slabs that left a tier this step are off")
        if self._touched_free != by([s for s in self._touched if self.owner[s] is None]):
            raise AssertionError("arena: the counts of free slabs a demotion freed a source in are off")
        if self._new_idle != [sum(1 for s in t._idle if self._stamp[s] == now) for t in self.tiers]:
            raise AssertionError("arena: the counts of slabs that became idle this step are off")
        if any(o is not None and w != o for o, w in zip(self.owner, self.written)):
            raise AssertionError("arena: a slab holds a tier's blocks but not its bytes (a wipe was missed)")
        for t in self.tiers:
            t.check_integrity()

    def describe(self) -> list[dict]:
        """Per tier: slabs, blocks in use, cached and allocatable."""
        return [{"tier": t.tier, "slabs": self.slabs_of(t.tier), "used": t.num_used, "cached": t.num_cached,
                 "free": t.num_free} for t in self.tiers]


class TierAllocator(BlockAllocator):
    """One tier's blocks in an :class:`Arena`: ids ``0 .. num_slabs * per_slab - 1``, block ``b`` in
    slab ``b // per_slab``; only the blocks of slabs the tier holds exist for it."""

    def __init__(self, arena: Arena, tier: int, per_slab: int, block_size: int, enable_prefix_caching: bool):
        super().__init__(arena.num_slabs * per_slab, block_size, enable_prefix_caching, name=f"tier {tier}")
        self.arena, self.tier, self.per_slab = arena, tier, per_slab
        self._free = []  # unused: free ids live per slab below
        self._slab_free: dict[int, list[int]] = {}  # held slab -> its free ids
        self._used_in = [0] * arena.num_slabs  # used blocks per slab
        self._cached_in = [0] * arena.num_slabs  # cached-free blocks per slab
        # held slabs with a free id, by how many blocks they use (allocation fills the fullest first)
        self._by_used: list[dict[int, None]] = [{} for _ in range(per_slab)]
        self._idle: dict[int, None] = {}  # held slabs with cached blocks only (another tier may reclaim them)
        self._num_free_ids = 0

    # -- counters -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.available(False)

    def available(self, reserve_ok: bool, demotion: bool = False) -> int:
        """Blocks :meth:`allocate` can give now (``reserve_ok``: may use the reserve; ``demotion``: a
        demotion's destination, which avoids the slabs the step's demotions freed sources in)."""
        a = self.arena
        return (self._num_free_ids + len(self._cached)
                + (a.grantable(reserve_ok, demotion, self.tier) + a.reclaimable(self.tier, demotion)) * self.per_slab)

    @property
    def num_slabs(self) -> int:
        return sum(1 for o in self.arena.owner if o == self.tier)

    @property
    def num_free_ids_busy(self) -> int:
        """Free ids in the held slabs that are not idle (no other tier reclaims those): what
        :meth:`allocate` gives before it takes a slab."""
        return sum(len(ids) for s, ids in self._slab_free.items() if s not in self._idle)

    def slab_of(self, block_id: int) -> int:
        return block_id // self.per_slab

    def slab_used(self, slab: int) -> int:
        """Blocks of ``slab`` in use (refcount >= 1)."""
        return self._used_in[slab]

    def is_idle(self, block_id: int) -> bool:
        """Whether the block's slab holds no block in use (another tier may reclaim it)."""
        return self._slab(block_id) in self._idle

    # -- slab bookkeeping ---------------------------------------------------------------------
    def _slab(self, block_id: int) -> int:
        return block_id // self.per_slab

    def _file(self, s: int) -> None:
        """Put held slab ``s`` where its counts say: in the bucket of its use while it has free ids,
        idle while no block of it is in use (another tier may reclaim it), back to the arena empty."""
        for bucket in self._by_used:
            bucket.pop(s, None)
        was_idle = self._idle.pop(s, 0) is None
        used, free = self._used_in[s], len(self._slab_free.get(s, ()))
        if used == 0 and self._cached_in[s] == 0:
            if was_idle:
                self.arena._idle_changed(s, self.tier, False)
            self._num_free_ids -= len(self._slab_free.pop(s, ()))
            self.arena._release(s)
            return
        if free:
            self._by_used[used][s] = None
        if was_idle != (used == 0):
            self.arena._idle_changed(s, self.tier, used == 0)
        if used == 0:
            self._idle[s] = None

    def _take_slab(self, reserve_ok: bool, demotion: bool = False) -> bool:
        s = self.arena._grant(self.tier, reserve_ok, demotion)
        if s is None:
            return False
        ids = list(range((s + 1) * self.per_slab - 1, s * self.per_slab - 1, -1))
        self._slab_free[s] = ids
        self._num_free_ids += len(ids)
        self._by_used[0][s] = None  # empty, about to be used (not released, not idle)
        return True

    def _surrender(self, s: int) -> int:
        """Give idle slab ``s`` back to the arena, evicting its cached blocks; -> the slab."""
        for b in range(s * self.per_slab, (s + 1) * self.per_slab):
            if b in self._cached:
                del self._cached[b]
                self._drop_hash(b)
        self._cached_in[s] = 0
        self._idle.pop(s)
        self.arena._idle_changed(s, self.tier, False)
        for bucket in self._by_used:
            bucket.pop(s, None)
        self._num_free_ids -= len(self._slab_free.pop(s, ()))
        self.arena.owner[s] = None
        return s

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self, reserve_ok: bool = False, demotion: bool = False) -> int:
        """A block with refcount 1 (order: module docstring; ``demotion``: :meth:`available`);
        NoFreeBlocksError when none."""
        bucket = next((b for b in reversed(self._by_used) if b), None)
        if bucket is None and not self.arena.grantable(reserve_ok, demotion, self.tier) and self._cached:
            b = next(iter(self._cached))  # this tier's least recently freed cached block
            del self._cached[b]
            self._drop_hash(b)
            self._cached_in[self._slab(b)] -= 1
            return self._hand_out(b)
        if bucket is None:
            if not self._take_slab(reserve_ok, demotion):
                raise NoFreeBlocksError(f"{self.name}: no free blocks ({self.num_used} in use, "
                                        f"{self.arena.num_unowned} free slabs of {self.arena.num_slabs})")
            bucket = next(b for b in reversed(self._by_used) if b)
        b = self._slab_free[next(iter(bucket))].pop()
        self._num_free_ids -= 1
        return self._hand_out(b)

    def _hand_out(self, b: int) -> int:
        assert self._refcount[b] == 0 and self._hash[b] is None, (self.name, b)
        s = self._slab(b)
        self._refcount[b] = 1
        self._num_used += 1
        self._used_in[s] += 1
        self.arena.hand(s)
        self._file(s)
        return b

    def free(self, block_id: int) -> None:
        self._check_held(block_id)
        rc = self._refcount[block_id]
        if rc == 0:
            raise ValueError(f"{self.name}: double free of block {block_id} (refcount is already 0)")
        self._refcount[block_id] = rc - 1
        if rc > 1:
            return
        s = self._slab(block_id)
        self._num_used -= 1
        self._used_in[s] -= 1
        if self._hash[block_id] is not None:
            self._cached[block_id] = None
            self._cached_in[s] += 1
        else:
            self._slab_free.setdefault(s, []).append(block_id)
            self._num_free_ids += 1
        self._file(s)

    def _freed(self, block_id: int) -> None:
        s = self._slab(block_id)
        self._cached_in[s] -= 1
        self._slab_free.setdefault(s, []).append(block_id)
        self._num_free_ids += 1
        self._file(s)

    def discard(self, block_id: int) -> None:
        """:meth:`free` that forgets the block's hash when it drops the last reference, so the block is
        free at once, not cached (a demoted source: its slab may empty and go back to the arena)."""
        if self._refcount[block_id] == 1:
            self.forget(block_id)
        self.free(block_id)
        self.arena.touch(self._slab(block_id))

    def lookup(self, block_hash: int, token_ids) -> int | None:
        block_id = self.probe(block_hash, token_ids)
        revived = block_id is not None and self._refcount[block_id] == 0
        got = super().lookup(block_hash, token_ids)
        if got is not None:
            self.arena.hand(self._slab(got))  # (the step's forward reads it)
        if revived:
            s = self._slab(got)
            self._cached_in[s] -= 1
            self._used_in[s] += 1
            self._file(s)
        return got

    def incref(self, block_id: int) -> None:
        self._check_held(block_id)
        super().incref(block_id)

    def _check_held(self, block_id: int) -> None:
        self._check_id(block_id)
        if self.arena.owner[self._slab(block_id)] != self.tier:
            raise ValueError(f"{self.name}: block {block_id} lies in a slab this tier does not hold")

    # -- checks -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        def fail(msg: str) -> None:
            raise AssertionError(f"{self.name}: {msg}")

        held = {s for s, o in enumerate(self.arena.owner) if o == self.tier}
        used = {b for b in range(self._num_blocks) if self._refcount[b] > 0}
        cached = set(self._cached)
        free = [b for ids in self._slab_free.values() for b in ids]
        if len(set(free)) != len(free) or len(free) != self._num_free_ids:
            fail("free ids repeat, or their count is off")
        free_set = set(free)
        if free_set & used or free_set & cached or used & cached:
            fail("a block is in two states")
        if any(self._slab(b) not in held for b in used | cached | free_set):
            fail("a block outside the tier's slabs")
        if self._num_used != len(used):
            fail(f"num_used {self._num_used} != {len(used)}")
        for s in held:
            ids = set(range(s * self.per_slab, (s + 1) * self.per_slab))
            u, c, f = len(ids & used), len(ids & cached), len(ids & free_set)
            if u + c + f != self.per_slab:
                fail(f"slab {s}: used {u} + cached {c} + free {f} != {self.per_slab}")
            if (u, c) != (self._used_in[s], self._cached_in[s]):
                fail(f"slab {s}: counters ({self._used_in[s]}, {self._cached_in[s]}) != ({u}, {c})")
            if u == 0 and c == 0:
                fail(f"slab {s} is empty but still held")
            buckets = [i for i, b in enumerate(self._by_used) if s in b]
            if buckets != ([u] if f else []) or (s in self._idle) != (u == 0):
                fail(f"slab {s} is filed wrong (buckets {buckets}, idle {s in self._idle}; used {u}, free {f})")
        for h, b in self._index.items():
            if self._hash[b] != h:
                fail(f"index maps a hash to block {b}, which does not hold it")
        for b in cached:
            if self._hash[b] is None:
                fail(f"cached-free block {b} holds no hash")
        for b in free_set:
            if self._hash[b] is not None:
                fail(f"free block {b} holds a hash")

    def __repr__(self) -> str:
        return (f"TierAllocator({self.tier}, per_slab={self.per_slab}, slabs={self.num_slabs}, "
                f"used={self._num_used}, cached={len(self._cached)}, free_ids={self._num_free_ids})")
