"""Paged KV pools: the tensors behind a :class:`~kvq.cache.plan.CachePlan`.

Per layer there are two pools with the same block size and head layout:

* the resident ("q") pool in the layer's format: one tensor per plane of the
  spec (``data``, ``scale``, ``zero``), each ``[num_q_blocks, *plane.shape]``;
* the high-precision ("hp") pool in the model dtype, ``[num_hp_blocks, H, bs, D]``
  for K and for V: sink blocks, the recent window, blocks awaiting their seal.

Kernels address both through one signed block table per sequence::

    entry >= 0   -> q pool block  entry
    entry <  0   -> hp pool block -entry - 1

and one signed slot per written token (``block * bs + offset``, hp slots
encoded the same way), so a step's metadata is plain int tensors built on the
host in one place (:func:`encode_table`, :func:`encode_slots`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

import torch

from kvq.cache.arena import ArenaLayout, arena_layout, plane_offsets
from kvq.cache.plan import CachePlan
from kvq.cache.tiers import pool_tier
from kvq.formats import fp8
from kvq.formats.spec import KVFormat, TensorFormat, element_bytes


#: Table entries of tier ``t >= 1`` (kvq.cache.tiers) are ``t * TIER_BASE + block``: kernels that read
#: one tier take tables of that tier's blocks only (kvq.cache.step.TierTables), the reference reads the tag.
TIER_BASE = 1 << 26
_TIER_OFFSET = {"q": 0, **{f"q{t}": t * TIER_BASE for t in range(1, 8)}}


def encode_ref(pool: str, block_id: int) -> int:
    assert (pool == "hp" or pool in _TIER_OFFSET) and 0 <= block_id < TIER_BASE, (pool, block_id)
    return -block_id - 1 if pool == "hp" else _TIER_OFFSET[pool] + block_id


def decode_ref(entry: int) -> tuple[str, int]:
    """(pool, block id) of a signed table entry (:func:`encode_ref`)."""
    if entry < 0:
        return "hp", -entry - 1
    t, b = divmod(entry, TIER_BASE)
    return ("q" if t == 0 else f"q{t}"), b


def encode_table(refs: Iterable) -> list[int]:
    """BlockRef-like objects (``.pool``, ``.block_id``) -> signed table entries."""
    return [r.block_id if r.pool == "q" else encode_ref(r.pool, r.block_id) for r in refs]  # "q" inlined (hot)


def encode_slots(slots: Sequence[tuple[str, int, int]], block_size: int) -> list[int]:
    """``(pool, block, offset)`` per token -> signed slot ids (tokens are written to ``q`` or ``hp``
    only: the lower tiers are written by demotion)."""
    return [b * block_size + o if p == "q" else -(b * block_size + o) - 1 for p, b, o in slots]  # encode_ref, inlined


@dataclass
class LayerKV:
    """The cache tensors of one layer (see module docstring for the layout)."""

    fmt: KVFormat
    block_size: int
    k: dict[str, torch.Tensor]  # q pool planes, [num_q_blocks, *plane.shape]
    v: dict[str, torch.Tensor]
    k_hp: torch.Tensor  # [num_hp_blocks, H, bs, D], model dtype
    v_hp: torch.Tensor
    k_scale: torch.Tensor  # [H] float32, static scales (ones unless the format is static-scaled)
    v_scale: torch.Tensor
    index: int = 0
    # elastic precision: the planes of tiers 1, 2, ... (kvq.cache.tiers) and the byte arena that every
    # tier's planes, tier 0's (``k``, ``v``) included, are views of (kvq.cache.arena); None untiered
    tiers: tuple["TierPlanes", ...] = ()
    arena: torch.Tensor | None = None

    def tier(self, t: int) -> "LayerKV":
        """This layer as tier ``t`` stores it: its format and planes in place of the resident ones
        (hp pool and static scales shared), what a kernel takes to read or write that tier."""
        if t == 0:
            return self
        tp = self.tiers[t - 1]
        return replace(self, fmt=tp.fmt, k=tp.k, v=tp.v, tiers=(), arena=None)

    def planes(self, role: str) -> dict[str, torch.Tensor]:
        return self.k if role == "k" else self.v

    def hp(self, role: str) -> torch.Tensor:
        return self.k_hp if role == "k" else self.v_hp

    def static_scale(self, role: str) -> torch.Tensor:
        return self.k_scale if role == "k" else self.v_scale

    def tensor_format(self, role: str) -> TensorFormat:
        return self.fmt.k if role == "k" else self.fmt.v

    @property
    def num_kv_heads(self) -> int:
        return self.k_hp.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_hp.shape[3]

    def tensors(self) -> list[torch.Tensor]:
        """The tensors that own the layer's memory (the arena, not its views, when tiered)."""
        if self.arena is not None:
            return [self.arena, self.k_hp, self.v_hp]
        return [*self.k.values(), *self.v.values(), self.k_hp, self.v_hp]

    def with_q_blocks(self, n: int) -> "LayerKV":
        """This layer with ``n`` fresh, zeroed q blocks in place of its q pool (hp pool, scales
        and format shared): scratch to seal hp blocks into without touching the cache."""
        H, D, bs = self.num_kv_heads, self.head_dim, self.block_size
        dev = self.k_hp.device
        return replace(self, k=_planes(self.fmt.k, n, H, D, bs, dev), v=_planes(self.fmt.v, n, H, D, bs, dev))


