"""Block transports: real NIXL/UCX transfers on the CPU (two agents in one process, and two
processes), and the fault-injecting fake, whose faults each do what its docstring says.

Pools are filled with random bytes (every bit pattern: NaN bf16, any FP8 code, any packed
int4), so "byte-exact" means every byte of every plane of every layer; destination pools
start with other random bytes, so an untouched neighbour is one whose bytes did not change.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from kvq.cache.plan import KVCacheConfig, bare_model
from kvq.cache.pool import KVPool
from kvq.transfer.fake_transport import FakeFabric, FakeTransport, Fault
from kvq.transfer.nixl_transport import (LayoutMismatch, PeerError, PoolDescriptor, TransferError, block_runs,
                                         pool_regions)

SHAPE = bare_model(2, 2, 32)  # layers, KV heads, head dim
NUM_Q, NUM_HP = 12, 6
CONFIGS = {
    "bfloat16": KVCacheConfig(dtype="bfloat16"),
    "fp8_e4m3": KVCacheConfig(dtype="fp8_e4m3"),
    "int8_per_token_head": KVCacheConfig(dtype="int8_per_token_head"),
    "int4_kivi": KVCacheConfig(dtype="int4_kivi", residual_tokens=32),
}
#: (local, remote): q runs 0-2 -> 5-7, then singles, given out of order; hp: a run of 2 and a single
Q_PAIRS = [(9, 0), (0, 5), (4, 11), (1, 6), (5, 2), (2, 7)]
HP_PAIRS = [(5, 0), (0, 3), (1, 4)]
Q_RUNS, HP_RUNS = 4, 2
TIMEOUT = 10.0


def filled(config: KVCacheConfig, seed: int) -> KVPool:
    pool = KVPool.create(config.plan(SHAPE), NUM_Q, NUM_HP)
    g = torch.Generator().manual_seed(seed)
    for _, t in pool_regions(pool):
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
    return pool


def snapshot(pool: KVPool) -> dict[str, torch.Tensor]:
    """Region name -> ``[num_blocks, block_bytes]`` uint8 copy."""
    return {r.name: t.view(torch.uint8).reshape(r.num_blocks, r.block_bytes).clone() for r, t in pool_regions(pool)}


def expected(src: dict, dst: dict, q_pairs, hp_pairs, layers=None) -> dict[str, torch.Tensor]:
    """``dst`` after copying ``src`` blocks (pairs are (src block, dst block))."""
    out = {name: t.clone() for name, t in dst.items()}
    for name, t in out.items():
        if layers is not None and int(name.split(".")[0]) not in layers:
            continue
        for s, d in (hp_pairs if name.endswith(".hp") else q_pairs):
            t[d] = src[name][s]
    return out


def assert_bytes(got: dict, want: dict) -> None:
    for name in want:
        bad = (got[name] != want[name]).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"{name}: blocks {bad} differ"


def wait_notif(receiver, sender=None, timeout: float = TIMEOUT, on_arrival=None) -> list[tuple[str, bytes]]:
    """Poll ``receiver`` (and ``sender``, whose polls send its notifications) until one arrives."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sender is not None:
            assert sender.poll_notifications() == []
        got = receiver.poll_notifications()
        if got:
            if on_arrival is not None:
                on_arrival()
            return got
        time.sleep(1e-4)
    raise AssertionError(f"no notification within {timeout} s")


def test_block_runs_coalesce_both_sides():
    assert block_runs([3, 0, 1, 2, 7], [9, 4, 5, 6, 8]).tolist() == [[0, 4, 3], [3, 9, 1], [7, 8, 1]]
    assert block_runs([0, 1], [5, 4]).tolist() == [[0, 5, 1], [1, 4, 1]]  # consecutive on one side only
    assert block_runs([], []).shape == (0, 3)


# -- real NIXL (UCX) ------------------------------------------------------------------------

@pytest.fixture
def nixl_pair():
    pytest.importorskip("nixl")
    from kvq.transfer.nixl_transport import NixlTransport

    made = []

    def make(config: KVCacheConfig, names=("prefill", "decode")):
        a, b = NixlTransport(names[0]), NixlTransport(names[1])
        made.extend([a, b])
        pa, pb = filled(config, 1), filled(config, 2)
        da, db = a.register_pool(pa), b.register_pool(pb)
        assert a.connect(db.to_bytes()) == names[1] and b.connect(da) == names[0]
        return a, b, pa, pb

    yield make
    for t in made:
        t.close()


