"""The shape of a model as the KV cache sees it: layers, heads, head dim, positions.

The cache knows formats and shapes, not models: kvq.models.source reads a
model's files into a :class:`ModelShape`; the plan, the pools and the kernels
only ever see this.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache needs to know about a model (no weights)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    max_position_embeddings: int
    dtype: str = "bfloat16"
    #: Layer indices using sliding-window attention (``--kv-cache-dtype-skip-layers sliding_window``).
    sliding_window_layers: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        for attr in ("num_layers", "num_kv_heads", "head_dim", "num_attention_heads", "max_position_embeddings"):
            if getattr(self, attr) < 1:
                raise ValueError(f"{attr} must be >= 1, got {getattr(self, attr)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