@dataclass
class TierPlanes:
    """One tier's format and planes in a layer (views of the layer's arena)."""

    fmt: KVFormat
    k: dict[str, torch.Tensor]
    v: dict[str, torch.Tensor]


def arena_planes(arena: torch.Tensor, fmt: KVFormat, n: int, stride: int, H: int, D: int, bs: int
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(K planes, V planes) of ``n`` blocks of ``fmt`` in a uint8 ``arena``, block ``b`` at byte
    ``b * stride`` (kvq.cache.arena.plane_offsets inside it): ``[n, *plane.shape]`` views whose
    block stride is ``stride`` bytes."""
    out: dict[str, dict[str, torch.Tensor]] = {"k": {}, "v": {}}
    for role, plane, off in plane_offsets(fmt, H, D, bs)[0]:
        elt = element_bytes(plane.dtype)
        inner = [1]
        for d in reversed(plane.shape[1:]):
            inner.insert(0, inner[0] * d)
        base = arena.view(fp8.torch_dtype(plane.dtype))  # (as_strided's offset counts from the storage's start)
        out[role][plane.name] = base.as_strided((n, *plane.shape), (stride // elt, *inner),
                                                base.storage_offset() + off // elt)
    return out["k"], out["v"]


def _planes(fmt: TensorFormat, n: int, H: int, D: int, bs: int, device) -> dict[str, torch.Tensor]:
    return {
        p.name: torch.zeros((n, *p.shape), dtype=fp8.torch_dtype(p.dtype), device=device)
        for p in fmt.planes(H, D, bs)
    }


@dataclass
class KVPool:
    """All layers' pools for one plan."""

    plan: CachePlan
    num_q_blocks: int
    num_hp_blocks: int
    device: torch.device
    layers: list[LayerKV] = field(default_factory=list)
    # sees each layer's new K and V before the write (``observe(layer, k, v)``): the warm-up of
    # static scales (kvq.cache.scales_warmup); None otherwise
    observer: object = None
    layout: ArenaLayout | None = None  # tiered plans: the arena's layout (num_q_blocks = slabs x per_slab[0])
    num_slabs: int = 0

    @classmethod
    def create(
        cls,
        plan: CachePlan,
        num_q_blocks: int,
        num_hp_blocks: int,
        device: torch.device | str = "cpu",
        static_scales: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
        num_slabs: int | None = None,
    ) -> "KVPool":
        """Allocate zeroed pools.  ``static_scales[layer] = (k_scale, v_scale)``, each a
        scalar or ``[H]`` tensor or None (that role keeps 1.0, e.g. a V that computes its own scales),
        for FP8 formats with static scales (default 1.0).  A plan with
        tiers takes ``num_slabs`` slabs of its arena instead of ``num_q_blocks``."""
        if num_q_blocks < 0 or num_hp_blocks < 0:
            raise ValueError("block counts must be >= 0")
        if (num_slabs is not None) != bool(plan.tiers):
            raise ValueError("a plan with tiers sizes its arena in slabs (num_slabs), a plan without in q blocks")
        layout = arena_layout(plan) if plan.tiers else None
        if layout is not None:
            if num_slabs < 0:
                raise ValueError("num_slabs must be >= 0")
            num_q_blocks = num_slabs * layout.per_slab[0]
        device = torch.device(device)
        plan.check_numerics(device)
        m, bs = plan.model, plan.block_size
        H, D = m.num_kv_heads, m.head_dim
        hp_dtype = fp8.torch_dtype(plan.hp.k.storage)
        layers = []
        for i, fmt in enumerate(plan.layers):
            scales = []
            for j, tf in enumerate((fmt.k, fmt.v)):
                s = torch.ones(H, dtype=torch.float32, device=device)
                given = (static_scales or {}).get(i)
                if given is not None and given[j] is not None:
                    if tf.scale != "static":
                        raise ValueError(f"layer {i}: {tf.name} computes its own scales; static scales do not apply")
                    s = torch.as_tensor(given[j], dtype=torch.float32, device=device).reshape(-1).expand(H).clone()
                    if not bool((s > 0).all()):
                        raise ValueError(f"layer {i}: static KV scales must be positive")
                scales.append(s)
            if layout is None:
                k, v, tiers, arena = (_planes(fmt.k, num_q_blocks, H, D, bs, device),
                                      _planes(fmt.v, num_q_blocks, H, D, bs, device), (), None)
            else:
                arena = torch.zeros(num_slabs * layout.slab_bytes[i], dtype=torch.uint8, device=device)
                views = [arena_planes(arena, plan.tier_layers(t)[i], num_slabs * layout.per_slab[t],
                                      layout.stride(t, i), H, D, bs) for t in range(plan.num_tiers + 1)]
                (k, v), tiers = views[0], tuple(TierPlanes(plan.tier_layers(t)[i], *views[t])
                                                for t in range(1, plan.num_tiers + 1))
            layers.append(
                LayerKV(
                    fmt=fmt,
                    block_size=bs,
                    k=k,
                    v=v,
                    k_hp=torch.zeros(num_hp_blocks, H, bs, D, dtype=hp_dtype, device=device),
                    v_hp=torch.zeros(num_hp_blocks, H, bs, D, dtype=hp_dtype, device=device),
                    k_scale=scales[0],
                    v_scale=scales[1],
                    index=i,
                    tiers=tiers,
                    arena=arena,
                )
            )
        return cls(plan, num_q_blocks, num_hp_blocks, device, layers, layout=layout, num_slabs=num_slabs or 0)

    def nbytes(self) -> int:
        """Bytes actually allocated (static scales excluded: per layer, not per block)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    def expected_nbytes(self) -> int:
        """What the plan says these pools take (a tiered plan: its arena's slabs)."""
        hp = self.num_hp_blocks * self.plan.hp_bytes_per_block
        if self.layout is not None:
            return self.num_slabs * self.layout.bytes_per_slab + hp
        return self.num_q_blocks * self.plan.bytes_per_block + hp

    def copy_blocks(self, pool: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks (all layers, all planes) within one pool (copy-on-write): ``hp``, or the
        q pool of a tier (``q``, ``q1``...)."""
        tier = pool_tier(pool)
        for layer in self.layers:
            lt = layer if tier is None else layer.tier(tier)
            tensors = [lt.k_hp, lt.v_hp] if tier is None else [*lt.k.values(), *lt.v.values()]
            for t in tensors:
                fp8.index_copy_(t, 0, dst, fp8.index_select(t, 0, src))
