"""The KV format spec: the one object that knows bytes and layouts.

A user names a KV cache format once; :mod:`kvq.formats.registry` turns the name
into a frozen :class:`TensorFormat` for K and one for V (they may differ, and
KIVI's K and V are quantized along different axes).  Everything else (pool
allocation, write/seal/attention kernels, memory budget, transfer headers,
evaluation records) reads these objects and never re-derives anything from the
name string or multiplies by an element size of its own.

Storage of one cache block for one layer and one of K/V is a set of *planes*,
each a tensor whose leading dimension is the block id (so a block, with its
scales, is copied byte for byte by indexing every plane with the same id)::

    plane   per-block shape          used by
    data    [H, bs, Dp]              every format (Dp = D for 8/16-bit formats,
                                     D * bits / 8 for packed sub-byte formats)
    scale   [H, bs]                  per token and head  (int8, *_per_token_head)
            [H]                      per block and head  (fp8_per_block)
            [H, bs // G, D]          KIVI K: per channel over G tokens
            [H, bs, D // G]          KIVI V: per token over G channels
    zero    same shape as scale      KIVI only (asymmetric)
            [H, bs]                  rotated codebook: the norm, per token and head
            [H, bs // G, D]          (zero) rotated codebook K: the mean per channel over G tokens

H = KV heads, bs = block size (tokens per page), D = head dim, G = group size.

Sub-byte packing is *planar*: with ``per = 8 // bits`` values per byte and
``Dp = D // per``, byte ``j`` of a token row holds channels ``j + m * Dp`` for
``m = 0 .. per-1``, channel ``j + m * Dp`` in bits ``[m*bits, (m+1)*bits)``::

    int4, D = 8, Dp = 4:   byte 0 = c0 | c4 << 4,  byte 1 = c1 | c5 << 4, ...
    int2, D = 8, Dp = 2:   byte 0 = c0 | c2 << 2 | c4 << 4 | c6 << 6, ...

so a kernel unpacks a [bs, Dp] tile into ``per`` contiguous [bs, Dp] slices of
the head dim with shifts and masks only, and can dot each slice with the
matching slice of the query without interleaving.

3-bit codes (rotated codebook formats) are a 2-bit plane and a 1-bit plane, both planar, one
after the other in the row: bytes ``[0, D/4)`` hold the low two bits of every code as the
2-bit layout above, bytes ``[D/4, 3D/8)`` the high bit as a 1-bit planar layout (byte ``j``
of it holds channels ``j + m * D/8`` for ``m = 0 .. 7``)::

    int3, D = 16:  bytes 0-3: low bits (4 codes a byte), bytes 4-5: high bits (8 a byte)

Rotated codebook formats (family ``rot``, kvq.formats.codebook): each token-head vector (K
first centred per channel over its group of G tokens, ``mean``) is rotated by a seeded
random-sign Hadamard transform, each coordinate of the rotated unit vector scaled by sqrt(D)
takes the nearest of ``2^bits`` Lloyd-Max levels, and a norm (the ``scale`` plane) restores the
vector's norm (norm correction: the dequantized vector has exactly the stored norm).  The
planes keep the generic names (``scale``, ``zero``) that pools, host copies and the transfer
wire already carry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Role = Literal["k", "v"]

#: Scale granularities.  ``static`` scales are per layer (a scalar or one per
#: KV head), supplied by the user or a calibration, and cost no bytes per block.
SCALE_KINDS = ("none", "static", "token_head", "block_head", "channel_group", "token_group", "token_norm",
               "centred_norm")

#: Bytes of each storage / scale dtype this package uses.  The only table of
#: element sizes in kvq.
_ELEMENT_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "int8": 1,
    "uint8": 1,
}

#: Largest finite value of each FP8 storage dtype (seed 001: OCP e4m3fn 448,
#: AMD fnuz 240).  Checked against the running torch at start-up.
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "float8_e4m3fnuz": 240.0}


def element_bytes(dtype: str) -> int:
    """Bytes per element of a storage or scale dtype name."""
    try:
        return _ELEMENT_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown storage dtype {dtype!r}; known: {sorted(_ELEMENT_BYTES)}") from None


@dataclass(frozen=True)
class Plane:
    """One tensor of a paged pool; ``shape`` excludes the leading block dim."""

    name: str  # "data" | "scale" | "zero"
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_bytes(self.dtype)


@dataclass(frozen=True)
class TensorFormat:
    """How one of K or V is stored in the cache.

    Attributes:
        name: canonical format name (``bfloat16``, ``fp8_e4m3``, ``int4_kivi``...).
        role: ``"k"`` or ``"v"``.
        family: ``dense`` | ``fp8`` | ``int`` | ``kivi``.
        storage: dtype name of the data plane (``uint8`` for packed sub-byte).
        bits: bits per stored value.
        scale: one of :data:`SCALE_KINDS`.
        scale_dtype: dtype of the scale (and zero-point) planes, or None.
        zero_point: asymmetric quantization with a zero-point plane (KIVI).
        group_size: KIVI group (tokens for K, channels for V), else None.
        qmax: largest code (127 for int8, 2**bits - 1 for KIVI), or the largest
            finite value for FP8, or None for dense.
        reference_only: no kernel serves it (AMD fnuz on NVIDIA/CPU).
        rotation_seed: the seed of the random-sign Hadamard rotation (family ``rot``), part of
            the format: two processes with the same format produce the same codes.
    """

    name: str
    role: Role
    family: str
    storage: str
    bits: int
    scale: str = "none"
    scale_dtype: str | None = None
    zero_point: bool = False
    group_size: int | None = None
    qmax: float | None = None
    reference_only: bool = False
    rotation_seed: int | None = None

    def __post_init__(self) -> None:
        assert self.role in ("k", "v"), self.role
        assert self.scale in SCALE_KINDS, self.scale
        assert (self.scale_dtype is None) == (self.scale in ("none", "static")), self
        assert not self.zero_point or self.family == "kivi", self
        assert self.family != "kivi" or self.group_size, self
        assert (self.family == "rot") == (self.scale in ("token_norm", "centred_norm")), self
        assert self.family != "rot" or (self.rotation_seed is not None and self.bits in (2, 3, 4)), self
        assert self.scale != "centred_norm" or self.group_size, self
        element_bytes(self.storage)

    # -- derived properties ---------------------------------------------------------
    @property
    def is_quantized(self) -> bool:
        return self.family != "dense"

    @property
    def packed(self) -> bool:
        """Several values share a byte (planar layout, see module docstring)."""
        return self.bits < 8

    @property
    def values_per_byte(self) -> int:
        """Codes per byte of the 1/2/4-bit layouts (3-bit rows: :meth:`row_bytes`)."""
        assert self.bits != 3, "3-bit rows are two planes: use row_bytes"
        return 8 // self.bits if self.packed else 1

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one token-head row of the data plane."""
        return head_dim * self.bits // 8 if self.packed else head_dim

    @property
    def write_direct(self) -> bool:
        """Tokens can be quantized one at a time into their resident format.

        False where a scale spans several tokens (per-block FP8, KIVI K's
        per-channel groups): such blocks are written in high precision and
        sealed into the resident format once full.
        """
        return self.scale not in ("block_head", "channel_group", "centred_norm")

    @property
    def token_granularity(self) -> int:
        """Tokens that must be present before a unit can be quantized."""
        if self.scale in ("channel_group", "centred_norm"):
            return self.group_size
        return 1

    # -- layout and bytes -----------------------------------------------------------
    def check_shape(self, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        """Raise ValueError if this format cannot lay out such a block."""
        if num_kv_heads < 1 or head_dim < 1 or block_size < 1:
            raise ValueError(
                f"num_kv_heads, head_dim and block_size must be >= 1 "
                f"(got {num_kv_heads}, {head_dim}, {block_size})"
            )
        if self.packed and head_dim % (8 if self.bits == 3 else self.values_per_byte):
            raise ValueError(f"{self.name}: head_dim {head_dim} is not a multiple of "
                             f"{8 if self.bits == 3 else self.values_per_byte}")
        if self.family == "rot" and head_dim & (head_dim - 1):
            raise ValueError(f"{self.name}: the Hadamard rotation needs a power-of-two head_dim, got {head_dim}")
        if self.scale in ("channel_group", "centred_norm") and block_size % self.group_size:
            raise ValueError(
                f"{self.name}: K is quantized per channel over groups of {self.group_size} tokens, "
                f"so block_size must be a multiple of {self.group_size} (got {block_size})"
            )
        if self.scale == "token_group" and head_dim % self.group_size:
            raise ValueError(
                f"{self.name}: V is quantized per token over groups of {self.group_size} channels, "
                f"so head_dim must be a multiple of {self.group_size} (got {head_dim})"
            )

    def planes(self, num_kv_heads: int, head_dim: int, block_size: int) -> tuple[Plane, ...]:
        """The tensors of one block of this format (see module docstring)."""
        self.check_shape(num_kv_heads, head_dim, block_size)
        H, D, bs = num_kv_heads, head_dim, block_size
        out = [Plane("data", (H, bs, self.row_bytes(D)), self.storage)]
        if self.family == "rot":
            out.append(Plane("scale", (H, bs), self.scale_dtype))  # the norm
            if self.scale == "centred_norm":
                out.append(Plane("zero", (H, bs // self.group_size, D), self.scale_dtype))  # the mean
            return tuple(out)
        sidecar: tuple[int, ...] | None = {
            "none": None,
            "static": None,
            "token_head": (H, bs),
            "block_head": (H,),
            "channel_group": (H, bs // (self.group_size or 1), D),
            "token_group": (H, bs, D // (self.group_size or 1)),
        }[self.scale]
        if sidecar is not None:
            out.append(Plane("scale", sidecar, self.scale_dtype))
            if self.zero_point:
                out.append(Plane("zero", sidecar, self.scale_dtype))
        return tuple(out)

    def block_bytes(self, num_kv_heads: int, head_dim: int, block_size: int) -> int:
        """Bytes of one block of one layer (data + scales + zero points)."""
        return sum(p.nbytes for p in self.planes(num_kv_heads, head_dim, block_size))

    def bits_per_value(self, num_kv_heads: int, head_dim: int, block_size: int) -> float:
        """Effective bits per cached element, sidecars included."""
        return 8 * self.block_bytes(num_kv_heads, head_dim, block_size) / (num_kv_heads * head_dim * block_size)

    def describe_scale(self) -> str:
        return {
            "none": "none",
            "static": "static per tensor or per head (default 1.0)",
            "token_head": f"dynamic per token and head ({self.scale_dtype})",
            "block_head": f"dynamic per cache block and head ({self.scale_dtype})",
            "channel_group": f"per channel over {self.group_size} tokens, scale+zero ({self.scale_dtype})",
            "token_group": f"per token over {self.group_size} channels, scale+zero ({self.scale_dtype})",
            "token_norm": f"rotated, {2 ** self.bits}-level codebook, norm per token and head ({self.scale_dtype})",
            "centred_norm": f"centred per channel over {self.group_size} tokens, rotated, {2 ** self.bits}-level "
                            f"codebook, norm per token and head ({self.scale_dtype})",
        }[self.scale]


@dataclass(frozen=True)
class KVFormat:
    """The formats of K and V for one layer, plus the name the user typed."""

    k: TensorFormat
    v: TensorFormat
    requested: str = ""

    def __post_init__(self) -> None:
        assert self.k.role == "k" and self.v.role == "v", (self.k.role, self.v.role)

    @property
    def name(self) -> str:
        return self.k.name if self.k.name == self.v.name else f"k={self.k.name},v={self.v.name}"

    @property
    def write_direct(self) -> bool:
        return self.k.write_direct and self.v.write_direct

    @property
    def is_quantized(self) -> bool:
        return self.k.is_quantized or self.v.is_quantized

    def block_bytes(self, num_kv_heads: int, head_dim: int, block_size: int) -> int:
        """Bytes of one block of one layer, K and V together."""
        return self.k.block_bytes(num_kv_heads, head_dim, block_size) + self.v.block_bytes(
            num_kv_heads, head_dim, block_size
        )

    def min_block_size(self) -> int:
        """Smallest block size this pair can lay out (KIVI K needs whole groups)."""
        return math.lcm(self.k.token_granularity, self.v.token_granularity)
