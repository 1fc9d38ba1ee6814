"""The wire format of KV transfer: chunk layouts from the format spec, and the chunk header.

A transfer moves one request's blocks (laid out as the *receiver* holds them,
:class:`~kvq.transfer.describe.Negotiated`) as a series of chunks.  **One chunk
= a range of layers [layer_start, layer_end) x the same set of blocks**: the
request's ``num_q_blocks`` resident blocks and ``num_hp_blocks`` high-precision
blocks (or a subset of them, if the caller also splits by blocks).  Splitting by
layers lets the sender ship layer ``i`` while prefill computes layer ``i + 1``.

Payload of a chunk: segments in a fixed order, each the given blocks of one pool
tensor, packed back to back with no padding (``n_q`` / ``n_hp`` blocks)::

    for layer in layer_start .. layer_end - 1:
        for role in k, v:
            for plane in fmt[role].planes(H, D, bs):   # data, [scale, [zero]]  (spec order)
                n_q  x plane.nbytes                   bytes of q blocks, in q_block_ids order
        for role in k, v:
            n_hp x hp.planes(...)[0].nbytes           [H, bs, D] model dtype, hp_block_ids order

Every length comes from :attr:`Plane.nbytes` of the spec's planes; nothing here
knows an element size.  A block's bytes within a plane are its row of the pool
tensor ``[num_blocks, *plane.shape]`` (so sub-byte packing, scale shapes and
FP8 encodings travel as the pool holds them).

Chunk header (little endian; ``H`` = u16, ``I`` = u32, ``Q`` = u64)::

    off  size  field
      0     4  magic            b"KVQW"
      4     2  version          WIRE_VERSION (= describe.PROTOCOL_VERSION)
      6     2  header_len       bytes of the whole header, checksum included (172 + rid_len)
      8     2  flags            bit 0: payload_crc32 is set; other bits 0
     10     2  rid_len          bytes of request_id, 1..MAX_REQUEST_ID_BYTES
     12     4  layer_start      I   first layer of the chunk
     16     4  layer_end        I   one past the last (> layer_start)
     20     4  num_q_blocks     I
     24     4  num_hp_blocks    I   (num_q_blocks + num_hp_blocks >= 1)
     28     4  payload_crc32    I   zlib.crc32 of the payload (0 if flag 0 is clear)
     32    32  compat_hash      Negotiated.digest(): who may write to whom, in which layout
     64     8  transfer_id      Q
     72     8  generation       Q   the receiver drops chunks whose generation is not its current
     80     8  token_start      Q   tokens [token_start, token_end) of the request the blocks hold
     88     8  token_end        Q   (> token_start)
     96     8  payload_len      Q   = sum of the plane lengths
    104    64  plane lengths    8 x Q, PLANE_SLOTS order: k_data k_scale k_zero v_data v_scale
                                v_zero k_hp v_hp (bytes of that plane over the chunk's layers
                                and blocks; 0 where the format has no such plane)
    168   rid  request_id       UTF-8
    168+rid 4  header_crc32     I   zlib.crc32 of every byte before it

Checksums are CRC-32 (``zlib.crc32``: standard library, GB/s on a CPU).  They
catch accidents (truncation, a corrupted or misplaced write), not attackers:
CRC-32 detects every error of 1 to 3 bits and every burst of up to 32 bits, so a
single flipped bit anywhere in a header is always refused.  A transport that
moves GPU memory directly may leave the payload checksum out (flag 0 clear)
rather than stage the payload through the host; the receiver decides whether to
require it.  The header is always checked.

:meth:`ChunkHeader.decode` is strict: wrong magic, version, length, flags,
checksum, out-of-range or inconsistent fields, a truncated or over-long buffer
all raise :class:`WireError` (a ValueError) with the reason; no partially valid
header is returned.  :meth:`ChunkHeader.check` then compares a decoded header
with the receiver's own :class:`ChunkLayout`, digest and generation.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

from kvq.formats import fp8
from kvq.formats.spec import KVFormat, Plane
from kvq.transfer.describe import PROTOCOL_VERSION, KVDescription, Negotiated

MAGIC = b"KVQW"
WIRE_VERSION = PROTOCOL_VERSION
MAX_REQUEST_ID_BYTES = 256
FLAG_PAYLOAD_CRC = 1
#: The eight per-plane lengths of a header, in order.
PLANE_SLOTS = ("k_data", "k_scale", "k_zero", "v_data", "v_scale", "v_zero", "k_hp", "v_hp")

_FIXED = struct.Struct("<4sHHHHIIIII32sQQQQQ8Q")
_CRC = struct.Struct("<I")
HEADER_MIN_BYTES = _FIXED.size + 1 + _CRC.size
assert _FIXED.size == 168, _FIXED.size
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1
_ROLES = ("k", "v")


class WireError(ValueError):
    """A chunk header or payload that must not be written into the cache; says why."""


class StaleChunk(WireError):
    """A chunk of an earlier generation (a writer the receiver has moved on from)."""


# -- chunk layouts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """What a chunk layout is computed from: the receiver's formats and block shape."""

    layers: tuple[KVFormat, ...]
    hp: KVFormat
    num_kv_heads: int
    head_dim: int
    block_size: int

    @classmethod
    def of(cls, source) -> "Geometry":
        """From a CachePlan, a KVDescription or a Negotiated (its wire side)."""
        if isinstance(source, Negotiated):
            source = source.wire
        if isinstance(source, KVDescription):
            return cls(source.layers, source.hp, source.num_kv_heads, source.head_dim, source.block_size)
        m = source.model  # a CachePlan
        return cls(tuple(source.layers), source.hp, m.num_kv_heads, m.head_dim, source.block_size)

    def planes(self, layer: int, role: str, pool: str) -> tuple[Plane, ...]:
        fmt = self.hp if pool == "hp" else self.layers[layer]
        tf = fmt.k if role == "k" else fmt.v
        out = tf.planes(self.num_kv_heads, self.head_dim, self.block_size)
        assert pool == "q" or len(out) == 1, out  # the hp pool is one dense tensor per role
        return out


