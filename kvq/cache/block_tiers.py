"""Elastic precision for :class:`~kvq.cache.block_manager.BlockManager`: sealed blocks move down the
tiers of a :class:`~kvq.cache.tiers.TierRule` by age (at each append, like seals; the scheduler's
prompt chunks age nothing, so a prompt ages from its first decode on) and under pressure
(:meth:`TiersMixin.make_room`, when the scheduler would preempt or cannot admit).

Each move is a :class:`DemoteOp` (a new block of the lower tier, the table updated at once, the
source released), which the engine runs like a seal: per layer, in the order they were made,
before the step's seals and writes (kvq.cache.step), so a block may move down twice in one step.
Blocks sealed in the current step (:meth:`TiersMixin.begin_step` clears that set) are never
moved, nor shared blocks (a copy per sharer would cost memory instead of saving it), blocks not
yet computed, or protected ones (sinks, the recent window: :func:`~kvq.cache.tiers.protected`).

Pressure works slab by slab (kvq.cache.arena): it evacuates the tier-0 slab whose used blocks
are demotable and coldest (tokens behind their sequence's head, on average), so that whole slabs
return to the arena for any tier; when the tier below has no room, it evacuates that tier's slab
first.  A demotion may use the arena's reserve slabs, which nothing else takes, and pressure goes
on until the reserve is back (evacuated slabs refill it), so that the next time can start.  A
demoted source is freed with its prefix hash forgotten (its demoted copy is indexed instead).
Its scan of the running sequences' blocks (:meth:`TiersMixin._candidates`) is kept for
``RESCAN_STEPS`` steps, every entry checked again when it is used; a scan that runs dry before
then is redone once (blocks sealed since may move).  While pressure keeps coming, the next scan is
made ahead, a slice of the sequences at each of the ``AHEAD_STEPS`` steps before the kept one grows
old (:meth:`TiersMixin.begin_step`), so that no single step pays for a walk of every block (10^5 at
768 requests: 66-80 ms of one step on a 2-core CPU).
"""

from __future__ import annotations

import math

from kvq.cache.block_types import BlockRef, DemoteOp, SeqBlocks, SeqId
from kvq.cache.tiers import age_tier, pool_tier, protected, tier_pool

#: Steps a pressure scan is reused for (:meth:`TiersMixin.make_room`).
RESCAN_STEPS = 64
#: Steps the next scan is spread over, ahead of the kept one's age limit, while pressure lasts.
AHEAD_STEPS = 16


class _Scan:
    """A pressure scan of the running sequences, walked a slice at a time: per tier above the lowest, slab ->
    ``(tokens behind the head, seq id, block)`` of its demotable blocks (:meth:`TiersMixin._walk`)."""

    def __init__(self, sids: list, num_tiers: int, step: int):
        self.sids, self.pos, self.step = sids, 0, step
        self.out: list[dict[int, list[tuple[int, SeqId, int]]]] = [{} for _ in range(num_tiers)]


