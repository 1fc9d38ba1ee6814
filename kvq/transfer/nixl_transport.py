"""Moving KV blocks between two processes' pools with NIXL (UCX): the block transport.

A transport registers one :class:`~kvq.cache.pool.KVPool` and describes it to peers as a
:class:`PoolDescriptor`: the NIXL agent's metadata plus, for every pool tensor, a
*region* (base address, bytes per block, block count, block stride), in this order::

    for layer in 0 .. L-1:
        k planes (data, [scale, [zero]], spec order)   region "{layer}.k.{plane}"   pool "q"
        v planes                                       region "{layer}.v.{plane}"   pool "q"
        k hp, v hp  [num_hp_blocks, H, bs, D]          region "{layer}.k.hp", ".v.hp" pool "hp"

Block ``b`` of a region lives at ``addr + b * stride``, ``block_bytes`` long (pool tensors are
block-major; ``stride == block_bytes`` for a contiguous tensor, more for a tier's view of an
elastic-precision arena, kvq.cache.arena, whose planes of one block sit side by side).  Two
pools can exchange blocks when their regions agree name for name and byte for byte per block
(same plan; block counts and strides may differ): :meth:`BlockTransport.connect` checks it.
Converting between formats is not this layer's job.

One :meth:`~BlockTransport.write_blocks` / :meth:`~BlockTransport.read_blocks` call is ONE
NIXL transfer whose descriptor list covers every region of the chosen layers for the
given ``(local block, remote block)`` pairs of each pool.  Pairs are sorted by local
block and runs where both sides are consecutive become one descriptor ("chunk"), in a region
contiguous on both sides (a strided region moves one block a descriptor)::

    chunks: int64 [N, 4]  (region index, local block, remote block, block count)
            region-major in region order, runs by ascending local block

The optional ``notif`` is delivered to the peer's :meth:`~BlockTransport.poll_notifications`
after the data of that transfer has landed (NIXL's guarantee, for WRITE and READ: a READ
notifies the side that was read).  An empty ``notif`` sends none.  The bytes a transfer
reads must not change, and the bytes it writes must not be read, until the handle is
done and (receiver) the notification has arrived.

The initiator must keep polling until its handle settles (``handle.poll()``/``wait()``,
or ``poll_notifications()``, which polls every pending handle of the transport): NIXL's
UCX backend sends a transfer's notification from the status check that finds its data
complete, so a handle nobody polls may never notify (seen on a fresh connection, whose
first transfer is still in progress when posted).

:mod:`kvq.transfer.fake_transport` implements the same contract over in-process copies,
with injected faults.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
import weakref

import numpy as np
import torch

from kvq.cache.host_pool import _pairs
from kvq.cache.pool import KVPool
from kvq.transfer.regions import (POOLS, LayoutMismatch, PoolDescriptor, Region, block_runs,  # noqa: F401
                                  check_layout, memory_spans, pool_regions, single_blocks)

OPS = ("WRITE", "READ")


class TransferError(RuntimeError):
    """A transfer failed (the handle says why); the blocks it wrote hold unknown bytes."""


class PeerError(TransferError):
    """The peer is unknown, was disconnected, or died."""


class TransferHandle(abc.ABC):
    """One posted transfer.  ``poll()`` never blocks; ``wait()`` blocks at most ``timeout`` seconds.

    States: ``"pending"`` -> ``"done"`` | ``"failed"`` (``error`` says why).  After a
    ``TimeoutError`` the transfer is still pending: poll again, or :meth:`cancel` it."""

    def __init__(self, peer: str, op: str, num_descriptors: int, nbytes: int) -> None:
        self.peer, self.op = peer, op
        self.num_descriptors, self.nbytes = num_descriptors, nbytes
        self.error: Exception | None = None
        self._state = "pending"

    @abc.abstractmethod
    def poll(self) -> str:
        """``"pending"`` | ``"done"`` | ``"failed"``."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Abandon a pending transfer (state ``"failed"``); its destination blocks hold unknown bytes."""

    def _settle(self, state: str, error: Exception | None = None) -> str:
        self._state, self.error = state, error
        return state

    def wait(self, timeout: float) -> None:
        """Block until done; raise ``TimeoutError`` after ``timeout`` s, the transfer's error if it failed."""
        deadline = time.monotonic() + timeout
        nap = 50e-6
        while (state := self.poll()) == "pending":
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.op} of {self.nbytes} bytes with {self.peer}: not done after {timeout:g} s")
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)
        if state == "failed":
            raise self.error


