"""Host (CPU) mirror of a :class:`~kvq.cache.pool.KVPool`: the data layer of swap to CPU.

Per layer the host pool holds the same tensors as the device pool, with the same
per-block layout and dtypes, only a different number of blocks::

    device  layer.k[plane]  [num_q_blocks,  *plane.shape]      host  k[plane]  [host_q_blocks,  *plane.shape]
            layer.k_hp      [num_hp_blocks, H, bs, D]                k_hp      [host_hp_blocks, H, bs, D]
            (and V alike)

so a block moves between them as whole rows of every plane (data, scale, zero)
and of both hp pools, byte for byte (FP8 planes through :mod:`kvq.formats.fp8`'s
uint8 views).  Which host slot holds what is the block manager's business; this
module holds tensors only and moves the rows it is told to.

The copy (one ``index_select`` + one ``index_copy_`` per plane per layer, batched
over every block of a call):

* CUDA, pinned (the default): the host tensors are page-locked with
  ``cudaHostRegister`` (exact size: the caching host allocator would round every
  tensor up to a power of two) and addressed by the GPU through CUDA aliases of
  the same memory (unified addressing), so gather and scatter are plain device
  kernels on a dedicated copy stream.  The copy stream first waits on an event
  recorded on the current stream, and :meth:`HostKVPool.store` / :meth:`load`
  return a :class:`CopyHandle` whose event marks the end of the copy.  Nothing
  waits on the host.
* CPU pools, and CUDA pools with ``pin=False``: the same calls, synchronous; the
  handle is complete when returned.

What the caller must do with a handle (the engine's order)::

    store:  h = host.store(pool, q_pairs, hp_pairs)  ->  h.done()  ->  free the device blocks
    load:   h = host.load(pool, q_pairs, hp_pairs)   ->  h.wait()  ->  read the device blocks
            (host slots of an in-flight load are not reused until h.done())
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvq.cache.host_faults import CopyFaults
from kvq.cache.plan import CachePlan
from kvq.cache.pool import KVPool, arena_planes
from kvq.cache.tiers import pool_tier
from kvq.formats import fp8

log = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


@dataclass
class HostLayerKV:
    """One layer's host tensors (layout: module docstring).  A tiered pool's (elastic precision): every
    host q block is one row of ``raw`` ([host_q_blocks, the resident tier's block bytes]), which holds
    a block of any tier; ``k``/``v`` view the rows as the resident tier's planes, ``tiers`` as each
    lower tier's."""

    k: dict[str, torch.Tensor]  # [host_q_blocks, *plane.shape]
    v: dict[str, torch.Tensor]
    k_hp: torch.Tensor  # [host_hp_blocks, H, bs, D], model dtype
    v_hp: torch.Tensor
    tiers: tuple[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]], ...] = ()
    raw: torch.Tensor | None = None

    def planes(self, role: str, tier: int = 0) -> dict[str, torch.Tensor]:
        k, v = (self.k, self.v) if tier == 0 else self.tiers[tier - 1]
        return k if role == "k" else v

    def tensors(self) -> list[torch.Tensor]:
        q = [self.raw] if self.raw is not None else [*self.k.values(), *self.v.values()]
        return [*q, self.k_hp, self.v_hp]