@pytest.mark.parametrize("fmt", list(CONFIGS))
def test_nixl_write_scattered_blocks_byte_exact(nixl_pair, fmt):
    a, b, pa, pb = nixl_pair(CONFIGS[fmt])
    src, before = snapshot(pa), snapshot(pb)
    want = expected(src, before, Q_PAIRS, HP_PAIRS)
    n_q = sum(r.pool == "q" for r in a.descriptor.regions)
    h = a.write_blocks("decode", Q_PAIRS, HP_PAIRS, notif=b"req-7:done")
    assert h.num_descriptors == n_q * Q_RUNS + (len(a.descriptor.regions) - n_q) * HP_RUNS
    # the receiver reads on the notification alone: the data must be there when it arrives
    got = wait_notif(b, a, on_arrival=lambda: assert_bytes(snapshot(pb), want))
    assert got == [("prefill", b"req-7:done")]
    h.wait(TIMEOUT)
    assert h.poll() == "done"
    assert_bytes(snapshot(pa), src)  # the source is unchanged
    assert a.poll_notifications() == []


def test_nixl_read_pull_mode_and_layer_subset(nixl_pair):
    a, b, pa, pb = nixl_pair(CONFIGS["int8_per_token_head"])
    src, before = snapshot(pa), snapshot(pb)
    # decode pulls from prefill: pairs are (local, remote); the notification goes to the side read
    pairs = [(d, s) for s, d in Q_PAIRS]
    h = b.read_blocks("prefill", pairs, [(3, 0)], notif=b"read-1", layers=[1])
    h.wait(TIMEOUT)
    assert wait_notif(a, b) == [("decode", b"read-1")]
    assert_bytes(snapshot(pb), expected(src, before, Q_PAIRS, [(0, 3)], layers={1}))
    # no blocks, only a notification
    h = a.write_blocks("decode", notif=b"nothing to send")
    assert h.poll() == "done" and h.nbytes == 0
    assert wait_notif(b, a) == [("prefill", b"nothing to send")]


def test_nixl_wait_times_out_while_the_receiver_makes_no_progress():
    pytest.importorskip("nixl")
    from kvq.transfer.nixl_transport import NixlTransport

    # no progress thread on the receiver: it progresses only inside its own calls
    with NixlTransport("sender") as a, NixlTransport("idle", progress_delay_us=None) as b:
        pa, pb = filled(CONFIGS["bfloat16"], 1), filled(CONFIGS["bfloat16"], 2)
        da, db = a.register_pool(pa), b.register_pool(pb)
        a.connect(db)
        b.connect(da)
        h = a.write_blocks("idle", [(0, 0)], notif=b"x")
        with pytest.raises(TimeoutError, match="not done after 0.2 s"):
            h.wait(0.2)
        assert h.poll() == "pending"
        assert wait_notif(b, a) == [("sender", b"x")]  # the receiver polls: everything completes
        h.wait(TIMEOUT)


def test_nixl_errors_are_clear(nixl_pair):
    from kvq.transfer.nixl_transport import NixlTransport

    a, b, pa, pb = nixl_pair(CONFIGS["fp8_e4m3"])
    with pytest.raises(PeerError, match="'nobody' is unknown"):
        a.write_blocks("nobody", [(0, 0)])
    with pytest.raises(ValueError, match="decode q block 12 out of range"):
        a.write_blocks("decode", [(0, 12)])
    with pytest.raises(ValueError, match="written twice"):
        a.write_blocks("decode", [(0, 1), (2, 1)])
    with pytest.raises(ValueError, match="local q block 3 is written twice"):
        a.read_blocks("decode", [(3, 0), (3, 1)])
    with pytest.raises(ValueError, match="not a pool descriptor"):
        a.connect(b"{}")
    other = NixlTransport("int8-side")
    try:
        d = other.register_pool(filled(CONFIGS["int8_per_token_head"], 3))
        with pytest.raises(LayoutMismatch, match=r"pool tensor 0\.v\.data .* meets 0\.k\.scale"):
            a.connect(d)
    finally:
        other.close()
    desc = PoolDescriptor.from_bytes(b.descriptor.to_bytes())
    assert desc == b.descriptor
    assert desc.address("1.v.hp", 2) == pb.layers[1].v_hp[2].data_ptr()
    a.disconnect("decode")
    with pytest.raises(PeerError, match="gone"):
        a.write_blocks("decode", [(0, 0)])
    a.close()
    a.close()
    with pytest.raises(TransferError, match="closed"):
        a.write_blocks("decode", [(0, 0)])
    assert a.poll_notifications() == []