@dataclass(frozen=True)
class Segment:
    """The given blocks of one pool tensor, at ``offset`` in the payload."""

    layer: int
    role: str  # "k" | "v"
    pool: str  # "q" | "hp"
    plane: Plane
    num_blocks: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.plane.nbytes

    @property
    def slot(self) -> str:
        """Its entry of :data:`PLANE_SLOTS`."""
        return f"{self.role}_hp" if self.pool == "hp" else f"{self.role}_{self.plane.name}"


@dataclass(frozen=True)
class ChunkLayout:
    """The payload of one chunk (module docstring): its segments, offsets and lengths."""

    layer_start: int
    layer_end: int
    num_q_blocks: int
    num_hp_blocks: int
    block_size: int
    segments: tuple[Segment, ...]

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    @property
    def payload_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @property
    def plane_lengths(self) -> tuple[int, ...]:
        """Bytes per :data:`PLANE_SLOTS` entry, summed over the chunk's layers."""
        out = dict.fromkeys(PLANE_SLOTS, 0)
        for s in self.segments:
            out[s.slot] += s.nbytes
        return tuple(out.values())


def layout_chunk(source, layers: range, num_q_blocks: int, num_hp_blocks: int) -> ChunkLayout:
    """The layout of one chunk of ``layers`` (a step-1 range) x the given block counts."""
    g = source if isinstance(source, Geometry) else Geometry.of(source)
    if not (isinstance(layers, range) and layers.step == 1 and 0 <= layers.start < layers.stop <= len(g.layers)):
        raise ValueError(f"layers must be a non-empty range within 0..{len(g.layers)}, got {layers}")
    if num_q_blocks < 0 or num_hp_blocks < 0 or num_q_blocks + num_hp_blocks < 1:
        raise ValueError(f"a chunk needs >= 1 block (got {num_q_blocks} q, {num_hp_blocks} hp)")
    segs, off = [], 0
    for layer in layers:
        for pool, n in (("q", num_q_blocks), ("hp", num_hp_blocks)):
            if n == 0:
                continue
            for role in _ROLES:
                for plane in g.planes(layer, role, pool):
                    segs.append(Segment(layer, role, pool, plane, n, off))
                    off += segs[-1].nbytes
    return ChunkLayout(layers.start, layers.stop, num_q_blocks, num_hp_blocks, g.block_size, tuple(segs))


