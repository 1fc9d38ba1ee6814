"""Who a model is, as hashes: its config, a fingerprint of its weight files, its tokenizer's vocabulary.

The KV transfer handshake (:mod:`kvq.transfer.describe`) and static-scale files
(:mod:`kvq.cache.scales_file`) carry them, so that KV or scales measured on one
model are never read with another.  The config hash covers the config as parsed
(``config.json`` without private ``_*`` keys and ``transformers_version``; for a
GGUF file, its scalar and string header metadata).  The weights hash is a
*fingerprint*: per weight file (sorted by name) its name, size, first and last
MiB -- the safetensors/GGUF headers (every tensor's name, dtype, shape, offset)
and the last tensors, without reading whole checkpoints at every handshake.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

#: Bytes hashed at each end of a weight file.
WEIGHT_EDGE_BYTES = 1 << 20
#: Suffixes of weight files in an HF model folder.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def canonical_json(obj, *, allow_nan: bool = False) -> bytes:
    """Sorted keys, no whitespace, UTF-8: equal values give equal bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=allow_nan).encode("utf-8", "surrogatepass")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ModelIdentity:
    """Hex sha256 of a model's config and fingerprint of its weights (see module docstring)."""

    config_hash: str
    weights_hash: str


def _config_dict(source) -> dict:
    from kvq.models.source import read_gguf_header, read_hf_config

    if source.gguf_file:
        return {k: v for k, v in read_gguf_header(source.path).items() if v is not None}
    cfg = read_hf_config(source.folder)
    return {k: v for k, v in cfg.items() if not k.startswith("_") and k != "transformers_version"}


def _weight_files(source) -> list[tuple[str, Path]]:
    if source.gguf_file:
        return [("model.gguf", source.path)]  # a copy under another name is the same model
    return sorted((p.name, p) for p in source.folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def weights_fingerprint(files: list[tuple[str, Path]], edge: int = WEIGHT_EDGE_BYTES) -> str:
    """sha256 over, per file: name, size (u64), first ``edge`` bytes, last ``edge`` bytes
    (non-overlapping: a file under ``2 * edge`` bytes is hashed whole)."""
    h = hashlib.sha256(b"kvq-weights-v1\0")
    for name, path in files:
        size = path.stat().st_size
        h.update(name.encode() + b"\0" + struct.pack("<Q", size))
        with open(path, "rb") as f:
            h.update(f.read(min(size, edge)))
            if size > edge:
                f.seek(max(edge, size - edge))
                h.update(f.read(edge))
    return h.hexdigest()


def model_identity(source) -> ModelIdentity:
    """Identity of a :class:`~kvq.models.source.ModelSource` (or a name ``resolve_model`` takes).

    A shipped config (no weight files, ``--load-format dummy``) has the fingerprint
    of an empty file list: such models are identified by their config alone."""
    from kvq.models.source import resolve_model

    src = resolve_model(source) if isinstance(source, str) else source
    return ModelIdentity(
        config_hash=sha256_hex(b"kvq-config-v1\0" + canonical_json(_config_dict(src), allow_nan=True)),
        weights_hash=weights_fingerprint(_weight_files(src)),
    )


def tokenizer_hash(tokenizer) -> str:
    """sha256 of a HF tokenizer's vocabulary (``get_vocab()``, added tokens included) and its
    bos/eos/pad/unk ids, as canonical JSON: what token ids mean.  Normalizer and
    pre-tokenizer rules are not covered.  ``None`` (a model driven by token ids) hashes to
    a fixed value."""
    if tokenizer is None:
        return sha256_hex(b"kvq-tokenizer-v1\0none")
    vocab = sorted((str(t), int(i)) for t, i in tokenizer.get_vocab().items())
    special = {k: getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    return sha256_hex(b"kvq-tokenizer-v1\0" + canonical_json({"vocab": vocab, "special": special}))