def wait_stopped(pid: int, timeout: float = TIMEOUT) -> None:
    """Block until process ``pid`` is in the stopped state (Linux /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(1e-3)
    raise AssertionError(f"process {pid} did not stop")


def _receiver(conn, fmt: str) -> None:
    """Child process: a decode-side transport that reports its pool on every notification."""
    from kvq.transfer.nixl_transport import NixlTransport

    pool = filled(CONFIGS[fmt], 2)
    with NixlTransport("decode-proc") as t:
        conn.send(t.register_pool(pool).to_bytes())
        t.connect(conn.recv())
        while True:
            for peer, msg in t.poll_notifications():
                conn.send((peer, msg, {k: v.numpy() for k, v in snapshot(pool).items()}))
            if conn.poll(0.001) and conn.recv() == "exit":
                return


def test_nixl_two_processes_hung_and_dead_peer():
    pytest.importorskip("nixl")
    from kvq.transfer.nixl_transport import NixlTransport

    fmt = "int4_kivi"
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_receiver, args=(there, fmt), daemon=True)
    child.start()
    a = NixlTransport("prefill-proc")
    try:
        pa = filled(CONFIGS[fmt], 1)
        da = a.register_pool(pa)
        assert here.poll(60), "the receiver process did not start"
        peer = a.connect(here.recv())
        here.send(da.to_bytes())
        src = snapshot(pa)

        def report(msg: bytes) -> dict:
            assert here.poll(TIMEOUT), "no report from the receiver"
            who, got, pool = here.recv()
            assert (who, got) == ("prefill-proc", msg)
            return {k: torch.from_numpy(v) for k, v in pool.items()}

        a.write_blocks(peer, notif=b"hello")  # the receiver's pool as it starts
        before = report(b"hello")
        h = a.write_blocks(peer, Q_PAIRS, HP_PAIRS, notif=b"req-1")
        h.wait(TIMEOUT)
        assert_bytes(report(b"req-1"), expected(src, before, Q_PAIRS, HP_PAIRS))

        # a hung peer (stopped): the write does not complete, wait() times out instead of hanging
        os.kill(child.pid, signal.SIGSTOP)
        try:
            wait_stopped(child.pid)  # kill() returns before the child stops; until then it may still progress
            h = a.write_blocks(peer, [(3, 3)], notif=b"req-2")
            with pytest.raises(TimeoutError, match="not done after"):
                h.wait(0.5)
            assert h.poll() == "pending"
        finally:
            os.kill(child.pid, signal.SIGCONT)
        h.wait(TIMEOUT)
        assert_bytes(report(b"req-2"), expected(src, before, Q_PAIRS + [(3, 3)], HP_PAIRS))

        # a dead peer: a clear PeerError, at once or from the handle, never a hang
        child.kill()
        child.join(TIMEOUT)
        t0 = time.monotonic()
        with pytest.raises(PeerError):
            for _ in range(3):  # a write posted before UCX notices may still complete
                a.write_blocks(peer, [(0, 0)]).wait(TIMEOUT)
        assert time.monotonic() - t0 < TIMEOUT
        with pytest.raises(PeerError, match="gone"):
            a.write_blocks(peer, [(0, 0)])
    finally:
        a.close()
        if child.is_alive():
            child.kill()
        child.join(TIMEOUT)


# -- the fake -------------------------------------------------------------------------------

@pytest.fixture
def fake_pair():
    fabric = FakeFabric()
    a, b = FakeTransport("prefill", fabric), FakeTransport("decode", fabric)
    pa, pb = filled(CONFIGS["int4_kivi"], 1), filled(CONFIGS["int4_kivi"], 2)
    da, db = a.register_pool(pa), b.register_pool(pb)
    a.connect(db.to_bytes())
    b.connect(da)
    yield a, b, pa, pb
    a.close()
    b.close()


def chunk_targets(a: FakeTransport, q_pairs, hp_pairs) -> list[tuple[str, list[int]]]:
    """(region, destination blocks) of each chunk of a write, in the transport's chunk order."""
    out = []
    for r in a.descriptor.regions:
        runs = block_runs(*zip(*(hp_pairs if r.pool == "hp" else q_pairs)))
        out += [(r.name, list(range(d, d + n))) for _, d, n in runs.tolist()]
    return out


