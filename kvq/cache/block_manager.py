"""Per-sequence block tables over two pools: quantized ("q") and high precision ("hp").

Logical block ``i`` of a sequence covers tokens ``[i*bs, (i+1)*bs)``. Most blocks
live in the compact quantized pool; the first ``sink_blocks`` blocks and the
tail that still overlaps the recent ``residual_tokens`` window live in the hp
pool (:func:`block_state` is the one rule). When a block leaves the window it
is *sealed*: a q block is allocated, the engine quantizes the hp block into it,
the hp block is released::

    n = 23, bs = 4, sink_blocks = 1, residual_tokens = 8, write_direct = False
    block  0    1    2    3    4    5
    pool   hp   q    q    hp   hp   hp      (block 3 ends at 16 > n - 8 = 15)
           sink            residual window + partial tail

Lazy sealing. A call to :meth:`BlockManager.append_slots` first settles the
blocks that existed before it, at the length ``n_old`` the sequence had before
the call (all their tokens were written by earlier steps), then adds blocks for
the new tokens in the pool ``block_state(i, n_new)``. A block that holds some
of this call's tokens therefore keeps its pool until the next call, so its hp
copy is complete when it is sealed. The table follows ``block_state(i, n_old)``
for blocks that start before ``n_old`` and ``block_state(i, n_new)`` for the
others. Sizing: in decode (one token per call) a sequence holds at most one hp
block more than the rule at its length gives; after a multi-token call, blocks
that were hp before it stay hp until the next call. Blocks born in q (prompt blocks outside the window,
whole new blocks of a chunk) are written directly in the quantized format by
the forward pass that computes them.  Formats without per-token writes
(``write_direct=False``) need each such block computed in one forward pass, and
they get it from the rule itself, wherever chunks end: a block born in q is
whole at ``n_new`` and starts at or after ``n_old``, so it lies inside the call
(a block a chunk leaves partial is hp, finished in hp by the next chunk, and
sealed from hp after that).

Ordering contract for the returned ops (:class:`SealOp`, :class:`CopyOp`):
the manager updates tables and refcounts at once, so a source block may
already be back in its pool and handed out again by a later call of the same
step (for any sequence). The engine must therefore execute every op returned
in a scheduling step, in order, before the forward pass of that step writes
any KV (including into the slots reserved by the call that returned the op).
Ops only read KV written by earlier steps.

Prefix caching: full blocks are registered under chained content hashes once
their tokens are *computed*: ``num_computed`` advances on :meth:`mark_computed`
and, implicitly, to ``n_old`` on every :meth:`append_slots`. Registering only
computed blocks keeps another sequence from hitting a block that a chunked
prefill has reserved but not yet written.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

from kvq.cache.arena import Arena
from kvq.cache.block_allocator import BlockAllocator, NoFreeBlocksError, hash_block_tokens
from kvq.cache.block_integrity import check_block_manager
from kvq.cache.block_loads import LoadsMixin
from kvq.cache.block_prefix import PrefixMixin
from kvq.cache.block_swap import SwapMixin
from kvq.cache.block_tiers import TiersMixin
from kvq.cache.block_types import (PENDING_TOKEN, BlockRef, CopyOp, DemoteOp, HostLoadOp, HostOp,  # noqa: F401
                                   HostStoreOp, Op, PrefixHit, RemoteLoadOp, SealOp, SeqBlocks, SeqId, SwapOp,
                                   WipeOp)
from kvq.cache.tiers import TierRule
from kvq.cache.host_tier import HostHit, HostPrefixTier
from kvq.cache.window import POOLS, Pool, WindowPolicy, block_state  # noqa: F401 (re-exported)

def _pick(allocators: dict[str, BlockAllocator], pool: Pool) -> BlockAllocator:
    if pool not in allocators:
        raise ValueError(f"unknown pool {pool!r}; valid: {', '.join(allocators)}")
    return allocators[pool]


class BlockManager(PrefixMixin, LoadsMixin, SwapMixin, TiersMixin):
    """Block tables for sequences, over a q pool and an hp pool (and, with elastic precision, the
    lower tiers' pools ``q1``, ``q2``... out of one arena with ``q``: kvq.cache.block_tiers).

    Every method that can run out of blocks checks first and raises
    :class:`NoFreeBlocksError` with the manager unchanged. Unknown sequence ids
    raise ``KeyError``; bad arguments raise ``ValueError``.
    """

    def __init__(self, num_q_blocks: int, num_hp_blocks: int, policy: WindowPolicy, enable_prefix_caching: bool = True,
                 host_blocks: tuple[int, int] = (0, 0), host_tier_blocks: tuple[int, int] = (0, 0),
                 tiers: TierRule | None = None, arena: tuple[tuple[int, ...], int, int] | None = None):
        """``tiers`` with ``arena`` = (blocks of each tier per slab, slabs, reserve slabs): the q pools
        of every tier come out of one :class:`~kvq.cache.arena.Arena` (``num_q_blocks`` is ignored)."""
        if not isinstance(policy, WindowPolicy):
            raise TypeError(f"policy must be a WindowPolicy, got {type(policy).__name__}")
        if (tiers is None) != (arena is None):
            raise ValueError("tiers and their arena come together")
        self.policy = policy
        self.block_size = policy.block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.tiers = tiers
        self.arena = None
        if tiers is not None:
            per_slab, num_slabs, reserve = arena
            if len(per_slab) != tiers.num_tiers + 1:
                raise ValueError(f"the arena holds {len(per_slab)} tiers, the rule {tiers.num_tiers + 1}")
            self.arena = Arena(per_slab, num_slabs, policy.block_size, enable_prefix_caching, reserve)
        self._fresh: set[BlockRef] = set()  # blocks sealed this step: never moved in it
        self._landing: set[SeqBlocks] = set()  # swapped in this step: not registered before its copy ran
        self._cands = None  # pressure's scan of demotable blocks, reused for a few steps (kvq.cache.block_tiers)
        # the step its walk began in, the step it took over in, the current step (begin_step counts)
        self._cands_step = self._cands_at = self._step = 0
        self._ahead = None  # the next scan, made a slice a step while pressure lasts
        self._pressed = -(1 << 30)  # the last step make_room was asked for room
        self.num_scans = 0
        self.num_demotions = [0] * ((tiers.num_tiers if tiers else 0) + 1)  # by destination tier
        self._alloc = {
            "q": (self.arena.tiers[0] if self.arena else
                  BlockAllocator(num_q_blocks, policy.block_size, enable_prefix_caching, name="q")),
            "hp": BlockAllocator(num_hp_blocks, policy.block_size, enable_prefix_caching, name="hp"),
        }
        for t in range(1, (tiers.num_tiers if tiers else 0) + 1):
            self._alloc[f"q{t}"] = self.arena.tiers[t]
        self._seqs: dict[SeqId, SeqBlocks] = {}
        # The host tier of request-level swap: (q, hp) blocks in host memory, no prefix index.
        self._host = {pool: BlockAllocator(n, policy.block_size, False, name=f"host {pool}")
                      for pool, n in zip(POOLS, host_blocks)}
        self._swapped: dict[SeqId, SeqBlocks] = {}  # tables hold host block ids
        # The CPU prefix tier: host copies of full computed blocks by prefix hash, at host ids after
        # the swap tier's (one HostKVPool holds both).  Offered when a sequence frees its blocks,
        # loaded back when a prompt's prefix misses the device but hits the tier.
        self.host_tier = (HostPrefixTier(policy.block_size, *host_tier_blocks, first_block=tuple(host_blocks))
                          if self.enable_prefix_caching and any(host_tier_blocks) else None)
        self._host_ops: list[HostOp] = []  # issued by nobody yet (take_host_ops)
        self._stores: dict[int, HostStoreOp] = {}  # outstanding, by first ticket: hold their device blocks
        self._loads: dict[int, HostLoadOp] = {}  # outstanding, by ticket
        self._loading: dict[SeqId, HostLoadOp] = {}  # sequences waiting for their load
        self._failed_loads: set[SeqId] = set()  # sequences whose load failed: recompute them
        self._quarantine: dict[int, list[BlockRef]] = {}  # load ticket -> destination blocks of a freed sequence
        self._unpinned: set[int] = set()  # load tickets whose host blocks the tier already released (timeout)
        self._remote: dict[int, RemoteLoadOp] = {}  # outstanding remote fills, by ticket
        self._remote_of: dict[SeqId, RemoteLoadOp] = {}  # sequences waiting for theirs
        self._remote_quarantine: dict[int, tuple[BlockRef, ...]] = {}  # ticket -> blocks of a freed sequence
        self._next_remote = 0

    # -- queries ----------------------------------------------------------------------------
    def _seq(self, seq_id: SeqId)  -> SeqBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence id {seq_id!r} (not allocated, or already freed)") from None

    def _any(self, seq_id: SeqId)  -> SeqBlocks:
        """A sequence on the device or swapped to the host."""
        seq = self._seqs.get(seq_id) or self._swapped.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence id {seq_id!r} (not allocated, or already freed)")
        return seq

    def __contains__(self, seq_id: SeqId) -> bool:
        """Whether the sequence has device blocks (a swapped one has not: :meth:`is_swapped`)."""
        return seq_id in self._seqs

    def is_swapped(self, seq_id: SeqId) -> bool:
        return seq_id in self._swapped

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    def host_allocator(self, pool: Pool) -> BlockAllocator:
        """The host tier's allocator of ``pool`` blocks (counters; do not mutate it)."""
        return _pick(self._host, pool)

    def __len__(self) -> int:
        return len(self._seqs)

    def allocator(self, pool: Pool) -> BlockAllocator:
        """The pool's allocator, for counters and stats; do not mutate it directly."""
        return _pick(self._alloc, pool)

    def usable_blocks(self, pool: Pool) -> int:
        """Blocks of ``pool`` one sequence could hold with the others gone: all of them, but for the
        resident tier of an arena, whose reserve slabs only demotion takes."""
        a = self.allocator(pool)
        if self.arena is not None and pool == "q":
            return max(0, self.arena.num_slabs - self.arena.reserve_slabs) * a.per_slab
        return a.num_blocks

    def num_free_blocks(self, pool: Pool) -> int:
        return self.allocator(pool).num_free

    def block_table(self, seq_id: SeqId) -> list[BlockRef]:
        return list(self._seq(seq_id).table)

    def table_delta(self, seq_id: SeqId) -> tuple[int, tuple[BlockRef, ...], int]:
        """``(start, refs, length)``: the table entries ``[start, length)`` that changed since
        the previous call for this sequence (all of them on the first call), so a mirror of
        the table stays equal to :meth:`block_table` by overwriting ``[start, length)``."""
        seq = self._seq(seq_id)
        start, n = seq.changed, len(seq.table)
        seq.changed = n
        return start, tuple(seq.table[start:]), n

    def num_tokens(self, seq_id: SeqId) -> int:
        return len(self._any(seq_id).tokens)

    def num_computed(self, seq_id: SeqId) -> int:
        return self._any(seq_id).num_computed

    def token_ids(self, seq_id: SeqId) -> tuple[int, ...]:
        return tuple(self._any(seq_id).tokens)

    def slots(self, seq_id: SeqId, start: int, end: int) -> list[tuple[str, int, int]]:
        """``(pool, block_id, offset)`` for each token position in ``[start, end)``."""
        seq = self._seq(seq_id)
        if not 0 <= start <= end <= len(seq.tokens):
            raise ValueError(f"slot range [{start}, {end}) outside sequence {seq_id!r} of {len(seq.tokens)} tokens")
        bs, table = self.block_size, seq.table
        return [(table[pos // bs].pool, table[pos // bs].block_id, pos % bs) for pos in range(start, end)]

    # -- hashing helpers --------------------------------------------------------------------
    def _block_tokens(self, tokens: Sequence[int], i: int) -> Sequence[int]:
        return tokens[i * self.block_size:(i + 1) * self.block_size]

    def _chain_hash(self, parent: int | None, tokens: Sequence[int]) -> int:
        return hash_block_tokens(parent, tokens)

    def _hashes_upto(self, seq: SeqBlocks, upto: int) -> list[int]:
        """Hashes of full blocks ``[len(seq.hashes), upto)``, not stored (planning must not mutate)."""
        extra: list[int] = []
        parent = seq.hashes[-1] if seq.hashes else None
        for i in range(len(seq.hashes), upto):
            parent = hash_block_tokens(parent, self._block_tokens(seq.tokens, i))
            extra.append(parent)
        return extra

    def _register_computed(self, seq: SeqBlocks) -> None:
        """Offer full, computed blocks to their pool's prefix index (not while a swap-in's copy may
        still fail: from the next step on, kvq.cache.block_swap)."""
        if not self.enable_prefix_caching or seq in self._landing:
            return
        upto = seq.num_computed // self.block_size
        if seq.num_registered >= upto:
            return
        seq.hashes.extend(self._hashes_upto(seq, upto))
        for i in range(seq.num_registered, upto):
            ref = seq.table[i]
            self._alloc[ref.pool].register(ref.block_id, seq.hashes[i], self._block_tokens(seq.tokens, i))
        seq.num_registered = upto

    # -- prompts ----------------------------------------------------------------------------
    def allocate_prompt(self, seq_id: SeqId, token_ids: Sequence[int], end=None, use_host: bool = True,
                        use_cache: bool = True) -> PrefixHit:
        """Reserve blocks for a prompt, or for its first chunk (``end(hit_tokens)``: how far to
        reserve for a given prefix hit; the scheduler appends the other chunks with
        :meth:`append_slots`), reusing cached full blocks of its prefix.

        A cached prefix of ``h`` blocks is reused when block ``i < h`` is cached in
        pool ``block_state(i, h * bs)``, the longest such prefix whose reservation fits
        (:meth:`_plan_prompt`); hits never cover the last token. The other blocks come
        from pool ``block_state(i, L)`` for the reserved length ``L``, as
        :meth:`append_slots` would give them. The engine computes tokens
        ``[num_cached_tokens, L)``; ``num_computed`` starts at ``num_cached_tokens``
        (call :meth:`mark_computed` after the prefill).

        Blocks of the hit that only the CPU prefix tier holds (``use_host``) get fresh device
        blocks and a :class:`HostLoadOp` (:meth:`take_host_ops`); ``num_computed`` covers them
        only once it has completed (:meth:`host_copy_done`), and the sequence must not run before
        (:meth:`load_state`).  ``use_cache=False`` takes no hit: every token is computed.

        A hit that loads blocks of several tiers (elastic precision: each back into the tier it
        was stored from) is planned by counting the arena's slabs, which the allocators' order
        can still defeat: then nothing is kept and the prompt is planned again without such loads.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence id {seq_id!r} already has blocks")
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("a prompt needs at least one token")
        plan = self._plan_prompt(token_ids, use_cache, end=end, use_host=use_host)  # use_cache=False: no hit
        try:
            table = self._take_prompt_blocks(plan, token_ids) if plan.ok else None
        except NoFreeBlocksError:  # only a load into lower tiers can get here: taken blocks given back
            plan = self._plan_prompt(token_ids, use_cache, end=end, use_host=use_host, lower_loads=False)
            table = self._take_prompt_blocks(plan, token_ids) if plan.ok else None
        bs, L = self.block_size, plan.L
        if table is None:
            raise NoFreeBlocksError(
                f"prompt of {L} tokens for {seq_id!r} does not fit: "
                f"q free {self.num_free_blocks('q')}, hp free {self.num_free_blocks('hp')}"
            )
        token_ids = token_ids[:L]
        k, h = len(plan.hits), len(plan.hits) + len(plan.loads)
        if plan.miss:
            self._alloc[block_state(h, L, self.policy)].note_miss()
            if self.host_tier is not None and use_host:
                self.host_tier.note_miss(block_state(h, L, self.policy))
        seq = self._seqs[seq_id] = SeqBlocks(token_ids, table, k * bs, plan.hashes[:k], self.policy.sink_blocks)
        seq.num_settled = h * bs  # the hits follow the rule at their end, as after an append
        if plan.loads:
            req = self.host_tier.pin_for_load(HostHit(k, tuple(plan.loads)), [r.block_id for r in table[k:h]])
            op = self._loading[seq_id] = self._loads[req.ticket] = HostLoadOp(seq_id, req)
            self._host_ops.append(op)
        return PrefixHit(h * bs, (h - k) * bs)

    def _take_prompt_blocks(self, plan, token_ids: Sequence[int]) -> list[BlockRef]:
        """A planned prompt's table: its hits taken first (so none is evicted), a block for each load,
        then the blocks it computes.  All or nothing: on NoFreeBlocksError every block taken is given
        back and the hit counters restored (a cached block evicted on the way stays evicted)."""
        bs, L, table = self.block_size, plan.L, []
        with self._tentative():
            try:
                for i, (pool, want) in enumerate(plan.hits):
                    got = self._alloc[pool].lookup(plan.hashes[i], self._block_tokens(token_ids, i))
                    assert got == want, (pool, got, want)
                    table.append(BlockRef(pool, got))
                for b in plan.loads:
                    table.append(BlockRef(b.pool, self._alloc[b.pool].allocate()))
                for i in range(len(plan.hits) + len(plan.loads), -(-L // bs)):
                    pool = block_state(i, L, self.policy)
                    table.append(BlockRef(pool, self._alloc[pool].allocate()))
            except NoFreeBlocksError:
                for ref in reversed(table):
                    self._alloc[ref.pool].free(ref.block_id)
                for pool, _ in plan.hits:
                    self._alloc[pool].num_hits -= 1
                raise
        return table

    def _tentative(self, keep: bool = True):
        """The arena's tentative allocation (:meth:`kvq.cache.arena.Arena.tentative`); nothing without tiers."""
        return self.arena.tentative(keep) if self.arena is not None else nullcontext()


    # -- appends ----------------------------------------------------------------------------
    def _seal_candidates(self, seq: SeqBlocks, n: int) -> tuple[list[int], int]:
        """Logical blocks that are hp in the table but q at length ``n``; and the new seal_from."""
        p = self.policy
        if p.write_direct and p.residual_tokens == 0:
            return [], seq.seal_from
        hi = min(max(n - p.residual_tokens, 0) // p.block_size, len(seq.table))
        return [i for i in range(seq.seal_from, hi) if seq.table[i].pool == "hp"], max(seq.seal_from, hi)

    def _plan_append(self, seq: SeqBlocks, k: int):
        """(seals, dedup, seal_from, feasible, (q, hp) blocks it takes: :meth:`append_need`) for appending
        ``k`` tokens, without mutating anything."""
        n_old, bs = len(seq.tokens), self.block_size
        q, hp = self._alloc["q"], self._alloc["hp"]
        seals, seal_from = self._seal_candidates(seq, n_old)
        hashes = self._hashes_upto(seq, seals[-1] + 1) if seals and self.enable_prefix_caching else []
        need, free_hp, taken_q = {"q": 0, "hp": 0}, 0, 0
        dedup: dict[int, int] = {}  # logical index -> q block already holding its content
        for i in seals:
            if self.enable_prefix_caching:
                h = seq.hashes[i] if i < len(seq.hashes) else hashes[i - len(seq.hashes)]
                bid = q.probe(h, self._block_tokens(seq.tokens, i))
                if bid is not None:
                    dedup[i] = bid
                    taken_q += q.refcount(bid) == 0
            need["q"] += i not in dedup
            free_hp += hp.refcount(seq.table[i].block_id) == 1
        if k and n_old % bs:
            tail = seq.table[n_old // bs]
            need[tail.pool] += self._alloc[tail.pool].refcount(tail.block_id) > 1  # copy-on-write
        for i in range(len(seq.table), -(-(n_old + k) // bs)):
            need[block_state(i, n_old + k, self.policy)] += 1
        ok = need["q"] <= q.num_free - taken_q and need["hp"] <= hp.num_free + free_hp
        return seals, dedup, seal_from, ok, (need["q"] + taken_q, need["hp"] - free_hp)

    def _appends_in_place(self, seq: SeqBlocks, n_old: int) -> bool:
        """Whether one token appended at ``n_old`` (inside the partial tail block) needs nothing of
        :meth:`append_slots`' general path: no block leaves the window or ages into a lower tier and
        the tail is not shared (the decode step's common case, kept cheap: it runs once per running
        sequence per step)."""
        p = self.policy
        if self.tiers is not None and self.tiers.ages:
            r = self.tiers
            if not seq.tier_from or any(max(0, (n_old - a) // p.block_size) > f for a, f in zip(r.ages, seq.tier_from)):
                return False
        if not (p.write_direct and p.residual_tokens == 0):
            hi = min(max(n_old - p.residual_tokens, 0) // p.block_size, len(seq.table))
            if hi > seq.seal_from:  # a block may have left the window: the general path decides
                return False
        tail = seq.table[n_old // self.block_size]
        return self._alloc[tail.pool].refcount(tail.block_id) == 1

    def can_append_slots(self, seq_id: SeqId, num_new_tokens: int) -> bool:
        """Whether :meth:`append_slots` of ``num_new_tokens`` tokens would succeed now."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        return self._plan_append(self._seq(seq_id), num_new_tokens)[3]

    def append_need(self, seq_id: SeqId, num_new_tokens: int) -> tuple[int, int]:
        """(resident, hp) blocks :meth:`append_slots` of ``num_new_tokens`` tokens would take now,
        cached blocks it revives included, hp blocks its seals release deducted (what demotion must
        free for it: kvq.cache.block_tiers)."""
        return self._plan_append(self._seq(seq_id), num_new_tokens)[4]

    def append_slots(self, seq_id: SeqId, new_token_ids: Sequence[int], age: bool = True) -> list[Op]:
        """Extend a sequence by ``new_token_ids`` and return the data movement to do first.

        Declares every earlier token computed (registering full blocks for
        prefix reuse), seals blocks that left the window at the old length,
        copies a shared partial tail on write, and allocates blocks for the
        new tokens. See the module docstring for the ordering contract.
        ``age=False`` (a prompt's chunk): the age policy (elastic precision) moves
        none of its blocks now; the scheduler ages a prompt from its first decode on,
        so that a prompt reads its own past in one format whatever its chunks.
        """
        seq = self._seq(seq_id)
        n_old, bs = len(seq.tokens), self.block_size
        if len(new_token_ids) == 1 and n_old % bs and self._appends_in_place(seq, n_old):
            seq.num_computed = n_old  # a decode token into its own partial tail: no op, no allocation
            self._register_computed(seq)
            seq.changed = min(seq.changed, len(seq.table))
            seq.tokens.append(new_token_ids[0])
            seq.num_settled = n_old
            return []
        new_token_ids = list(new_token_ids)
        k = len(new_token_ids)
        seals, dedup, seal_from, ok, _ = self._plan_append(seq, k)
        if not ok:
            raise NoFreeBlocksError(
                f"cannot append {k} tokens to {seq_id!r}: "
                f"q free {self.num_free_blocks('q')}, hp free {self.num_free_blocks('hp')}"
            )
        q, hp = self._alloc["q"], self._alloc["hp"]
        seq.num_computed = n_old
        self._register_computed(seq)  # covers every sealed block (they end <= n_old), except while landing
        if self.enable_prefix_caching and seals:  # a swap-in landing this step registers nothing, but its
            seq.hashes.extend(self._hashes_upto(seq, seals[-1] + 1))  # seals still look up their content
        ops: list[Op] = []
        for i, want in dedup.items():  # revive cached q blocks before any allocation can evict them
            got = q.lookup(seq.hashes[i], self._block_tokens(seq.tokens, i))
            assert got == want, (i, got, want)
        for i in seals:
            src = seq.table[i].block_id
            if i in dedup:
                dst = dedup[i]  # same content already quantized: no data movement
            else:
                dst = q.allocate()
                if self.enable_prefix_caching and seq not in self._landing:  # (its copy may yet fail)
                    q.register(dst, seq.hashes[i], self._block_tokens(seq.tokens, i))
                ops.append(SealOp(seq_id, i, src, dst))
                if self.tiers is not None:
                    self._fresh.add(BlockRef("q", dst))  # written by this step: it may not move in it
            seq.table[i] = BlockRef("q", dst)
            seq.changed = min(seq.changed, i)
            hp.free(src)
        seq.seal_from = seal_from
        if k and n_old % bs:
            j = n_old // bs
            tail = seq.table[j]
            pool = self._alloc[tail.pool]
            if pool.refcount(tail.block_id) > 1:
                new = BlockRef(tail.pool, pool.allocate())
                ops.append(CopyOp(tail, new))
                pool.free(tail.block_id)
                seq.table[j] = new
                seq.changed = min(seq.changed, j)
        n_new = n_old + k
        seq.changed = min(seq.changed, len(seq.table))
        for i in range(len(seq.table), -(-n_new // bs)):
            pool = block_state(i, n_new, self.policy)
            seq.table.append(BlockRef(pool, self._alloc[pool].allocate()))
        seq.tokens.extend(new_token_ids)
        seq.num_settled = n_old
        if self.tiers is not None and age:  # after every allocation: they take only what is left
            ops += self._age(seq_id, seq, n_old)
        return ops

    def set_token(self, seq_id: SeqId, position: int, token_id: int) -> None:
        """Give the token at ``position``, appended as :data:`PENDING_TOKEN` (asynchronous
        scheduling appends a token before the step that samples it has finished), its id.
        Pending tokens are never hashed: they lie past every computed position."""
        seq = self._any(seq_id)
        if not 0 <= position < len(seq.tokens) or seq.tokens[position] != PENDING_TOKEN:
            raise ValueError(f"position {position} of {seq_id!r} holds no pending token")
        assert position >= seq.num_computed, (position, seq.num_computed)
        seq.tokens[position] = token_id

    def mark_computed(self, seq_id: SeqId, num_computed: int) -> None:
        """Declare the KV of the first ``num_computed`` tokens written (monotone; never lowers it).

        Full blocks below it become prefix-cacheable. Call it after a prefill
        forward (or before :meth:`free`) so a finished prompt's blocks are cached.
        """
        seq = self._any(seq_id)
        if not 0 <= num_computed <= len(seq.tokens):
            raise ValueError(f"num_computed={num_computed} outside [0, {len(seq.tokens)}] for {seq_id!r}")
        seq.num_computed = max(seq.num_computed, num_computed)
        if seq_id in self._seqs:  # a swapped sequence's blocks are registered when it returns
            self._register_computed(seq)

    # -- fork / free ------------------------------------------------------------------------
    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Give ``child_id`` the parent's tokens and blocks, shared (copy-on-write on the tail)."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence id {child_id!r} already has blocks")
        for ref in parent.table:
            self._alloc[ref.pool].incref(ref.block_id)
        self._seqs[child_id] = parent.clone()

    def free(self, seq_id: SeqId) -> None:
        """Release a sequence's blocks; computed, registered full blocks stay cached.

        Blocks are released tail first, so the LRU evicts a prefix's tail
        before its head.
        """
        if seq_id in self._swapped:
            for ref in reversed(self._swapped.pop(seq_id).table):
                self._host_of(ref.pool).free(ref.block_id)
            return
        seq = self._seq(seq_id)
        self._register_computed(seq)
        self._failed_loads.discard(seq_id)
        held: set[BlockRef] = set()
        remote = self._remote_of.pop(seq_id, None)
        if remote is not None:  # a peer may still write every block: out of use until the fill ends
            held = set(remote.table)
            self._remote_quarantine[remote.ticket] = remote.table
        op = self._loading.pop(seq_id, None)
        if op is not None:  # its load may still write these: out of use until it reports its end
            req = op.request
            held = {BlockRef(b.pool, d) for b, d in zip(req.hit.blocks, req.device_blocks)}
            self._quarantine[req.ticket] = sorted(held, key=lambda r: (r.pool, r.block_id))
        if self.host_tier is not None:
            self._offer(seq, held)
        for ref in reversed(seq.table):
            if ref not in held:
                self._alloc[ref.pool].free(ref.block_id)
        del self._seqs[seq_id]


    # -- checks -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant (kvq.cache.block_integrity)."""
        check_block_manager(self)
