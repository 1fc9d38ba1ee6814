"""The Triton backend's kernels under the reference's names (see kvq.attention.reference)."""

from kvq.attention.triton.decode import paged_decode
from kvq.attention.triton.demote import demote_layers, demote_pairs
from kvq.attention.triton.prefill import paged_attention
from kvq.attention.triton.store import seal_blocks, seal_pairs, write_kv

__all__ = ["demote_layers", "demote_pairs", "paged_attention", "paged_decode", "seal_blocks", "seal_pairs", "write_kv"]