def test_fake_clean_write_matches_nixl_contract(fake_pair):
    a, b, pa, pb = fake_pair
    src, before = snapshot(pa), snapshot(pb)
    h = a.write_blocks("decode", Q_PAIRS, HP_PAIRS, notif=b"ok")
    assert h.poll() == "done" and h.num_descriptors == len(chunk_targets(a, Q_PAIRS, HP_PAIRS))
    assert b.poll_notifications() == [("prefill", b"ok")]
    assert_bytes(snapshot(pb), expected(src, before, Q_PAIRS, HP_PAIRS))
    assert b.tainted() == {"q": set(), "hp": set()}
    h = b.read_blocks("prefill", [(10, 10)], notif=b"read")
    assert h.poll() == "done" and a.poll_notifications() == [("decode", b"read")]


def test_fake_peer_dies_mid_transfer(fake_pair):
    a, b, pa, pb = fake_pair
    src, before = snapshot(pa), snapshot(pb)
    a.inject(Fault.peer_dies(after_chunks=5, keep_bytes=7, poison=0xFF))
    h = a.write_blocks("decode", Q_PAIRS, HP_PAIRS, notif=b"never")
    assert h.poll() == "failed"
    with pytest.raises(PeerError, match="died after 5"):
        h.wait(TIMEOUT)
    got, full = snapshot(pb), expected(src, before, Q_PAIRS, HP_PAIRS)
    for i, (name, blocks) in enumerate(chunk_targets(a, Q_PAIRS, HP_PAIRS)):
        rows, want = got[name][blocks].reshape(-1), full[name][blocks].reshape(-1)
        keep = rows.numel() if i < 5 else 7 if i == 5 else 0
        assert torch.equal(rows[:keep], want[:keep]) and bool((rows[keep:] == 0xFF).all()), (i, name)
    for name, t in got.items():  # neighbours untouched
        hit = {d for _, d in (HP_PAIRS if name.endswith(".hp") else Q_PAIRS)}
        rest = [x for x in range(t.shape[0]) if x not in hit]
        assert torch.equal(t[rest], before[name][rest]), name
    # every destination block misses some plane: all are tainted; the receiver never hears
    assert b.tainted() == {"q": {d for _, d in Q_PAIRS}, "hp": {d for _, d in HP_PAIRS}}
    assert b.poll_notifications() == []
    with pytest.raises(PeerError, match="gone"):
        a.write_blocks("decode", [(0, 0)])
    late = FakeTransport("late", a.fabric)
    late.register_pool(filled(CONFIGS["int4_kivi"], 3))
    with pytest.raises(PeerError, match="dead"):
        late.connect(b.descriptor)


def test_fake_truncated_chunk(fake_pair):
    a, b, pa, pb = fake_pair
    src, before = snapshot(pa), snapshot(pb)
    targets = chunk_targets(a, Q_PAIRS, HP_PAIRS)
    name, blocks = targets[0]  # 0.k.data, blocks 5, 6, 7 (one run of three)
    row = src[name].shape[1]
    a.inject(Fault.truncated(chunk=0, keep_bytes=row + 3))
    h = a.write_blocks("decode", Q_PAIRS, HP_PAIRS, notif=b"looks fine")
    assert h.poll() == "done" and b.poll_notifications() == [("prefill", b"looks fine")]
    got, full = snapshot(pb), expected(src, before, Q_PAIRS, HP_PAIRS)
    rows = got[name][blocks].reshape(-1)
    assert torch.equal(rows[:row + 3], full[name][blocks].reshape(-1)[:row + 3])
    assert torch.equal(rows[row + 3:], before[name][blocks].reshape(-1)[row + 3:])  # stale
    assert_bytes({n: t for n, t in got.items() if n != name}, {n: t for n, t in full.items() if n != name})
    assert b.tainted() == {"q": set(blocks[1:]), "hp": set()}
    # a clean rewrite of the same blocks clears the taint
    a.write_blocks("decode", Q_PAIRS, HP_PAIRS)
    assert b.tainted() == {"q": set(), "hp": set()}
    assert_bytes(snapshot(pb), full)