class _DoneHandle(TransferHandle):
    """A call that moved no bytes."""

    def __init__(self, peer: str, op: str) -> None:
        super().__init__(peer, op, 0, 0)
        self._state = "done"

    def poll(self) -> str:
        return self._state

    def cancel(self) -> None:
        pass


def _flip(pairs):
    """(local, remote) pairs -> (remote, local), for range and duplicate checks of a READ."""
    if isinstance(pairs, torch.Tensor):
        return pairs.flip(-1) if pairs.dim() == 2 else pairs
    return [tuple(p)[::-1] if isinstance(p, (tuple, list)) else p for p in pairs]


class BlockTransport(abc.ABC):
    """The transport contract (module docstring); :class:`NixlTransport` and the fake implement it."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"transport name must be a non-empty string, got {name!r}")
        self.name = name
        self.pool: KVPool | None = None
        self.descriptor: PoolDescriptor | None = None
        self._peers: dict[str, PoolDescriptor] = {}
        self._gone: dict[str, str] = {}  # peer -> why it is no longer connected
        self._closed = False

    # -- set-up ------------------------------------------------------------------------------
    def register_pool(self, pool: KVPool) -> PoolDescriptor:
        """Register every tensor of ``pool``; the descriptor to hand to peers (``.to_bytes()``)."""
        self._check_open()
        if self.pool is not None:
            raise RuntimeError(f"transport {self.name} already has a pool registered")
        regions = pool_regions(pool)
        metadata = self._register(regions)
        self.pool = pool
        self.descriptor = PoolDescriptor(self.name, metadata, pool.plan.name, pool.num_q_blocks, pool.num_hp_blocks,
                                         tuple(r for r, _ in regions))
        return self.descriptor

    def connect(self, peer: PoolDescriptor | bytes) -> str:
        """Make a peer's pool addressable (its descriptor, or its bytes); returns the peer's name."""
        self._check_open()
        if self.descriptor is None:
            raise RuntimeError(f"transport {self.name}: register_pool before connect")
        desc = peer if isinstance(peer, PoolDescriptor) else PoolDescriptor.from_bytes(peer)
        if desc.agent == self.name:
            raise ValueError(f"transport {self.name} cannot connect to itself")
        check_layout(self.descriptor, desc)
        self._connect(desc, replace=desc.agent in self._peers)
        self._peers[desc.agent] = desc
        self._gone.pop(desc.agent, None)
        return desc.agent

    def disconnect(self, peer: str, why: str = "disconnected") -> None:
        if self._peers.pop(peer, None) is not None:
            self._gone[peer] = why
            self._disconnect(peer)

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    # -- transfers ---------------------------------------------------------------------------
    def write_blocks(self, peer: str, q_pairs=(), hp_pairs=(), notif: bytes = b"",
                     layers=None) -> TransferHandle:
        """Copy our blocks into the peer's: pairs are ``(local block, remote block)`` of the q and
        hp pools (lists of pairs or ``[N, 2]`` int tensors); ``layers`` (default all) limits the
        regions.  ``notif`` reaches the peer after the data."""
        return self._transfer("WRITE", peer, q_pairs, hp_pairs, notif, layers)

    def read_blocks(self, peer: str, q_pairs=(), hp_pairs=(), notif: bytes = b"",
                    layers=None) -> TransferHandle:
        """Copy the peer's blocks into ours (pull mode): pairs are ``(local block, remote block)``;
        ``notif`` reaches the peer once its blocks have been read."""
        return self._transfer("READ", peer, q_pairs, hp_pairs, notif, layers)

    def _transfer(self, op: str, peer: str, q_pairs, hp_pairs, notif, layers) -> TransferHandle:
        self._check_open()
        desc = self._peer(peer)
        notif = bytes(notif)
        runs = {}
        for kind, pairs, ln, rn in (("q", q_pairs, self.pool.num_q_blocks, desc.num_q_blocks),
                                    ("hp", hp_pairs, self.pool.num_hp_blocks, desc.num_hp_blocks)):
            what = f"{kind}_pairs"
            if op == "WRITE":  # the destination (checked for duplicates) is the second of a pair
                local, remote = _pairs(pairs, what, f"local {kind} block", ln, f"{peer} {kind} block", rn)
            else:
                remote, local = _pairs(_flip(pairs), what, f"{peer} {kind} block", rn, f"local {kind} block", ln)
            runs[kind] = block_runs(local, remote)
        if layers is not None:
            layers = set(layers)
            bad = sorted(x for x in layers if not 0 <= x < len(self.pool.layers))
            if bad:
                raise ValueError(f"layers: {bad[0]} out of range 0..{len(self.pool.layers) - 1}")
        units: dict = {}  # a region strided on either side moves block by block (cut once per pool)
        rows = []
        for i, r in enumerate(self.descriptor.regions):
            if len(runs[r.pool]) and (layers is None or r.layer in layers):
                if r.contiguous and desc.regions[i].contiguous:
                    ch = runs[r.pool]
                else:
                    ch = units.get(r.pool)
                    if ch is None:
                        ch = units[r.pool] = single_blocks(runs[r.pool])
                rows.append(np.column_stack([np.full(len(ch), i, np.int64), ch]))
        if not rows:
            if notif:
                self.notify(peer, notif)
            return _DoneHandle(peer, op)
        chunks = np.concatenate(rows)
        return self._post(op, desc, chunks, notif)

    def _peer(self, peer: str) -> PoolDescriptor:
        desc = self._peers.get(peer)
        if desc is None:
            why = self._gone.get(peer)
            raise PeerError(f"transport {self.name}: peer {peer!r} " + (f"is gone ({why})" if why else
                            f"is unknown (connected: {', '.join(self._peers) or 'none'})"))
        return desc

    def chunk_bytes(self, chunks: np.ndarray) -> np.ndarray:
        """Bytes of each chunk."""
        stride = np.array([r.block_bytes for r in self.descriptor.regions], np.int64)
        return chunks[:, 3] * stride[chunks[:, 0]]

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"transport {self.name} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what an implementation provides -----------------------------------------------------
    @abc.abstractmethod
    def _register(self, regions: list[tuple[Region, torch.Tensor]]) -> bytes:
        """Register the tensors; return the metadata a peer needs to reach them."""

    @abc.abstractmethod
    def _connect(self, desc: PoolDescriptor, replace: bool) -> None: ...

    @abc.abstractmethod
    def _disconnect(self, peer: str) -> None: ...

    @abc.abstractmethod
    def _post(self, op: str, desc: PoolDescriptor, chunks: np.ndarray, notif: bytes) -> TransferHandle: ...

    @abc.abstractmethod
    def notify(self, peer: str, msg: bytes) -> None:
        """A notification not bound to a transfer (e.g. "blocks read, free them")."""

    @abc.abstractmethod
    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call: ``(peer name, message)``, per peer in order."""

    @abc.abstractmethod
    def close(self) -> None:
        """Cancel pending transfers, forget peers, release memory registrations; safe to call twice."""


