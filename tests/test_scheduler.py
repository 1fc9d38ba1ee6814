"""Scheduler, Sequence, SamplingParams: unit tests and a stateful test over a simulated engine.

The simulated engine keeps the "KV" of every cache slot (``mem``), runs the step's
ops in order, writes each scheduled token's KV through the block table, and only
samples after checking that the sequence reads the KV of exactly its own tokens.
The fake model's next token is a function of all tokens so far, so a request's
outputs must not depend on batching, chunking, prefix hits or preemption.
"""

from __future__ import annotations

import functools
import random
import zlib

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvq.cache.block_manager import (BlockManager, CopyOp, DemoteOp, HostLoadOp, HostStoreOp, SealOp, SwapOp,
                                     WindowPolicy, block_state)
from kvq.cache.tiers import TierRule
from kvq.engine.sampling_params import SamplingParams
from kvq.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, peak_blocks, rule_counts
from kvq.engine.sequence import SeqStatus, Sequence

VOCAB, EOS = 5, 0
POISON = "lost"  # the 'KV' a failed swap copy leaves behind


def next_token(tokens) -> int:
    return zlib.crc32(bytes(tokens)) % VOCAB


def kv_chain(tokens) -> list[int]:
    """The 'KV' of position p depends on tokens[:p + 1] (like real attention KV)."""
    out, h = [], 0
    for t in tokens:
        h = zlib.crc32(bytes([t]), h)
        out.append(h)
    return out


