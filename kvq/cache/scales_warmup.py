"""``--kv-scales warmup[:N]``: static FP8 scales measured on the first tokens the engine serves.

Until ``N`` tokens have been computed (default :data:`DEFAULT_TOKENS`; the step that
crosses ``N`` counts whole), every layer stored in a static-scaled format
(``fp8_e4m3``, ``fp8_e5m2``) is written with scale 1.0 while the model's forward
hands each layer's new K and V (post-RoPE, what the cache stores) to
:meth:`WarmupScales.observe`, which keeps their absmax per KV head on the device
(no host sync).  Then the scales freeze at ``absmax / qmax`` per layer, K/V and KV
head, and the blocks written so far are re-encoded from scale 1.0 to the new scale
(in chunks of blocks, through the format reference), so every cached token reads
back under the scale its layer now holds; the high-precision windows are
untouched.  Decode runs eagerly during the warm-up (CUDA graphs replay only
after the freeze, with the new scales in the same tensors the graphs read).

The route needs the cache to live in one place: a host tier (``--cpu-offload-gb``)
or a KV-transfer role would hold blocks written under scale 1.0 where the
re-encoding does not reach, so the engine and the server refuse those combinations.
"""

from __future__ import annotations

import logging

import torch

from kvq.formats import reference

DEFAULT_TOKENS = 1024
#: Blocks re-encoded per chunk at the freeze (bounds the float32 scratch).
CHUNK_BLOCKS = 1024

logger = logging.getLogger("kvq")


def parse_warmup(value) -> int | None:
    """``"warmup"`` / ``"warmup:N"`` -> N; anything else -> None (ValueError for a bad N)."""
    if not isinstance(value, str) or not (value == "warmup" or value.startswith("warmup:")):
        return None
    if value == "warmup":
        return DEFAULT_TOKENS
    n = value.split(":", 1)[1]
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"kv_scales {value!r}: warmup:N takes a number of tokens N >= 1")
    return int(n)


class WarmupScales:
    """The warm-up of one engine's pool (module docstring)."""

    def __init__(self, pool, layers: list[int], tokens: int, on_freeze=None):
        self.pool, self.layers, self.tokens = pool, set(layers), tokens
        self.on_freeze = on_freeze  # called with the frozen scales ({layer: (k, v)})
        self.seen = 0
        self.frozen = False
        H = pool.plan.model.num_kv_heads
        self.absmax = {(i, r): torch.zeros(H, dtype=torch.float32, device=pool.device) for i in layers for r in "kv"}

    @property
    def source(self) -> str:
        """What ``info["kv_scales"]`` and ``/status`` report."""
        if self.frozen:
            return f"warmup: frozen after {self.seen} tokens"
        return f"warmup: observing ({self.seen}/{self.tokens} tokens)"

    def observe(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A layer's new K and V ``[T, H, D]`` of one step."""
        if layer in self.layers and k.shape[0]:
            for r, x in (("k", k), ("v", v)):
                m = self.absmax[(layer, r)]
                torch.maximum(m, x.detach().abs().amax(dim=(0, 2)).float(), out=m)

    def advance(self, num_tokens: int) -> bool:
        """Count a computed step; True when the warm-up is complete (then call :meth:`freeze`)."""
        self.seen += num_tokens
        return self.seen >= self.tokens

    def scales(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """``absmax / qmax`` per layer (K, V); a head that saw only zeros keeps 1.0."""
        out = {}
        for i in sorted(self.layers):
            pair = []
            for r in "kv":
                tf = self.pool.layers[i].tensor_format(r)
                a = self.absmax[(i, r)]
                pair.append(torch.where(a > 0, a / tf.qmax, torch.ones_like(a)) if tf.scale == "static"
                            else torch.ones_like(a))
            out[i] = (pair[0], pair[1])
        return out

    @torch.no_grad()
    def freeze(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Set the scales and re-encode every q block of the static layers under them; -> the scales."""
        new = self.scales()
        for i, pair in new.items():
            layer = self.pool.layers[i]
            for r, s in zip("kv", pair):
                tf = layer.tensor_format(r)
                if tf.scale != "static":
                    continue
                old = layer.static_scale(r)
                data = layer.planes(r)["data"]
                for b in range(0, data.shape[0], CHUNK_BLOCKS):
                    part = data[b:b + CHUNK_BLOCKS]
                    x = reference.dequantize(tf, {"data": part}, old)
                    part.copy_(reference.quantize(tf, x, s)["data"])
                old.copy_(s)  # in place: kernels and captured graphs read this tensor
        self.frozen = True
        logger.info("kv scales: %s", self.source)
        if self.on_freeze is not None:
            self.on_freeze(new)
        return new