def plan_chunks(source, num_q_blocks: int, num_hp_blocks: int, layers_per_chunk: int) -> list[ChunkLayout]:
    """Every chunk of a transfer: layers in runs of ``layers_per_chunk`` (the last may be
    shorter), each carrying all the given blocks.  ``source``: the receiver's CachePlan or
    KVDescription, or a Negotiated."""
    g = Geometry.of(source)
    if layers_per_chunk < 1:
        raise ValueError(f"layers_per_chunk must be >= 1, got {layers_per_chunk}")
    n = len(g.layers)
    return [layout_chunk(g, range(i, min(i + layers_per_chunk, n)), num_q_blocks, num_hp_blocks)
            for i in range(0, n, layers_per_chunk)]


# -- the header ------------------------------------------------------------------------------------
def payload_crc32(payload) -> int:
    """CRC-32 of a payload (bytes-like, or a uint8 tensor; a device tensor is copied to the host)."""
    if isinstance(payload, torch.Tensor):
        payload = payload.detach().contiguous().cpu().numpy()
    return zlib.crc32(memoryview(payload).cast("B"))


@dataclass(frozen=True)
class ChunkHeader:
    """The header of one chunk (module docstring).  Constructing one validates every field."""

    compat_hash: bytes
    request_id: str
    transfer_id: int
    generation: int
    token_start: int
    token_end: int
    layer_start: int
    layer_end: int
    num_q_blocks: int
    num_hp_blocks: int
    plane_lengths: tuple[int, ...]  # PLANE_SLOTS order
    payload_crc32: int | None  # None: not checksummed
    version: int = WIRE_VERSION

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise WireError(msg)

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        need(self.version == WIRE_VERSION, f"version {self.version!r}: this side speaks {WIRE_VERSION}")
        need(isinstance(self.compat_hash, bytes) and len(self.compat_hash) == 32,
             f"compat_hash must be 32 bytes, got {self.compat_hash!r}")
        need(isinstance(self.request_id, str), f"request_id must be a string, got {self.request_id!r}")
        try:
            rid = self.request_id.encode("utf-8")
        except UnicodeEncodeError:
            raise WireError(f"request_id {self.request_id!r} is not encodable as UTF-8") from None
        need(1 <= len(rid) <= MAX_REQUEST_ID_BYTES,
             f"request_id must be 1..{MAX_REQUEST_ID_BYTES} UTF-8 bytes, got {len(rid)}")
        for name, top in (("transfer_id", _U64), ("generation", _U64), ("token_start", _U64), ("token_end", _U64),
                          ("layer_start", _U32), ("layer_end", _U32), ("num_q_blocks", _U32),
                          ("num_hp_blocks", _U32)):
            val = getattr(self, name)
            need(is_int(val) and 0 <= val <= top, f"{name} {val!r} is not in 0..{top}")
        need(self.token_start < self.token_end, f"token range [{self.token_start}, {self.token_end}) is empty")
        need(self.layer_start < self.layer_end, f"layer range [{self.layer_start}, {self.layer_end}) is empty")
        need(self.num_q_blocks + self.num_hp_blocks >= 1, "a chunk must carry at least one block")
        need(self.payload_crc32 is None or (is_int(self.payload_crc32) and 0 <= self.payload_crc32 <= _U32),
             f"payload_crc32 {self.payload_crc32!r} is not None or in 0..{_U32}")
        lens = self.plane_lengths
        need(isinstance(lens, tuple) and len(lens) == len(PLANE_SLOTS) and all(is_int(x) and 0 <= x <= _U64
                                                                              for x in lens),
             f"plane_lengths must be {len(PLANE_SLOTS)} ints in 0..{_U64}, got {lens!r}")
        need(sum(lens) <= _U64, f"payload of {sum(lens)} bytes overflows u64")
        nl = self.layer_end - self.layer_start
        for slot, n in zip(PLANE_SLOTS, lens):
            blocks = self.num_hp_blocks if slot.endswith("_hp") else self.num_q_blocks
            if blocks == 0:
                need(n == 0, f"{slot}: {n} bytes for a chunk of no such blocks")
                continue
            need(n % (nl * blocks) == 0, f"{slot}: {n} bytes do not divide into {nl} layer(s) x {blocks} block(s)")
            need(n > 0 or not slot.endswith(("_data", "_hp")), f"{slot}: every block has this plane, got 0 bytes")

    @property
    def payload_len(self) -> int:
        return sum(self.plane_lengths)

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    @classmethod
    def for_chunk(cls, layout: ChunkLayout, payload=None, *, compat_hash: bytes, request_id: str,
                  transfer_id: int, generation: int, token_range: tuple[int, int]) -> "ChunkHeader":
        """The header of ``layout``; with ``payload`` given (bytes-like or uint8 tensor of
        ``layout.payload_bytes``), its CRC-32 is included."""
        crc = None
        if payload is not None:
            n = payload.numel() if isinstance(payload, torch.Tensor) else len(memoryview(payload).cast("B"))
            if n != layout.payload_bytes:
                raise WireError(f"payload is {n} bytes, the chunk layout {layout.payload_bytes}")
            crc = payload_crc32(payload)
        return cls(compat_hash, request_id, transfer_id, generation, token_range[0], token_range[1],
                   layout.layer_start, layout.layer_end, layout.num_q_blocks, layout.num_hp_blocks,
                   layout.plane_lengths, crc)

    # -- bytes ---------------------------------------------------------------------------------------
    def encode(self) -> bytes:
        rid = self.request_id.encode("utf-8")
        fixed = _FIXED.pack(
            MAGIC, self.version, _FIXED.size + len(rid) + _CRC.size,
            FLAG_PAYLOAD_CRC if self.payload_crc32 is not None else 0, len(rid),
            self.layer_start, self.layer_end, self.num_q_blocks, self.num_hp_blocks, self.payload_crc32 or 0,
            self.compat_hash, self.transfer_id, self.generation, self.token_start, self.token_end,
            self.payload_len, *self.plane_lengths)
        body = fixed + rid
        return body + _CRC.pack(zlib.crc32(body))

    @staticmethod
    def size_from_prefix(prefix: bytes) -> int:
        """Bytes of the header that starts ``prefix`` (needs its first 8 bytes; checks magic
        and version, not the rest)."""
        prefix = bytes(prefix)
        if len(prefix) < 8:
            raise WireError(f"need 8 bytes to size a chunk header, got {len(prefix)}")
        magic, version, header_len = struct.unpack_from("<4sHH", prefix)
        _check_magic_version(magic, version)
        if not HEADER_MIN_BYTES <= header_len <= HEADER_MIN_BYTES - 1 + MAX_REQUEST_ID_BYTES:
            raise WireError(f"header_len {header_len} is outside {HEADER_MIN_BYTES}.."
                            f"{HEADER_MIN_BYTES - 1 + MAX_REQUEST_ID_BYTES}")
        return header_len

    @classmethod
    def decode(cls, data) -> "ChunkHeader":
        """The header encoded in ``data`` exactly (no trailing bytes), or WireError."""
        try:
            data = bytes(data)
        except (TypeError, ValueError) as e:
            raise WireError(f"chunk header must be bytes-like ({e})") from None
        if len(data) < HEADER_MIN_BYTES:
            raise WireError(f"chunk header truncated: {len(data)} bytes, at least {HEADER_MIN_BYTES} needed")
        header_len = cls.size_from_prefix(data[:8])
        if len(data) != header_len:
            what = "truncated" if len(data) < header_len else f"followed by {len(data) - header_len} extra bytes"
            raise WireError(f"chunk header {what}: {len(data)} bytes, header_len says {header_len}")
        (crc,) = _CRC.unpack_from(data, header_len - _CRC.size)
        if zlib.crc32(data[:header_len - _CRC.size]) != crc:
            raise WireError("chunk header checksum mismatch (corrupted header)")
        (_, version, _, flags, rid_len, layer_start, layer_end, n_q, n_hp, pcrc, compat, transfer_id, generation,
         token_start, token_end, payload_len, *lens) = _FIXED.unpack_from(data)
        if _FIXED.size + rid_len + _CRC.size != header_len:
            raise WireError(f"rid_len {rid_len} does not match header_len {header_len}")
        if flags & ~FLAG_PAYLOAD_CRC:
            raise WireError(f"unknown flags {flags:#x}")
        if not flags & FLAG_PAYLOAD_CRC and pcrc:
            raise WireError("payload_crc32 is set but its flag is not")
        try:
            rid = data[_FIXED.size:_FIXED.size + rid_len].decode("utf-8")
        except UnicodeDecodeError:
            raise WireError("request_id is not valid UTF-8") from None
        if sum(lens) != payload_len:
            raise WireError(f"payload_len {payload_len} is not the sum of the plane lengths ({sum(lens)})")
        return cls(compat, rid, transfer_id, generation, token_start, token_end, layer_start, layer_end, n_q, n_hp,
                   tuple(lens), pcrc if flags & FLAG_PAYLOAD_CRC else None, version)

    # -- receiver checks -----------------------------------------------------------------------------
    def check(self, layout: ChunkLayout, *, compat_hash: bytes, generation: int) -> None:
        """Raise WireError unless this header is for ``layout`` (the receiver's own layout of the
        chunk), under ``compat_hash`` (its Negotiated.digest()) and the current ``generation``
        (:class:`StaleChunk` otherwise)."""
        if self.compat_hash != compat_hash:
            raise WireError(f"compat_hash {self.compat_hash.hex()[:16]}... is not the negotiated "
                            f"{compat_hash.hex()[:16]}...")
        if self.generation != generation:
            raise StaleChunk(f"generation {self.generation}: the receiver is at generation {generation}")
        for name in ("layer_start", "layer_end", "num_q_blocks", "num_hp_blocks"):
            if getattr(self, name) != getattr(layout, name):
                raise WireError(f"{name}: header {getattr(self, name)}, expected {getattr(layout, name)}")
        for slot, got, want in zip(PLANE_SLOTS, self.plane_lengths, layout.plane_lengths):
            if got != want:
                raise WireError(f"{slot}: header {got} bytes, the receiver's layout {want}")
        span = (self.num_q_blocks + self.num_hp_blocks) * layout.block_size
        if self.token_end - self.token_start > span:
            raise WireError(f"token range [{self.token_start}, {self.token_end}) is longer than the "
                            f"{span} tokens its blocks hold")

    def check_payload(self, payload, *, require_crc: bool = True) -> None:
        """Raise WireError if ``payload`` has the wrong length or checksum (or none where required)."""
        n = payload.numel() if isinstance(payload, torch.Tensor) else len(memoryview(payload).cast("B"))
        if n != self.payload_len:
            raise WireError(f"payload is {n} bytes, the header says {self.payload_len} (truncated chunk?)")
        if self.payload_crc32 is None:
            if require_crc:
                raise WireError("chunk has no payload checksum and the receiver requires one")
            return
        got = payload_crc32(payload)
        if got != self.payload_crc32:
            raise WireError(f"payload checksum mismatch: {got:#010x}, header {self.payload_crc32:#010x}")