@dataclass
class CopyHandle:
    """One :meth:`HostKVPool.store` / :meth:`~HostKVPool.load` call.

    ``event`` is recorded on the copy stream after the last copy (None: the copy ran
    synchronously and is complete).  ``keep`` holds what the copy stream still reads
    or writes (index tensors, gather buffers, the host memory's owner) until the
    event has completed."""

    event: torch.cuda.Event | None
    num_q_blocks: int
    num_hp_blocks: int
    keep: list = field(default_factory=list, repr=False)

    def done(self) -> bool:
        """Non-blocking: has the copy completed?  (Releases ``keep`` once it has.)"""
        if self.event is not None and not self.event.query():
            return False
        self.keep.clear()
        return True

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current one) wait for the copy; no host sync."""
        if self.event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self.event)

    def synchronize(self) -> None:
        """Block the host until the copy is complete (tests, shutdown; not the step loop)."""
        if self.event is not None:
            self.event.synchronize()
        self.keep.clear()


_ALIGN = 256  # bytes: every host tensor starts on this boundary inside the arena


class _Arena:
    """All host tensors of a pool as slices of one zeroed byte buffer: one page-lock call,
    no two registrations sharing a page, exact size."""

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype, int]]) -> None:
        self._specs = []  # (offset, shape, dtype)
        off = 0
        for row_shape, dtype, n in specs:
            shape = (n, *row_shape)
            self._specs.append((off, shape, dtype))
            off += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        self.memory = torch.zeros(off, dtype=torch.uint8)

    def tensors(self, memory: torch.Tensor) -> list[torch.Tensor]:
        """The tensors, in spec order, as views of ``memory`` (the buffer or its CUDA alias)."""
        return [memory[off:off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for off, shape, dtype in self._specs]


class _Registration:
    """Page-locks a host buffer with ``cudaHostRegister`` (portable, mapped) and unlocks it on
    release.  The pool and every in-flight handle hold it, so memory the GPU may still
    touch stays locked."""

    def __init__(self) -> None:
        self._memory: torch.Tensor | None = None

    def register(self, memory: torch.Tensor) -> None:
        if memory.numel() == 0:
            return
        err = int(torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.numel(),
                                                        _CUDA_HOST_REGISTER_PORTABLE_MAPPED))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {memory.numel()} bytes failed (cudaError {err})")
        self._memory = memory

    def __del__(self) -> None:
        if self._memory is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._memory.data_ptr())
            except Exception:  # interpreter shutdown: the process is releasing everything anyway
                pass
            self._memory = None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of any tensor's memory (last dim scaled by the element size)."""
    return fp8.as_bytes(t).view(torch.uint8)


class _HostArray:
    """``__cuda_array_interface__`` over page-locked host bytes: torch makes a CUDA tensor
    aliasing them (the host pointer is valid on the device under unified addressing)."""

    def __init__(self, t: torch.Tensor) -> None:
        b = _bytes(t).reshape(-1)
        self.__cuda_array_interface__ = {"shape": tuple(b.shape), "typestr": "|u1", "data": (b.data_ptr(), False),
                                         "strides": None, "version": 3}


