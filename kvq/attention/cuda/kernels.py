"""The ``cuda`` backend's kernels under the reference's names (see kvq.attention.reference).

Decode over layers stored in 8 bits or as KIVI runs the CUDA kernel of
decode8.cu (a tiered cache's: one launch a tier, the CUDA kernel for the tiers
it reads; the last launch, a CUDA one of one split, merges the others' partial
results by log-sum-exp in its epilogue, else a reduce launch does); decode over
any other layer (bf16 skip layers, and what :func:`kvq.attention.cuda.decode8.routes`
refuses, e.g. 3-bit rotated codes at head_dim 64) and
prefill run the Triton kernels.  Block seals of KIVI and
per-block-scaled layers (window seals in the decode step, a prefill chunk's whole
blocks) run the CUDA kernel of seal.cu; token writes and every other seal run the
Triton kernels.  Which kernel serves a layer depends only on its format, so a
plan's choice is fixed when the backend is selected (backends.py reports it).
"""

from __future__ import annotations

from kvq.attention.cuda import decode8, seal
from kvq.attention.triton import decode as triton_decode
from kvq.attention.triton.demote import demote_layers, demote_pairs  # noqa: F401 (Triton's serve every tier)
from kvq.attention.triton import store
from kvq.attention.triton.prefill import paged_attention

__all__ = ["demote_layers", "demote_pairs", "paged_attention", "paged_decode", "seal_blocks", "seal_pairs", "write_kv"]


def paged_decode(q, layer, block_tables, seq_lens, sm_scale, max_seq_len=None, has_hp=None, tiers=None):
    group = q.shape[1] // layer.num_kv_heads
    if tiers is None:
        if decode8.routes(layer, group, q.dtype):
            return decode8.paged_decode(q, layer, block_tables, seq_lens, sm_scale, max_seq_len=max_seq_len,
                                        has_hp=has_hp)
        return triton_decode.paged_decode(q, layer, block_tables, seq_lens, sm_scale, max_seq_len=max_seq_len,
                                          has_hp=has_hp)
    # a tiered cache: one launch a tier, each by the kernel of its format (the CUDA one where it reads it),
    # into one set of partial results merged by log-sum-exp
    parts = triton_decode.decode_parts(layer, block_tables, seq_lens, max_seq_len, has_hp, tiers)
    cuda = [decode8.routes(p.layer, group, q.dtype) for p in parts]
    splits = [decode8.splits_for(q, p.layer, p.longest) if c else triton_decode.part_splits(q, p)
              for p, c in zip(parts, cuda)]
    by_cuda = {id(p) for p, c in zip(parts, cuda) if c}

    def launch(p, po, plse, base, n, merge_into=None):
        if id(p) in by_cuda:
            return decode8.paged_decode(q, p.layer, p.tables, p.lens, sm_scale, max_seq_len=p.longest,
                                        has_hp=p.has_hp, num_splits=n, partials=(po, plse, base),
                                        merge_into=merge_into)
        triton_decode.launch_part(q, p, po, plse, base, sm_scale, n, natural=True)

    # a CUDA part of one split runs last and merges the others' partials in its epilogue (no reduce
    # launch); without one (a small batch over long contexts splits every part), a reduce merges them all
    last = next((i for i in reversed(range(len(parts))) if cuda[i] and splits[i] == 1), None)
    return triton_decode.run_parts(q, parts, splits, launch, merger=last)


def seal_pairs(layer, pairs):
    if seal.layer_reason(layer) is None:
        return seal.seal_pairs(layer, pairs)
    return store.seal_pairs(layer, pairs)


def seal_blocks(layer, src_hp, dst_q):
    if seal.layer_reason(layer) is None:
        return seal.seal_blocks(layer, src_hp, dst_q)
    return store.seal_blocks(layer, src_hp, dst_q)


def write_kv(layer, k, v, slots, full_blocks=None):
    if seal.layer_reason(layer) is not None:
        return store.write_kv(layer, k, v, slots, full_blocks)
    return store.write_kv(layer, k, v, slots, full_blocks, sealer=seal.seal_from, pair_sealer=seal.seal_both_from)
