"""Static KV scales: the file `kvq calibrate` writes and `--kv-scales FILE` reads.

Formats with static scales (``fp8_e4m3``, ``fp8_e5m2``: ``kvq formats``) store
``x / s`` per layer and K/V, with ``s`` a scalar or one value per KV head; 1.0
(the default, ``--kv-scales none``) wastes most of FP8's range on the small
values of a real model's K and V.  A scales file holds, per layer,
``layers.{i}.k_scale`` and ``layers.{i}.v_scale`` (float32, shape ``[H]``) as
safetensors, with metadata naming the model it was measured on (the transfer
handshake's config and weights hashes), the FP8 storage it was computed for,
the observer, and the tokens seen.

Loading checks everything before the pool is built: the file exists and is a
scales file, the model identity matches (a file of another model is refused,
naming both hashes), every layer stored in a static format has both scales with
``H`` positive finite values, and the plan has static-scaled layers at all (a
file given to a format that computes its own scales is an error naming the
format, never ignored).  Layers kept in the model dtype
(``--kv-cache-dtype-skip-layers``) ignore their entries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT_TAG = "kvq-kv-scales-v1"


class ScalesError(ValueError):
    """A scales file that cannot be used with this model and plan (the message says why)."""


@dataclass(frozen=True)
class KVScales:
    """Per-layer static scales ``{layer: (k [H], v [H])}`` and what they were measured on."""

    scales: dict[int, tuple[torch.Tensor, torch.Tensor]]
    meta: dict

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for i, (k, v) in sorted(self.scales.items()):
            tensors[f"layers.{i}.k_scale"] = k.detach().float().contiguous().cpu()
            tensors[f"layers.{i}.v_scale"] = v.detach().float().contiguous().cpu()
        meta = {"format": FORMAT_TAG, **{k: v if isinstance(v, str) else json.dumps(v) for k, v in self.meta.items()}}
        save_file(tensors, str(path), metadata=meta)


def per_head(t: torch.Tensor, num_kv_heads: int, where: str) -> torch.Tensor:
    """A scale tensor as ``[H]`` float32 (one value is every head's), or ScalesError naming ``where``."""
    t = t.float().reshape(-1)
    if t.numel() == 1:
        t = t.expand(num_kv_heads).clone()
    if t.numel() != num_kv_heads:
        raise ScalesError(f"{where} has {t.numel()} values; the model has {num_kv_heads} KV heads")
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        raise ScalesError(f"{where} must be positive and finite, got {t.tolist()}")
    return t


def static_layers(plan) -> list[int]:
    """Layers whose K or V format takes static scales."""
    return [i for i, f in enumerate(plan.layers) if "static" in (f.k.scale, f.v.scale)]


def load_scales(path: str | Path, plan, model_id) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer: (k_scale, v_scale)}`` for :meth:`KVPool.create`, from a file checked against ``plan``
    and ``model_id`` (:class:`ScalesError` otherwise; module docstring)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    wanted = static_layers(plan)
    if not wanted:
        names = sorted({f.k.name for f in plan.layers} | {f.v.name for f in plan.layers})
        raise ScalesError(f"--kv-scales {path}: the KV format ({', '.join(names)}) takes no static scales; "
                          "static-scaled formats: fp8_e4m3, fp8_e5m2 (see `kvq formats`)")
    if not path.is_file():
        raise ScalesError(f"--kv-scales {path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ScalesError(f"--kv-scales {path}: not a safetensors file ({e})") from None
    if meta.get("format") != FORMAT_TAG:
        raise ScalesError(f"--kv-scales {path}: not a kvq scales file (metadata format {meta.get('format')!r}, "
                          f"expected {FORMAT_TAG!r}; `kvq calibrate` writes them)")
    for name in ("config_hash", "weights_hash"):
        if meta.get(name) != getattr(model_id, name):
            raise ScalesError(f"--kv-scales {path}: measured on another model ({name} {meta.get(name)!r:.20}..., "
                              f"this model {getattr(model_id, name)[:16]}...)")
    H = plan.model.num_kv_heads
    out = {}
    for i in wanted:
        pair = []
        for role in ("k", "v"):
            key = f"layers.{i}.{role}_scale"
            t = tensors.get(key)
            if t is None:
                raise ScalesError(f"--kv-scales {path}: {key} is missing")
            pair.append(per_head(t, H, f"--kv-scales {path}: {key}"))
        out[i] = (pair[0], pair[1])
    return out