# -- NIXL -------------------------------------------------------------------------------------

log = logging.getLogger(__name__)
_AGENT_LOCK = threading.Lock()


def _nixl():
    try:
        from nixl import _api
    except ImportError as e:
        raise ImportError("NixlTransport needs NIXL: pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1 "
                          "(`make install-test`)") from e
    return _api


def _make_agent(api, name: str, backend: str, progress_delay_us: int | None):
    """A ``nixl_agent`` whose progress thread sleeps ``progress_delay_us`` between idle polls.

    ``nixl_agent`` hard-codes the progress thread's delay to 0: each agent then spins a
    core at 100% for its whole life.  With a delay the UCX progress thread waits on the
    worker's event fd (woken by traffic: the latency of a 1 MiB loopback write stayed
    ~0.5 ms at 100 ms delay on the dev machine) and costs ~nothing idle.  The delay is set
    by handing ``nixl_agent.__init__`` a config class whose ``pthrDelay`` ignores the 0.
    ``None``: no progress thread; then both sides only progress inside their own calls
    (a writer's handle stays pending until the receiver polls)."""
    bind = api.nixlBind
    base = bind.nixlAgentConfig

    class _Config(base):
        @property
        def pthrDelay(self):
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _ignored):
            base.pthrDelay.__set__(self, int(progress_delay_us or 0))

    conf = api.nixl_agent_config(enable_prog_thread=progress_delay_us is not None, backends=[backend])
    with _AGENT_LOCK:
        bind.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, conf)
        finally:
            bind.nixlAgentConfig = base