def _check_magic_version(magic: bytes, version: int) -> None:
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: not a kvq chunk (expected {MAGIC!r})")
    if version != WIRE_VERSION:
        raise WireError(f"wire version {version}: this side speaks {WIRE_VERSION}")


# -- moving pool bytes -----------------------------------------------------------------------------
def _byte_view(pool, seg: Segment) -> torch.Tensor:
    """The pool tensor of ``seg`` as bytes: [num_blocks, *plane.shape[:-1], last * element size]."""
    layer = pool.layers[seg.layer]
    t = layer.hp(seg.role) if seg.pool == "hp" else layer.planes(seg.role)[seg.plane.name]
    if t.dim() - 1 != len(seg.plane.shape) or tuple(t.shape[1:]) != seg.plane.shape or not t[:1].is_contiguous():
        raise ValueError(f"layer {seg.layer} {seg.slot}: pool tensor {tuple(t.shape)} is not the layout's "
                         f"[n, {seg.plane.shape}] (a pool of another plan?)")
    if t.dtype != fp8.torch_dtype(seg.plane.dtype):
        raise ValueError(f"layer {seg.layer} {seg.slot}: pool dtype {t.dtype} is not the layout's {seg.plane.dtype}")
    return t.view(torch.uint8)


def _block_ids(ids: Sequence[int] | torch.Tensor, count: int, limit: int, what: str, device) -> torch.Tensor:
    idx = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
    if idx.numel() != count:
        raise ValueError(f"{what}: {idx.numel()} block ids for a chunk of {count} blocks")
    if count and (int(idx.min()) < 0 or int(idx.max()) >= limit):
        raise ValueError(f"{what}: block ids {idx.tolist()} outside the pool's 0..{limit - 1}")
    if idx.unique().numel() != count:
        raise ValueError(f"{what}: block ids {idx.tolist()} repeat")
    return idx.to(device)


