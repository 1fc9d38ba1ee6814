"""The runner's host mirror of block tables (kvq/engine/block_tables.py)."""

import numpy as np

from kvq.cache.block_manager import BlockRef
from kvq.cache.pool import encode_table
from kvq.engine.block_tables import BlockTables


def refs(*ids):
    return tuple(BlockRef("q", i) if i >= 0 else BlockRef("hp", -i - 1) for i in ids)


def test_deltas_rows_growth_and_release():
    t = BlockTables(rows=2, width=2)
    t.update(7, 0, refs(3, -1), 2)
    t.update(9, 0, refs(5), 1)
    t.update(11, 0, refs(1, 2, 3, 4, 5), 5)  # a third row and a wider table: both grow
    assert t.get(7) == encode_table(refs(3, -1)) == [3, -1]
    t.update(7, 1, refs(8, 6), 3)  # entry 1 sealed into q block 8, a new block appended
    assert t.get(7) == [3, 8, 6] and t.get(11) == [1, 2, 3, 4, 5] and t.get(9) == [5]
    g = t.gather([9, 7])
    assert g.dtype == np.int32 and g.tolist() == [[5, 0, 0], [3, 8, 6]]  # rows padded with 0
    t.release([7, 42])  # unknown ids are ignored
    assert 7 not in t.row_of and len(t) == 2
    t.update(13, 0, refs(-4), 1)  # reuses the released row: its old entries are gone
    assert t.gather([13]).tolist() == [[-4]]
    t.update(11, 0, refs(9, 9), 2)  # a shorter table (preempted and readmitted under the same id)
    assert t.gather([11, 13]).tolist() == [[9, 9], [-4, 0]]
