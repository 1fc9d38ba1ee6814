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

from kvq.cache.plan import CachePlan
from kvq.formats import fp8
from kvq.formats.spec import KVFormat, TensorFormat


def encode_ref(pool: str, block_id: int) -> int:
    assert pool in ("q", "hp") and block_id >= 0, (pool, block_id)
    return block_id if pool == "q" else -block_id - 1


def encode_table(refs: Iterable) -> list[int]:
    """BlockRef-like objects (``.pool``, ``.block_id``) -> signed table entries."""
    return [r.block_id if r.pool == "q" else -r.block_id - 1 for r in refs]  # encode_ref, inlined (hot)


def encode_slots(slots: Sequence[tuple[str, int, int]], block_size: int) -> list[int]:
    """``(pool, block, offset)`` per token -> signed slot ids."""
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
        return [*self.k.values(), *self.v.values(), self.k_hp, self.v_hp]

    def with_q_blocks(self, n: int) -> "LayerKV":
        """This layer with ``n`` fresh, zeroed q blocks in place of its q pool (hp pool, scales
        and format shared): scratch to seal hp blocks into without touching the cache."""
        H, D, bs = self.num_kv_heads, self.head_dim, self.block_size
        dev = self.k_hp.device
        return replace(self, k=_planes(self.fmt.k, n, H, D, bs, dev), v=_planes(self.fmt.v, n, H, D, bs, dev))


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

    @classmethod
    def create(
        cls,
        plan: CachePlan,
        num_q_blocks: int,
        num_hp_blocks: int,
        device: torch.device | str = "cpu",
        static_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> "KVPool":
        """Allocate zeroed pools.  ``static_scales[layer] = (k_scale, v_scale)``, each a
        scalar or ``[H]`` tensor, for FP8 formats with static scales (default 1.0)."""
        if num_q_blocks < 0 or num_hp_blocks < 0:
            raise ValueError("block counts must be >= 0")
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
                if given is not None:
                    if tf.scale != "static":
                        raise ValueError(f"layer {i}: {tf.name} computes its own scales; static scales do not apply")
                    s = torch.as_tensor(given[j], dtype=torch.float32, device=device).reshape(-1).expand(H).clone()
                    if not bool((s > 0).all()):
                        raise ValueError(f"layer {i}: static KV scales must be positive")
                scales.append(s)
            layers.append(
                LayerKV(
                    fmt=fmt,
                    block_size=bs,
                    k=_planes(fmt.k, num_q_blocks, H, D, bs, device),
                    v=_planes(fmt.v, num_q_blocks, H, D, bs, device),
                    k_hp=torch.zeros(num_hp_blocks, H, bs, D, dtype=hp_dtype, device=device),
                    v_hp=torch.zeros(num_hp_blocks, H, bs, D, dtype=hp_dtype, device=device),
                    k_scale=scales[0],
                    v_scale=scales[1],
                    index=i,
                )
            )
        return cls(plan, num_q_blocks, num_hp_blocks, device, layers)

    def nbytes(self) -> int:
        """Bytes actually allocated (static scales excluded: per layer, not per block)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    def expected_nbytes(self) -> int:
        """What the plan says these pools take."""
        return self.num_q_blocks * self.plan.bytes_per_block + self.num_hp_blocks * self.plan.hp_bytes_per_block

    def copy_blocks(self, pool: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks (all layers, all planes) within one pool (copy-on-write)."""
        for layer in self.layers:
            tensors = [*layer.k.values(), *layer.v.values()] if pool == "q" else [layer.k_hp, layer.v_hp]
            for t in tensors:
                fp8.index_copy_(t, 0, dst, fp8.index_select(t, 0, src))