def _chunk_for(pool, layers, q_block_ids, hp_block_ids) -> ChunkLayout:
    if isinstance(layers, ChunkLayout):
        return layers
    nq, nhp = len(torch.as_tensor(q_block_ids).reshape(-1)), len(torch.as_tensor(hp_block_ids).reshape(-1))
    return layout_chunk(pool.plan, layers, nq, nhp)


def pack_payload(pool, layers: range | ChunkLayout, q_block_ids, hp_block_ids) -> torch.Tensor:
    """The payload of the chunk ``layers`` (a range, or a ChunkLayout of ``pool``'s plan) with
    the given blocks of a :class:`~kvq.cache.pool.KVPool`: a 1-D uint8 tensor on the pool's device."""
    chunk = _chunk_for(pool, layers, q_block_ids, hp_block_ids)
    ids = {"q": _block_ids(q_block_ids, chunk.num_q_blocks, pool.num_q_blocks, "q_block_ids", pool.device),
           "hp": _block_ids(hp_block_ids, chunk.num_hp_blocks, pool.num_hp_blocks, "hp_block_ids", pool.device)}
    out = torch.empty(chunk.payload_bytes, dtype=torch.uint8, device=pool.device)
    for seg in chunk.segments:
        src = _byte_view(pool, seg)
        torch.index_select(src, 0, ids[seg.pool], out=out[seg.offset:seg.offset + seg.nbytes].view(
            seg.num_blocks, *src.shape[1:]))
    return out


