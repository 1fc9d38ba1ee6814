"""An in-process :class:`~kvq.transfer.nixl_transport.BlockTransport` with injected faults.

Transports that share a :class:`FakeFabric` (default: one per process) reach each other by
name; a transfer copies the same chunks a NIXL transfer would post (same planner, same
order: :mod:`kvq.transfer.nixl_transport`), synchronously, and delivers its notification
after the data.  Faults are injected at the initiator (``inject``), one per transfer, in
order; each says what the *destination* memory and the *receiver* then see:

* ``Fault.peer_dies(k, b)``: chunks ``< k`` land whole, then ``b`` bytes of chunk ``k``,
  nothing more (undelivered bytes stale, or ``poison``); the handle fails with
  :class:`PeerError`, no notification; the remote peer is dead from then on (every later
  call with it raises PeerError).  :meth:`FakeFabric.kill` kills a peer between transfers.
* ``Fault.truncated(i, b)``: everything lands except chunk ``i``, of which only ``b`` bytes
  (default half); the handle is done and the notification is sent.
* ``Fault.corrupted(i, n)``: everything lands, then ``n`` bits flip inside chunk ``i``;
  done, notification sent.
* ``Fault.delayed(s)``: nothing lands (or ``poison`` does) until ``s`` seconds have passed
  and someone polls (handle or ``poll_notifications``); then everything, the notification,
  and the handle is done.  ``s=None``: never (``wait`` raises TimeoutError; ``cancel``).
* ``Fault.dropped_notif()``: everything lands, done, the notification is lost.

Truncation and corruption are silent, as on a real wire: the chunk checksum of
:mod:`kvq.transfer.wire` must catch them.  To let engine-level tests prove that a receiver
never reads a partially written block, every transport keeps **taint**: a (region, block)
row is tainted when the last transfer that targeted it did not deliver it whole and
intact, untainted again when a later transfer delivers it cleanly.  :meth:`FakeTransport.tainted`
lists the blocks with any tainted row; ``poison`` (a byte value, e.g. 0xFF: NaN in bf16 and
FP8 E4M3) fills undelivered bytes so that reading them shows.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from kvq.formats import fp8
from kvq.transfer.nixl_transport import (BlockTransport, PeerError, PoolDescriptor, Region, TransferError,
                                         TransferHandle)

FAULT_KINDS = ("peer_dies", "truncated", "corrupted", "delayed", "dropped_notif")


@dataclass(frozen=True)
class Fault:
    """One injected fault (module docstring); build with the class methods."""

    kind: str
    chunk: int = 0  # peer_dies: chunks delivered whole; truncated / corrupted: the chunk hit
    keep_bytes: int | None = None  # peer_dies / truncated: bytes of that chunk delivered
    flips: int = 1  # corrupted: bits flipped
    delay_s: float | None = None  # delayed: seconds until completion (None: never)
    poison: int | None = None  # byte written where bytes were not delivered (None: leave them stale)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r}; valid: {', '.join(FAULT_KINDS)}")
        if self.poison is not None and not 0 <= self.poison <= 255:
            raise ValueError(f"poison must be a byte value 0..255, got {self.poison}")

    @classmethod
    def peer_dies(cls, after_chunks: int = 0, keep_bytes: int = 0, poison: int | None = None) -> Fault:
        return cls("peer_dies", chunk=after_chunks, keep_bytes=keep_bytes, poison=poison)

    @classmethod
    def truncated(cls, chunk: int = 0, keep_bytes: int | None = None, poison: int | None = None) -> Fault:
        return cls("truncated", chunk=chunk, keep_bytes=keep_bytes, poison=poison)

    @classmethod
    def corrupted(cls, chunk: int = 0, flips: int = 1, seed: int = 0) -> Fault:
        return cls("corrupted", chunk=chunk, flips=flips, seed=seed)

    @classmethod
    def delayed(cls, delay_s: float | None = None, poison: int | None = None) -> Fault:
        return cls("delayed", delay_s=delay_s, poison=poison)

    @classmethod
    def dropped_notif(cls) -> Fault:
        return cls("dropped_notif")


class FakeFabric:
    """The in-process "network": transports by name, dead peers, deferred completions."""

    def __init__(self) -> None:
        self.agents: weakref.WeakValueDictionary[str, FakeTransport] = weakref.WeakValueDictionary()
        self.dead: set[str] = set()
        self._pending: list[FakeHandle] = []

    def kill(self, name: str) -> None:
        """``name`` dies now: its pending transfers fail, every later call with it raises PeerError."""
        self.dead.add(name)
        for h in [h for h in self._pending if name in (h.peer, h._initiator.name)]:
            h._fail(PeerError(f"{h.op} with {h.peer}: {name} died before completion (fake)"))

    def progress(self) -> None:
        """Complete every delayed transfer whose time has come."""
        now = time.monotonic()
        for h in [h for h in self._pending if h._due is not None and h._due <= now]:
            h._complete()

    def _alive(self, name: str) -> FakeTransport:
        t = self.agents.get(name)
        if t is None or name in self.dead or t._closed:
            raise PeerError(f"peer {name!r} is " + ("dead (fake)" if name in self.dead else "not on the fabric"))
        return t


DEFAULT_FABRIC = FakeFabric()


class FakeHandle(TransferHandle):
    def __init__(self, initiator: FakeTransport, peer: str, op: str, num_descriptors: int, nbytes: int) -> None:
        super().__init__(peer, op, num_descriptors, nbytes)
        self._initiator = initiator
        self._due: float | None = None
        self._copies: list = []  # deferred (src rows, dst rows, dst transport, region, blocks)
        self._notif: tuple[FakeTransport, bytes] | None = None

    def poll(self) -> str:
        self._initiator.fabric.progress()
        return self._state

    def cancel(self) -> None:
        if self._state == "pending":
            self._fail(TransferError(f"{self.op} with {self.peer} cancelled"))

    def _complete(self) -> None:
        for src, dst, owner, region, blocks in self._copies:
            dst.copy_(src)
            owner._clean(region, blocks)
        if self._notif is not None:
            self._notif[0]._inbox.append((self._initiator.name, self._notif[1]))
        self._drop()
        self._settle("done")

    def _fail(self, error: Exception) -> None:
        self._drop()
        self._settle("failed", error)

    def _drop(self) -> None:
        self._copies, self._notif = [], None
        fabric = self._initiator.fabric
        if self in fabric._pending:
            fabric._pending.remove(self)


def _rows(t: torch.Tensor, r: Region) -> torch.Tensor:
    """``[num_blocks, block_bytes]`` uint8 view of a pool tensor (rows ``r.stride`` bytes apart)."""
    rows = fp8.as_bytes(t).view(torch.uint8).flatten(1)
    assert tuple(rows.shape) == (r.num_blocks, r.block_bytes) and (r.num_blocks < 2 or rows.stride(0) == r.stride)
    return rows


class FakeTransport(BlockTransport):
    """:class:`BlockTransport` by in-process copies, with :meth:`inject` (module docstring)."""

    def __init__(self, name: str, fabric: FakeFabric | None = None) -> None:
        super().__init__(name)
        self.fabric = DEFAULT_FABRIC if fabric is None else fabric
        if self.fabric.agents.get(name) is not None and not self.fabric.agents[name]._closed:
            raise ValueError(f"a transport named {name!r} is already on this fabric")
        self.fabric.agents[name] = self
        self.fabric.dead.discard(name)
        self._faults: deque[Fault] = deque()
        self._inbox: list[tuple[str, bytes]] = []
        self._rows: list[torch.Tensor] = []
        self._taint: set[tuple[int, int]] = set()  # (region index, block)

    def inject(self, *faults: Fault) -> None:
        """Faults for this transport's next transfers, one each, in order."""
        self._faults.extend(faults)

    def tainted(self) -> dict[str, set[int]]:
        """Blocks of our pool, per pool ("q", "hp"), holding bytes of an incomplete or damaged transfer."""
        out: dict[str, set[int]] = {"q": set(), "hp": set()}
        for region, block in self._taint:
            out[self.descriptor.regions[region].pool].add(block)
        return out

    def _clean(self, region: int, blocks: range) -> None:
        self._taint.difference_update((region, b) for b in blocks)

    def _register(self, regions) -> bytes:
        self._rows = [_rows(t, r) for r, t in regions]
        return f"fake:{self.name}".encode()

    def _connect(self, desc: PoolDescriptor, replace: bool) -> None:
        peer = self.fabric._alive(desc.agent)
        if desc.metadata != f"fake:{desc.agent}".encode() or peer.descriptor != desc:
            raise ValueError(f"pool descriptor of {desc.agent!r} does not describe that fake transport's pool")

    def _disconnect(self, peer: str) -> None:
        pass

    def _check_open(self) -> None:
        super()._check_open()
        if self.name in self.fabric.dead:
            raise TransferError(f"transport {self.name} is dead (fake)")

    def _post(self, op: str, desc: PoolDescriptor, chunks: np.ndarray, notif: bytes) -> TransferHandle:
        try:
            peer = self.fabric._alive(desc.agent)
        except PeerError as e:
            self.disconnect(desc.agent, str(e))
            raise
        nbytes = self.chunk_bytes(chunks)
        fault = self._faults.popleft() if self._faults else None
        last = len(chunks) if fault is not None and fault.kind == "peer_dies" else len(chunks) - 1
        if fault is not None and fault.kind != "delayed" and not 0 <= fault.chunk <= last:
            raise ValueError(f"{fault.kind}: chunk {fault.chunk} of a transfer of {len(chunks)} chunks")
        src_t, dst_t = (self, peer) if op == "WRITE" else (peer, self)
        h = FakeHandle(self, desc.agent, op, len(chunks), int(nbytes.sum()))
        copies = []
        for region, lb, rb, n in chunks.tolist():
            s, d = (lb, rb) if op == "WRITE" else (rb, lb)
            copies.append((src_t._rows[region][s:s + n], dst_t._rows[region][d:d + n], dst_t, region,
                           range(d, d + n)))
        kind = fault.kind if fault else None
        if kind == "delayed":
            for _, dst, owner, region, blocks in copies:
                owner._taint.update((region, b) for b in blocks)
                if fault.poison is not None:
                    dst.fill_(fault.poison)
            h._copies, h._notif = copies, (peer, notif) if notif else None
            h._due = None if fault.delay_s is None else time.monotonic() + fault.delay_s
            self.fabric._pending.append(h)
            return h
        if kind == "peer_dies":
            whole, cut = copies[:fault.chunk], copies[fault.chunk:]
            h._copies = whole
            h._complete()
            for i, (src, dst, owner, region, blocks) in enumerate(cut):
                keep = fault.keep_bytes if i == 0 else 0
                _partial(src, dst, owner, region, blocks, keep, fault.poison)
            self.fabric.kill(desc.agent)
            self.disconnect(desc.agent, "died mid-transfer (fake)")
            h._settle("failed", PeerError(f"{op} with {desc.agent}: the peer died after {fault.chunk} of "
                                          f"{len(chunks)} chunks (fake)"))
            return h
        h._copies, h._notif = copies, (peer, notif) if notif and kind != "dropped_notif" else None
        if kind == "truncated":
            src, dst, owner, region, blocks = copies[fault.chunk]
            keep = int(nbytes[fault.chunk]) // 2 if fault.keep_bytes is None else fault.keep_bytes
            del h._copies[fault.chunk]
            h._complete()  # data, then the notification: the damage below lands before anyone looks
            _partial(src, dst, owner, region, blocks, keep, fault.poison)
        elif kind == "corrupted":
            h._complete()
            src, dst, owner, region, blocks = copies[fault.chunk]
            flat = dst.reshape(-1)
            g = torch.Generator().manual_seed(fault.seed)
            bits = torch.randperm(flat.numel() * 8, generator=g)[:fault.flips].tolist()
            for bit in bits:
                flat[bit // 8] ^= 1 << (bit % 8)
            owner._taint.update((region, blocks[bit // 8 // dst.shape[1]]) for bit in bits)
        else:
            h._complete()
        return h

    def notify(self, peer: str, msg: bytes) -> None:
        self._check_open()
        self._peer(peer)
        try:
            target = self.fabric._alive(peer)
        except PeerError as e:
            self.disconnect(peer, str(e))
            raise
        target._inbox.append((self.name, bytes(msg)))

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        if self._closed:
            return []
        self.fabric.progress()
        out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        if self._closed:
            return
        for h in [h for h in self.fabric._pending if h._initiator is self or h.peer == self.name]:
            h._fail(TransferError(f"{h.op} with {h.peer}: transport {self.name} closed"))
        self._peers.clear()
        self._closed = True
        self.pool, self._rows = None, []


def _partial(src: torch.Tensor, dst: torch.Tensor, owner: FakeTransport, region: int, blocks: range, keep: int,
             poison: int | None) -> None:
    """Deliver the first ``keep`` bytes of a chunk; taint every block not delivered whole."""
    s, d = src.reshape(-1), dst.reshape(-1)
    keep = max(0, min(keep, d.numel()))
    d[:keep].copy_(s[:keep])
    if poison is not None:
        d[keep:].fill_(poison)
    whole = keep // dst.shape[1]
    owner._clean(region, blocks[:whole])
    owner._taint.update((region, b) for b in blocks[whole:])
