"""The transfer handshake: what a kvq server says about its KV cache, and what two agree on.

Before any KV block moves, the prefill and the decode server exchange a
:class:`KVDescription` over HTTP (``to_json`` / ``from_json``; strict: a
missing or unknown key is a ValueError naming it).  Its fields, in two groups:

**Agreed** (must be equal on both sides; :meth:`KVDescription.compat_hash`
is the sha256 of their canonical JSON, and :func:`check_compatible` names the
first that differs, in this order)::

    protocol        PROTOCOL_VERSION: the meaning of every field here and the
                    wire layout of kvq.transfer.wire (plane order, planar
                    sub-byte packing, block-major planes)
    config_hash     sha256 of the model config, canonical JSON   } model_identity()
    weights_hash    sha256 fingerprint of the weight files       }
    tokenizer_hash  sha256 of the vocabulary (tokenizer_hash())
    num_layers, num_kv_heads, head_dim
                    the shape of one token's KV (KV heads held by this rank)
    model_dtype     the dtype the model runs in
    hp_dtype        the high-precision pool's dtype (sinks, recent window)
    tp_size, tp_rank
                    tensor-parallel geometry: rank r of a prefill group talks
                    to rank r of a decode group of the same size

**Per side** (may differ; the sender converts)::

    block_size      tokens per cache block
    sink_tokens, residual_tokens
                    the high-precision windows (which blocks are hp)
    layers          per layer, the resident TensorFormat of K and of V, every
                    field of the spec (name, storage dtype, bits, scale
                    granularity and dtype, zero point, group size, qmax...)

The per-side group is the point of kvq's transfer (seed 000): the prefill side
may hold bf16 and the decode side FP8 or KIVI, with other windows and another
block size; the sender casts through tokens into the receiver's layout
(:mod:`kvq.transfer.convert`), so the wire always carries the **receiver's**
formats, windows and block size, and the receiver stores bytes as they
arrive.  :func:`check_compatible` returns a :class:`Negotiated` saying so, and
its :meth:`Negotiated.digest` (a hash of the agreed fields and the receiver's
layout) is what every chunk header carries.

A remote format is rebuilt from its fields and must equal what this side's
registry builds under that name (version skew between two kvq builds, where
one name means other bytes, is refused, never reinterpreted).

Model identity (:func:`model_identity`): the config hash covers the config as
parsed (``config.json`` without private ``_*`` keys and ``transformers_version``;
for a GGUF file, its scalar and string header metadata).  The weights hash is a
*fingerprint*, not a full content hash: for every weight file (sorted by name)
it hashes the name, the size, the first and the last MiB.  Reading whole
checkpoints (GBs) at every handshake is too slow; head and tail cover the
safetensors/GGUF headers (every tensor's name, dtype, shape and offset) and the
last tensors.  Two checkpoints of equal size, headers and tails that differ only
in the middle collide; size + mtime alone would not even survive a copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass

from kvq.formats.registry import MODEL_DTYPES, resolve_format, resolve_kv
from kvq.formats.spec import KVFormat, TensorFormat
from kvq.models.identity import ModelIdentity, canonical_json, model_identity, sha256_hex  # noqa: F401

#: Version of the handshake fields and of the wire layout (kvq.transfer.wire).
PROTOCOL_VERSION = 1

#: Fields both sides must agree on, in the order check_compatible compares them.
AGREED_FIELDS = ("protocol", "config_hash", "weights_hash", "tokenizer_hash", "num_layers", "num_kv_heads",
                 "head_dim", "model_dtype", "hp_dtype", "tp_size", "tp_rank")
_HASH_FIELDS = ("config_hash", "weights_hash", "tokenizer_hash")
_ROLES = ("k", "v")


class TransferIncompatible(ValueError):
    """Two servers whose KV caches cannot exchange blocks; the message names the field."""


# -- strict JSON helpers ---------------------------------------------------------------------------
def _check_keys(where: str, obj, expected) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in expected if k not in obj]
    unknown = sorted(k for k in obj if k not in expected)
    if missing or unknown:
        parts = ([f"missing keys {missing}"] if missing else []) + ([f"unknown keys {unknown}"] if unknown else [])
        raise ValueError(f"{where}: {'; '.join(parts)}")


def _check_type(where: str, value, tp):
    """``value`` as annotation ``tp`` says (int excludes bool; an int is a valid float)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        return _check_type(where, value, next(a for a in args if a is not type(None)))
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ValueError(f"{where}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    ok = {int: lambda x: isinstance(x, int) and not isinstance(x, bool),
          float: lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
          bool: lambda x: isinstance(x, bool), str: lambda x: isinstance(x, str)}[tp](value)
    if not ok:
        raise ValueError(f"{where}: expected {tp.__name__}, got {value!r}")
    return float(value) if tp is float else value