class TiersMixin:
    """Demotion (state set up by BlockManager.__init__: ``tiers``, ``arena``, ``_fresh``,
    ``num_demotions``)."""

    def begin_step(self) -> None:
        """A new scheduling step: blocks sealed by the previous one may move, and swap-ins' blocks (their
        copies ran) may be registered for prefix reuse."""
        self._fresh.clear()
        self._landing.clear()
        self._step += 1
        if self.arena is not None:
            self.arena.begin_step()
            self._scan_ahead()

    def take_wipes(self) -> tuple[int, ...]:
        """Slabs of the arena to zero before the step runs (:meth:`kvq.cache.arena.Arena.take_wipes`)."""
        return self.arena.take_wipes() if self.arena is not None else ()

    @property
    def num_tiers(self) -> int:
        return 0 if self.tiers is None else self.tiers.num_tiers

    @property
    def pools(self) -> tuple[str, ...]:
        """Every device pool: ``q``, ``hp``, then the lower tiers' (``q1``...)."""
        return ("q", "hp", *(tier_pool(t) for t in range(1, self.num_tiers + 1)))

    def tier_counts(self) -> list[dict]:
        """Per tier: blocks in use, cached and allocatable, the slabs it holds, demotions into it."""
        if self.arena is None:
            return []
        out = self.arena.describe()
        for row in out:
            row["demotions"] = self.num_demotions[row["tier"]]
        return out

    # -- one move ---------------------------------------------------------------------------------
    def _demotable(self, seq: SeqBlocks, i: int) -> bool:
        """Whether block ``i`` of ``seq`` may move down now (module docstring)."""
        ref = seq.table[i]
        t = pool_tier(ref.pool)
        return (t is not None and t < self.tiers.num_tiers and ref not in self._fresh
                and (i + 1) * self.block_size <= seq.num_computed
                and not protected(i, len(seq.tokens), self.tiers)
                and self._alloc[ref.pool].refcount(ref.block_id) == 1)

    def _demote(self, seq_id: SeqId, seq: SeqBlocks, i: int, tier: int, reserve_ok: bool) -> DemoteOp | None:
        """Move block ``i`` of ``seq`` into ``tier``; None (nothing changed) when that tier has no room."""
        pool = tier_pool(tier)
        below = self._alloc[pool]
        if below.available(reserve_ok, demotion=True) == 0:
            return None
        src = seq.table[i]
        new = BlockRef(pool, below.allocate(reserve_ok, demotion=True))
        if i < seq.num_registered:  # a later prompt with this prefix hits the demoted copy, served as stored
            below.register(new.block_id, seq.hashes[i], self._block_tokens(seq.tokens, i))
        seq.table[i] = new
        seq.changed = min(seq.changed, i)
        # the source is free at once, its hash forgotten (the demoted copy serves the prefix now), so that
        # an evacuated slab goes back to the arena whole
        self._alloc[src.pool].discard(src.block_id)
        self.num_demotions[tier] += 1
        return DemoteOp(seq_id, i, src, new)

    # -- age --------------------------------------------------------------------------------------
    def _age(self, seq_id: SeqId, seq: SeqBlocks, n: int) -> list[DemoteOp]:
        """Demotions the age policy asks of ``seq`` at length ``n`` (its blocks settled there), as far
        as the tiers have room without the reserve; what cannot move now is retried at the next append."""
        rule = self.tiers
        if rule is None or not rule.ages:
            return []
        bs, sinks = self.block_size, rule.sink_blocks
        his = [min(max(0, (n - a) // bs), len(seq.table)) for a in rule.ages]
        if not seq.tier_from:
            seq.tier_from = [sinks] * rule.num_tiers
        todo = [t for t in range(rule.num_tiers) if his[t] > seq.tier_from[t]]
        if not todo:
            return []
        ops, stuck = [], None
        for i in range(max(sinks, min(seq.tier_from[t] for t in todo)), his[0]):
            cur = pool_tier(seq.table[i].pool)
            want = age_tier(i, n, rule)
            if cur is None or cur >= want:
                continue
            if self._alloc[seq.table[i].pool].refcount(seq.table[i].block_id) > 1:
                continue  # shared: it stays (a copy per sharer would cost memory)
            op = self._demote(seq_id, seq, i, want, reserve_ok=False) if self._demotable(seq, i) else None
            if op is None:
                stuck = i
                break
            ops.append(op)
        seq.tier_from = [min(h, stuck) if stuck is not None else h for h in his]
        return ops

    def age_due(self) -> list[DemoteOp]:
        """The age policy's demotions due now for every sequence, at its length now.  :meth:`_age` runs
        after an append's allocation, so a sequence whose next append cannot fit may hold blocks already
        due (a prompt in its chunks ages nothing until its first decode); each moved block frees a resident
        one.  The scheduler runs these before pressure or preemption (a prompt short of memory ages then):
        without them an age-only ladder preempted and, through the prefix cache, re-admitted the same prompt
        forever."""
        rule = self.tiers
        if rule is None or not rule.ages:
            return []
        ops: list[DemoteOp] = []
        for sid, seq in self._seqs.items():
            ops += self._age(sid, seq, len(seq.tokens))
        return ops

    # -- pressure ---------------------------------------------------------------------------------
    def make_room(self, need: int, headroom: int | None = None) -> list[DemoteOp]:
        """Demote the coldest sealed blocks of running sequences until the resident tier can give
        ``need`` blocks (``need + headroom`` where the blocks allow, so that the next steps do not come
        back at once: default a slab or 1% of the resident tier's blocks, whichever is more); -> the
        ops (empty without the pressure policy, or when nothing can move)."""
        if self.tiers is None or not self.tiers.pressure or self._alloc["q"].num_free >= need:
            return []
        self._pressed = self._step
        if headroom is None:
            q = self._alloc["q"]
            headroom = max(q.per_slab, q.num_blocks // 100)
        # one scan serves later calls and steps (each entry is checked when it is used) until it runs dry or
        # is RESCAN_STEPS old: at 768 requests a scan reads 10^5 blocks, a step seals about 24 new ones
        if self._cands is None or self._step - self._cands_at >= RESCAN_STEPS:
            self._rescan()
        ops: list[DemoteOp] = []
        arena = self.arena
        # until the step fits, and the arena has its reserve back (the next demotion starts from it)
        while self._alloc["q"].num_free < need + headroom or arena.num_unowned < arena.reserve_slabs:
            # the resident tier's slabs first; with none left to move, a lower tier's (its slabs go back too)
            moved = blocked = False
            for t in range(self.tiers.num_tiers):
                r = self._evacuate(t, self._cands, ops)
                if r:
                    moved = True
                    break
                blocked = blocked or r is None
            if not moved:
                if blocked or self._cands_step == self._step:
                    break  # nowhere to move blocks to this step, or nothing left to move
                self._rescan()  # an older scan ran dry: blocks sealed since may move
        return ops

    def _rescan(self) -> None:
        self._cands, self._ahead = self._candidates(), None
        self._cands_step = self._cands_at = self._step
        self.num_scans += 1

    def _scan_ahead(self) -> None:
        """While pressure lasts (a call in the kept scan's lifetime), one slice of the next scan a step over the
        ``AHEAD_STEPS`` steps before the kept one has served ``RESCAN_STEPS``; done, it replaces the kept one,
        dated from its first slice (so a kept scan's rules apply: a slab whose used blocks are not all its
        entries is passed over, and one that runs dry is redone)."""
        ahead = min(AHEAD_STEPS, RESCAN_STEPS // 2)
        if (self._cands is None or ahead < 2 or not self.tiers.pressure or self._step - self._pressed >= RESCAN_STEPS
                or self._step - self._cands_at < RESCAN_STEPS - ahead):
            return
        if self._ahead is None:
            self._ahead = _Scan(list(self._seqs), self.tiers.num_tiers, self._step)
        scan = self._ahead
        self._walk(scan, math.ceil(len(scan.sids) / ahead))
        if scan.pos >= len(scan.sids):
            self._cands, self._ahead = self._rank(scan.out), None
            self._cands_step, self._cands_at = scan.step, self._step
            self.num_scans += 1

    def _candidates(self) -> list[tuple[dict[int, list[tuple[int, SeqId, int]]], list[int]]]:
        """Per tier above the lowest: (per slab ``(tokens behind the head, seq id, block)`` of every
        demotable block of the device's sequences (not those a load or a remote fill still writes),
        the slabs in the order pressure takes them: fewest blocks that cannot move first, then the
        coldest on average)."""
        scan = _Scan(list(self._seqs), self.tiers.num_tiers, self._step)
        self._walk(scan, len(scan.sids))
        return self._rank(scan.out)

    def _walk(self, scan: _Scan, n: int) -> None:
        """Add the demotable blocks of the scan's next ``n`` sequences (those still running) to it."""
        bs, rule = self.block_size, self.tiers
        out, seqs = scan.out, self._seqs
        busy = set(self._loading) | set(self._remote_of)
        # :meth:`_demotable` inlined (the scan reads every block of every running sequence: 10^5 at 768
        # requests): the pools above the lowest tier, each with its allocator's reference counts
        # (pool -> its tier, reference counts, blocks a slab, slab -> entries; the step's fresh blocks by id)
        movable = {tier_pool(t): (t, self._alloc[tier_pool(t)]._refcount, self._alloc[tier_pool(t)].per_slab, out[t],
                                  {r.block_id for r in self._fresh if r.pool == tier_pool(t)})
                   for t in range(rule.num_tiers)}
        for sid in scan.sids[scan.pos:scan.pos + n]:
            seq = seqs.get(sid)
            if seq is None or sid in busy:
                continue
            n_tok = len(seq.tokens)
            # full, computed blocks that end before the recent window (protected() and the computed check)
            end = min(len(seq.table), seq.num_computed // bs, (n_tok - rule.residual_tokens) // bs)
            table = seq.table
            for i in range(rule.sink_blocks, end):
                ref = table[i]
                m = movable.get(ref.pool)
                if m is None:
                    continue
                b = ref.block_id
                t, counts, per_slab, slabs, fresh = m
                if counts[b] != 1 or b in fresh:
                    continue
                entries = slabs.get(b // per_slab)
                if entries is None:
                    entries = slabs[b // per_slab] = []
                entries.append((n_tok - (i + 1) * bs, sid, i))
        scan.pos += n

    def _rank(self, out: list[dict]) -> list[tuple[dict[int, list[tuple[int, SeqId, int]]], list[int]]]:
        """A walked scan with each tier's slabs in the order pressure takes them (:meth:`_candidates`)."""
        ranked = []
        for t, d in enumerate(out):
            alloc = self._alloc[tier_pool(t)]
            ranked.append((d, sorted(d, key=lambda s: (alloc.slab_used(s) - len(d[s]),
                                                       -sum(c for c, _, _ in d[s]) / len(d[s])))))
        return ranked

    def _evacuate(self, t: int, cands, ops: list[DemoteOp]) -> bool | None:
        """Move the demotable blocks of one slab of tier ``t`` down one tier (the next in
        :meth:`_candidates`' order whose entries still hold a demotable block: a kept scan's may
        not), making room below first; True when some moved, None when the tier below has no room,
        False when no slab has anything to move."""
        if t >= self.tiers.num_tiers:
            return None
        slabs, order = cands[t]
        while order:
            moved = self._evacuate_slab(t, cands, ops)
            if moved is None:
                return None
            if moved:
                return True
        return False

    def _evacuate_slab(self, t: int, cands, ops: list[DemoteOp]) -> int | None:
        """:meth:`_evacuate` of the next slab in the order: blocks moved (None: the tier below is full).
        From a scan of an earlier step, only a slab whose used blocks are all its entries: one that took
        new blocks since would not empty (a fresh scan ranks it again)."""
        slabs, order = cands[t]
        while order and order[0] not in slabs:
            order.pop(0)
        if not order:
            return 0
        slab = order.pop(0)
        entries = slabs.pop(slab)
        if self._cands_step != self._step and self._alloc[tier_pool(t)].slab_used(slab) > len(entries):
            return 0
        moved = 0
        for cold, sid, i in sorted(entries, key=lambda x: -x[0]):
            seq = self._seqs.get(sid)  # the step may have freed it, or moved the block, since the scan
            if seq is None or i >= len(seq.table) or pool_tier(seq.table[i].pool) != t or not self._demotable(seq, i):
                continue
            while self._alloc[tier_pool(t + 1)].available(True, demotion=True) == 0:
                if not self._evacuate(t + 1, cands, ops):  # (the lowest tier: None, nowhere below it)
                    return moved or None
            op = self._demote(sid, seq, i, t + 1, reserve_ok=True)
            ops.append(op)
            moved += 1
            if t + 1 < self.tiers.num_tiers:  # it may move on down in this call (its op runs before)
                below_slabs, below_order = cands[t + 1]
                slab = self._alloc[op.dst.pool].slab_of(op.dst.block_id)
                if slab not in below_slabs:
                    below_order.append(slab)
                below_slabs.setdefault(slab, []).append((cold, sid, i))
        return moved