class NixlTransferHandle(TransferHandle):
    """A posted NIXL transfer; the NIXL request is released once it settles."""

    def __init__(self, transport: NixlTransport, xfer, peer: str, op: str, num_descriptors: int, nbytes: int,
                 posted: str) -> None:
        super().__init__(peer, op, num_descriptors, nbytes)
        self._transport, self._xfer = transport, xfer
        self._check(posted)

    def _check(self, status: str) -> str:
        if status == "DONE":
            return self._finish("done")
        if status == "ERR":
            return self._finish("failed", TransferError(f"{self.op} with {self.peer} failed (NIXL status ERR)"))
        return self._state

    def poll(self) -> str:
        if self._state != "pending":
            return self._state
        t = self._transport
        if t._closed:
            return self._finish("failed", TransferError(f"{self.op} with {self.peer}: transport {t.name} closed"))
        try:
            return self._check(t._agent.check_xfer_state(self._xfer))
        except t._errors as e:
            return self._finish("failed", t._error(self.peer, self.op, e))

    def cancel(self) -> None:
        if self._state == "pending":
            self._finish("failed", TransferError(f"{self.op} with {self.peer} cancelled"))

    def _finish(self, state: str, error: Exception | None = None) -> str:
        xfer, self._xfer = self._xfer, None
        if xfer is not None:
            self._transport._release(xfer)
        self._transport._handles.discard(self)
        return self._settle(state, error)