def unpack_payload(pool, chunk: ChunkLayout, payload, q_block_ids, hp_block_ids) -> None:
    """Write ``payload`` (bytes-like or uint8 tensor laid out as ``chunk``) into the given blocks
    of ``pool``; nothing else is touched.  Validates everything before writing anything."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(f"payload must be a 1-D uint8 tensor, got {payload.dtype} {tuple(payload.shape)}")
    else:
        payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else torch.empty(
            0, dtype=torch.uint8)
    if payload.numel() != chunk.payload_bytes:
        raise WireError(f"payload is {payload.numel()} bytes, the chunk layout {chunk.payload_bytes}")
    ids = {"q": _block_ids(q_block_ids, chunk.num_q_blocks, pool.num_q_blocks, "q_block_ids", pool.device),
           "hp": _block_ids(hp_block_ids, chunk.num_hp_blocks, pool.num_hp_blocks, "hp_block_ids", pool.device)}
    views = [_byte_view(pool, seg) for seg in chunk.segments]  # every layout check before the first write
    payload = payload.to(pool.device)
    for seg, dst in zip(chunk.segments, views):
        dst.index_copy_(0, ids[seg.pool], payload[seg.offset:seg.offset + seg.nbytes].view(
            seg.num_blocks, *dst.shape[1:]))