_TF_FIELDS = tuple(f.name for f in dataclasses.fields(TensorFormat))
_TF_TYPES = typing.get_type_hints(TensorFormat)


def format_to_dict(tf: TensorFormat) -> dict:
    """Every field of the spec (the spec decides what a format is; nothing listed twice)."""
    return dataclasses.asdict(tf)


def format_from_dict(where: str, obj) -> TensorFormat:
    _check_keys(where, obj, _TF_FIELDS)
    kw = {k: _check_type(f"{where}.{k}", obj[k], _TF_TYPES[k]) for k in _TF_FIELDS}
    try:
        return TensorFormat(**kw)
    except (AssertionError, ValueError) as e:
        raise ValueError(f"{where}: not a valid format ({e})") from None


# -- the description -------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVDescription:
    """One server's KV cache as the transfer sees it (module docstring lists the fields)."""

    protocol: int
    config_hash: str
    weights_hash: str
    tokenizer_hash: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_dtype: str
    hp_dtype: str
    tp_size: int
    tp_rank: int
    block_size: int
    sink_tokens: int
    residual_tokens: int
    layers: tuple[KVFormat, ...]  # resident K/V format per layer (``requested`` is always "")

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(KVDescription)
        for f in dataclasses.fields(self):
            if f.name != "layers":
                _check_type(f.name, getattr(self, f.name), hints[f.name])
        for name in _HASH_FIELDS:
            val = getattr(self, name)
            if len(val) != 64 or val.strip("0123456789abcdef"):
                raise ValueError(f"{name}: expected 64 lowercase hex digits (sha256), got {val!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "tp_size", "block_size", "protocol"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("sink_tokens", "residual_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not in 0..{self.tp_size - 1}")
        if not isinstance(self.layers, tuple) or len(self.layers) != self.num_layers:
            raise ValueError(f"layers: expected a tuple of {self.num_layers} formats, got {len(self.layers)}")
        for name in ("model_dtype", "hp_dtype"):
            if getattr(self, name) not in MODEL_DTYPES:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not a model dtype ({', '.join(MODEL_DTYPES)})")
        for i, fmt in enumerate((*self.layers, self.hp)):
            where = f"layers[{i}]" if i < self.num_layers else "hp"
            if not isinstance(fmt, KVFormat) or fmt.requested:
                raise ValueError(f"{where}: expected a KVFormat without a requested name, got {fmt!r}")
            for tf in (fmt.k, fmt.v):
                try:
                    tf.check_shape(self.num_kv_heads, self.head_dim, self.block_size)
                except ValueError as e:
                    raise ValueError(f"{where}.{tf.role}: {e}") from None

    @property
    def hp(self) -> KVFormat:
        """The high-precision pool's format, as the registry builds it (``requested`` cleared)."""
        return dataclasses.replace(resolve_kv(self.hp_dtype, model_dtype=self.model_dtype), requested="")

    # -- JSON ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "layers"}
        out["layers"] = [{r: format_to_dict(getattr(f, r)) for r in _ROLES} for f in self.layers]
        return out

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no whitespace)."""
        return canonical_json(self.to_dict()).decode()

    @classmethod
    def from_dict(cls, obj) -> "KVDescription":
        names = tuple(f.name for f in dataclasses.fields(cls))
        _check_keys("KVDescription", obj, names)
        layers = obj["layers"]
        if not isinstance(layers, list):
            raise ValueError(f"layers: expected a JSON array, got {type(layers).__name__}")
        fmts = []
        for i, entry in enumerate(layers):
            _check_keys(f"layers[{i}]", entry, _ROLES)
            k, v = (format_from_dict(f"layers[{i}].{r}", entry[r]) for r in _ROLES)
            if (k.role, v.role) != _ROLES:
                raise ValueError(f"layers[{i}]: role fields are ({k.role!r}, {v.role!r}), expected ('k', 'v')")
            fmts.append(KVFormat(k, v))
        return cls(**{n: obj[n] for n in names if n != "layers"}, layers=tuple(fmts))

    @classmethod
    def from_json(cls, text: str | bytes) -> "KVDescription":
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"KVDescription: not valid JSON ({e})") from None
        return cls.from_dict(obj)

    # -- hashes --------------------------------------------------------------------------------------
    def agreed(self) -> dict:
        """The fields both sides must agree on (:data:`AGREED_FIELDS`)."""
        return {name: getattr(self, name) for name in AGREED_FIELDS}

    def compat_hash(self) -> str:
        """Hex sha256 of the agreed fields' canonical JSON."""
        return sha256_hex(b"kvq-compat-v1\0" + canonical_json(self.agreed()))


