"""HostPrefixTier: the tensor-free bookkeeping of the block-level CPU prefix tier (issue 14, part 2)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvq.cache.block_allocator import hash_block_tokens
from kvq.cache.block_manager import BlockManager, WindowPolicy
from kvq.cache.host_tier import HostBlock, HostHit, HostPrefixTier, chain_blocks, host_pool_of

BS = 4


def prompt(*values: int, bs: int = BS) -> list[int]:
    """A prompt of one block per value, every token of block ``i`` equal to ``values[i]``."""
    return [v for v in values for _ in range(bs)]


def stored(tier: HostPrefixTier, pool: str, block_hash: int, tokens, device_block: int = 0):
    req = tier.offer(pool, block_hash, tokens, device_block)
    assert req is not None
    tier.store_done(req)
    return req


def lru_hashes(tier: HostPrefixTier, pool: str) -> list[int]:
    t = tier._pools[pool]
    return [t.hash[i] for i in t.lru]


# -- hashing -------------------------------------------------------------------------------------------
def test_chain_blocks_hashes_like_the_device_prefix_index():
    policy = WindowPolicy(BS, sink_blocks=1, residual_tokens=4, write_direct=False)
    m = BlockManager(16, 8, policy)
    toks = prompt(3, 1, 4, 1, 5) + [9, 2]
    m.allocate_prompt("a", toks)
    m.mark_computed("a", len(toks))
    table = m.block_table("a")
    chain = chain_blocks(toks, BS)
    assert len(chain) == 5 and chain[0][1] == (3,) * BS
    for i, (h, t) in enumerate(chain):
        alloc = m.allocator(table[i].pool)
        assert alloc.block_hash(table[i].block_id) == h
        assert alloc.block_tokens(table[i].block_id) == t
    assert chain[1][0] == hash_block_tokens(chain[0][0], (1,) * BS)
    assert chain_blocks(toks, BS, 2) == chain[:2]
    with pytest.raises(ValueError):
        chain_blocks(toks, BS, 6)


# -- stores --------------------------------------------------------------------------------------------
def test_a_block_is_loadable_only_after_its_store_completes():
    tier = HostPrefixTier(BS, 2, 1)
    (h, t), = chain_blocks(prompt(7), BS)
    req = tier.offer("q", h, t, device_block=5)
    assert req.pool == "q" and req.block_hash == h and req.device_block == 5 and req.evicted_hash is None
    assert req.host_block == 0
    assert tier.probe("q", h, t) is None and tier.lookup_chain(["q"], [(h, t)]).num_blocks == 0
    assert (tier.num_used("q"), tier.num_storing("q"), tier.num_loadable("q")) == (1, 1, 0)
    assert tier.offer("q", h, t, 6) is None  # already held (in flight)
    tier.check_integrity()
    tier.store_done(req)
    assert tier.probe("q", h, t) == 0 and tier.probe("hp", h, t) is None  # per pool
    assert (tier.num_used("q"), tier.num_storing("q"), tier.num_loadable("q")) == (1, 0, 1)
    assert tier.stats("q").stores == 1 and tier.stats("hp").stores == 0
    assert tier.offer("q", h, t, 6) is None  # already held
    tier.check_integrity()


def test_store_failed_drops_the_entry_and_stale_requests_raise():
    tier = HostPrefixTier(BS, 1, 0)
    (h, t), = chain_blocks(prompt(7), BS)
    req = tier.offer("q", h, t, 0)
    tier.store_failed(req)
    assert tier.num_used("q") == 0 and tier.probe("q", h, t) is None
    assert tier.stats("q").store_failures == 1 and tier.stats("q").stores == 0
    for end in (tier.store_done, tier.store_failed):
        with pytest.raises(ValueError):
            end(req)
    again = tier.offer("q", h, t, 0)  # the hash is free to be offered again
    assert again is not None and again.ticket != req.ticket
    tier.store_done(again)
    with pytest.raises(ValueError):
        tier.store_done(again)
    tier.check_integrity()


def test_a_pool_without_blocks_refuses_every_offer():
    tier = HostPrefixTier(BS, 0, 1)
    (h, t), = chain_blocks(prompt(1), BS)
    assert tier.offer("q", h, t, 0) is None and tier.stats("q").rejected == 1
    assert tier.lookup_chain(["q"], [(h, t)]).num_blocks == 0
    assert tier.offer("hp", h, t, 0) is not None  # the other pool is independent
    tier.check_integrity()


def test_lru_eviction_takes_the_least_recently_used_loadable_block():
    tier = HostPrefixTier(BS, 2, 0)
    (a, ta), (b, tb), (c, tc) = chain_blocks(prompt(1, 2, 3), BS)
    stored(tier, "q", a, ta)
    stored(tier, "q", b, tb)
    assert lru_hashes(tier, "q") == [a, b]
    assert tier.offer("q", a, ta, 0) is None  # a re-offer is a use: a becomes the most recent
    assert lru_hashes(tier, "q") == [b, a]
    req = tier.offer("q", c, tc, 0)
    assert req.evicted_hash == b and tier.stats("q").evictions == 1
    assert tier.probe("q", b, tb) is None and tier.probe("q", a, ta) is not None
    tier.store_done(req)
    assert lru_hashes(tier, "q") == [a, c]
    tier.check_integrity()


def test_storing_and_pinned_blocks_are_never_evicted():
    tier = HostPrefixTier(BS, 1, 0)
    (a, ta), (b, tb) = chain_blocks(prompt(1, 2), BS)
    req = tier.offer("q", a, ta, 0)
    assert tier.offer("q", b, tb, 1) is None  # the only block is STORING
    assert tier.stats("q").rejected == 1
    tier.store_done(req)
    load = tier.pin_for_load(tier.lookup_chain(["q"], [(a, ta)]), [3])
    assert tier.num_pinned("q") == 1
    assert tier.offer("q", b, tb, 1) is None  # the only block is pinned
    assert tier.stats("q").rejected == 2 and tier.probe("q", a, ta) == 0
    tier.check_integrity()
    tier.load_done(load)
    assert tier.num_pinned("q") == 0
    req = tier.offer("q", b, tb, 1)
    assert req.evicted_hash == a
    tier.check_integrity()


def test_a_hash_hit_with_other_tokens_is_a_miss():
    tier = HostPrefixTier(BS, 4, 0)
    chain = chain_blocks(prompt(1, 2, 3), BS)
    (h0, t0), (h1, t1), (h2, t2) = chain
    stored(tier, "q", h0, t0)
    stored(tier, "q", h1, (9,) * BS)  # a collision: block 1's hash with other tokens
    stored(tier, "q", h2, t2)
    assert tier.probe("q", h1, t1) is None
    assert tier.lookup_chain(["q"] * 3, chain).num_blocks == 1  # the run stops at the collision
    assert tier.offer("q", h1, t1, 0) is None  # the hash is held; the held block stays
    assert tier.probe("q", h1, (9,) * BS) is not None


# -- lookups and loads ---------------------------------------------------------------------------------
def test_lookup_chain_continues_a_device_hit_in_the_right_pools_without_mutating():
    tier = HostPrefixTier(BS, 4, 2, first_block=(10, 20))
    chain = chain_blocks(prompt(1, 2, 3, 4, 5), BS)
    pools = ["hp", "q", "q", "hp", "q"]
    for i in (1, 2, 3):
        stored(tier, pools[i], *chain[i])
    stored(tier, "q", *chain[4])
    stored(tier, "q", *chain[0])  # block 0 is wanted in hp: held in q does not count
    before = (tier.stats("q"), tier.stats("hp"), lru_hashes(tier, "q"), lru_hashes(tier, "hp"))
    assert tier.lookup_chain(pools, chain, start=0).num_blocks == 0
    hit = tier.lookup_chain(pools, chain, start=1)
    assert hit.start == 1 and hit.end == 5
    assert [b.pool for b in hit.blocks] == pools[1:]
    assert [b.block_hash for b in hit.blocks] == [h for h, _ in chain[1:]]
    assert all(10 <= b.host_block < 14 if b.pool == "q" else 20 <= b.host_block < 22 for b in hit.blocks)
    assert tier.lookup_chain(lambda i: pools[i], chain, start=1) == hit
    assert tier.lookup_chain(pools, chain, start=2).blocks == hit.blocks[1:]
    assert tier.lookup_chain(pools[:3] + ["q", "q"], chain, start=1).num_blocks == 2  # block 3 is in hp
    assert tier.lookup_chain(pools, chain, start=5).num_blocks == 0
    with pytest.raises(ValueError):
        tier.lookup_chain(pools, chain, start=6)
    assert (tier.stats("q"), tier.stats("hp"), lru_hashes(tier, "q"), lru_hashes(tier, "hp")) == before


def test_pinned_load_pairs_counters_and_unpin_outcomes():
    tier = HostPrefixTier(BS, 3, 2, first_block=(0, 5))
    chain = chain_blocks(prompt(1, 2, 3), BS)
    pools = ["hp", "q", "q"]
    for i in range(3):
        stored(tier, pools[i], *chain[i])
    hit = tier.lookup_chain(pools, chain)
    load = tier.pin_for_load(hit, [7, 8, 9])
    assert load.hit == hit and load.device_blocks == (7, 8, 9)
    assert load.hp_pairs == ((hit.blocks[0].host_block, 7),)
    assert load.q_pairs == ((hit.blocks[1].host_block, 8), (hit.blocks[2].host_block, 9))
    assert tier.stats("q").hits == 2 and tier.stats("hp").hits == 1
    assert tier.num_pinned("q") == 2 and lru_hashes(tier, "q") == []
    second = tier.pin_for_load(tier.lookup_chain(pools, chain, start=1), [1, 2])  # two loads share blocks
    tier.check_integrity()
    tier.load_timed_out(load)
    assert tier.stats("q").load_timeouts == 2 and tier.stats("hp").load_timeouts == 1
    assert tier.num_pinned("q") == 2 and tier.num_pinned("hp") == 0  # `second` still reads them
    with pytest.raises(ValueError):
        tier.load_done(load)
    tier.load_failed(second)
    assert tier.stats("q").load_failures == 2 and tier.num_pinned("q") == 0
    assert lru_hashes(tier, "q") == [chain[1][0], chain[2][0]]  # back in the LRU, most recent
    assert tier.lookup_chain(pools, chain) == hit  # host copies stay after a failed or timed-out load
    third = tier.pin_for_load(hit, [7, 8, 9])
    tier.load_done(third)
    assert tier.stats("q").loads == 2 and tier.stats("hp").loads == 1
    tier.note_miss("hp")
    assert tier.stats("hp").misses == 1 and tier.stats("q").misses == 0
    tier.check_integrity()


def test_pin_of_a_stale_hit_raises_and_changes_nothing():
    tier = HostPrefixTier(BS, 1, 0)
    chain = chain_blocks(prompt(1, 2), BS)
    stored(tier, "q", *chain[0])
    hit = tier.lookup_chain(["q", "q"], chain)
    assert hit.num_blocks == 1
    assert tier.offer("q", *chain[1], 0).evicted_hash == chain[0][0]  # an offer between lookup and pin
    with pytest.raises(ValueError):
        tier.pin_for_load(hit, [0])
    assert tier.num_pinned("q") == 0 and tier.stats("q").hits == 0
    tier.check_integrity()


def test_bad_arguments_raise():
    tier = HostPrefixTier(BS, 2, 2, first_block=(4, 0))
    (h, t), (h1, t1) = chain_blocks(prompt(1, 2), BS)
    with pytest.raises(ValueError):
        tier.offer("fp8", h, t, 0)
    with pytest.raises(ValueError):
        tier.offer("q", h, t[:-1], 0)  # partial block
    with pytest.raises(ValueError):
        tier.offer("q", h, t, -1)
    stored(tier, "q", h, t)
    stored(tier, "q", h1, t1)
    hit = tier.lookup_chain(["q", "q"], [(h, t), (h1, t1)])
    with pytest.raises(ValueError):
        tier.pin_for_load(hit, [0])  # one device block for two host blocks
    with pytest.raises(ValueError):
        tier.pin_for_load(hit, [3, 3])  # one device block receives two
    with pytest.raises(ValueError):
        tier.pin_for_load(HostHit(0, ()), [])
    with pytest.raises(ValueError):
        tier.pin_for_load(HostHit(0, (HostBlock("q", 0, h),)), [0])  # host id below first_block
    assert tier.num_pinned("q") == 0
    for args in ((0, 1, 1), (BS, -1, 1), (BS, 1, 1, (0, -2))):
        with pytest.raises(ValueError):
            HostPrefixTier(*args)
    tier.check_integrity()


@pytest.mark.parametrize("corrupt", ["pinned_in_lru", "storing_in_lru", "evicted_while_pinned", "lru_order",
                                     "index", "free_twice"])
def test_check_integrity_catches_each_broken_invariant(corrupt):
    tier = HostPrefixTier(BS, 4, 0)
    chain = chain_blocks(prompt(1, 2, 3), BS)
    stored(tier, "q", *chain[0])
    stored(tier, "q", *chain[1])
    tier.pin_for_load(tier.lookup_chain(["q"], chain[:1]), [0])
    pending = tier.offer("q", *chain[2], 0)
    tier.check_integrity()
    t = tier._pools["q"]
    if corrupt == "pinned_in_lru":
        t.lru[0] = None
    elif corrupt == "storing_in_lru":
        t.lru[pending.host_block] = None
    elif corrupt == "evicted_while_pinned":
        t.clear(0)
        t.free.append(0)
    elif corrupt == "lru_order":
        t.last_use[1] = tier._clock + 1
    elif corrupt == "index":
        t.index[12345] = 1
    else:
        t.free.append(t.free[-1])
    with pytest.raises(AssertionError):
        tier.check_integrity()


# -- random operations against a reference model -------------------------------------------------------
class TierMachine(RuleBasedStateMachine):
    """Random offers, store completions and failures, lookups, pinned loads and their ends over tiny pools.

    The model: per host pool, ``hash -> [tokens, state, pins, last use, device pool]``; the LRU victim
    is the LOADABLE unpinned entry of least last use.  Blocks are offered from the device pools q, hp
    and the lower tiers' q1, q2 (elastic precision: kept in host q blocks, tagged with their tier).
    After every rule the tier's integrity holds and it agrees with the model on what is held,
    loadable, pinned, from which device pool and in which LRU order.
    """

    @initialize(bs=st.integers(1, 3), nq=st.integers(1, 4), nhp=st.integers(1, 3),
                first=st.tuples(st.integers(0, 3), st.integers(0, 3)))
    def setup(self, bs, nq, nhp, first):
        self.bs = bs
        self.tier = HostPrefixTier(bs, nq, nhp, first_block=first)
        self.cap = {"q": nq, "hp": nhp}
        self.held: dict[str, dict[int, list]] = {"q": {}, "hp": {}}  # hash -> [tokens, state, pins, use]
        self.clock = 0
        self.seen: list = []  # (chain, pools) of prompts drawn so far
        self.offered: list = []  # (chain, pools, first block offered)
        self.stores: list = []  # outstanding StoreRequests
        self.loads: list = []
        self.ended: list = []  # requests already ended: ending them again raises
        self.counts = {p: dict(stores=0, store_failures=0, rejected=0, evictions=0, replaced=0, hits=0, loads=0,
                               load_failures=0, load_timeouts=0) for p in ("q", "hp")}

    def touch(self, entry):
        self.clock += 1
        entry[3] = self.clock

    def prompt(self, data):
        """A prompt's chained blocks and the pool each block lives in: half the time one seen before,
        else 1-4 blocks over 3 token values (so prompts share prefixes) in random pools."""
        if self.seen and data.draw(st.booleans()):
            return data.draw(st.sampled_from(self.seen))
        values = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=4))
        chain = chain_blocks(prompt(*values, bs=self.bs), self.bs)
        pools = data.draw(st.lists(st.sampled_from(["q", "hp", "q1", "q2"]), min_size=len(chain),
                                   max_size=len(chain)))
        self.seen.append((chain, pools))
        return chain, pools

    @rule(data=st.data(), collide=st.booleans(), dev=st.integers(0, 50), done=st.booleans())
    def offer(self, data, collide, dev, done):
        """Offer a run of a prompt's blocks, each to its pool (as a finished sequence's blocks are);
        with ``done`` the stores complete at once (a copy that finished before the next step)."""
        chain, pools = self.prompt(data)
        lo = data.draw(st.integers(0, len(chain) - 1))
        self.offered.append((chain, pools, lo))
        for i in range(lo, data.draw(st.integers(lo + 1, len(chain)))):
            h, toks = chain[i]
            if collide and data.draw(st.booleans()):
                toks = tuple(t + 3 for t in toks)  # the hash with other tokens
            req = self.offer_one(pools[i], h, toks, dev + i)
            if req is not None and done:
                self.end_store(req, True)

    def offer_one(self, pool, h, toks, dev):
        host = host_pool_of(pool)
        model = self.held[host]
        req = self.tier.offer(pool, h, toks, dev)
        if h in model:
            e = model[h]
            if e[1] == "loadable" and e[2] == 0 and e[0] == toks and e[4] != pool:  # another tier's: replaced
                assert req is not None and req.evicted_hash == h and (req.pool, req.device_block) == (pool, dev)
                model[h] = [toks, "storing", 0, 0, pool]
                self.counts[host]["replaced"] += 1
                self.stores.append(req)
                return req
            assert req is None
            if e[1] == "loadable" and e[2] == 0 and e[0] == toks:
                self.touch(e)
            return
        victims = [(e[3], hh) for hh, e in model.items() if e[1] == "loadable" and e[2] == 0]
        if len(model) < self.cap[host]:
            assert req is not None and req.evicted_hash is None
        elif victims:
            assert req is not None and req.evicted_hash == min(victims)[1]
            del model[req.evicted_hash]
            self.counts[host]["evictions"] += 1
        else:
            assert req is None
            self.counts[host]["rejected"] += 1
            return
        assert (req.pool, req.host_pool, req.block_hash, req.device_block) == (pool, host, h, dev)
        model[h] = [toks, "storing", 0, 0, pool]
        self.stores.append(req)
        return req

    def end_store(self, req, ok):
        self.stores.remove(req)
        model = self.held[req.host_pool]
        if ok:
            self.tier.store_done(req)
            model[req.block_hash][1] = "loadable"
            self.touch(model[req.block_hash])
            self.counts[req.host_pool]["stores"] += 1
        else:
            self.tier.store_failed(req)
            del model[req.block_hash]
            self.counts[req.host_pool]["store_failures"] += 1
        self.ended.append(req)

    @rule(data=st.data())
    def end_stores(self, data):
        """Outstanding stores (all, or some) complete (mostly) or fail, in any order."""
        n = len(self.stores)
        for _ in range(data.draw(st.sampled_from([n, n, data.draw(st.integers(0, n))]))):
            req = data.draw(st.sampled_from(self.stores))
            self.end_store(req, data.draw(st.sampled_from([True, True, True, False])))

    def expected_run(self, pools, chain, start):
        """(device pool stored from, hash) of the run: a host q block loads into the tier it came from."""
        run = []
        for i in range(start, len(chain)):
            e = self.held[pools[i]].get(chain[i][0])
            if e is None or e[1] != "loadable" or e[0] != chain[i][1]:
                break
            run.append((e[4], chain[i][0]))
        return run

    @rule(data=st.data(), pin=st.booleans())
    def lookup(self, data, pin):
        """A prompt's host run after a device hit of ``start`` blocks; pinned for a load if ``pin``."""
        if self.offered and data.draw(st.integers(0, 3)):  # a recent offer's prompt, from where it began
            chain, pools, start = data.draw(st.sampled_from(self.offered[-2:]))
        else:
            chain, pools = self.prompt(data)
            start = data.draw(st.sampled_from([0, data.draw(st.integers(0, len(chain)))]))
        pools = [host_pool_of(p) for p in pools]  # a lookup asks the window rule's state: q or hp
        if data.draw(st.integers(0, 3)) == 0:  # ask for other pools than the blocks were offered to
            pools = data.draw(st.lists(st.sampled_from(["q", "hp"]), min_size=len(chain), max_size=len(chain)))
        hit = self.tier.lookup_chain(pools, chain, start)
        want = self.expected_run(pools, chain, start)
        assert hit.start == start and [(b.pool, b.block_hash) for b in hit.blocks] == want
        for i, b in enumerate(hit.blocks, start):
            assert self.tier.probe(b.host_pool, b.block_hash, chain[i][1]) == b.host_block
            assert self.tier.probe_block(b.host_pool, b.block_hash, chain[i][1]) == b
        if not pin or not hit.blocks:
            return
        load = self.tier.pin_for_load(hit, range(100, 100 + hit.num_blocks))
        got = {"q": load.q_pairs, "hp": load.hp_pairs, **dict(load.tier_pairs)}
        want_pairs: dict[str, list] = {}
        for j, b in enumerate(hit.blocks):
            self.held[b.host_pool][b.block_hash][2] += 1
            self.counts[b.host_pool]["hits"] += 1
            want_pairs.setdefault(b.pool, []).append((b.host_block, 100 + j))
        assert {p: list(v) for p, v in got.items() if v} == want_pairs  # each block into its own pool
        assert [p for p, _ in load.tier_pairs] == sorted(set(want_pairs) - {"q", "hp"})
        self.loads.append(load)

    @rule(data=st.data(), outcome=st.sampled_from(["loads", "load_failures", "load_timeouts"]))
    def end_load(self, data, outcome):
        if not self.loads:
            return
        load = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        end = {"loads": self.tier.load_done, "load_failures": self.tier.load_failed,
               "load_timeouts": self.tier.load_timed_out}[outcome]
        end(load)
        for b in load.hit.blocks:
            e = self.held[b.host_pool][b.block_hash]
            e[2] -= 1
            if e[2] == 0:
                self.touch(e)
            self.counts[b.host_pool][outcome] += 1
        self.ended.append(load)

    @rule(data=st.data())
    def end_twice(self, data):
        if not self.ended:
            return
        req = data.draw(st.sampled_from(self.ended))
        ends = [self.tier.store_done, self.tier.store_failed] if hasattr(req, "evicted_hash") else \
            [self.tier.load_done, self.tier.load_failed, self.tier.load_timed_out]
        with pytest.raises(ValueError):
            data.draw(st.sampled_from(ends))(req)

    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "tier"):
            return
        tier = self.tier
        tier.check_integrity()
        for pool, model in self.held.items():
            t = tier._pools[pool]
            assert {t.hash[i]: t.state[i] for i in range(t.n) if t.hash[i] is not None} == \
                {h: e[1] for h, e in model.items()}
            loadable = [h for h, e in model.items() if e[1] == "loadable"]
            for h, e in model.items():
                got = tier.probe(pool, h, e[0])
                assert (got is not None) == (e[1] == "loadable")
                assert t.source[t.index[h]] == e[4]
                if got is not None:
                    assert t.pins[got - t.first] == e[2]
            assert tier.num_used(pool) == len(model) <= self.cap[pool]
            assert tier.num_loadable(pool) == len(loadable)
            assert tier.num_storing(pool) == len(model) - len(loadable)
            assert tier.num_pinned(pool) == sum(e[2] > 0 for e in model.values())
            assert lru_hashes(tier, pool) == [h for _, h in sorted((e[3], h) for h, e in model.items()
                                                                   if e[1] == "loadable" and e[2] == 0)]
            stats = tier.stats(pool)
            assert {k: getattr(stats, k) for k in self.counts[pool]} == self.counts[pool]

    def teardown(self):
        if not hasattr(self, "tier"):
            return
        for load in self.loads:
            self.tier.load_done(load)
        for req in self.stores:
            self.tier.store_done(req)
        self.tier.check_integrity()
        for pool in ("q", "hp"):
            assert self.tier.num_pinned(pool) == 0 and self.tier.num_storing(pool) == 0


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
