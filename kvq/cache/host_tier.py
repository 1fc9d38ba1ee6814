"""Block-level CPU prefix tier: which host block holds which full device block, by chained prefix hash.

Tensor-free bookkeeping for issue 14, part 2.  The device pools index computed
full blocks under chained content hashes (:func:`hash_block_tokens`, see
:mod:`kvq.cache.block_allocator`); this tier keeps host copies of such blocks
under the *same* hashes, one index per host pool ("q" resident, "hp" high precision),
so that a device prefix miss can continue from host memory.  With elastic precision
(:mod:`kvq.cache.tiers`) a block of a lower tier (device pool ``q1``, ``q2``...) is kept
as it was stored, in a host q block (a host q row holds a block of any tier), and tagged
with its device pool: a hit loads it back into that tier (served as stored, as a device
hit on a demoted block is).  Requests and hits name the *device* pool; a hash is held
once per host pool, in the tier last offered: the device indexes a demoted block's hash
in its new tier, so a copy offered from another tier replaces the one held (when it is
loadable and unpinned), and a reload serves what the device served.  It decides; the
engine moves bytes (:meth:`HostKVPool.store` / :meth:`~HostKVPool.load` on the
copy stream) and reports back when each copy's event has completed.

Every host block of a pool is in exactly one state::

    FREE      no hash                          -> taken first by offer()
    STORING   hash + tokens, store in flight   -> not loadable, never evicted
    LOADABLE  hash + tokens, copy complete     -> lookups see it
        pins == 0: in the LRU (evictable, least recently used first)
        pins >= 1: a load reads it: not in the LRU, never evicted

    offer()        FREE or evicted LRU head -> STORING   (StoreRequest)
                   (or the block of the same hash from another tier, replaced)
    store_done()   STORING -> LOADABLE (most recently used)
    store_failed() STORING -> FREE
    pin_for_load() LOADABLE: pins += 1                   (LoadRequest)
    load_done() / load_failed() / load_timed_out()   pins -= 1 (at 0: back in the LRU, most recent)

Invariants (:meth:`HostPrefixTier.check_integrity`): the three states partition
the blocks and the free list holds each FREE block once; a block holds a hash
iff the pool's index maps that hash to it, with a full block of tokens; the LRU
holds exactly the LOADABLE blocks with no pin, in increasing order of last use;
every STORING block has exactly one outstanding store request and nothing else
does; a block's pin count equals the number of outstanding load requests that
read it (so a pinned block is LOADABLE and still holds the hash it was pinned
under: it was never evicted).

Hits verify tokens: a hash the index holds with other tokens (a collision) is a
miss, as in the device prefix index.  Lookups (:meth:`probe`,
:meth:`lookup_chain`) change nothing, so a caller pins what it found before
anything else (an offer may evict an unpinned block).

Counters are in blocks, per host pool (a q and an hp block differ in bytes; the
caller multiplies by the plan's bytes per block).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count

from kvq.cache.block_allocator import hash_block_tokens
from kvq.cache.tiers import pool_tier
from kvq.cache.window import POOLS, Pool

FREE, STORING, LOADABLE = "free", "storing", "loadable"


def host_pool_of(pool: str) -> Pool:
    """The host pool that keeps blocks of device pool ``pool``: ``hp`` for hp, ``q`` for every q pool
    (the resident tier's and the lower tiers' ``q1``, ``q2``...); ValueError naming the valid ones."""
    return "hp" if pool_tier(pool) is None else "q"


def chain_blocks(token_ids: Sequence[int], block_size: int, num_blocks: int | None = None) -> list[tuple[int, tuple]]:
    """``(chained hash, tokens)`` of the first ``num_blocks`` full blocks of ``token_ids`` (default: all of
    them), hashed exactly as the device prefix index hashes a prompt (parent ``None`` for block 0)."""
    n = len(token_ids) // block_size if num_blocks is None else num_blocks
    if not 0 <= n <= len(token_ids) // block_size:
        raise ValueError(f"{n} full blocks of {block_size} requested from {len(token_ids)} tokens")
    out: list[tuple[int, tuple]] = []
    parent = None
    for i in range(n):
        toks = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash_block_tokens(parent, toks)
        out.append((parent, toks))
    return out


@dataclass(frozen=True)
class StoreRequest:
    """Copy device block ``device_block`` of ``pool`` (``q``, ``hp`` or a lower tier's ``q1``...) into
    host block ``host_block`` (of :attr:`host_pool`).

    The caller keeps the device block's content unchanged (holds a reference) until the copy's
    event completes, then calls :meth:`HostPrefixTier.store_done` (or ``store_failed``).
    ``evicted_hash`` is the hash whose host copy this store overwrites (None: a free block)."""

    ticket: int
    pool: Pool
    block_hash: int
    device_block: int
    host_block: int
    evicted_hash: int | None

    @property
    def host_pool(self) -> Pool:
        return host_pool_of(self.pool)


@dataclass(frozen=True)
class HostBlock:
    """A loadable host copy: logical block of a prompt -> host block holding ``block_hash``, stored from
    (and loaded back into) device pool ``pool`` (``q``, ``hp``, a lower tier's ``q1``...)."""

    pool: str
    host_block: int
    block_hash: int

    @property
    def host_pool(self) -> Pool:
        return host_pool_of(self.pool)


@dataclass(frozen=True)
class HostHit:
    """Loadable host blocks for logical blocks ``start .. start + len(blocks) - 1`` of a prompt."""

    start: int
    blocks: tuple[HostBlock, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def end(self) -> int:
        return self.start + len(self.blocks)


@dataclass(frozen=True)
class LoadRequest:
    """Copy pinned host blocks into device blocks: ``q_pairs`` / ``hp_pairs`` are ``(host, device)``
    block ids, the argument order of :meth:`HostKVPool.load`; ``tier_pairs`` ``((pool, pairs), ...)``
    those of the lower tiers' blocks (device ids of that tier).  ``device_blocks[j]`` receives
    ``hit.blocks[j]`` (a block of ``hit.blocks[j].pool``)."""

    ticket: int
    hit: HostHit
    device_blocks: tuple[int, ...]
    q_pairs: tuple[tuple[int, int], ...]
    hp_pairs: tuple[tuple[int, int], ...]
    tier_pairs: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()


@dataclass(frozen=True)
class HostTierStats:
    """One pool's counters (blocks) and occupancy, a snapshot for metrics."""

    num_blocks: int
    num_used: int  # STORING + LOADABLE
    num_loadable: int
    num_pinned: int  # LOADABLE blocks read by at least one outstanding load
    num_storing: int
    stores: int  # completed stores
    store_failures: int
    rejected: int  # offers refused: every block STORING or pinned
    evictions: int
    replaced: int  # copies of a hash replaced by the same hash from another tier (a block demoted since)
    hits: int  # blocks pinned for a load
    misses: int  # lookups the caller counted as missing (note_miss)
    loads: int  # blocks whose load completed
    load_failures: int
    load_timeouts: int


_COUNTERS = ("stores", "store_failures", "rejected", "evictions", "replaced", "hits", "misses", "loads",
             "load_failures", "load_timeouts")


class _PoolTier:
    """One pool's host blocks; private to :class:`HostPrefixTier` (indexes are local, 0 .. n-1)."""

    def __init__(self, name: str, num_blocks: int, first_block: int) -> None:
        self.name, self.n, self.first = name, num_blocks, first_block
        self.state = [FREE] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        self.tokens: list[tuple | None] = [None] * num_blocks
        self.source: list[str | None] = [None] * num_blocks  # the device pool it was stored from (q, q1...)
        self.pins = [0] * num_blocks
        self.last_use = [0] * num_blocks  # tick of the last use (store completion, touch, unpin)
        self.free = list(range(num_blocks - 1, -1, -1))  # stack: a fresh tier hands out 0, 1, 2, ...
        self.lru: OrderedDict[int, None] = OrderedDict()  # LOADABLE, unpinned; least recently used first
        self.index: dict[int, int] = {}  # hash -> local block holding it (STORING or LOADABLE)
        self.counters = dict.fromkeys(_COUNTERS, 0)

    def local(self, host_block: int) -> int:
        i = host_block - self.first
        if not isinstance(host_block, int) or not 0 <= i < self.n:
            raise ValueError(f"host {self.name} block {host_block!r} outside {self.first}..{self.first + self.n - 1}")
        return i

    def find(self, block_hash: int, token_ids: Sequence[int]) -> int | None:
        """Local id of the LOADABLE block holding ``block_hash`` with exactly ``token_ids``."""
        i = self.index.get(block_hash)
        if i is None or self.state[i] != LOADABLE or self.tokens[i] != tuple(token_ids):
            return None
        return i

    def clear(self, i: int) -> None:
        del self.index[self.hash[i]]
        self.state[i], self.hash[i], self.tokens[i], self.source[i] = FREE, None, None, None


class HostPrefixTier:
    """Host copies of full device blocks, keyed by chained prefix hash, over a q and an hp pool.

    ``first_block`` places the tier's host ids at ``first .. first + n - 1`` of each pool, so the
    tier can share a :class:`HostKVPool` with request-level swap (which then owns the other ids).
    Misuse (unknown pool, stale or repeated request, a hit that is no longer loadable) raises
    ``ValueError``; see the module docstring for the states and invariants.
    """

    def __init__(self, block_size: int, num_q_blocks: int, num_hp_blocks: int,
                 first_block: tuple[int, int] = (0, 0)) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        for what, n in (("num_q_blocks", num_q_blocks), ("num_hp_blocks", num_hp_blocks),
                        ("first q block", first_block[0]), ("first hp block", first_block[1])):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{what} must be an int >= 0, got {n!r}")
        self.block_size = block_size
        self._pools = {p: _PoolTier(p, n, f) for p, n, f in zip(POOLS, (num_q_blocks, num_hp_blocks), first_block)}
        self._stores: dict[int, StoreRequest] = {}  # outstanding, by ticket
        self._loads: dict[int, LoadRequest] = {}
        self._tickets = count()
        self._clock = 0

    def _pool(self, pool: Pool) -> _PoolTier:
        if pool not in self._pools:
            raise ValueError(f"unknown pool {pool!r}; valid: {', '.join(POOLS)}")
        return self._pools[pool]

    def _host(self, pool: str) -> _PoolTier:
        """The host pool keeping device pool ``pool``'s blocks (ValueError naming the valid ones)."""
        return self._pools[host_pool_of(pool)]

    def _touch(self, t: _PoolTier, i: int) -> None:
        """Make a LOADABLE, unpinned block the most recently used."""
        self._clock += 1
        t.last_use[i] = self._clock
        t.lru[i] = None
        t.lru.move_to_end(i)

    # -- occupancy and counters --------------------------------------------------------------
    def num_blocks(self, pool: Pool) -> int:
        return self._pool(pool).n

    def num_used(self, pool: Pool) -> int:
        t = self._pool(pool)
        return t.n - len(t.free)

    def num_loadable(self, pool: Pool) -> int:
        t = self._pool(pool)
        return t.n - len(t.free) - self.num_storing(pool)

    def num_storing(self, pool: Pool) -> int:
        return sum(r.host_pool == pool for r in self._stores.values())

    def num_pinned(self, pool: Pool) -> int:
        return sum(p > 0 for p in self._pool(pool).pins)

    def stats(self, pool: Pool) -> HostTierStats:
        t = self._pool(pool)
        return HostTierStats(t.n, self.num_used(pool), self.num_loadable(pool), self.num_pinned(pool),
                             self.num_storing(pool), **t.counters)

    def note_miss(self, pool: Pool) -> None:
        """Count a prompt whose next block (in ``pool``) neither the device nor this tier holds."""
        self._pool(pool).counters["misses"] += 1

    # -- stores ------------------------------------------------------------------------------
    def offer(self, pool: str, block_hash: int, token_ids: Sequence[int], device_block: int) -> StoreRequest | None:
        """Ask to keep a host copy of a full, computed device block of device pool ``pool`` (``q``,
        ``hp``, a lower tier's ``q1``...; kept as stored, tagged with its pool).

        None if the host pool already holds ``block_hash`` from ``pool`` (a LOADABLE, unpinned copy with
        these tokens becomes the most recently used), holds it STORING or pinned, or if every block is
        STORING or pinned.  A LOADABLE, unpinned copy from another tier is replaced in place.  Otherwise the
        hash is taken, in a free block or by evicting the least recently used LOADABLE unpinned
        block, and stays STORING (not loadable) until :meth:`store_done`.
        """
        t = self._host(pool)
        token_ids = tuple(token_ids)
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are offered ({len(token_ids)} tokens, block size {self.block_size})")
        if isinstance(device_block, bool) or not isinstance(device_block, int) or device_block < 0:
            raise ValueError(f"device block must be an int >= 0, got {device_block!r}")
        held = t.index.get(block_hash)
        evicted = None
        if held is not None:
            if t.state[held] != LOADABLE or t.pins[held] or t.tokens[held] != token_ids:
                return None
            if t.source[held] == pool:
                self._touch(t, held)
                return None
            i, evicted = held, block_hash  # another tier's copy: the device serves this one now
            del t.lru[i]
            t.clear(i)
            t.counters["replaced"] += 1
        elif t.free:
            i = t.free.pop()
        elif t.lru:
            i, _ = t.lru.popitem(last=False)
            evicted = t.hash[i]
            t.clear(i)
            t.counters["evictions"] += 1
        else:
            t.counters["rejected"] += 1
            return None
        t.state[i], t.hash[i], t.tokens[i], t.source[i] = STORING, block_hash, token_ids, pool
        t.index[block_hash] = i
        req = StoreRequest(next(self._tickets), pool, block_hash, device_block, t.first + i, evicted)
        self._stores[req.ticket] = req
        return req

    def _end_store(self, req: StoreRequest) -> tuple[_PoolTier, int]:
        if self._stores.get(getattr(req, "ticket", None)) != req:
            raise ValueError(f"{req!r} is not an outstanding store (already completed, failed, or never issued)")
        del self._stores[req.ticket]
        t = self._host(req.pool)
        i = t.local(req.host_block)
        assert t.state[i] == STORING and t.hash[i] == req.block_hash, (req, t.state[i])
        return t, i

    def store_done(self, req: StoreRequest) -> None:
        """The store's copy has completed: the block becomes LOADABLE, most recently used."""
        t, i = self._end_store(req)
        t.state[i] = LOADABLE
        t.counters["stores"] += 1
        self._touch(t, i)

    def store_failed(self, req: StoreRequest) -> None:
        """The store's copy did not happen: the block goes back to the free list."""
        t, i = self._end_store(req)
        t.clear(i)
        t.free.append(i)
        t.counters["store_failures"] += 1

    # -- lookups (no mutation) ---------------------------------------------------------------
    def probe(self, pool: Pool, block_hash: int, token_ids: Sequence[int]) -> int | None:
        """Host id of the LOADABLE block of host pool ``pool`` holding ``block_hash`` with ``token_ids``,
        or None."""
        b = self.probe_block(pool, block_hash, token_ids)
        return None if b is None else b.host_block

    def probe_block(self, pool: Pool, block_hash: int, token_ids: Sequence[int]) -> HostBlock | None:
        """The LOADABLE copy in host pool ``pool`` of ``block_hash`` with ``token_ids`` (its
        :attr:`HostBlock.pool`: the device pool to load it into), or None."""
        t = self._pool(pool)
        i = t.find(block_hash, token_ids)
        return None if i is None else HostBlock(t.source[i], t.first + i, block_hash)

    def lookup_chain(self, pool_for_index: Sequence[Pool] | Callable[[int], Pool],
                     blocks: Sequence[tuple[int, Sequence[int]]], start: int = 0) -> HostHit:
        """The longest run of LOADABLE host blocks continuing a device prefix hit of ``start`` blocks.

        ``blocks[i]`` is ``(chained hash, tokens)`` of the prompt's full block ``i`` (:func:`chain_blocks`;
        the caller leaves out a block holding the prompt's last token), ``pool_for_index(i)`` (or
        ``pool_for_index[i]``) the host pool block ``i`` must come from (``q`` or ``hp``: the window
        rule's state; a q block loads into the tier it was stored from).  The run covers blocks
        ``start, start + 1, ...`` up to the first one not loadable there.  Changes nothing.
        """
        if not 0 <= start <= len(blocks):
            raise ValueError(f"start {start} outside 0..{len(blocks)}")
        pool_of = pool_for_index if callable(pool_for_index) else pool_for_index.__getitem__
        found: list[HostBlock] = []
        for i in range(start, len(blocks)):
            block_hash, toks = blocks[i]
            b = self.probe_block(pool_of(i), block_hash, toks)
            if b is None:
                break
            found.append(b)
        return HostHit(start, tuple(found))

    # -- loads -------------------------------------------------------------------------------
    def pin_for_load(self, hit: HostHit, device_blocks: Sequence[int]) -> LoadRequest:
        """Pin a hit's host blocks (no eviction until the load ends) and return the copy to issue.

        ``device_blocks[j]`` is the device block (of ``hit.blocks[j].pool``) that receives block
        ``j``.  Every block must still be LOADABLE under its hash: pin right after the lookup.
        """
        device_blocks = tuple(device_blocks)
        if not hit.blocks:
            raise ValueError("an empty hit has nothing to load")
        if len(device_blocks) != len(hit.blocks):
            raise ValueError(f"{len(device_blocks)} device blocks for {len(hit.blocks)} host blocks")
        pairs: dict[str, list[tuple[int, int]]] = {p: [] for p in POOLS}
        for b, d in zip(hit.blocks, device_blocks):
            t = self._host(b.pool)
            i = t.local(b.host_block)
            if t.state[i] != LOADABLE or t.hash[i] != b.block_hash or t.source[i] != b.pool:
                raise ValueError(f"host {t.name} block {b.host_block} no longer holds a loadable copy of the hit "
                                 f"(from device pool {b.pool})")
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise ValueError(f"device block must be an int >= 0, got {d!r}")
            pairs.setdefault(b.pool, []).append((b.host_block, d))
        for pool, ps in pairs.items():
            if len({d for _, d in ps}) != len(ps):
                raise ValueError(f"a device {pool} block receives two host blocks")
        for b in hit.blocks:
            t = self._host(b.pool)
            i = t.local(b.host_block)
            if t.pins[i] == 0:
                del t.lru[i]
            t.pins[i] += 1
            t.counters["hits"] += 1
        tiers = tuple((p, tuple(pairs[p])) for p in sorted(set(pairs) - set(POOLS), key=pool_tier))
        req = LoadRequest(next(self._tickets), hit, device_blocks, tuple(pairs["q"]), tuple(pairs["hp"]), tiers)
        self._loads[req.ticket] = req
        return req

    def _end_load(self, req: LoadRequest, counter: str) -> None:
        if self._loads.get(getattr(req, "ticket", None)) != req:
            raise ValueError(f"{req!r} is not an outstanding load (already ended, or never issued)")
        del self._loads[req.ticket]
        for b in req.hit.blocks:
            t = self._host(b.pool)
            i = t.local(b.host_block)
            assert t.pins[i] > 0 and t.state[i] == LOADABLE and t.hash[i] == b.block_hash, (b, t.state[i])
            t.pins[i] -= 1
            t.counters[counter] += 1
            if t.pins[i] == 0:
                self._touch(t, i)

    def load_done(self, req: LoadRequest) -> None:
        """The load's copy has completed (its event): the device blocks hold the prefix; unpin."""
        self._end_load(req, "loads")

    def load_failed(self, req: LoadRequest) -> None:
        """The load's copy could not be issued or failed; unpin (the host copies stay) and recompute."""
        self._end_load(req, "load_failures")

    def load_timed_out(self, req: LoadRequest) -> None:
        """The caller gave up waiting for the load and recomputes; unpin.

        The copy may still run.  Host side this is safe when stores and loads share one in-order
        copy stream (:class:`HostKVPool` does): a store that reuses these host blocks is queued
        after the load.  Device side it is the caller's: the load's destination blocks must not be
        reused until its event completes.
        """
        self._end_load(req, "load_timeouts")

    # -- checks ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant (see module docstring)."""
        storing = {p: {} for p in POOLS}
        for ticket, r in self._stores.items():
            t = self._host(r.pool)
            i = r.host_block - t.first
            assert r.ticket == ticket and 0 <= i < t.n, f"store {r!r} names a block outside its pool"
            assert i not in storing[t.name], f"host {t.name} block {r.host_block}: two outstanding stores"
            assert t.hash[i] == r.block_hash, f"store {r!r}: its block holds another hash"
            assert t.source[i] == r.pool, f"store {r!r}: its block is tagged with device pool {t.source[i]}"
            storing[t.name][i] = r
        pins = {p: [0] * self._pools[p].n for p in POOLS}
        for ticket, r in self._loads.items():
            assert r.ticket == ticket and len(r.device_blocks) == len(r.hit.blocks), f"load {r!r} is malformed"
            for b in r.hit.blocks:
                t = self._host(b.pool)
                i = b.host_block - t.first
                assert 0 <= i < t.n, f"load {r!r} names a block outside its pool"
                assert t.hash[i] == b.block_hash and t.source[i] == b.pool, \
                    f"host {t.name} block {b.host_block} was evicted while pinned"
                pins[t.name][i] += 1
        for pool, t in self._pools.items():
            name = f"host {pool}"
            free = set(t.free)
            assert len(free) == len(t.free), f"{name}: a block appears twice in the free list"
            for i in range(t.n):
                s = t.state[i]
                assert (s == FREE) == (i in free), f"{name} block {i}: state {s} but free-listed: {i in free}"
                assert (s == STORING) == (i in storing[pool]), f"{name} block {i}: state {s}, store outstanding: " \
                                                              f"{i in storing[pool]}"
                assert t.pins[i] == pins[pool][i], f"{name} block {i}: {t.pins[i]} pins, {pins[pool][i]} loads"
                assert t.pins[i] == 0 or s == LOADABLE, f"{name} block {i}: pinned but {s}"
                assert (i in t.lru) == (s == LOADABLE and t.pins[i] == 0), \
                    f"{name} block {i}: in LRU {i in t.lru}, state {s}, pins {t.pins[i]}"
                if s == FREE:
                    assert t.hash[i] is None and t.tokens[i] is None and t.source[i] is None, \
                        f"{name} free block {i} holds a hash"
                else:
                    assert t.hash[i] is not None and t.index.get(t.hash[i]) == i, \
                        f"{name} block {i}: its hash is not indexed to it"
                    assert t.tokens[i] is not None and len(t.tokens[i]) == self.block_size, \
                        f"{name} block {i} holds a hash without a full block of tokens"
                    assert t.source[i] is not None and host_pool_of(t.source[i]) == pool, \
                        f"{name} block {i} is tagged with device pool {t.source[i]!r}"
            for h, i in t.index.items():
                assert 0 <= i < t.n and t.hash[i] == h, f"{name}: index maps a hash to block {i}, which lacks it"
            uses = [t.last_use[i] for i in t.lru]
            assert uses == sorted(uses) and len(set(uses)) == len(uses), f"{name}: LRU out of order of last use"
            assert all(u <= self._clock for u in uses), f"{name}: a last use in the future"

    def __repr__(self) -> str:
        parts = ", ".join(f"{p}: {self.num_loadable(p)}/{t.n} loadable, {self.num_storing(p)} storing, "
                          f"{self.num_pinned(p)} pinned" for p, t in self._pools.items())
        return f"HostPrefixTier(block_size={self.block_size}, {parts})"