def reference(prompt, params: SamplingParams, max_model_len: int, eos=EOS) -> tuple[list[int], str]:
    """The outputs of an unbatched, unpreempted run of the fake model."""
    out: list[int] = []
    while True:
        t = next_token(prompt + out)
        out.append(t)
        if (t == eos and not params.ignore_eos) or t in params.stop_token_ids:
            return out, "stop"
        if len(out) >= params.max_tokens or len(prompt) + len(out) >= max_model_len:
            return out, "length"


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Engine:
    """A fake engine around a real BlockManager and Scheduler."""

    def __init__(self, policy: WindowPolicy, nq=64, nhp=16, prefix=True, eos=EOS, pipelined=False, host=(0, 0),
                 tier=(0, 0), copy_seed=0, copy_faults=(0.0, 0.0), remote=0.0, tiers=None, **cfg):
        """``tiers``: (TierRule, blocks per slab of each tier, slabs, reserve slabs) for elastic precision."""
        if pipelined:  # asynchronous scheduling: step N+1 is scheduled and launched before step N's update
            cfg["max_inflight"] = 2
        self.pipelined = pipelined
        self.pending = None  # (output, sampled) launched and not yet update()d
        cfg.setdefault("max_model_len", 64)
        cfg.setdefault("max_num_seqs", 4)
        self.policy, self.bs = policy, policy.block_size
        arena = dict(tiers=tiers[0], arena=tiers[1:]) if tiers else {}
        self.bm = BlockManager(nq, nhp, policy, enable_prefix_caching=prefix, host_blocks=host, host_tier_blocks=tier,
                               **arena)
        self.cfg = SchedulerConfig(block_size=self.bs, **cfg)
        self.clock = Clock()
        self.s = Scheduler(self.cfg, self.bm, eos_token_id=eos, clock=self.clock)
        self.mem = {p: [[None] * self.bs for _ in range(self.bm.allocator(p).num_blocks)] for p in self.bm.pools}
        self.host = {p: [[None] * self.bs for _ in range(n + t)] for p, n, t in zip(("q", "hp"), host, tier)}
        # the CPU prefix tier's copies in flight: [op, steps left, fault]; each completes after a random
        # number of steps, fails ("fail": reported, nothing copied) or, for loads, ends late ("hang": after
        # the scheduler gave up on it, writing into blocks that must not have been reused meanwhile)
        self.copies: list[list] = []
        self.copy_rng = random.Random(copy_seed)
        self.copy_faults = copy_faults  # (P(fail), P(a load hangs))
        # prompts prefilled by a "peer" (remote fills): each ends after a random number of steps, writing
        # the prompt's KV into its reserved blocks only then; with the copy faults it fails (reported,
        # requeued or, without fallback, aborted) or hangs (ends after its request was freed, writing
        # into quarantined blocks)
        self.remote = remote
        self.fills: list[list] = []
        self.remote_aborted: set[int] = set()
        self.seqs: dict[int, Sequence] = {}
        self.num_preempted = 0
        self.tables: dict[int, list] = {}  # the runner's mirror, built only from scheduler outputs
        self.tier_swaps = 0  # swap ops that moved a lower tier's blocks (elastic precision)

    def add(self, sid, prompt, **params) -> Sequence:
        seq = Sequence(sid, prompt, SamplingParams(**params), arrival_time=self.clock.t)
        self.s.add(seq, remote=self.copy_rng.random() < self.remote)
        self.seqs[sid] = seq
        return seq

    def execute(self, ops, failed=()) -> None:
        """Run ops in the runner's order; a swap op in ``failed`` moves nothing and leaves its destination
        blocks POISON, which every op reading them passes on (nothing valid may ever read it)."""
        if all(isinstance(op, (SealOp, DemoteOp)) for op in ops):  # the runner's order: demotions, then seals
            ops = [op for op in ops if isinstance(op, DemoteOp)] + [op for op in ops if isinstance(op, SealOp)]
        for op in ops:
            if isinstance(op, DemoteOp):
                i, bs = op.logical_index, self.bs
                expect = kv_chain(self.seqs[op.seq_id].all_token_ids)[i * bs:(i + 1) * bs]
                src = self.mem[op.src.pool][op.src.block_id]
                assert src == expect or POISON in src, "a demotion read an incomplete block"
                self.mem[op.dst.pool][op.dst.block_id] = list(src)
            elif isinstance(op, CopyOp):
                self.mem[op.dst.pool][op.dst.block_id] = list(self.mem[op.src.pool][op.src.block_id])
            elif isinstance(op, SwapOp):  # blocks between the device and the host tier, as they are
                if op.tiers:
                    self.tier_swaps += 1
                    if currently_in_test_context():  # (the stateful machine's statistics)
                        event(f"swap {op.direction}: a lower tier's blocks")
                for pool, pairs in op.pools():  # a lower tier's block in a host q block
                    dev, host = self.mem[pool], self.host["hp" if pool == "hp" else "q"]
                    src, dst = (dev, host) if op.direction == "out" else (host, dev)
                    for a, b in pairs:
                        dst[b] = [POISON] * self.bs if op in failed else list(src[a])
            else:
                assert isinstance(op, SealOp)
                i, bs = op.logical_index, self.bs
                expect = kv_chain(self.seqs[op.seq_id].all_token_ids)[i * bs:(i + 1) * bs]
                src = self.mem["hp"][op.src_hp_block]
                assert src == expect or POISON in src, "a seal read an incomplete hp block"
                self.mem["q"][op.dst_q_block] = list(src)

    def issue(self, ops) -> None:
        for op in ops:
            r = self.copy_rng.random()
            fault = "fail" if r < self.copy_faults[0] else \
                "hang" if isinstance(op, HostLoadOp) and r < sum(self.copy_faults) else None
            late = fault == "hang"  # a stuck copy that ends long after the scheduler's timeout
            self.copies.append([op, self.copy_rng.randint(8, 16) if late else self.copy_rng.randint(0, 2), fault])

    def issue_fills(self, ops) -> None:
        for op in ops:
            r = self.copy_rng.random()
            fault = "fail" if r < self.copy_faults[0] else "hang" if r < sum(self.copy_faults) else None
            self.fills.append([op, self.copy_rng.randint(8, 16) if fault == "hang" else self.copy_rng.randint(0, 3),
                               fault, self.copy_rng.random() < 0.8])

    def progress_fills(self, drain: bool = False) -> None:
        left = []
        for c in self.fills:
            op, steps, fault, fallback = c
            if not drain and steps > 0:
                c[1] -= 1
                left.append(c)
                continue
            prompt = list(self.seqs[op.seq_id].prompt_token_ids)
            if fault == "fail":
                seq = self.s.remote_done(op, None, fallback=fallback)
                if seq is not None and not fallback:
                    assert seq.is_finished and seq.finish_reason == "abort" and op.seq_id not in self.bm
                    self.remote_aborted.add(op.seq_id)
                continue
            kv = kv_chain(prompt)  # the peer's bytes land now, whether or not anyone still waits
            for pos in range(op.num_tokens):
                ref = op.table[pos // self.bs]
                self.mem[ref.pool][ref.block_id][pos % self.bs] = kv[pos]
            seq = self.s.remote_done(op, next_token(prompt))
            if seq is not None:
                assert seq.output_token_ids == [next_token(prompt)] and seq.num_computed_tokens == len(prompt)
        self.fills = left

    def progress(self, drain: bool = False) -> None:
        """Complete the copies whose time has come (every one with ``drain``), moving their data as
        late as possible: a store reads its device blocks, a load writes its destinations, only now."""
        self.progress_fills(drain)
        left = []
        for c in self.copies:
            op, steps, fault = c
            if not drain and steps > 0:
                c[1] -= 1
                left.append(c)
                continue
            if fault == "fail":
                self.s.host_copy_done(op, ok=False)
                continue
            if op.tier_pairs():
                kind = "store" if isinstance(op, HostStoreOp) else "load"
                event(f"CPU prefix tier: a {kind} of a lower tier's blocks")
            if isinstance(op, HostStoreOp):
                for r in op.requests:  # a lower tier's block in a host q block, as stored
                    self.host[r.host_pool][r.host_block] = list(self.mem[r.pool][r.device_block])
            else:
                for pool in self.bm.pools:  # back into the tier each block was stored from
                    for h, d in op.pairs(pool):
                        self.mem[pool][d] = list(self.host["hp" if pool == "hp" else "q"][h])
            self.s.host_copy_done(op)
        self.copies = left

    def mirror(self, out) -> None:
        """Apply an output's released sequences and table deltas to the mirror; it must equal
        the block manager's tables, and each item's slots must be the manager's slots."""
        for sid in out.released:
            self.tables.pop(sid, None)
        for item in out.scheduled:
            t = self.tables.setdefault(item.seq_id, [])
            assert item.table_start <= len(t), "a delta must start inside the mirrored table"
            t[item.table_start:] = item.table_refs
            assert len(t) == item.table_len
            assert t == self.bm.block_table(item.seq_id), "the mirror drifted from the block manager"
            end = item.start + item.num_new_tokens
            assert list(item.slots) == self.bm.slots(item.seq_id, item.start, end)
            # The window rule as the step's first query reads it: blocks before the step settled at its
            # start (a prompt chunk as much as a decode), new blocks at its end.
            for i, ref in enumerate(t):
                n = item.start if i * self.bs < item.start else end
                assert ("q" if ref.pool.startswith("q") else ref.pool) == block_state(i, n, self.policy), (item, i, t)

    def forward(self, item, prev: dict) -> int | None:
        """``prev``: the previous launch's samples, which feed a pending token (the real runner
        gathers them on the device)."""
        seq = self.seqs[item.seq_id]
        toks, start, end = seq.all_token_ids, item.start, item.start + item.num_new_tokens
        if end > len(toks):  # its last input is the previous step's sample, not update()d yet
            assert self.pipelined and end == len(toks) + 1 and item.seq_id in prev, (item, seq)
            toks = toks + [prev[item.seq_id]]
        assert end == seq.num_scheduled_tokens and end <= len(toks)
        kv, written = kv_chain(toks), {}
        for pos, (pool, bid, off) in zip(range(start, end), item.slots):
            self.mem[pool][bid][off] = kv[pos]
            written.setdefault((pool, bid), set()).add(off)
        if not self.policy.write_direct:
            for (pool, bid), offs in written.items():
                assert pool == "hp" or len(offs) == self.bs, "a q block of a per-block format written in parts"
        assert item.sample == (end == len(toks))
        if not item.sample:
            return None
        table = self.tables[item.seq_id]
        got = [self.mem[table[i // self.bs].pool][table[i // self.bs].block_id][i % self.bs] for i in range(end)]
        assert got == kv, f"seq {item.seq_id} samples over KV that is not its own"
        return next_token(toks)

    def step(self, abort_one=None):
        self.progress()
        self.aborted = None  # the sequence ``abort_one`` aborted in this step
        out = self.s.schedule()
        self.issue(out.host_ops)
        self.issue_fills(out.remote_ops)
        cfg = self.s.config
        ids = [x.seq_id for x in out.scheduled]
        assert len(ids) == len(set(ids)) and len(ids) <= cfg.max_num_seqs
        assert out.num_batched_tokens == sum(x.num_new_tokens for x in out.scheduled) <= cfg.max_num_batched_tokens
        self.num_preempted += len(out.preempted)
        for sid in out.preempted:
            assert self.seqs[sid].status in (SeqStatus.WAITING, SeqStatus.SWAPPED) and sid not in self.bm
            assert (self.seqs[sid].status is SeqStatus.SWAPPED) == self.bm.is_swapped(sid)
        self.s.check_integrity()
        # The policy's no-stall claim.  Loaded prompts break it: one admitted LOADING takes no budget until
        # its load ends, and then runs its chunks (FCFS: before newer prefills admitted meanwhile).
        if not self.s.num_host_loads and not self.s.num_remote_loads:
            stalled = [q for q in self.seqs.values() if q.status is SeqStatus.PREFILL and q.seq_id not in ids]
            assert not stalled, f"a running prefill got no chunk: {stalled}"
        self.mirror(out)
        if not out.scheduled:  # its ops still run: a swap-out can come with no work
            self.run_ops(out)
            self.clock.t += 1.0
            finished = self.flush()
            self.issue(self.s.take_host_ops())
            return out, finished
        if abort_one is not None:  # an abort between schedule() and update()
            self.aborted = ids[abort_one % len(ids)]  # (run_ops may drop a failed swap-in's item from `out`)
            assert self.s.abort(self.aborted)
        out = self.run_ops(out)
        prev = self.pending[1] if self.pending else {}
        sampled = {}
        for item in out.scheduled:
            if not self.seqs[item.seq_id].is_finished:
                tok = self.forward(item, prev)
                if tok is not None:
                    sampled[item.seq_id] = tok
        self.clock.t += 1.0
        if not self.pipelined:
            finished = self.s.update(out, sampled)
        else:
            finished = self.flush()
            self.pending = (out, sampled)
        self.issue(self.s.take_host_ops())  # the stores of requests freed by update()
        return out, finished

    def run_ops(self, out):
        """Run the step's ops; with copy faults a swap copy may fail (nothing moves), and the scheduler
        then recomputes its sequence (a swap-in's item leaves the step): -> the output to run."""
        if not any(isinstance(op, SwapOp) for op in out.ops) or not self.copy_faults[0]:
            self.execute(out.ops)
            return out
        failed = [op for op in out.ops if isinstance(op, SwapOp) and self.copy_rng.random() < self.copy_faults[0]]
        self.execute(out.ops, failed)
        if not failed:
            return out if self.copy_rng.random() < 0.5 else self.s.swap_failed([], out)  # either is the engine's
        event(f"swap: a failed copy ({failed[0].direction})")
        new = self.s.swap_failed(failed, out)
        for op in failed:
            if not self.seqs[op.seq_id].is_finished:
                assert self.seqs[op.seq_id].status is SeqStatus.WAITING, (op, self.seqs[op.seq_id])
                assert op.seq_id not in {x.seq_id for x in new.scheduled} and op.seq_id not in self.bm
        return new

    def flush(self) -> list:
        """update() the launched step, if any (pipelined mode)."""
        pending, self.pending = self.pending, None
        return self.s.update(*pending) if pending else []

    def run(self, max_steps=10_000) -> None:
        for _ in range(max_steps):
            if not self.s.has_unfinished():
                self.flush()
                self.issue(self.s.take_host_ops())
                self.progress(drain=True)
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def used_blocks(self) -> int:
        return sum(self.bm.allocator(p).num_used for p in self.bm.pools)


# -- SamplingParams / Sequence ------------------------------------------------------------------
def test_sampling_params_normalise():
    p = SamplingParams(stop="###", stop_token_ids=[3, 4], temperature=0)
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4) and p.greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b") and not SamplingParams().greedy
    assert hash(p) == hash(SamplingParams(stop=("###",), stop_token_ids=(3, 4), temperature=0.0))


@pytest.mark.parametrize("kw,word", [({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
                                     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
                                     ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
                                     ({"n": 2}, "n=2"), ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop"),
                                     ({"seed": 1.5}, "seed"), ({"temperature": float("nan")}, "temperature")])
def test_sampling_params_rejects(kw, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kw)


def test_sequence_tokens_and_timings():
    seq = Sequence(7, [1, 2, 3], arrival_time=10.0)
    assert seq.status is SeqStatus.WAITING and seq.ttft() is None and seq.tpot() is None and seq.itls() == []
    for t, now in ((4, 12.0), (5, 12.5), (6, 13.5)):
        seq.append_token(t, now)
    assert seq.all_token_ids == [1, 2, 3, 4, 5, 6] and seq.prompt_token_ids == [1, 2, 3]
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.last_token_id) == (6, 3, 6)
    assert seq.ttft() == 2.0 and seq.itls() == [0.5, 1.0] and seq.tpot() == 0.75


# -- configuration and admission ----------------------------------------------------------------
@pytest.mark.parametrize("kw", [{"max_num_seqs": 0}, {"max_num_batched_tokens": 4, "max_num_seqs": 8},
                                {"chunked_prefill": False, "max_num_batched_tokens": 32}])
def test_config_rejects(kw):
    kw = {"max_model_len": 64, "block_size": 4, **kw}
    with pytest.raises(ValueError):
        SchedulerConfig(**kw)


def test_scheduler_checks_its_block_manager():
    bm = BlockManager(8, 8, WindowPolicy(4, write_direct=False))
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(max_model_len=32, block_size=8), bm)
    bm.allocate_prompt("x", [1])
    with pytest.raises(ValueError, match="only user"):
        Scheduler(SchedulerConfig(max_model_len=32, block_size=4), bm)


def test_add_rejects_requests_that_can_never_run():
    e = Engine(WindowPolicy(4), nq=3, max_model_len=16)
    for prompt, max_tokens, word in (([], 1, "empty"), ([1] * 17, 1, "max_model_len"),
                                     ([1] * 10, 7, "max_tokens"), ([1] * 13, 1, "needs up to 4 q")):
        with pytest.raises(ValueError, match=word):
            e.add(0, prompt, max_tokens=max_tokens)
    e.add(0, [1] * 11, max_tokens=2)  # the last output is never cached: 12 tokens hold KV, 3 blocks
    with pytest.raises(ValueError, match="already"):
        e.add(0, [1], max_tokens=1)
    assert e.s.num_waiting == 1


def test_fcfs_admission_and_max_num_seqs():
    e = Engine(WindowPolicy(4), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        e.add(i, [1, 2, 3, i], max_tokens=3, ignore_eos=True)
    out, _ = e.step()
    assert [x.seq_id for x in out.scheduled] == [0, 1] and all(x.sample and x.is_prefill for x in out.scheduled)
    assert (e.s.num_running, e.s.num_waiting) == (2, 1)
    out, _ = e.step()
    assert [(x.seq_id, x.is_prefill, x.start) for x in out.scheduled] == [(0, False, 4), (1, False, 4)]
    e.run()
    assert all(s.output_token_ids == reference(s.prompt_token_ids, s.params, 64)[0] for s in e.seqs.values())
    assert e.used_blocks() == 0 and len(e.bm) == 0


def test_head_of_line_blocks_later_requests():
    e = Engine(WindowPolicy(4), nq=6, max_model_len=24, max_num_batched_tokens=64)
    e.add(0, [1] * 16, max_tokens=4, ignore_eos=True)  # 4 blocks, growing to 5
    e.add(1, [2] * 12, max_tokens=1)  # 3 blocks: does not fit beside 0
    e.add(2, [3] * 2, max_tokens=1)  # 1 block: would fit, but must not overtake 1
    out, _ = e.step()
    assert [x.seq_id for x in out.scheduled] == [0] and e.s.num_waiting == 2
    e.run()
    assert e.seqs[1].first_scheduled_time <= e.seqs[2].first_scheduled_time and e.used_blocks() == 0


def test_chunked_prefill_shares_the_budget_with_decodes():
    e = Engine(WindowPolicy(4), max_num_batched_tokens=8)
    e.add(0, [1, 2], max_tokens=10, ignore_eos=True)
    e.step()
    e.add(1, list(range(20)), max_tokens=1)
    chunks = []
    while e.seqs[1].num_output_tokens == 0:
        out, _ = e.step()
        chunks += [(x.start, x.num_new_tokens, x.sample) for x in out.scheduled if x.seq_id == 1]
        assert out.num_batched_tokens <= 8 and out.scheduled[0].seq_id == 0  # the decode goes first
    assert chunks == [(0, 7, False), (7, 7, False), (14, 6, True)]


def test_per_block_formats_chunk_anywhere():
    # a format sealed per block: a chunk may end inside a block (the block stays hp, the harness
    # checks that no q block is written in parts)
    e = Engine(WindowPolicy(4, write_direct=False), max_num_batched_tokens=10)
    e.add(0, list(range(23)), max_tokens=2, ignore_eos=True)
    chunks = []
    while not e.seqs[0].is_finished:
        out, _ = e.step()
        chunks += [(x.start, x.num_new_tokens) for x in out.scheduled]
    assert chunks == [(0, 10), (10, 10), (20, 3), (23, 1)]


def test_a_prompt_takes_what_the_decodes_leave_with_per_block_formats():
    # three decodes leave 3 tokens of a 6-token budget, under one block (4): the long prompt starts
    # at once with 3 (with chunks aligned on blocks it waited until the decodes ended)
    e = Engine(WindowPolicy(4, write_direct=False), max_num_seqs=4, max_num_batched_tokens=6, max_model_len=64)
    for i in range(3):
        e.add(i, [i + 1, i + 2], max_tokens=20, ignore_eos=True)
    e.step()
    e.add(3, list(range(30)), max_tokens=2, ignore_eos=True)
    out, _ = e.step()
    assert sorted((x.seq_id, x.num_new_tokens) for x in out.scheduled) == [(0, 1), (1, 1), (2, 1), (3, 3)]


def test_no_chunking_waits_for_budget():
    e = Engine(WindowPolicy(4), max_model_len=16, max_num_batched_tokens=16, chunked_prefill=False)
    e.add(0, [1] * 10, max_tokens=1)
    e.add(1, [2] * 10, max_tokens=1)
    out, _ = e.step()
    assert [(x.seq_id, x.num_new_tokens) for x in out.scheduled] == [(0, 10)]
    out, _ = e.step()
    assert [(x.seq_id, x.num_new_tokens) for x in out.scheduled] == [(1, 10)]


def test_prefix_hit_starts_after_cached_blocks():
    e = Engine(WindowPolicy(4), max_num_batched_tokens=64)
    e.add(0, list(range(12)), max_tokens=1)
    e.run()
    e.add(1, list(range(10)) + [4, 4], max_tokens=1)
    out, _ = e.step()
    assert [(x.start, x.num_new_tokens) for x in out.scheduled] == [(8, 4)]
    assert e.seqs[1].output_token_ids == reference(e.seqs[1].prompt_token_ids, e.seqs[1].params, 64)[0]


# -- stopping ---------------------------------------------------------------------------------
def drive(e: Engine, sid: int, tokens: list[int]) -> None:
    """Step a lone sequence, sampling the given tokens instead of the fake model's."""
    for tok in tokens:
        out = e.s.schedule()
        e.s.update(out, {sid: tok}, now=e.clock.t)


@pytest.mark.parametrize("params,tokens,n_out,reason,stop_reason", [
    ({}, [3, EOS, 3], 2, "stop", None),
    ({"ignore_eos": True, "max_tokens": 3}, [3, EOS, 3], 3, "length", None),
    ({"stop_token_ids": [4]}, [3, 4, 3], 2, "stop", 4),
    ({"max_tokens": 2}, [3, 3, 3], 2, "length", None),
    ({"max_tokens": 2, "stop_token_ids": [3]}, [1, 3], 2, "stop", 3),  # a stop token wins over length
])
def test_stop_conditions(params, tokens, n_out, reason, stop_reason):
    e = Engine(WindowPolicy(4))
    seq = Sequence(0, [1, 2, 3, 4], SamplingParams(**params))
    e.s.add(seq)
    drive(e, 0, tokens[:n_out])
    assert seq.is_finished and (seq.finish_reason, seq.stop_reason) == (reason, stop_reason)
    assert seq.output_token_ids == tokens[:n_out] and e.used_blocks() == 0 and not e.s.has_unfinished()


def test_finish_and_abort_free_blocks():
    e = Engine(WindowPolicy(4), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        e.add(i, [1] * 9, max_tokens=8, ignore_eos=True)
    e.step()
    e.step()
    assert e.s.abort(2) and e.seqs[2].finish_reason == "abort"  # waiting
    assert e.s.finish(0, "stop", "###") and (e.seqs[0].finish_reason, e.seqs[0].stop_reason) == ("stop", "###")
    assert 0 not in e.bm and not e.s.abort(0) and not e.s.finish(99, "abort")
    with pytest.raises(ValueError, match="valid: stop, length, abort"):
        e.s.finish(1, "eos")
    with pytest.raises(KeyError):
        e.s.get(0)
    e.step(abort_one=0)  # abort 1 between schedule() and update()
    assert e.seqs[1].finish_reason == "abort" and e.used_blocks() == 0 and not e.s.has_unfinished()
    e.s.check_integrity()


def test_update_contract():
    e = Engine(WindowPolicy(4))
    e.add(0, [1, 2, 3], max_tokens=4)
    out = e.s.schedule()
    with pytest.raises(RuntimeError, match="update"):
        e.s.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        e.s.update(out, {})
    e.s.check_integrity()
    e.s.update(out, {0: 1})
    with pytest.raises(ValueError, match="oldest"):
        e.s.update(out, {0: 1})
    assert e.s.update(SchedulerOutput(), {}) == []  # an empty output needs no update


def test_timings_follow_the_clock():
    e = Engine(WindowPolicy(4))
    e.clock.t = 5.0
    seq = e.add(0, [1, 2], max_tokens=3, ignore_eos=True)
    e.run()
    assert seq.first_scheduled_time == 5.0 and seq.token_times == [6.0, 7.0, 8.0]
    assert seq.ttft() == 1.0 and seq.tpot() == 1.0


# -- preemption -------------------------------------------------------------------------------
def test_preemption_spares_the_served_sequence_and_keeps_outputs():
    e = Engine(WindowPolicy(2), nq=8, max_model_len=32, max_num_batched_tokens=32)
    e.add(0, [1, 2, 3, 4], max_tokens=9, ignore_eos=True)  # alone: up to 6 blocks, both: 12
    e.add(1, [4, 3, 2, 1], max_tokens=9, ignore_eos=True)
    first = None
    while e.s.has_unfinished():
        out, _ = e.step()
        if out.preempted and first is None:
            first = out
    assert first.preempted == (1,) and 0 in [x.seq_id for x in first.scheduled], "the newer one yields"
    assert e.seqs[1].num_preemptions >= 1 and e.seqs[0].num_preemptions == 0
    for seq in e.seqs.values():
        assert (seq.output_token_ids, seq.finish_reason) == reference(seq.prompt_token_ids, seq.params, 32)
    assert e.used_blocks() == 0


def test_newest_decode_preempts_itself_and_resumes_by_recompute():
    e = Engine(WindowPolicy(1), nq=10, max_model_len=16, max_num_batched_tokens=16)
    e.add(0, [1, 2, 3], max_tokens=5, ignore_eos=True)
    e.add(1, [3, 2, 1, 0], max_tokens=5, ignore_eos=True)
    e.step()  # both prompts: 7 blocks
    e.step()  # 0 takes block 8, 1 takes block 9
    out, _ = e.step()  # 0 takes the last block; 1, the newest, finds none and preempts itself
    assert [x.seq_id for x in out.scheduled] == [0] and out.preempted == (1,)
    seq = e.seqs[1]
    assert seq.status is SeqStatus.WAITING and seq.num_computed_tokens == 0 and seq.num_output_tokens == 2
    e.run()
    assert seq.output_token_ids == reference(seq.prompt_token_ids, seq.params, 16)[0]


@functools.lru_cache(maxsize=None)  # the state machine asks again and again for the same few (a pure function)
def literal_peak(last, p, max_chunk) -> tuple[int, int]:
    """peak_blocks by brute force over block_state: every call that grows a sequence from any
    length by 1..max_chunk tokens (the blocks it had settle at the old length, new ones follow
    the new length)."""
    q = hp = 0
    for n_old in range(last):
        for n_new in range(n_old + 1, min(n_old + max_chunk, last) + 1):
            nb_old, nb_new = -(-n_old // p.block_size), -(-n_new // p.block_size)
            states = [block_state(i, n_old if i < nb_old else n_new, p) for i in range(nb_new)]
            q, hp = max(q, states.count("q")), max(hp, states.count("hp"))
    return q, hp


@pytest.mark.parametrize("bs", [1, 3, 8])
@pytest.mark.parametrize("sink,res,write_direct", [(0, 0, True), (0, 0, False), (1, 5, True), (2, 9, False),
                                                   (1, 4, True), (0, 7, False)])
def test_rule_counts_and_peak_match_block_state(bs, sink, res, write_direct):
    p = WindowPolicy(bs, sink_blocks=sink, residual_tokens=res, write_direct=write_direct)
    for n in range(1, 60):
        states = [block_state(i, n, p) for i in range(-(-n // bs))]
        assert rule_counts(n, p) == (states.count("q"), states.count("hp")), n
    for last in [*range(1, 40, 2), 61, 97]:
        for chunk in (1, 2, 5, bs, 16, 40, 200):
            assert peak_blocks(last, p, chunk) == literal_peak(last, p, chunk), (last, chunk)


def test_a_chunk_holds_two_windows_in_hp():
    """While a chunk is reserved, the window its first query reads and the one it ends with are both hp."""
    p = WindowPolicy(16, sink_blocks=1, residual_tokens=128)
    assert peak_blocks(4096, p, 1)[1] == 1 + 8 + 1  # decode only: sink + window + the block a token opens
    # chunks: sink + the old window + the new one (128 tokens span 9 blocks off a block boundary)
    assert peak_blocks(4096, p, 512)[1] == 1 + 9 + 9


@pytest.mark.parametrize("pipelined", [False, True])
def test_swap_parks_kv_in_the_host_tier_and_resumes_first(pipelined):
    """Seed 002's smoke test: a 3-block pool, 10 requests; with swap every one completes with the
    tokens it would have alone, preempted requests come back from the host tier (no recompute),
    and nothing is left on either tier."""
    e = Engine(WindowPolicy(4), nq=3, nhp=0, host=(12, 0), max_num_seqs=4, max_num_batched_tokens=8,
               preemption_mode="swap", pipelined=pipelined)
    for i in range(10):
        e.add(i, [1 + i, 2, 3], max_tokens=6, ignore_eos=True)
    e.run()
    assert e.s.num_swapped_out > 0 and e.s.num_swapped_in == e.s.num_swapped_out and e.s.num_swap_fallbacks == 0
    for sid, seq in e.seqs.items():
        assert (seq.output_token_ids, seq.finish_reason) == reference(seq.prompt_token_ids, seq.params, 64), sid
    assert e.used_blocks() == 0 and e.bm.num_swapped == 0
    assert all(e.bm.host_allocator(p).num_used == 0 for p in ("q", "hp"))


def test_swap_carries_lower_tiers_blocks_and_brings_them_back():
    """Elastic precision with swap: blocks age into tier 1 (8 tokens behind their head), sequences
    holding them are swapped out whole (a lower tier's block in a host q block) and back into the tiers
    they left; every request gets the tokens it would have alone (each step reads its own KV)."""
    from kvq.cache.tiers import TierRule

    pol = WindowPolicy(4, sink_blocks=1, residual_tokens=4)
    rule = TierRule(1, 4, 1, 4, ages=(8,), pressure=False)
    e = Engine(pol, nq=8, nhp=12, host=(24, 12), max_num_seqs=4, max_num_batched_tokens=16,
               preemption_mode="swap", tiers=(rule, (2, 3), 4, 0))
    for i in range(8):
        e.add(i, [1 + i, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=24, ignore_eos=True)
    e.run()
    assert e.tier_swaps > 0 and e.s.num_swapped_in == e.s.num_swapped_out > 0
    for sid, seq in e.seqs.items():
        assert (seq.output_token_ids, seq.finish_reason) == reference(seq.prompt_token_ids, seq.params, 64), sid
    assert e.used_blocks() == 0 and e.bm.num_swapped == 0


def test_swap_falls_back_to_recompute_when_the_host_tier_is_full():
    e = Engine(WindowPolicy(4), nq=3, nhp=0, host=(0, 0), max_num_seqs=4, max_num_batched_tokens=8,
               preemption_mode="swap")
    for i in range(4):
        e.add(i, [1 + i, 2, 3], max_tokens=6, ignore_eos=True)
    e.run()
    assert e.s.num_swap_fallbacks > 0 and e.s.num_swapped_out == 0  # a tier of no blocks holds nothing
    for sid, seq in e.seqs.items():
        assert (seq.output_token_ids, seq.finish_reason) == reference(seq.prompt_token_ids, seq.params, 64), sid
    assert e.used_blocks() == 0 and e.bm.num_swapped == 0


def test_swapped_request_can_be_aborted():
    e = Engine(WindowPolicy(4), nq=3, nhp=0, host=(12, 0), max_num_seqs=4, max_num_batched_tokens=8,
               preemption_mode="swap")
    for i in range(3):
        e.add(i, [1 + i, 2, 3], max_tokens=8, ignore_eos=True)
    for _ in range(20):
        e.step()
        if e.s.num_swapped:
            break
    swapped = [sid for sid, q in e.seqs.items() if q.status is SeqStatus.SWAPPED]
    assert swapped, "the 3-block pool should have swapped a request out"
    assert e.bm.host_allocator("q").num_used > 0
    assert e.s.abort(swapped[0]) and not e.bm.is_swapped(swapped[0])
    e.s.check_integrity()
    e.bm.check_integrity()
    e.run()
    assert e.used_blocks() == 0 and e.bm.host_allocator("q").num_used == 0


def _multi_turn(e: Engine, users: int, turns: int, seed: int = 0) -> None:
    """Each user's next prompt extends its previous prompt and answer, as a chat does."""
    rng = random.Random(seed)
    prompts = {u: [rng.randrange(VOCAB) for _ in range(9)] for u in range(users)}
    for t in range(turns):
        for u in range(users):
            e.add(t * users + u, prompts[u], max_tokens=3, ignore_eos=True)
        e.run()
        for u in range(users):
            seq = e.seqs[t * users + u]
            assert (seq.output_token_ids, seq.finish_reason) == reference(seq.prompt_token_ids, seq.params, 64)
            prompts[u] = seq.all_token_ids + [rng.randrange(VOCAB) for _ in range(4)]


def _no_leaks(e: Engine) -> None:
    assert e.used_blocks() == 0 and len(e.bm) == 0 and not e.copies, "leaked device blocks or copies"
    tier = e.bm.host_tier
    for pool in ("q", "hp"):
        st_ = tier.stats(pool)
        assert st_.num_storing == 0 and st_.num_pinned == 0, (pool, st_)
    e.bm.check_integrity()


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("policy", [WindowPolicy(4), WindowPolicy(4, sink_blocks=1, residual_tokens=6,
                                                                  write_direct=False)])
def test_cpu_prefix_tier_serves_prefixes_the_device_lost(policy, pipelined):
    """Multi-turn chats in a pool too small to keep them: later turns load their history from the
    CPU prefix tier (LOADING, then PREFILL of the rest) and sample exactly the reference tokens,
    reading only KV that is their own; nothing is left on either tier."""
    e = Engine(policy, nq=12, nhp=8, tier=(64, 32), max_num_seqs=3, max_num_batched_tokens=16,
               pipelined=pipelined, copy_seed=1)
    _multi_turn(e, users=6, turns=3)
    tier = e.bm.host_tier
    assert e.s.num_host_loads > 0 and tier.stats("q").hits > 0 and tier.stats("q").loads > 0
    assert e.s.num_load_timeouts == e.s.num_load_failures == 0
    _no_leaks(e)


def test_cpu_prefix_tier_faults_lose_nothing():
    """Stores and loads that fail, and loads that never end (timeout): every request still gets its
    reference tokens, computed instead, and once the late copies end no block is held anywhere."""
    e = Engine(WindowPolicy(4, sink_blocks=1, residual_tokens=6), nq=12, nhp=8, tier=(64, 32), max_num_seqs=3,
               max_num_batched_tokens=16, copy_seed=3, copy_faults=(0.25, 0.25), load_timeout_s=3.0)
    _multi_turn(e, users=6, turns=4)
    assert e.s.num_load_timeouts > 0 and e.s.num_load_failures > 0
    assert e.bm.host_tier.stats("q").store_failures > 0
    _no_leaks(e)


def test_cpu_prefix_tier_full_rejects_and_evicts():
    """A tier of 4 blocks: offers beyond it evict the least recently used, and offers while every
    block is being stored are rejected; results stay exact."""
    e = Engine(WindowPolicy(4), nq=12, nhp=0, tier=(4, 0), max_num_seqs=3, max_num_batched_tokens=16, copy_seed=2)
    _multi_turn(e, users=6, turns=3)
    st_ = e.bm.host_tier.stats("q")
    assert st_.evictions > 0 and st_.rejected > 0, st_
    _no_leaks(e)


def test_bad_preemption_mode():
    with pytest.raises(ValueError, match="recompute, swap"):
        SchedulerConfig(block_size=4, max_model_len=16, preemption_mode="drop")


# -- stateful ---------------------------------------------------------------------------------
class SchedulerMachine(RuleBasedStateMachine):
    """Random requests (shared prefixes), steps, aborts and stop strings over random policies and tiny pools."""

    @initialize(bs=st.integers(1, 8), sink=st.integers(0, 2), res=st.integers(0, 10), direct=st.booleans(),
                prefix=st.booleans(), mml=st.integers(8, 48), dq=st.integers(-3, 4), dhp=st.integers(-3, 3),
                seqs=st.integers(1, 5), extra=st.sampled_from([0, 0, 1, 2, 3, 5, 8, 16]), chunked=st.booleans(),
                pipelined=st.booleans(),
                swap=st.one_of(st.none(), st.tuples(st.integers(0, 12), st.integers(0, 6))),
                tier=st.one_of(st.none(), *[st.tuples(st.integers(0, 24), st.integers(0, 8))] * 3),
                copy_seed=st.integers(0, 2**16), faults=st.sampled_from([(0.0, 0.0), (0.2, 0.2)]),
                remote=st.sampled_from([0.0, 0.0, 0.5, 1.0]),
                tiers=st.one_of(st.none(), st.tuples(st.sampled_from([(1, 2), (2, 3), (2, 3, 5)]),
                                                     st.sampled_from([None, 2, 6]), st.booleans())))
    def setup(self, bs, sink, res, direct, prefix, mml, dq, dhp, seqs, extra, chunked, pipelined, swap,
              tier, copy_seed, faults, remote, tiers):
        policy = WindowPolicy(bs, sink_blocks=sink, residual_tokens=res, write_direct=direct)
        # Pools around what one long request needs: sometimes too small (rejections), often contended.
        nb = -(-mml // bs)
        nq = max(0, nb + dq * max(1, nb // 4))
        nhp = 0 if direct and res == 0 and sink == 0 else max(0, min(sink, nb) + -(-res // bs) + 2 + dhp)
        budget = max(seqs, 1 if chunked else mml) + extra
        arena = None
        if tiers:  # elastic precision: the resident pool's bytes as slabs of an arena, a reserve for pressure
            per, age, pressure = tiers
            ages = () if age is None else tuple(max(res, 1) + age * (t + 1) for t in range(len(per) - 1))
            reserve = int(pressure or not ages)
            arena = (TierRule(len(per) - 1, bs, sink, res, ages=ages, pressure=pressure or not ages), per,
                     -(-nq // per[0]) + reserve, reserve)
            event("tiers: " + "+".join(arena[0].policies))
        self.e = Engine(policy, nq=nq, nhp=nhp, prefix=prefix, max_model_len=mml, max_num_seqs=seqs,
                        max_num_batched_tokens=budget, chunked_prefill=chunked,
                        pipelined=pipelined,
                        host=swap or (0, 0), preemption_mode="swap" if swap else "recompute",
                        tier=tier or (0, 0), copy_seed=copy_seed, copy_faults=faults, load_timeout_s=4.0,
                        remote=remote, tiers=arena)
        event("pipelined" if pipelined else "synchronous")
        self.history: list[list[int]] = [[]]
        self.next_id = 0
        self.stopped: set[int] = set()  # finished by the engine (abort, stop string), not by the scheduler

    def fits(self, prompt, max_tokens) -> bool:
        q, hp = literal_peak(len(prompt) + max_tokens - 1, self.e.policy, self.e.cfg.max_num_batched_tokens)
        return q <= self.e.bm.usable_blocks("q") and hp <= self.e.bm.usable_blocks("hp")

    @rule(data=st.data(), burst=st.integers(1, 4))
    def add(self, data, burst):
        for _ in range(burst):
            self.add_one(data)

    def add_one(self, data):
        base = data.draw(st.sampled_from(self.history))
        prompt = base[:data.draw(st.integers(0, len(base)))] + data.draw(st.lists(st.integers(0, VOCAB - 1),
                                                                                   min_size=1, max_size=12))
        max_tokens = data.draw(st.integers(1, max(1, min(16, self.e.cfg.max_model_len - len(prompt)))))
        kw = {"max_tokens": max_tokens, "ignore_eos": data.draw(st.booleans()),
              "stop_token_ids": data.draw(st.lists(st.integers(1, VOCAB - 1), max_size=1))}
        ok = len(prompt) + max_tokens <= self.e.cfg.max_model_len and self.fits(prompt, max_tokens)
        sid, self.next_id = self.next_id, self.next_id + 1
        if not ok:
            with pytest.raises(ValueError):
                self.e.add(sid, prompt, **kw)
            event("add: rejected " + ("long" if len(prompt) + max_tokens > self.e.cfg.max_model_len else "pool"))
            return
        self.e.add(sid, prompt, **kw)
        self.history.append(prompt)

    @rule(steps=st.integers(1, 6), abort=st.one_of(st.none(), st.integers(0, 7)))
    def step(self, steps, abort):
        for k in range(steps):
            out, _ = self.e.step(abort_one=abort if k == 0 else None)
            if self.e.aborted is not None:
                self.stopped.add(self.e.aborted)
            for name in ("preempted", "ops"):
                if getattr(out, name):
                    event(f"step: {name}")
            if any(x.is_prefill and not x.sample for x in out.scheduled):
                event("step: partial prefill chunk")
            if len(out.scheduled) > 1:
                event("step: batch")
            if self.e.bm.allocator("q").num_hits + self.e.bm.allocator("hp").num_hits:
                event("prefix hits")
            if any(s.status is SeqStatus.LOADING for s in self.e.seqs.values()):
                event("step: loading from the CPU prefix tier")
            self.check()

    @rule(data=st.data(), reason=st.sampled_from(["abort", "stop"]))
    def finish(self, data, reason):
        live = sorted(sid for sid, s in self.e.seqs.items() if not s.is_finished)
        if live:
            sid = data.draw(st.sampled_from(live))
            assert self.e.s.finish(sid, reason, "###" if reason == "stop" else None)
            assert sid not in self.e.bm
            self.stopped.add(sid)

    @invariant()
    def check(self):
        if not hasattr(self, "e"):
            return
        self.e.s.check_integrity()
        self.e.bm.check_integrity()
        for pool in ("q", "hp") if self.e.bm.arena is None else ("hp",):
            a = self.e.bm.allocator(pool)
            assert a.num_free + a.num_used == a.num_blocks

    def teardown(self):
        if not hasattr(self, "e"):
            return
        e = self.e
        e.run(max_steps=200 + 20 * sum(s.num_tokens + s.params.max_tokens for s in e.seqs.values()))
        assert e.used_blocks() == 0 and len(e.bm) == 0, "leaked blocks"
        for sid, seq in e.seqs.items():
            assert seq.is_finished
            if sid not in self.stopped and sid not in e.remote_aborted:
                assert (seq.output_token_ids, seq.finish_reason) == \
                    reference(seq.prompt_token_ids, seq.params, e.cfg.max_model_len), sid
        event(f"teardown: {'preemptions' if e.num_preempted else 'no preemption'}")
        if e.bm.arena is not None and sum(e.bm.num_demotions):
            event("teardown: demoted " + ("under pressure" if e.s.num_demotions else "by age"))
        if e.s.num_swapped_out:
            event("teardown: swapped out and back")
        assert e.s.num_swapped_in <= e.s.num_swapped_out  # the rest finished (abort, stop) while swapped
        if e.s.num_remote_loads:
            event("teardown: prefilled by a peer" + (" (some fills failed)" if e.s.num_remote_failures else ""))
        assert e.bm.num_swapped == 0 and all(e.bm.host_allocator(p).num_used == 0 for p in ("q", "hp"))
        if e.bm.host_tier is not None:
            _no_leaks(e)
            if e.s.num_host_loads:
                event("teardown: loaded from the CPU prefix tier")
            if e.s.num_load_timeouts + e.s.num_load_failures:
                event("teardown: load failed or timed out")


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=400, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_discard_inflight_after_a_failed_forward():
    bm = BlockManager(16, 0, WindowPolicy(block_size=4))
    sched = Scheduler(SchedulerConfig(max_model_len=32, block_size=4), bm)
    sched.add(Sequence(1, [1, 2, 3, 4, 1], SamplingParams(max_tokens=3)))
    sched.add(Sequence(2, [2, 2, 2], SamplingParams(max_tokens=3)))
    out = sched.schedule()
    assert len(out.scheduled) == 2
    with pytest.raises(RuntimeError, match="still running"):
        sched.discard_inflight()  # the forward failed, but nobody finished the sequences yet
    with pytest.raises(RuntimeError, match="not yet update"):
        sched.schedule()
    sched.abort(1)
    sched.abort(2)
    sched.discard_inflight()
    sched.check_integrity()
    bm.check_integrity()
    assert bm.num_free_blocks("q") == 16 and not sched.has_unfinished()
    sched.add(Sequence(3, [3, 3], SamplingParams(max_tokens=1)))
    assert [s.seq_id for s in sched.schedule().scheduled] == [3]  # the scheduler works on


def test_a_scored_prompt_is_chunked_to_bound_its_logit_rows():
    """prompt_logprobs asks for a logit row per prompt position: a scored prompt's chunks hold at most
    max(max_num_seqs, SCORED_CHUNK_MIN) tokens (the logits stay near what the memory profile saw), and
    every position is still scored once; an unscored prompt of the same length takes the whole budget."""
    from kvq.engine.scheduler import SCORED_CHUNK_MIN

    pol = WindowPolicy(16)
    n = SCORED_CHUNK_MIN + 100
    for scored in (True, False):
        e = Engine(pol, nq=64, nhp=64, max_model_len=1024, max_num_batched_tokens=1024)
        e.add(1, list(range(1, n + 1)), max_tokens=2, prompt_logprobs=1 if scored else None)
        out = e.s.schedule()
        (item,) = out.scheduled
        assert item.num_new_tokens == (SCORED_CHUNK_MIN if scored else n)
        assert item.prompt_rows == (tuple(range(SCORED_CHUNK_MIN)) if scored else ())


@pytest.mark.parametrize("pipelined", [False, True])
def test_pressure_demotes_instead_of_preempting(pipelined):
    """Elastic precision: four long requests in a pool that holds two of them at full precision.  The
    plain cache preempts; the tiered one (pressure policy, a tier half the size) moves cold blocks down
    and serves all four without a preemption.  Outputs equal the unbatched run in both (the fake engine
    checks that every sample reads exactly its own KV, through tables built only from the outputs)."""
    policy = WindowPolicy(4, sink_blocks=1, residual_tokens=4)
    runs = {}
    for tiered in (False, True):
        arena = (TierRule(1, 4, 1, 4, pressure=True), (2, 4), 13, 2) if tiered else None
        e = Engine(policy, nq=22, nhp=24, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
                   pipelined=pipelined, tiers=arena)
        for sid in range(4):
            e.add(sid, [1 + sid, 2, 3, 4, 1], max_tokens=40, ignore_eos=True)
        e.run()
        for sid, seq in e.seqs.items():
            assert (seq.output_token_ids, seq.finish_reason) == reference(seq.prompt_token_ids, seq.params, 64)
        assert e.used_blocks() == 0
        runs[tiered] = (e.num_preempted, e.s.num_demotions)
    assert runs[False][0] > 0 and runs[False][1] == 0
    assert runs[True][0] == 0 and runs[True][1] > 0, runs