def describe_plan(plan, *, model_id: ModelIdentity, tokenizer_hash: str, tp: tuple[int, int] = (1, 0)
                  ) -> KVDescription:
    """The description of a :class:`~kvq.cache.plan.CachePlan` (``tp`` = (tp_size, tp_rank))."""
    m = plan.model
    desc = KVDescription(
        protocol=PROTOCOL_VERSION,
        config_hash=model_id.config_hash,
        weights_hash=model_id.weights_hash,
        tokenizer_hash=tokenizer_hash,
        num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        model_dtype=m.dtype,
        hp_dtype=plan.hp.k.storage,
        tp_size=tp[0],
        tp_rank=tp[1],
        block_size=plan.block_size,
        sink_tokens=plan.sink_tokens,
        residual_tokens=plan.residual_tokens,
        layers=tuple(KVFormat(f.k, f.v) for f in plan.layers),
    )
    assert (desc.hp.k, desc.hp.v) == (plan.hp.k, plan.hp.v), (desc.hp, plan.hp)
    return desc


# -- negotiation -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Negotiated:
    """What two compatible servers agreed: the wire carries the receiver's layout.

    ``wire`` (= ``receiver``) decides every layer's format on the wire, the block
    size, and which blocks are high precision (its windows); the sender converts
    wherever :meth:`needs_cast` says so."""

    sender: KVDescription
    receiver: KVDescription

    @property
    def wire(self) -> KVDescription:
        return self.receiver

    def wire_format(self, layer: int) -> KVFormat:
        return self.receiver.layers[layer]

    def needs_cast(self, layer: int, role: str) -> bool:
        """Whether the sender's resident format differs from the wire's for one layer and role
        (a different block size or windows re-lays blocks even where this is False)."""
        return getattr(self.sender.layers[layer], role) != getattr(self.receiver.layers[layer], role)

    @property
    def same_layout(self) -> bool:
        """Sender blocks map one to one onto receiver blocks (formats, block size and windows equal)."""
        s, r = self.sender, self.receiver
        return (s.layers, s.block_size, s.sink_tokens, s.residual_tokens) == (
            r.layers, r.block_size, r.sink_tokens, r.residual_tokens)

    def digest(self) -> bytes:
        """32 bytes every chunk header carries: sha256 of the receiver's whole description
        (agreed fields, formats, windows, block size)."""
        return hashlib.sha256(b"kvq-wire-v1\0" + canonical_json(self.receiver.to_dict())).digest()

    def summary(self) -> dict:
        """For ``/status``: formats per layer on each side and on the wire."""
        return {
            "compat_hash": self.receiver.compat_hash(),
            "block_size": {"sender": self.sender.block_size, "wire": self.receiver.block_size},
            "sender_layers": [f.name for f in self.sender.layers],
            "wire_layers": [f.name for f in self.receiver.layers],
            "wire_windows": {"sink_tokens": self.receiver.sink_tokens,
                             "residual_tokens": self.receiver.residual_tokens},
        }


def _check_known_formats(desc: KVDescription, who: str) -> None:
    """Each of ``desc``'s formats must be exactly what this side's registry builds under its name."""
    for i, fmt in enumerate(desc.layers):
        for tf in (fmt.k, fmt.v):
            where = f"layers[{i}].{tf.role}"
            try:
                ours = resolve_format(tf.name, tf.role, model_dtype=desc.model_dtype, group_size=tf.group_size)
            except ValueError as e:
                raise TransferIncompatible(f"{where}: {who} format {tf.name!r} is not one this side knows ({e})"
                                           ) from None
            if ours != tf:
                diff = next(n for n in _TF_FIELDS if getattr(ours, n) != getattr(tf, n))
                raise TransferIncompatible(
                    f"{where}: {who} format {tf.name!r} differs from this side's format of that name "
                    f"({diff}: here {getattr(ours, diff)!r}, {who} {getattr(tf, diff)!r})")


def check_compatible(local: KVDescription, remote: KVDescription, *, receiver: str = "remote") -> Negotiated:
    """Raise :class:`TransferIncompatible` naming the first agreed field that differs
    (``"num_kv_heads: local 8, remote 4"``) or a remote format this side does not build
    the same way; else the :class:`Negotiated` agreement.  ``receiver`` says which side
    stores the blocks (``"remote"``: this side sends)."""
    if receiver not in ("local", "remote"):
        raise ValueError(f"receiver must be 'local' or 'remote', got {receiver!r}")
    for name in AGREED_FIELDS:
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            raise TransferIncompatible(f"{name}: local {a!r}, remote {b!r}")
    assert local.compat_hash() == remote.compat_hash()
    _check_known_formats(remote, "remote")
    return Negotiated(sender=local, receiver=remote) if receiver == "remote" else Negotiated(remote, local)
