"""BlockManager: the window rule, unit tests, and a stateful test that simulates the engine's KV data."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvq.cache.block_manager as bm
from kvq.cache.block_allocator import NoFreeBlocksError
from kvq.cache.block_manager import BlockManager, BlockRef, CopyOp, PrefixHit, SealOp, WindowPolicy, block_state

# -- the rule -------------------------------------------------------------------------------
# (block_size, sink_blocks, residual_tokens, write_direct, n, expected pools of blocks 0..ceil(n/bs)-1)
RULE_CASES = [
    (4, 0, 0, True, 10, "q q q"),  # direct writes, no window: even the partial tail is q
    (4, 0, 0, False, 10, "q q hp"),  # per-block format: partial tail stays hp until full
    (4, 0, 0, False, 8, "q q"),  # a block seals as soon as it is full
    (4, 1, 0, True, 10, "hp q q"),  # sinks are hp forever
    (4, 2, 0, False, 3, "hp"),
    (4, 0, 4, True, 10, "q hp hp"),  # block 1 ends at 8 > 10 - 4: still in the window
    (4, 0, 4, True, 12, "q q hp"),  # block 1 ends at 8 <= 12 - 4: sealed
    (4, 1, 8, False, 23, "hp q q hp hp hp"),
    (1, 0, 2, True, 5, "q q q hp hp"),
    (8, 0, 100, True, 50, "hp hp hp hp hp hp hp"),
    (4, 3, 0, True, 8, "hp hp"),  # more sinks than blocks
]


@pytest.mark.parametrize("bs,sink,res,direct,n,expected", RULE_CASES)
def test_block_state_table(bs, sink, res, direct, n, expected):
    policy = WindowPolicy(bs, sink_blocks=sink, residual_tokens=res, write_direct=direct)
    got = [block_state(i, n, policy) for i in range(-(-n // bs))]
    assert got == expected.split()


@pytest.mark.parametrize("bs,sink,res,direct", [(4, 1, 5, False), (2, 0, 0, False), (3, 2, 7, True)])
def test_block_state_is_monotone_in_n(bs, sink, res, direct):
    policy = WindowPolicy(bs, sink, res, direct)
    for i in range(8):
        states = [block_state(i, n, policy) for n in range(60)]
        assert states == sorted(states, key=lambda s: s == "q"), "a block may only go hp -> q"


def test_policy_validation():
    for bad in ({"block_size": 0}, {"block_size": 4, "sink_blocks": -1}, {"block_size": 4, "residual_tokens": -2},
                {"block_size": True}):
        with pytest.raises(ValueError):
            WindowPolicy(**bad)


# -- unit tests -----------------------------------------------------------------------------
def test_prompt_prefix_hit_and_cap():
    m = BlockManager(16, 4, WindowPolicy(4))
    prompt = list(range(9))
    assert m.allocate_prompt("a", prompt) == PrefixHit(0)
    m.mark_computed("a", 9)
    m.free("a")
    assert m.allocator("q").num_cached == 2  # the partial block 2 is not cached
    assert m.allocate_prompt("b", prompt) == PrefixHit(8)
    assert m.allocate_prompt("c", prompt[:8]) == PrefixHit(4)  # the last token is always computed
    assert m.allocate_prompt("d", prompt[:4] + [99] * 5) == PrefixHit(4)  # stops at the first miss
    b = m.block_table("b")
    assert m.block_table("c")[0] == m.block_table("d")[0] == b[0]
    assert b[1] not in m.block_table("c") + m.block_table("d")
    assert m.allocator("q").num_hits == 4 and m.allocator("q").num_misses == 2  # "a" and "d"
    m.check_integrity()


def test_blocks_are_registered_only_once_computed():
    """A reserved prompt whose chunked prefill is not done yet must not be hit by another sequence."""
    m = BlockManager(16, 4, WindowPolicy(4))
    prompt = list(range(12))
    m.allocate_prompt("a", prompt)
    assert m.allocate_prompt("b", prompt) == PrefixHit(0)
    m.mark_computed("a", 6)
    assert m.allocate_prompt("c", prompt) == PrefixHit(4)
    m.append_slots("a", [12])  # appending implies the whole prompt was computed
    assert m.num_computed("a") == 12
    assert m.allocate_prompt("d", prompt) == PrefixHit(8)
    m.check_integrity()


def test_a_swap_in_that_seals_at_once_registers_next_step():
    """Pipelined: a sequence swapped out while its last token was still in flight comes back, and its
    next append seals the block that token filled.  The swap-in's copy may yet fail, so nothing of it
    is registered in that step (the seal still finds its content's hash), and the next step registers
    the sealed block for prefix hits (the scheduler's stateful test found an IndexError here)."""
    m = BlockManager(8, 8, WindowPolicy(2, sink_blocks=0, residual_tokens=0, write_direct=False), host_blocks=(8, 8))
    m.allocate_prompt(0, [1, 2, 3])
    m.mark_computed(0, 3)
    m.begin_step()
    m.append_slots(0, [4])  # its KV still to be computed when the sequence is swapped out
    m.swap_out(0)
    m.begin_step()
    m.swap_in(0)
    ops = m.append_slots(0, [5])
    assert [type(op).__name__ for op in ops] == ["SealOp"] and [r.pool for r in m.block_table(0)] == ["q", "q", "hp"]
    assert m.allocate_prompt(1, [1, 2, 3, 4, 9]) == PrefixHit(2)  # landing: the sealed block is not offered yet
    m.free(1)
    m.begin_step()
    m.append_slots(0, [6])
    assert m.allocate_prompt(2, [1, 2, 3, 4, 9]) == PrefixHit(4)
    m.check_integrity()


def test_prefix_hit_only_from_the_pool_the_block_must_live_in():
    """A cached prefix of h blocks is reused only if each block is cached in the pool the window rule
    gives it at length h * bs: the first computed query must read exactly what the rule says."""
    policy = WindowPolicy(4, sink_blocks=1, residual_tokens=4, write_direct=False)
    m = BlockManager(16, 8, policy)
    m.allocate_prompt("a", list(range(10)))  # blocks: hp(sink) hp hp
    m.append_slots("a", [10, 11, 12])  # settles at 10: block 1 stays hp; block 2 fills up
    m.mark_computed("a", 13)
    m.free("a")  # cached: blocks 0, 1, 2, all in hp
    # Same 10 tokens: a hit of 2 blocks ends at 8, where block 1 is hp (within 4 of 8) -> hit 8.
    assert m.allocate_prompt("b", list(range(10))) == PrefixHit(8)
    # 14 tokens could hit 3 blocks, but at 12 block 1 must be q and only its hp copy is cached ->
    # the longest valid hit is 2 blocks; block 2 is recomputed.
    assert m.allocate_prompt("c", list(range(14))) == PrefixHit(8)
    assert [r.pool for r in m.block_table("c")] == ["hp", "hp", "hp", "hp"]  # settled at 8; new at 14
    m.check_integrity()
    m.free("b")
    m.free("c")
    # Once block 1's sealed copy is cached too, all 3 blocks hit (the q copy of block 1).
    m.allocate_prompt("d", list(range(14)))
    m.append_slots("d", [14])  # settles at 14: blocks 1 (ends 8 <= 10) sealed into q
    m.mark_computed("d", 15)
    m.free("d")
    assert m.allocate_prompt("e", list(range(14))) == PrefixHit(12)
    assert [r.pool for r in m.block_table("e")] == ["hp", "q", "hp", "hp"]
    m.check_integrity()


def test_hash_collision_is_rejected(monkeypatch):
    """With a degenerate hash every block collides; token verification must reject the wrong ones."""
    monkeypatch.setattr(bm, "hash_block_tokens", lambda parent, toks, extra=(): 0 if parent is None else parent + 1)
    m = BlockManager(16, 4, WindowPolicy(4))
    m.allocate_prompt("a", [1, 1, 1, 1, 2, 2, 2, 2, 9])
    m.mark_computed("a", 9)
    m.free("a")
    assert m.allocate_prompt("b", [5, 5, 5, 5, 2, 2, 2, 2, 9]) == PrefixHit(0)
    assert m.allocate_prompt("c", [1, 1, 1, 1, 2, 2, 2, 2, 7]) == PrefixHit(8)
    m.check_integrity()


def test_decode_seals_lazily_and_returns_ops():
    policy = WindowPolicy(4, sink_blocks=1, residual_tokens=4, write_direct=False)
    m = BlockManager(8, 8, policy)
    m.allocate_prompt(0, list(range(10)))
    sealed = {}
    for t in range(10, 21):
        for op in m.append_slots(0, [t]):
            assert isinstance(op, SealOp) and op.seq_id == 0
            sealed[op.logical_index] = (t, op)
        m.check_integrity()
    # block 1 ends at 8: q once n_old >= 12, i.e. on the call that appends token 12.
    assert [sealed[i][0] for i in (1, 2, 3)] == [12, 16, 20] and sorted(sealed) == [1, 2, 3]
    assert m.block_table(0)[1] == BlockRef("q", sealed[1][1].dst_q_block)
    assert [r.pool for r in m.block_table(0)] == ["hp", "q", "q", "q", "hp", "hp"]


def test_per_block_format_seals_full_tail_on_next_call():
    m = BlockManager(8, 2, WindowPolicy(2, write_direct=False))
    m.allocate_prompt("s", [1])
    assert m.append_slots("s", [2]) == []  # block 0 is now full but holds this call's token
    assert m.block_table("s")[0].pool == "hp"
    ops = m.append_slots("s", [3])
    assert [type(o) for o in ops] == [SealOp] and m.block_table("s")[0].pool == "q"
    assert m.allocator("hp").num_used == 1  # only the new partial tail


def test_write_direct_without_window_is_all_q():
    m = BlockManager(8, 0, WindowPolicy(4))
    m.allocate_prompt("s", [1, 2, 3])
    for t in range(5):
        assert m.append_slots("s", [t]) == []
    assert {r.pool for r in m.block_table("s")} == {"q"}
    assert m.slots("s", 3, 5) == [("q", 0, 3), ("q", 1, 0)]
    with pytest.raises(ValueError):
        m.slots("s", 0, 9)


def test_fork_copy_on_write_and_seal_dedup():
    policy = WindowPolicy(2, residual_tokens=2, write_direct=False)
    m = BlockManager(8, 8, policy)
    m.allocate_prompt("p", [1, 2, 3])  # hp hp
    m.fork("p", "c")
    assert m.block_table("p") == m.block_table("c")
    ops = m.append_slots("c", [4])
    assert len(ops) == 1 and isinstance(ops[0], CopyOp)
    assert ops[0].src == m.block_table("p")[1] and ops[0].dst == m.block_table("c")[1]
    assert m.append_slots("p", [4]) == []  # now the only owner: writes in place
    seal_c = m.append_slots("c", [5])  # n_old = 4: block 0 ends at 2 <= 4 - 2 and seals
    assert [type(o) for o in seal_c] == [SealOp]
    assert m.append_slots("p", [5]) == []  # same content already quantized by the sibling: shared
    assert m.block_table("p")[0] == m.block_table("c")[0] == BlockRef("q", seal_c[0].dst_q_block)
    m.check_integrity()
    for s in ("p", "c"):
        m.free(s)
    assert m.allocator("q").num_used == m.allocator("hp").num_used == 0


def test_failed_calls_leave_state_unchanged():
    m = BlockManager(2, 2, WindowPolicy(2, residual_tokens=2, write_direct=False))
    before = pickle.dumps(m)
    assert not m.can_allocate(9)  # blocks 0..2 must be q at n=9: three q blocks, two exist
    with pytest.raises(NoFreeBlocksError):
        m.allocate_prompt("a", list(range(9)))
    assert pickle.dumps(m) == before and "a" not in m
    assert m.can_allocate(3)
    m.allocate_prompt("a", [1, 2, 3])  # hp hp: the hp pool is full
    m.fork("a", "b")
    before = pickle.dumps(m)
    assert not m.can_append_slots("b", 1)
    with pytest.raises(NoFreeBlocksError):
        m.append_slots("b", [4])  # copy-on-write of the shared tail needs an hp block
    assert pickle.dumps(m) == before
    m.free("a")
    assert m.append_slots("b", [4]) == []
    m.check_integrity()


def test_failed_calls_account_for_revived_cached_blocks():
    """Reviving a cached-free block uses up an allocatable block: the check must see that."""
    m = BlockManager(3, 0, WindowPolicy(2))
    m.allocate_prompt("a", [1, 2, 3, 4, 5])
    m.mark_computed("a", 5)
    m.free("a")  # two cached-free blocks + one free
    prompt = [1, 2, 3, 4, 9, 9, 9]  # hits both cached blocks, needs two new ones: 4 > 3
    before = pickle.dumps(m)
    assert not m.can_allocate(7, prompt)
    with pytest.raises(NoFreeBlocksError):
        m.allocate_prompt("b", prompt)
    assert pickle.dumps(m) == before

    m = BlockManager(2, 8, WindowPolicy(2, residual_tokens=2, write_direct=False))
    m.allocate_prompt("p", [1, 2, 3])
    m.fork("p", "c")
    m.append_slots("c", [4])
    assert [type(o) for o in m.append_slots("c", [5])] == [SealOp]
    m.free("c")  # its q block stays cached
    m.append_slots("p", [4])
    before = pickle.dumps(m)
    assert not m.can_append_slots("p", 6)  # seal dedup revives the cached q block + 2 new q blocks > 2
    with pytest.raises(NoFreeBlocksError):
        m.append_slots("p", [5, 6, 7, 8, 9, 10])
    assert pickle.dumps(m) == before
    m.check_integrity()


def test_unknown_and_duplicate_ids():
    m = BlockManager(4, 4, WindowPolicy(2))
    with pytest.raises(KeyError, match="unknown sequence"):
        m.append_slots("x", [1])
    with pytest.raises(KeyError):
        m.free("x")
    with pytest.raises(KeyError):
        m.fork("x", "y")
    m.allocate_prompt("a", [1])
    with pytest.raises(ValueError):
        m.allocate_prompt("a", [1])
    with pytest.raises(ValueError):
        m.fork("a", "a")
    with pytest.raises(ValueError):
        m.allocate_prompt("b", [])
    with pytest.raises(ValueError):
        m.num_free_blocks("x")
    with pytest.raises(ValueError):
        m.mark_computed("a", 2)


def test_prefix_caching_disabled():
    m = BlockManager(8, 2, WindowPolicy(2), enable_prefix_caching=False)
    m.allocate_prompt("a", [1, 2, 3, 4, 5])
    m.mark_computed("a", 5)
    m.free("a")
    assert m.allocator("q").num_cached == 0
    assert m.allocate_prompt("b", [1, 2, 3, 4, 5]) == PrefixHit(0)
    m.check_integrity()


# -- stateful: the manager driven like an engine, with simulated KV data --------------------
def kv_chain(tokens) -> list[int]:
    """The 'KV' of position p: a value determined by tokens[:p+1] (its whole prefix)."""
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class ManagerMachine(RuleBasedStateMachine):
    """Random prompts (sharing prefixes), appends, forks, frees over random policies and tiny pools.

    An engine is simulated: ``mem`` holds the 'KV' of every slot; ops are executed in order,
    then the new tokens are written through ``slots()``. After every step each live sequence,
    read through its block table, must see exactly the KV of its own prefix.
    """

    @initialize(bs=st.integers(1, 8), sink=st.integers(0, 2), res=st.integers(0, 12),
                direct=st.booleans(), prefix=st.booleans(), nq=st.integers(0, 48), nhp=st.integers(0, 16))
    def setup(self, bs, sink, res, direct, prefix, nq, nhp):
        self.policy = WindowPolicy(bs, sink_blocks=sink, residual_tokens=res, write_direct=direct)
        self.m = BlockManager(nq, nhp, self.policy, enable_prefix_caching=prefix)
        self.bs = bs
        self.mem = {"q": [[None] * bs for _ in range(nq)], "hp": [[None] * bs for _ in range(nhp)]}
        self.tokens: dict[int, list[int]] = {}
        self.history: list[list[int]] = [[]]
        self.next_id = 0

    # -- engine simulation ----------------------------------------------------------------
    def execute(self, ops):
        for op in ops:
            if isinstance(op, CopyOp):
                assert op.src.pool == op.dst.pool and op.src != op.dst
                self.mem[op.dst.pool][op.dst.block_id] = list(self.mem[op.src.pool][op.src.block_id])
            else:
                assert isinstance(op, SealOp)
                src = self.mem["hp"][op.src_hp_block]
                i, bs = op.logical_index, self.bs
                expect = kv_chain(self.tokens[op.seq_id])[i * bs:(i + 1) * bs]
                assert src == expect, "a seal must only read an hp block whose KV is complete"
                self.mem["q"][op.dst_q_block] = list(src)

    def write(self, sid, start, end):
        kv = kv_chain(self.tokens[sid])
        written: dict[tuple, set] = {}
        for pos, (pool, bid, off) in zip(range(start, end), self.m.slots(sid, start, end)):
            self.mem[pool][bid][off] = kv[pos]
            written.setdefault((pool, bid), set()).add(off)
        if not (self.policy.write_direct and self.policy.residual_tokens == 0):
            for (pool, bid), offs in written.items():
                if pool == "q":
                    assert len(offs) == self.bs, "a q block of a per-block format must be written whole"

    def check_unchanged(self, before):
        assert pickle.dumps(self.m) == before, "a failed call changed the manager"

    # -- rules ----------------------------------------------------------------------------
    @rule(data=st.data())
    def add_sequence(self, data):
        base = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(0, len(base)))
        suffix = data.draw(st.lists(st.integers(0, 1), max_size=3 * self.bs + 2))
        prompt = base[:cut] + suffix or [0]
        sid, self.next_id = self.next_id, self.next_id + 1
        before = pickle.dumps(self.m)
        can = self.m.can_allocate(len(prompt), prompt)
        if self.m.can_allocate(len(prompt)):
            assert can, "prefix hits can only make a prompt cheaper"
        try:
            hit = self.m.allocate_prompt(sid, prompt)
        except NoFreeBlocksError:
            assert not can
            self.check_unchanged(before)
            event("prompt: out of blocks")
            return
        assert can
        c = hit.num_cached_tokens
        event("prompt: prefix hit" if c else "prompt: no hit")
        assert c % self.bs == 0 and 0 <= c <= len(prompt) - 1
        self.tokens[sid] = list(prompt)
        table = self.m.block_table(sid)
        for i in range(c // self.bs):
            stored = self.m.allocator(table[i].pool).block_tokens(table[i].block_id)
            assert stored == tuple(prompt[i * self.bs:(i + 1) * self.bs])
        kv = kv_chain(prompt)
        for pos, (pool, bid, off) in zip(range(c), self.m.slots(sid, 0, c)):
            assert self.mem[pool][bid][off] == kv[pos], "a prefix hit returned a block with other KV"
        self.write(sid, c, len(prompt))
        self.history.append(list(prompt))
        if data.draw(st.booleans()):
            self.m.mark_computed(sid, len(prompt))

    def do_append(self, sid, new) -> bool:
        """One engine step for ``sid``: append, execute ops, write; False if out of blocks."""
        k = len(new)
        before = pickle.dumps(self.m)
        can = self.m.can_append_slots(sid, k)
        try:
            ops = self.m.append_slots(sid, new)
        except NoFreeBlocksError:
            assert not can
            self.check_unchanged(before)
            event("append: out of blocks")
            return False
        assert can
        for op in ops:
            event(f"append: {type(op).__name__}")
        n_old = len(self.tokens[sid])
        self.execute(ops)  # ops read the pre-call KV (sealed blocks end before n_old)
        self.tokens[sid].extend(new)
        self.write(sid, n_old, n_old + k)
        n = n_old + k
        if k == 1:  # decode: lazy sealing costs at most one hp block above the rule
            hp = sum(r.pool == "hp" for r in self.m.block_table(sid))
            rule_hp = sum(block_state(i, n, self.policy) == "hp" for i in range(-(-n // self.bs)))
            assert hp <= rule_hp + 1
        return True

    @rule(data=st.data())
    def append(self, data):
        """Chunked prefill or multi-token append (k may be 0)."""
        if not self.tokens:
            return
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        k = data.draw(st.integers(0, 3 * self.bs))
        self.do_append(sid, data.draw(st.lists(st.integers(0, 1), min_size=k, max_size=k)))

    @rule(data=st.data())
    def decode(self, data):
        """Several decode steps of one sequence, long enough to cross the residual window."""
        if not self.tokens:
            return
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        steps = data.draw(st.integers(1, 2 * self.bs + self.policy.residual_tokens + 1))
        for _ in range(steps):
            if not self.do_append(sid, [data.draw(st.integers(0, 1))]):
                break
            self.consistent()

    @rule(data=st.data())
    def fork(self, data):
        if not self.tokens:
            return
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child, self.next_id = self.next_id, self.next_id + 1
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        if data.draw(st.booleans()):  # parallel sampling: both continue with different tokens
            for sid, tok in ((child, 1), (parent, 0)):
                if not self.do_append(sid, [tok]):
                    break

    @rule(data=st.data())
    def mark_computed(self, data):
        if not self.tokens:
            return
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.mark_computed(sid, data.draw(st.integers(0, len(self.tokens[sid]))))

    @rule(data=st.data())
    def free(self, data):
        if not self.tokens:
            return
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        if data.draw(st.booleans()):
            self.m.mark_computed(sid, len(self.tokens[sid]))
        self.m.free(sid)
        self.history.append(self.tokens.pop(sid))
        with pytest.raises(KeyError):
            self.m.block_table(sid)

    @rule()
    def free_all(self):
        for sid in list(self.tokens):
            self.m.free(sid)
            del self.tokens[sid]
        self.no_leaks()

    def no_leaks(self):
        for pool in ("q", "hp"):
            a = self.m.allocator(pool)
            assert a.num_used == 0 and a.num_free == a.num_blocks, f"{pool} leaked blocks"

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "m"):
            return
        self.m.check_integrity()
        for pool in ("q", "hp"):
            a = self.m.allocator(pool)
            plain_free = a.num_free - a.num_cached
            assert plain_free >= 0 and plain_free + a.num_cached + a.num_used == a.num_blocks
        assert len(self.m) == len(self.tokens)
        for sid, toks in self.tokens.items():
            assert list(self.m.token_ids(sid)) == toks
            kv = kv_chain(toks)
            got = [self.mem[p][b][o] for p, b, o in self.m.slots(sid, 0, len(toks))]
            assert got == kv, f"seq {sid} reads wrong KV through its block table"

    def teardown(self):
        if hasattr(self, "m"):
            self.free_all()


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=400, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
