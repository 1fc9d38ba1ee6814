"""The ``cuda`` backend's kernels under the reference's names (see kvq.attention.reference).

Decode over layers stored in 8 bits or as KIVI runs the CUDA kernel of
decode8.cu; decode over any other layer (bf16 skip layers, per-token 4/2-bit
baselines), prefill, write and seal run the Triton kernels.  Which kernel
serves a layer depends only on its format, so a
plan's choice is fixed when the backend is selected (backends.py reports it).
"""

from __future__ import annotations

from kvq.attention.cuda import decode8
from kvq.attention.triton import decode as triton_decode
from kvq.attention.triton.prefill import paged_attention
from kvq.attention.triton.store import seal_blocks, seal_pairs, write_kv

__all__ = ["paged_attention", "paged_decode", "seal_blocks", "seal_pairs", "write_kv"]


def paged_decode(q, layer, block_tables, seq_lens, sm_scale, max_seq_len=None, has_hp=None):
    group = q.shape[1] // layer.num_kv_heads
    if decode8.unsupported_reason(layer, group, q.dtype) is None:
        return decode8.paged_decode(q, layer, block_tables, seq_lens, sm_scale, max_seq_len=max_seq_len,
                                    has_hp=has_hp)
    return triton_decode.paged_decode(q, layer, block_tables, seq_lens, sm_scale, max_seq_len=max_seq_len,
                                      has_hp=has_hp)
