"""A pool's blocks as NIXL sees them: one *region* per pool tensor (base address, bytes per block,
block count, block stride), the :class:`PoolDescriptor` a peer needs to address them, and the
planning of a transfer's descriptors (runs of consecutive blocks, or single blocks where a region's
blocks are not adjacent).  The transport itself: :mod:`kvq.transfer.nixl_transport` (whose module
docstring gives the region order and the descriptor layout)."""

from __future__ import annotations

import base64
import json
import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvq.cache.pool import KVPool

POOLS = ("q", "hp")


class LayoutMismatch(ValueError):
    """Two pools whose blocks are not laid out alike (the message names the first difference)."""


@dataclass(frozen=True)
class Region:
    """One registered pool tensor (module docstring)."""

    name: str  # "{layer}.{role}.{plane}", plane "hp" for the hp pool
    layer: int
    pool: str  # "q" | "hp"
    addr: int
    block_bytes: int
    num_blocks: int
    mem: str  # "DRAM" | "VRAM"
    device_id: int
    stride: int = 0  # bytes from one block to the next (0: block_bytes, a contiguous tensor)

    def __post_init__(self) -> None:  # descriptors arrive from peers: check what they say
        if self.stride == 0 and isinstance(self.block_bytes, int):
            object.__setattr__(self, "stride", self.block_bytes)
        for f, tp in (("name", str), ("layer", int), ("pool", str), ("addr", int), ("block_bytes", int),
                      ("num_blocks", int), ("mem", str), ("device_id", int), ("stride", int)):
            v = getattr(self, f)
            if not isinstance(v, tp) or isinstance(v, bool) or (tp is int and v < 0):
                raise ValueError(f"region {self.name!r}: {f} = {v!r}")
        if self.pool not in POOLS or self.mem not in ("DRAM", "VRAM") or self.block_bytes == 0 \
                or self.stride < self.block_bytes:
            raise ValueError(f"region {self.name!r}: pool {self.pool!r}, mem {self.mem!r}, "
                             f"{self.block_bytes} bytes/block every {self.stride} bytes")

    @property
    def contiguous(self) -> bool:
        return self.stride == self.block_bytes

    @property
    def span(self) -> tuple[int, int]:
        """(first byte, bytes) of memory its blocks lie in."""
        return self.addr, (self.num_blocks - 1) * self.stride + self.block_bytes if self.num_blocks else 0


@dataclass(frozen=True)
class PoolDescriptor:
    """What a peer needs to address our blocks: agent name and metadata, and the regions."""

    agent: str
    metadata: bytes  # NIXL agent metadata (opaque); the fake transport's own tag
    plan: str
    num_q_blocks: int
    num_hp_blocks: int
    regions: tuple[Region, ...]

    def to_bytes(self) -> bytes:
        d = asdict(self)
        d["metadata"] = base64.b64encode(self.metadata).decode()
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> PoolDescriptor:
        try:
            d = json.loads(data)
            regions = tuple(Region(**r) for r in d.pop("regions"))
            meta = base64.b64decode(d.pop("metadata"), validate=True)
            return cls(metadata=meta, regions=regions, **d)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"not a pool descriptor: {e}") from None

    def address(self, name: str, block: int) -> int:
        """Address of block ``block`` of region ``name`` (e.g. ``"3.v.scale"``, ``"0.k.hp"``)."""
        r = next((r for r in self.regions if r.name == name), None)
        if r is None or not 0 <= block < r.num_blocks:
            raise KeyError(f"{self.agent}: no block {block} in region {name!r}")
        return r.addr + block * r.stride


def pool_regions(pool: KVPool) -> list[tuple[Region, torch.Tensor]]:
    """Every tensor of ``pool`` with its region, in region order (module docstring)."""
    out = []
    for i, layer in enumerate(pool.layers):
        named = [(f"{i}.{role}.{p}", "q", t) for role in ("k", "v") for p, t in layer.planes(role).items()]
        named += [(f"{i}.{role}.hp", "hp", layer.hp(role)) for role in ("k", "v")]
        for name, kind, t in named:
            block_bytes = math.prod(t.shape[1:]) * t.element_size()
            stride = t.stride(0) * t.element_size() if t.shape[0] > 1 else block_bytes
            if not t[:1].is_contiguous() or stride < block_bytes:
                raise ValueError(f"pool tensor {name} is not block-major with contiguous blocks; blocks cannot be "
                                 "addressed by stride")
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"pool tensor {name} is on {t.device}; NIXL moves CPU (DRAM) or CUDA (VRAM) memory")
            mem, dev = ("VRAM", t.device.index or 0) if t.device.type == "cuda" else ("DRAM", 0)
            out.append((Region(name, i, kind, t.data_ptr(), block_bytes, t.shape[0], mem, dev, stride), t))
    return out


def memory_spans(regions) -> list[tuple[int, int, int]]:
    """``(address, bytes, device)`` covering every region's blocks, overlapping and touching spans merged
    (the planes of an arena's blocks interleave: registered once, not once a plane)."""
    spans = sorted((r.device_id, *r.span) for r in regions if r.num_blocks)
    out: list[list[int]] = []
    for dev, addr, n in spans:
        if out and out[-1][2] == dev and addr <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], addr + n - out[-1][0])
        else:
            out.append([addr, n, dev])
    return [tuple(s) for s in out]


def check_layout(local: PoolDescriptor, remote: PoolDescriptor) -> None:
    """Raise :class:`LayoutMismatch` unless blocks of the two pools are laid out alike."""
    for a, b in zip(local.regions, remote.regions):
        if (a.name, a.pool, a.block_bytes) != (b.name, b.pool, b.block_bytes):
            raise LayoutMismatch(f"pool tensor {a.name} ({a.block_bytes} bytes/block) of {local.agent} ({local.plan}) "
                                 f"meets {b.name} ({b.block_bytes} bytes/block) of {remote.agent} ({remote.plan})")
    if len(local.regions) != len(remote.regions):
        raise LayoutMismatch(f"{local.agent} has {len(local.regions)} pool tensors ({local.plan}), "
                             f"{remote.agent} has {len(remote.regions)} ({remote.plan})")


def block_runs(src: list[int], dst: list[int]) -> np.ndarray:
    """``int64 [R, 3]`` (src start, dst start, count): pairs sorted by src, runs consecutive on both sides merged."""
    if not src:
        return np.zeros((0, 3), np.int64)
    s, d = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    order = np.argsort(s, kind="stable")
    s, d = s[order], d[order]
    start = np.ones(len(s), bool)
    start[1:] = (np.diff(s) != 1) | (np.diff(d) != 1)
    first = np.flatnonzero(start)
    return np.column_stack([s[first], d[first], np.diff(np.append(first, len(s)))])


def single_blocks(runs: np.ndarray) -> np.ndarray:
    """:func:`block_runs`' runs cut into runs of one block (for a region whose blocks are not adjacent)."""
    n = runs[:, 2]
    step = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    return np.column_stack([np.repeat(runs[:, :2], n, axis=0) + step[:, None], np.ones(len(step), np.int64)])
