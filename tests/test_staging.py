"""One host->device copy per step: the packing layout, buffer reuse, and the runner's use of it."""

import numpy as np
import torch

from kvq.cache.step import HostStep, each_to, stage_step
from kvq.engine.staging import Staging, layout


def test_pack_round_trips_every_dtype_shape_and_empty_array():
    st = Staging("cpu", nbytes=16)  # grows
    arrays = [np.arange(5, dtype=np.int64), np.arange(7, dtype=np.int32).reshape(7),  # odd int32 count: padding
              np.zeros((0, 2), np.int64), np.arange(12, dtype=np.int32).reshape(3, 4) - 6,
              np.array([2 ** 40, -3], np.int64)]
    offs, n = layout(arrays)
    assert all(o % 16 == 0 for o in offs) and n >= sum(a.nbytes for a in arrays)
    out = st.pack(arrays)
    for a, t in zip(arrays, out):
        assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
        assert np.array_equal(t.numpy(), a)
    assert st.copies == 1


def test_a_pack_is_not_overwritten_by_the_next_ones():
    st = Staging("cpu")
    first = st.pack([np.full(100, 7, np.int64)])[0]
    for k in range(3):
        st.pack([np.full(300, k, np.int64)])  # larger: the host buffers grow and alternate
    assert (first == 7).all()


def test_stage_step_packs_what_the_per_array_copies_give():
    step = HostStep(slots=list(range(32, 48)) + [-5, 70], tables=[[2, 3], [-1, 4, 5]], seq_lens=[17, 40],
                    num_new=[1, 17], seals=[(1, 9)])
    extra = [np.arange(18, dtype=np.int64), np.arange(18, dtype=np.int64) + 3]
    st = Staging("cpu")
    packed, pex = stage_step(step, 16, st.pack, extra)
    each, eex = stage_step(step, 16, each_to("cpu"), extra)
    assert st.copies == 1
    for f in ("slots", "full_blocks", "cu_seqlens_q", "block_tables", "seq_lens", "prefill_cu", "seals"):
        a, b = getattr(packed, f), getattr(each, f)
        assert a.dtype == b.dtype and torch.equal(a, b), f
    assert packed.full_blocks.tolist() == [[2, 0]]  # slots 32..47 fill q block 2
    assert packed.prefill_cu.tolist() == [0, 17] and packed.num_decodes == 1 and packed.has_hp
    assert all(torch.equal(a, b) for a, b in zip(pex, eex))
