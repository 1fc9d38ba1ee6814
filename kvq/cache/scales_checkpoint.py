"""Static KV scales shipped inside a checkpoint (HF folders with safetensors).

Quantized checkpoints carry the scales their KV cache was calibrated with; kvq
reads the three conventions vLLM accepts, by tensor name::

    compressed-tensors   model.layers.N.self_attn.k_scale, .v_scale        (1,) or (H,)
                         (config.json: quantization_config.kv_cache_scheme)
    ModelOpt             model.layers.N.self_attn.k_proj.k_scale, v_proj.v_scale
    legacy               model.layers.N.self_attn.kv_scale                 one scale for K and V

A scale ``s`` means the cache stores ``x / s`` (kvq's static-scale convention).
:func:`checkpoint_scales` returns them per layer as ``[H]`` tensors, checked:
a convention that covers some layers but not all, a tensor of the wrong size, a
value that is not positive and finite, or a ``kv_cache_scheme`` without any
scale tensor is a :class:`~kvq.cache.scales_file.ScalesError`.  Only tensor
names are read from each file (safetensors headers), then the few scale tensors.
"""

from __future__ import annotations

import json
import re

from kvq.cache.scales_file import ScalesError, per_head

_PATTERNS = (
    ("compressed-tensors", re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")),
    ("modelopt", re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_proj\.([kv])_scale$")),
    ("legacy kv_scale", re.compile(r"^model\.layers\.(\d+)\.self_attn\.(kv)_scale$")),
)


def _scheme(folder) -> dict | None:
    cfg = folder / "config.json"
    if not cfg.is_file():
        return None
    q = json.loads(cfg.read_text()).get("quantization_config") or {}
    return q.get("kv_cache_scheme") if isinstance(q, dict) else None


def checkpoint_scales(src, num_layers: int, num_kv_heads: int) -> tuple[str, dict] | None:
    """``(convention, {layer: (k [H], v [H])})`` of a checkpoint that ships KV scales, else None
    (GGUF files and folders without them)."""
    from safetensors import safe_open

    if src.gguf_file:
        return None
    found: dict[str, dict[tuple[int, str], tuple[str, str]]] = {}
    for path in sorted(src.folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                for name, pat in _PATTERNS:
                    m = pat.match(key)
                    if m and (name != "modelopt" or m.group(2) == m.group(3)):
                        found.setdefault(name, {})[(int(m.group(1)), m.group(2))] = (str(path), key)
    scheme = _scheme(src.folder)
    if not found:
        if scheme:
            raise ScalesError(f"{src.name}: config.json declares quantization_config.kv_cache_scheme {scheme} "
                              "but no file holds a k_scale/v_scale tensor")
        return None
    if len(found) > 1:
        raise ScalesError(f"{src.name}: KV scales in more than one convention ({', '.join(sorted(found))})")
    (name, entries), = found.items()
    roles = ("kv",) if name == "legacy kv_scale" else ("k", "v")
    missing = [f"layer {i} {r}" for i in range(num_layers) for r in roles if (i, r) not in entries]
    if missing:
        raise ScalesError(f"{src.name}: {name} KV scales cover some layers but not {', '.join(missing[:4])}"
                          f"{' ...' if len(missing) > 4 else ''}")
    out = {}
    for i in range(num_layers):
        pair = []
        for r in ("k", "v"):
            path, key = entries[(i, "kv" if name == "legacy kv_scale" else r)]
            with safe_open(path, framework="pt") as f:
                pair.append(per_head(f.get_tensor(key), num_kv_heads, f"{src.name}: {key}"))
        out[i] = (pair[0], pair[1])
    return name, out