def _device_alias(memory: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A uint8 tensor on ``device`` that reads and writes ``memory``'s page-locked host bytes."""
    alias = torch.as_tensor(_HostArray(memory), device=device)
    if alias.device.type != "cuda" or device.index not in (None, alias.device.index) \
            or alias.data_ptr() != memory.data_ptr():
        raise RuntimeError(f"the CUDA alias of host memory landed on {alias.device} at another address")
    return alias


def _pairs(pairs, what: str, src_what: str, src_n: int, dst_what: str, dst_n: int) -> tuple[list[int], list[int]]:
    """``[(src, dst), ...]`` (or an [N, 2] int tensor) -> (src ids, dst ids), checked."""
    if isinstance(pairs, torch.Tensor):
        if pairs.numel() and (pairs.dim() != 2 or pairs.shape[1] != 2):
            raise ValueError(f"{what}: expected an [N, 2] tensor of ({src_what}, {dst_what}) pairs, "
                             f"got shape {tuple(pairs.shape)}")
        if pairs.dtype.is_floating_point or pairs.dtype == torch.bool:
            raise ValueError(f"{what}: block ids must be integers, got {pairs.dtype}")
        pairs = pairs.reshape(-1, 2).tolist()
    src, dst = [], []
    for i, p in enumerate(pairs):
        if isinstance(p, (str, bytes)) or not hasattr(p, "__len__") or len(p) != 2:
            n = len(p) if hasattr(p, "__len__") else "no"
            raise ValueError(f"{what}[{i}] = {p!r}: expected a ({src_what}, {dst_what}) pair, length 2, "
                             f"got length {n}")
        try:
            if any(isinstance(x, bool) for x in p):
                raise TypeError
            s, d = operator.index(p[0]), operator.index(p[1])
        except TypeError:
            raise ValueError(f"{what}[{i}] = {p!r}: block ids must be ints") from None
        src.append(s)
        dst.append(d)
    for ids, name, n in ((src, src_what, src_n), (dst, dst_what, dst_n)):
        bad = [x for x in ids if not 0 <= x < n]
        if bad:
            raise ValueError(f"{what}: {name} {bad[0]} out of range 0..{n - 1} ({n} blocks)" if n else
                             f"{what}: {name} {bad[0]} out of range: that pool has no blocks")
    if len(set(dst)) != len(dst):
        seen: set[int] = set()
        dup = next(x for x in dst if x in seen or seen.add(x))
        raise ValueError(f"{what}: {dst_what} {dup} is written twice in one call")
    return src, dst


class HostKVPool:
    """Host blocks mirroring a device :class:`KVPool` (see module docstring)."""

    def __init__(self, plan: CachePlan, num_q_blocks: int, num_hp_blocks: int, device: torch.device,
                 layers: list[HostLayerKV], addressed: list[HostLayerKV], pinned: bool,
                 registration: _Registration | None) -> None:
        self.plan = plan
        self.num_q_blocks = num_q_blocks
        self.num_hp_blocks = num_hp_blocks
        self.device = device  # the device pool's device
        self.layers = layers  # host tensors
        self.pinned = pinned
        self._addressed = addressed  # what the copy kernels index: CUDA aliases when mapped, else `layers`
        self._registration = registration
        self._mapped = addressed is not layers
        self._stream = torch.cuda.Stream(device) if self._mapped else None
        self.faults = CopyFaults.from_env()  # None unless KVQ_FAULT_HOST_COPY is set (kvq.cache.host_faults)

    # -- creation ----------------------------------------------------------------------------
    @classmethod
    def create(cls, pool: KVPool, num_q_blocks: int, num_hp_blocks: int, pin: bool | None = None) -> HostKVPool:
        """Zeroed host blocks shaped like ``pool``'s.  ``pin`` (default: when ``pool`` is on CUDA)
        page-locks them so copies run asynchronously on a copy stream."""
        for name, n in (("num_q_blocks", num_q_blocks), ("num_hp_blocks", num_hp_blocks)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{name} must be an int >= 0, got {n!r}")
        device = torch.device(pool.device)
        pin = device.type == "cuda" if pin is None else bool(pin)
        if pin and device.type != "cuda":
            raise ValueError(f"pin=True needs a CUDA pool (page-locked memory serves CUDA copies); this pool is on "
                             f"{device}")
        lay = pool.layout  # a tiered pool: one row of bytes a host q block, which any tier's block fits
        rows = [max(lay.block_bytes[t][i] for t in range(len(lay.per_slab))) for i in range(len(pool.layers))] \
            if lay is not None else None
        arena = _Arena([(t.shape[1:], t.dtype, n) for i, dl in enumerate(pool.layers)
                        for t, n in [*(((torch.empty(0, rows[i], dtype=torch.uint8), num_q_blocks),) if rows else
                                       ((t, num_q_blocks) for t in (*dl.k.values(), *dl.v.values()))),
                                     (dl.k_hp, num_hp_blocks), (dl.v_hp, num_hp_blocks)]])
        plan, m = pool.plan, pool.plan.model

        def split(memory: torch.Tensor) -> list[HostLayerKV]:
            it = iter(arena.tensors(memory))
            out = []
            for i, dl in enumerate(pool.layers):
                if rows is None:
                    out.append(HostLayerKV(k={name: next(it) for name in dl.k}, v={name: next(it) for name in dl.v},
                                           k_hp=next(it), v_hp=next(it)))
                    continue
                raw = next(it)
                views = [arena_planes(raw.view(-1), plan.tier_layers(t)[i], num_q_blocks, rows[i], m.num_kv_heads,
                                      m.head_dim, plan.block_size) for t in range(plan.num_tiers + 1)]
                out.append(HostLayerKV(k=views[0][0], v=views[0][1], k_hp=next(it), v_hp=next(it),
                                       tiers=tuple(views[1:]), raw=raw))
            return out

        layers = addressed = split(arena.memory)
        registration = None
        if pin and arena.memory.numel():
            try:
                registration = _Registration()
                registration.register(arena.memory)
                alias = _device_alias(arena.memory, device)
                _check_alias(arena.memory, alias, device)
                addressed = split(alias)
            except (RuntimeError, TypeError, ValueError) as e:
                log.warning("host KV pool: page-locked, device-addressed host memory unavailable (%s); swap copies "
                            "will be synchronous", e)
                registration, addressed, pin = None, layers, False
        return cls(pool.plan, num_q_blocks, num_hp_blocks, device, layers, addressed, pin, registration)

    @classmethod
    def from_budget(cls, pool: KVPool, budget_bytes: int, context_len: int | None = None,
                    pin: bool | None = None) -> HostKVPool:
        """A host pool of at most ``budget_bytes`` (``--cpu-offload-gb``), split by :meth:`blocks_for_budget`."""
        return cls.create(pool, *cls.blocks_for_budget(pool.plan, budget_bytes, context_len), pin=pin)

    @staticmethod
    def blocks_for_budget(plan: CachePlan, budget_bytes: int, context_len: int | None = None) -> tuple[int, int]:
        """(q blocks, hp blocks) that ``budget_bytes`` of host memory holds.

        Split as swapped sequences of ``context_len`` tokens (default: the model's maximum)
        hold them (:meth:`CachePlan.blocks_for`): room for the hp blocks of every such
        sequence that fits (at least one, if its hp blocks fit), the rest resident blocks.
        A plan without windows gets resident blocks only."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"host KV budget must be an int number of bytes >= 0, got {budget_bytes!r}")
        bq, bhp = plan.bytes_per_block, plan.hp_bytes_per_block
        L = context_len or plan.model.max_position_embeddings
        if L < 1:
            raise ValueError(f"context length must be >= 1, got {L}")
        q_per, hp_per = plan.blocks_for(L)
        if hp_per == 0:
            return budget_bytes // bq, 0
        seqs = max(1, budget_bytes // (q_per * bq + hp_per * bhp))
        num_hp = min(seqs * hp_per, budget_bytes // bhp)
        return (budget_bytes - num_hp * bhp) // bq, num_hp

    # -- bytes -------------------------------------------------------------------------------
    @property
    def bytes_per_q_block(self) -> int:
        """One resident block across all layers, K and V, every plane (scales, zeros); a tiered pool's
        host q block: the row that holds a block of any tier."""
        return sum(_row_bytes(hl.raw) if hl.raw is not None else
                   sum(_row_bytes(t) for t in (*hl.k.values(), *hl.v.values())) for hl in self.layers)

    @property
    def bytes_per_hp_block(self) -> int:
        """One high-precision block across all layers, K and V."""
        return sum(_row_bytes(t) for hl in self.layers for t in (hl.k_hp, hl.v_hp))

    @property
    def capacity_bytes(self) -> int:
        return self.num_q_blocks * self.bytes_per_q_block + self.num_hp_blocks * self.bytes_per_hp_block

    def nbytes(self) -> int:
        """Bytes actually allocated."""
        return sum(t.numel() * t.element_size() for hl in self.layers for t in hl.tensors())

    # -- copies ------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Block the host until every copy queued so far has finished (after a failed call, before
        its blocks are used again; not the step loop)."""
        if self._stream is not None:
            self._stream.synchronize()

    def store(self, pool: KVPool, q_pairs: Sequence = (), hp_pairs: Sequence = (),
              tier_pairs: Sequence = ()) -> CopyHandle:
        """Copy device blocks to host slots: ``q_pairs`` / ``hp_pairs`` are ``(device_block_id,
        host_block_id)``; ``tier_pairs`` ``((pool, pairs), ...)`` for a tiered pool's lower tiers
        (``q1``...: device ids of that tier, host q ids).  Free the device blocks only once the handle
        is done."""
        if self.faults is not None:
            self.faults.maybe_fail("store")
        return self._copy(pool, self._groups(pool, q_pairs, hp_pairs, tier_pairs, to_host=True), to_host=True)

    def load(self, pool: KVPool, q_pairs: Sequence = (), hp_pairs: Sequence = (),
             tier_pairs: Sequence = ()) -> CopyHandle:
        """Copy host slots to device blocks: pairs are ``(host_block_id, device_block_id)``.
        Read the device blocks only after ``handle.wait()`` (or on a stream that waited)."""
        if self.faults is not None:
            self.faults.maybe_fail("load")
        return self._copy(pool, self._groups(pool, q_pairs, hp_pairs, tier_pairs, to_host=False), to_host=False)

    def _groups(self, pool: KVPool, q_pairs, hp_pairs, tier_pairs, to_host: bool) -> list:
        """``[(kind, src ids, dst ids)]`` for the pools of a call, checked (kind: q, hp, q1, ...)."""
        groups = []
        for kind, pairs in (("q", q_pairs), ("hp", hp_pairs), *tier_pairs):
            tier = pool_tier(kind)
            if tier is None:
                dev_n, host_n, host_what = pool.num_hp_blocks, self.num_hp_blocks, "host hp block"
            elif tier == 0 or self._tiers:
                if tier > len(self._tiers):
                    raise ValueError(f"{kind}_pairs: the pool has {len(self._tiers)} lower tiers")
                dev_n = pool.num_q_blocks if tier == 0 else pool.layers[0].tier(tier).k["data"].shape[0]
                host_n, host_what = self.num_q_blocks, "host q block"
            else:
                raise ValueError(f"{kind}_pairs: this host pool mirrors an untiered pool")
            dev_what = f"device {kind} block"
            src_w, src_n, dst_w, dst_n = ((dev_what, dev_n, host_what, host_n) if to_host else
                                          (host_what, host_n, dev_what, dev_n))
            s, d = _pairs(pairs, f"{kind}_pairs", src_w, src_n, dst_w, dst_n)
            groups.append((kind, s, d))
        q_hosts = [x for kind, s, d in groups if kind != "hp" for x in (d if to_host else s)]
        if len(set(q_hosts)) != len(q_hosts):
            raise ValueError("a host q block is named twice in one call (q and tier pairs)")
        return groups

    @property
    def _tiers(self) -> tuple:
        return self.layers[0].tiers if self.layers else ()

    def _tensor_pairs(self, pool: KVPool, kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device tensor, addressed host tensor) of every plane of a q pool (``q``, a tier's ``q1``...)
        or of the hp pools (``hp``), all layers."""
        if pool.plan != self.plan or torch.device(pool.device) != self.device or len(pool.layers) != len(self.layers):
            raise ValueError(f"this host pool mirrors a pool of plan {self.plan.name} on {self.device}; "
                             f"got plan {pool.plan.name} on {pool.device}")
        out = []
        tier = pool_tier(kind)
        for dl, hl in zip(pool.layers, self._addressed):
            if tier is None:
                out += [(dl.k_hp, hl.k_hp), (dl.v_hp, hl.v_hp)]
            else:
                lt = dl.tier(tier)
                out += [(t, hl.planes(role, tier)[name]) for role in ("k", "v") for name, t in lt.planes(role).items()]
        for d, h in out:
            assert d.shape[1:] == h.shape[1:] and d.dtype == h.dtype, (d.shape, h.shape, d.dtype, h.dtype)
        return out

    def _copy(self, pool: KVPool, groups: list, to_host: bool) -> CopyHandle:
        jobs = []  # (src tensor, dst tensor, offset of its src ids, offset of its dst ids, count)
        ids, n_q, n_hp = [], 0, 0
        for kind, s, d in groups:
            n = len(s)
            if not n:
                continue
            off = len(ids)
            ids += s + d
            n_hp, n_q = (n_hp + n, n_q) if kind == "hp" else (n_hp, n_q + n)
            for dev, host in self._tensor_pairs(pool, kind):
                src, dst = (dev, host) if to_host else (host, dev)
                jobs.append((src, dst, off, off + n, n))
        handle = CopyHandle(None, n_q, n_hp)
        if not jobs:
            return handle
        ids_host = torch.tensor(ids, dtype=torch.int64)
        if not self._mapped:
            # Synchronous: gather where the source lives, move, scatter where the destination lives.
            ids_dev = ids_host.to(self.device)

            def on(t: torch.Tensor) -> torch.Tensor:
                return ids_host if t.device.type == "cpu" else ids_dev

            for src, dst, so, do, n in jobs:
                buf = fp8.index_select(src, 0, on(src)[so:so + n]).to(dst.device)
                fp8.index_copy_(dst, 0, on(dst)[do:do + n], buf)
            return handle
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        self._stream.wait_event(ready)  # the copy sees every write the compute stream has queued
        ids_host = ids_host.pin_memory()
        bufs = []
        with torch.cuda.stream(self._stream):
            ids = ids_host.to(self.device, non_blocking=True)
            for src, dst, so, do, n in jobs:
                buf = fp8.index_select(src, 0, ids[so:so + n])
                fp8.index_copy_(dst, 0, ids[do:do + n], buf)
                bufs.append(buf)
            handle.event = torch.cuda.Event()
            handle.event.record(self._stream)
        handle.keep += [ids_host, ids, bufs, self._registration]
        return handle


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one block (row 0 of the leading dim) of a pool tensor."""
    return math.prod(t.shape[1:]) * t.element_size()


def _check_alias(memory: torch.Tensor, alias: torch.Tensor, device: torch.device) -> None:
    """A GPU write through the alias must land in host memory (checked once, at creation)."""
    _bytes(alias).view(-1)[:1].fill_(0xA5)
    torch.cuda.synchronize(device)
    ok = int(_bytes(memory).view(-1)[0]) == 0xA5
    _bytes(memory).view(-1)[0] = 0
    if not ok:
        raise RuntimeError("a GPU write through the host alias did not reach host memory")
