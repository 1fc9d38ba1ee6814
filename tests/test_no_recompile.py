"""The attention kernels compile once per format and shape, not once per step.

A step's block tables, lengths and query starts are views at varying offsets (so their 16-byte
alignment varies) and widths; a Triton kernel that specialized on either compiled again in the
middle of a serving wave (bench_engine's JIT record on the H200: the prefill kernel 4.1 s, the
dequantizer twice, every sequence of the step waiting).  Each kernel launched once, then again
with views at unaligned offsets, other widths and another split count: no compile.  GPU only:
the CPU interpreter compiles nothing."""

from __future__ import annotations

import pytest
import torch

from benchmarks.jit_compiles import JitCompiles
from kvq.attention.triton import decode, prefill
from kvq.cache.plan import bare_model, make_plan
from kvq.cache.pool import KVPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the interpreter compiles nothing")


@pytest.mark.parametrize("fmt", ["bfloat16", "int4_kivi"])
def test_step_views_at_any_offset_and_width_do_not_recompile(fmt):
    H, group, D, dev = 2, 4, 128, "cuda"
    plan = make_plan(bare_model(1, H, D, num_attention_heads=H * group), fmt, sink_tokens=0, residual_tokens=0)
    bs = plan.block_size
    layer = KVPool.create(plan, 64, 16, dev).layers[0]
    for t in (layer.k_hp, layer.v_hp, *layer.k.values(), *layer.v.values()):  # finite pages of any dtype
        if t.is_floating_point() and t.element_size() > 1:
            t.uniform_(-1, 1)
        else:
            t.view(torch.uint8).copy_(torch.randint(0, 128, t.shape, dtype=torch.uint8, device=dev).view(t.shape))
    W, L, T = 37, 3 * bs, 2 * bs  # tables' full width (37 int32: an odd row is not 16-byte aligned)
    tables = torch.arange(9 * W, device=dev, dtype=torch.int32).view(9, W) % 64
    lens = torch.full((12,), L, dtype=torch.int32, device=dev)
    cu = torch.zeros(12, dtype=torch.int32, device=dev)
    q = torch.randn(T, H * group, D, device=dev, dtype=torch.bfloat16)

    def step(row: int, width: int, splits: int):
        cu[row:row + 3] = torch.tensor([0, bs, T], dtype=torch.int32)
        tb, ln = tables[row:row + 2, :width], lens[row:row + 2]
        out = prefill.paged_attention(q, layer, cu[row:row + 3], tb, ln, 0.1, max_q_len=bs, max_seq_len=L,
                                      has_hp=False, dequant_first=fmt != "bfloat16")
        return out, decode.paged_decode(q[:2], layer, tb, ln, 0.1, max_seq_len=L, has_hp=False, num_splits=splits)

    first = step(0, W, 2)
    with JitCompiles() as jit:
        again = [step(row, width, splits) for row, width, splits in
                 ((1, W, 3), (3, 5, 2), (5, 16, 4), (0, 8, 1), (0, 8, 2))]
        torch.cuda.synchronize()
    assert jit.names == {}, jit.variants
    # the same blocks (a narrower view of the same rows) at the first call's split count: the same
    # result (another split count reorders the decode's float32 sums, which moved an output of 4.6
    # by one bf16 ulp, 0.031, on the H200)
    for a, b in zip(first, again[-1]):
        assert a.isfinite().all()
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)