class NixlTransport(BlockTransport):
    """:class:`BlockTransport` over one NIXL agent (module docstring for the contract).

    CPU pools register as DRAM.  CUDA pools register as VRAM (device index from each
    tensor; a CUDA context is created on ``device`` before the agent, which UCX needs to
    see GPU memory): it ran on one H200 (two agents, one process: UCX used TCP there); not yet between two GPUs.
    Peer failures come back as :class:`PeerError` (UCX error handling mode "peer": a dead
    peer's endpoint fails at once), a hung peer as ``TimeoutError`` from ``wait``.  One
    transport is driven from one thread."""

    def __init__(self, name: str, backend: str = "UCX", device: torch.device | str = "cpu",
                 progress_delay_us: int | None = 10_000) -> None:
        super().__init__(name)
        api = _nixl()
        self._errors = tuple(getattr(api.nixlBind, n) for n in dir(api.nixlBind)
                             if n.startswith("nixl") and n.endswith("Error"))
        self._disconnected = api.nixlBind.nixlRemoteDisconnectError
        self.backend, self.device = backend, torch.device(device)
        if self.device.type == "cuda":
            torch.zeros(1, device=self.device)  # the device's CUDA context, before UCX starts
        self._reg = None
        self._handles: weakref.WeakSet[NixlTransferHandle] = weakref.WeakSet()
        try:
            self._agent = _make_agent(api, name, backend, progress_delay_us)
        except self._errors as e:
            raise TransferError(f"NIXL agent {name}: {type(e).__name__}: {e}") from None
        if backend not in self._agent.backends:
            plugins = self._agent.get_plugin_list()
            self._agent, self._closed = None, True
            raise ValueError(f"NIXL backend {backend!r} is not available; plugins: {', '.join(plugins)}")

    def _error(self, peer: str, op: str, e: Exception) -> TransferError:
        if isinstance(e, self._disconnected):
            self.disconnect(peer, f"disconnected during {op}: {e}")
            return PeerError(f"{op} with {peer}: the peer disconnected ({e})")
        return TransferError(f"{op} with {peer}: {type(e).__name__}: {e}")

    def _release(self, xfer) -> None:
        try:
            xfer.release()
        except self._errors as e:  # NIXL keeps it on its leak list and retries when the agent goes
            log.warning("%s: NIXL transfer request not released (%s: %s)", self.name, type(e).__name__, e)

    def _register(self, regions: list[tuple[Region, torch.Tensor]]) -> bytes:
        for r, t in regions:
            if t.device.type != self.device.type:
                raise ValueError(f"pool tensor {r.name} is on {t.device}; transport {self.name} serves {self.device}")
        rows = memory_spans([r for r, _ in regions])
        if rows:
            try:
                self._reg = self._agent.register_memory(np.array(rows, np.uint64), regions[0][0].mem,
                                                        backends=[self.backend])
            except self._errors as e:
                raise TransferError(f"{self.name}: registering {len(rows)} pool tensors: {type(e).__name__}: {e}")
        return self._agent.get_agent_metadata()  # after registration: it carries the memory keys

    def _connect(self, desc: PoolDescriptor, replace: bool) -> None:
        if replace:
            self._disconnect(desc.agent)
        try:
            name = self._agent.add_remote_agent(desc.metadata)
        except self._errors as e:
            raise PeerError(f"{self.name}: loading metadata of {desc.agent}: {type(e).__name__}: {e}") from None
        name = name.decode() if isinstance(name, bytes) else name
        if name != desc.agent:
            self._agent.remove_remote_agent(name)
            raise ValueError(f"pool descriptor of {desc.agent!r} carries NIXL metadata of agent {name!r}")

    def _disconnect(self, peer: str) -> None:
        try:
            self._agent.remove_remote_agent(peer)
        except self._errors as e:
            log.debug("%s: removing %s: %s", self.name, peer, e)

    def _post(self, op: str, desc: PoolDescriptor, chunks: np.ndarray, notif: bytes) -> TransferHandle:
        reg, lb, rb, n = chunks.T
        nbytes = self.chunk_bytes(chunks)

        def dlist(regions: tuple[Region, ...], blocks: np.ndarray) -> np.ndarray:  # [N, 3] (addr, len, dev)
            addr = np.array([r.addr for r in regions], np.int64)
            stride = np.array([r.stride for r in regions], np.int64)
            dev = np.array([r.device_id for r in regions], np.int64)
            return np.column_stack([addr[reg] + blocks * stride[reg], nbytes, dev[reg]]).astype(np.uint64)

        xfer = None
        try:
            local = self._agent.get_xfer_descs(dlist(self.descriptor.regions, lb), self.descriptor.regions[0].mem)
            remote = self._agent.get_xfer_descs(dlist(desc.regions, rb), desc.regions[0].mem)
            xfer = self._agent.initialize_xfer(op, local, remote, desc.agent, notif, backends=[self.backend])
            posted = self._agent.transfer(xfer)
        except self._errors as e:
            if xfer is not None:
                self._release(xfer)
            raise self._error(desc.agent, op, e) from None
        handle = NixlTransferHandle(self, xfer, desc.agent, op, len(chunks), int(nbytes.sum()), posted)
        self._handles.add(handle)
        return handle

    def notify(self, peer: str, msg: bytes) -> None:
        self._check_open()
        self._peer(peer)
        try:
            self._agent.send_notif(peer, bytes(msg))  # backend=... is broken in nixl 1.5.1 (a handle, not a list)
        except self._errors as e:
            raise self._error(peer, "notify", e) from None

    def progress(self) -> None:
        """Poll every pending transfer this transport initiated (a WRITE's notification is sent
        from such a poll once its data has landed)."""
        for h in list(self._handles):
            h.poll()

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received (module docstring); also progresses our own pending transfers."""
        if self._closed:
            return []
        self.progress()
        try:
            got = self._agent.get_new_notifs()
        except self._errors as e:
            raise TransferError(f"{self.name}: reading notifications: {type(e).__name__}: {e}") from None
        return [(peer.decode() if isinstance(peer, bytes) else peer, bytes(m)) for peer, msgs in got.items()
                for m in msgs]

    def close(self) -> None:
        if self._closed:
            return
        for h in list(self._handles):
            h.cancel()
        for peer in list(self._peers):
            self.disconnect(peer, f"transport {self.name} closed")
        self._closed = True
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg, backends=[self.backend])
            except self._errors as e:
                log.warning("%s: deregistering the pool: %s: %s", self.name, type(e).__name__, e)
        self._reg = self._agent = self.pool = None