def test_fake_corrupted_chunk(fake_pair):
    a, b, pa, pb = fake_pair
    src, before = snapshot(pa), snapshot(pb)
    targets = chunk_targets(a, Q_PAIRS, HP_PAIRS)
    name, blocks = targets[-1]  # the last chunk: hp block 0
    a.inject(Fault.corrupted(chunk=len(targets) - 1, flips=3, seed=5))
    h = a.write_blocks("decode", Q_PAIRS, HP_PAIRS, notif=b"looks fine")
    assert h.poll() == "done" and b.poll_notifications() == [("prefill", b"looks fine")]
    got, full = snapshot(pb), expected(src, before, Q_PAIRS, HP_PAIRS)
    diff = got[name][blocks] ^ full[name][blocks]
    assert sum(bin(x).count("1") for x in diff.reshape(-1).tolist()) == 3
    assert_bytes({n: t for n, t in got.items() if n != name}, {n: t for n, t in full.items() if n != name})
    assert b.tainted() == {"q": set(), "hp": set(blocks)}


def test_fake_delayed_completion(fake_pair):
    a, b, pa, pb = fake_pair
    src, before = snapshot(pa), snapshot(pb)
    a.inject(Fault.delayed(None, poison=0xFF))
    h = a.write_blocks("decode", Q_PAIRS, HP_PAIRS, notif=b"late")
    with pytest.raises(TimeoutError, match="not done after"):
        h.wait(0.05)
    assert h.poll() == "pending" and b.poll_notifications() == []
    assert b.tainted() == {"q": {d for _, d in Q_PAIRS}, "hp": {d for _, d in HP_PAIRS}}
    assert all(bool((snapshot(pb)[n][[d for _, d in Q_PAIRS]] == 0xFF).all()) for n in before if not n.endswith(".hp"))
    h.cancel()
    assert h.poll() == "failed" and b.poll_notifications() == []
    # a delay that ends: data, then the notification, then the handle is done
    a.inject(Fault.delayed(0.05))
    h = a.write_blocks("decode", Q_PAIRS, HP_PAIRS, notif=b"late")
    assert h.poll() == "pending"
    assert wait_notif(b) == [("prefill", b"late")]
    h.wait(TIMEOUT)
    assert_bytes(snapshot(pb), expected(src, before, Q_PAIRS, HP_PAIRS))
    assert b.tainted() == {"q": set(), "hp": set()}


def test_fake_dropped_notification(fake_pair):
    a, b, pa, pb = fake_pair
    src, before = snapshot(pa), snapshot(pb)
    a.inject(Fault.dropped_notif())
    h = a.write_blocks("decode", Q_PAIRS, HP_PAIRS, notif=b"lost")
    assert h.poll() == "done"
    assert_bytes(snapshot(pb), expected(src, before, Q_PAIRS, HP_PAIRS))
    assert b.tainted() == {"q": set(), "hp": set()}
    time.sleep(0.01)
    assert b.poll_notifications() == []
    a.write_blocks("decode", [(0, 0)], notif=b"next")  # one fault per transfer
    assert b.poll_notifications() == [("prefill", b"next")]


def test_fake_read_fault_taints_the_reader(fake_pair):
    a, b, pa, pb = fake_pair
    b.inject(Fault.truncated(chunk=0, keep_bytes=0))
    b.read_blocks("prefill", [(4, 8), (5, 9)], notif=b"r").wait(TIMEOUT)
    assert b.tainted() == {"q": {4, 5}, "hp": set()} and a.tainted() == {"q": set(), "hp": set()}
    assert a.poll_notifications() == [("decode", b"r")]


def test_fake_errors(fake_pair):
    a, b, pa, pb = fake_pair
    with pytest.raises(ValueError, match="already on this fabric"):
        FakeTransport("decode", a.fabric)
    a.inject(Fault.truncated(chunk=99))
    with pytest.raises(ValueError, match="chunk 99"):
        a.write_blocks("decode", [(0, 0)])
    with pytest.raises(ValueError, match="fault kind"):
        Fault("meteor")
    a.fabric.kill("decode")
    with pytest.raises(PeerError, match="dead"):
        a.write_blocks("decode", [(0, 0)])
    a.close()
    a.close()


# -- a tiered pool (elastic precision): tier 0's planes are strided views of a byte arena -----------
TIERED = KVCacheConfig(dtype="fp8_e4m3", tiers=("int4_kivi",), residual_tokens=32)


def owned_filled(tiered: bool, seed: int) -> KVPool:
    """A tiered pool (at least NUM_Q resident blocks) or a plain fp8_e4m3 one of the same block size,
    every byte it owns random."""
    from kvq.cache.arena import arena_layout

    plan = TIERED.plan(SHAPE)
    if tiered:
        pool = KVPool.create(plan, 0, NUM_HP, num_slabs=-(-NUM_Q // arena_layout(plan).per_slab[0]) + 1)
    else:
        pool = KVPool.create(KVCacheConfig(dtype="fp8_e4m3", block_size=plan.block_size).plan(SHAPE), NUM_Q, NUM_HP)
    g = torch.Generator().manual_seed(seed)
    for layer in pool.layers:
        for t in layer.tensors():
            b = t.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
    return pool


def memory(pool: KVPool) -> list[torch.Tensor]:
    """Every byte the pool owns (a tiered layer's arena whole, every tier's blocks and padding)."""
    return [t.view(torch.uint8).clone() for layer in pool.layers for t in layer.tensors()]


@pytest.mark.parametrize("transport", ["nixl", "fake"])
@pytest.mark.parametrize("op", ["tiered pulls", "tiered is read"])
def test_a_tiered_pools_resident_tier_moves_block_by_block_byte_exact(transport, op):
    """A decode server with elastic precision registers its arena: tier 0's planes are views whose blocks
    lie a whole arena block apart (the other planes and tiers in between).  Regions say their stride,
    the registration covers each arena once, and a strided region moves one block a descriptor: every
    pair lands byte for byte, and no other byte of the arena (other planes, other tiers' blocks) moves."""
    if transport == "nixl":
        pytest.importorskip("nixl")
        from kvq.transfer.nixl_transport import NixlTransport as make
    else:
        fabric = FakeFabric()

        def make(name):
            return FakeTransport(name, fabric)

    tiered, plain = owned_filled(True, 1), owned_filled(False, 2)
    a, b = make("decode"), make("prefill")
    try:
        da, db = a.register_pool(tiered), b.register_pool(plain)
        assert any(not r.contiguous for r in da.regions) and all(r.contiguous for r in db.regions)
        a.connect(db.to_bytes()), b.connect(da.to_bytes())
        # the expected bytes: the same copies through torch's strided views of a twin pool
        src, dst = (plain, tiered) if op == "tiered pulls" else (tiered, plain)
        twin = owned_filled(True, 1) if dst is tiered else owned_filled(False, 2)
        for ls, ld in zip(src.layers, twin.layers):
            for role in ("k", "v"):
                for name, t in ls.planes(role).items():
                    for s, d in Q_PAIRS:
                        ld.planes(role)[name][d] = t[s]
                for s, d in HP_PAIRS:
                    ld.hp(role)[d] = ls.hp(role)[s]
        before_src = memory(src)
        if op == "tiered pulls":  # (local, remote) pairs: the tiered pool reads the plain one
            h = a.read_blocks("prefill", [(d, s) for s, d in Q_PAIRS], [(d, s) for s, d in HP_PAIRS])
        else:  # the plain pool reads the tiered one
            h = b.read_blocks("decode", [(d, s) for s, d in Q_PAIRS], [(d, s) for s, d in HP_PAIRS])
        h.wait(TIMEOUT)
        assert h.poll() == "done"
        for i, (got, want) in enumerate(zip(memory(dst), memory(twin))):
            bad = (got != want).nonzero().flatten()
            assert not len(bad), f"tensor {i}: {len(bad)} bytes differ, first at {bad[:4].tolist()}"
        assert all(torch.equal(x, y) for x, y in zip(memory(src), before_src))
    finally:
        a.close()
        b.close()
