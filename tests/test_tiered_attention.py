"""Attention over a tiered cache (elastic precision): each block read as its tier stores it.

The reference reads a table's tier tags itself; it must equal plain softmax attention over the
blocks dequantized one by one.  The Triton decode splits the tables by tier (kvq.cache.step
.split_tiers, staged with the step) and merges the parts by log-sum-exp; the Triton prefill reads
every page through its tier into the scratch, with and without the per-query exact windows.
Both must give the reference's output.  K/V are real (tests/fixtures/kv_smollm2.pt).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kvq.attention import reference
from kvq.attention.triton import decode as triton_decode
from kvq.attention.triton import prefill as triton_prefill
from kvq.cache.plan import bare_model, make_plan
from kvq.cache.pool import KVPool, encode_ref
from kvq.cache.step import HostStep, each_to, split_tiers, stage_step
from kvq.formats.reference import dequantize

FIXTURE = Path(__file__).parent / "fixtures" / "kv_smollm2.pt"
H, GROUP, D = 3, 3, 64
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton tests: on a GPU, else under the interpreter


@pytest.fixture(scope="module")
def kv():
    data = torch.load(FIXTURE, weights_only=True)
    return data["k"][2], data["v"][2]  # [896, 3, 64] bf16


def tiered_layer(base: str, tiers: str, kv, layout: list[str], device="cpu", pools: list | None = None):
    """A one-layer tiered pool holding one sequence whose logical block ``i`` lies in pool
    ``layout[i]`` ("hp", "q", "q1"...), filled with consecutive real K/V; -> (layer, table, values)
    (``pools``: the pool is appended to it)."""
    plan = make_plan(bare_model(1, H, D, num_attention_heads=H * GROUP), base, tiers=tiers, sink_tokens=32,
                     residual_tokens=32)
    bs = plan.block_size
    pool = KVPool.create(plan, 0, layout.count("hp") + 1, device, num_slabs=16)
    layer = pool.layers[0]
    if pools is not None:
        pools.append(pool)
    k, v = kv
    # tier t's blocks from slab 4t on (a slab belongs to one tier), apart where slabs hold several: ids are
    # not positions
    per = {p: pool.layout.per_slab[0 if p == "q" else int(p[1:])] for p in set(layout) if p != "hp"}
    next_id = {p: 0 if p == "hp" else 4 * (0 if p == "q" else int(p[1:])) * per[p] for p in set(layout)}
    table, dense_k, dense_v = [], [], []
    for i, p in enumerate(layout):
        # [1, H, bs, D]
        x = [t[i * bs:(i + 1) * bs].transpose(0, 1).unsqueeze(0).contiguous().to(device) for t in (k, v)]
        b = next_id[p]
        next_id[p] += 1 + (p != "hp" and per[p] > 2)
        if p == "hp":
            layer.k_hp[b], layer.v_hp[b] = x[0][0], x[1][0]
            vals = [t[0].float() for t in x]
        else:
            tier = 0 if p == "q" else int(p[1:])
            lt = layer.tier(tier)
            reference.seal_blocks(replace(lt, k_hp=x[0], v_hp=x[1]), torch.tensor([0], device=device),
                                  torch.tensor([b], device=device))
            vals = [dequantize(lt.tensor_format(r), {n: t[b:b + 1] for n, t in lt.planes(r).items()},
                               layer.static_scale(r))[0] for r in ("k", "v")]
        table.append(encode_ref(p, b))
        dense_k.append(vals[0])
        dense_v.append(vals[1])
    return layer, table, torch.cat(dense_k, dim=1), torch.cat(dense_v, dim=1)  # [H, n, D]


LADDER = ("fp8_e4m3", "int4_kivi,int2_kivi")
LAYOUT = ["hp", "q1", "q", "q2", "q1", "q", "q2", "q2", "hp", "hp"]


def test_reference_reads_each_block_in_its_tier(kv):
    layer, table, kk, vv = tiered_layer(*LADDER, kv, LAYOUT)
    n = len(LAYOUT) * layer.block_size - 7  # a partial tail
    q = torch.randn(2, H * GROUP, D, generator=torch.Generator().manual_seed(0)).bfloat16()
    tables = torch.tensor([table, table], dtype=torch.int32)
    lens = torch.tensor([n, n - 40], dtype=torch.int32)
    got = reference.paged_decode(q, layer, tables, lens, D ** -0.5).float()
    for b, m in enumerate(lens.tolist()):
        s = torch.einsum("hgd,hnd->hgn", q[b].float().view(H, GROUP, D), kk[:, :m]) * D ** -0.5
        want = torch.einsum("hgn,hnd->hgd", s.softmax(-1), vv[:, :m]).reshape(H * GROUP, D)
        torch.testing.assert_close(got[b], want, rtol=0, atol=1e-2)
    # the tolerance sees the tiers: the values as written (bf16) give another answer
    k, v = (x[:n].float().transpose(0, 1) for x in kv)
    s = torch.einsum("hgd,hnd->hgn", q[0].float().view(H, GROUP, D), k) * D ** -0.5
    exact = torch.einsum("hgn,hnd->hgd", s.softmax(-1), v).reshape(H * GROUP, D)
    assert (exact - got[0]).abs().max() > 5e-2


#: centred rotated K in the lower tiers and resident: each block's means at its own arena offset
CENTRED = [("fp8_e4m3", "rot4_kc,rot3_kc"), ("rot4_kc", "rot3_kc")]


@pytest.mark.parametrize("ladder", [LADDER, ("bfloat16", "fp8_e4m3"), *CENTRED])
def test_triton_decode_merges_the_tiers(ladder, kv):
    layout = LAYOUT if "," in ladder[1] else ["q", "q1", "q", "q1", "q1", "q"]
    layer, table, _, _ = tiered_layer(*ladder, kv, layout, DEV)
    bs = layer.block_size
    other = [e for e in table if e < 0] + [table[2]]  # a second sequence with no lower tier's block
    W = len(table)
    rows = np.zeros((3, W), np.int32)
    rows[0, :W], rows[1, :len(other)], rows[2, :W] = table, other, table
    lens = [W * bs - 3, len(other) * bs, W * bs - bs]
    step = HostStep(slots=[0, 1, 2], tables=rows, seq_lens=lens, num_new=[1, 1, 1])
    meta, _ = stage_step(step, bs, each_to(DEV))
    assert not meta.prefill_tiers and meta.tiers is not None and len(meta.tiers.tiers) == (2 if "," in ladder[1] else 1)
    q = torch.randn(3, H * GROUP, D, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEV)
    want = reference.paged_decode(q, layer, meta.block_tables, meta.seq_lens, D ** -0.5).float()
    got = triton_decode.paged_decode(q, layer, meta.block_tables, meta.seq_lens, D ** -0.5,
                                     max_seq_len=max(lens), tiers=meta.tiers).float()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)


def test_cuda_decode_reads_a_tiers_view_of_the_arena(kv):
    """The CUDA decode reads a tier's planes where they lie in the arena (blocks further apart than their
    bytes): each 8-bit and KIVI tier qualifies, int2_kivi at head_dim 64 included (16-byte rows)."""
    from kvq.attention.cuda import decode8

    layer, _, _, _ = tiered_layer(*LADDER, kv, LAYOUT)
    for t in (0, 1, 2):
        lt = layer.tier(t)
        assert not lt.k["data"].is_contiguous() and not lt.v["data"].is_contiguous()  # views of the arena
        assert decode8.unsupported_reason(lt, GROUP, torch.bfloat16) is None, t
    bad = layer.tier(1)
    bad = replace(bad, k={**bad.k, "data": bad.k["data"].transpose(2, 3)})  # a block's rows out of order
    assert "not contiguous" in decode8.unsupported_reason(bad, GROUP, torch.bfloat16)


@pytest.mark.parametrize("cuda_splits", [3, 1])
def test_cuda_backend_runs_each_tier_by_its_kernel_into_one_merge(kv, monkeypatch, cuda_splits):
    """The cuda backend's tiered decode (kvq.attention.cuda.kernels), its dispatch checked on the CPU: the
    tiers the CUDA kernel reads go to it with their own split offsets into one set of partials (here a
    stand-in writes them through the Triton kernel), a rotated codebook tier goes to Triton, and the merge
    gives the reference's output.  With several splits a tier, the tiers run in order and a reduce merges
    them; with one, the last CUDA tier runs last and merges every other launch's partials itself."""
    from kvq.attention.cuda import decode8
    from kvq.attention.cuda import kernels as cuda_kernels

    layer, table, _, _ = tiered_layer("fp8_e4m3", "int4_kivi,turboquant_3bit_nc", kv, LAYOUT, DEV)
    bs, W = layer.block_size, len(table)
    lens = [W * bs - 3, W * bs - bs - 5]
    meta, _ = stage_step(HostStep(slots=[0, 1], tables=np.array([table, table], np.int32), seq_lens=lens,
                                  num_new=[1, 1]), bs, each_to(DEV))
    calls = []

    def stand_in(q, lay, tab, ln, scale, max_seq_len=None, has_hp=None, num_splits=None, partials=None,
                 merge_into=None):
        po, plse, base = partials
        calls.append((lay.fmt.k.name, base, num_splits, merge_into is not None))
        part = triton_decode.DecodePart(lay, tab, ln, max_seq_len, has_hp)
        if merge_into is None:
            triton_decode.launch_part(q, part, po, plse, base, scale, num_splits, True)
            return None
        assert num_splits == 1 and base == po.shape[2]  # every other launch's partials are in
        own_o, own_lse = triton_decode.partial_buffers(q, 1)
        triton_decode.launch_part(q, part, own_o, own_lse, 0, scale, 1, True)
        return triton_decode.merge_parts(torch.cat([po, own_o], 2), torch.cat([plse, own_lse], 2), merge_into)

    monkeypatch.setattr(decode8, "splits_for", lambda q, lay, longest, *a: cuda_splits)
    monkeypatch.setattr(decode8, "paged_decode", stand_in)
    monkeypatch.setattr(triton_decode, "part_splits", lambda q, p, *a: 2)
    q = torch.randn(2, H * GROUP, D, generator=torch.Generator().manual_seed(2)).bfloat16().to(DEV)
    want = reference.paged_decode(q, layer, meta.block_tables, meta.seq_lens, D ** -0.5).float()
    got = cuda_kernels.paged_decode(q, layer, meta.block_tables, meta.seq_lens, D ** -0.5, max_seq_len=max(lens),
                                    tiers=meta.tiers).float()
    if cuda_splits == 3:
        assert calls == [("fp8_e4m3", 0, 3, False), ("int4_kivi", 3, 3, False)]
    else:  # int4_kivi last: after fp8_e4m3's split and the rotated tier's two (by Triton)
        assert calls == [("fp8_e4m3", 0, 1, False), ("int4_kivi", 3, 1, True)]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)


def test_cuda_launch_outputs_of_each_write_mode():
    """Where a CUDA decode launch writes (decode8.launch_outputs, the kernel's MODE), on the CPU: a
    non-merging launch before the merging one may be its only partial (fp8_e4m3>int4_kivi at a large batch,
    both tiers by CUDA, one split each; session 42's H100 run stopped on that case's assertion)."""
    from kvq.attention.cuda.decode8 import launch_outputs

    q = torch.zeros(2, 4, 8, dtype=torch.bfloat16)
    po, plse = triton_decode.partial_buffers(q, 1)
    got = launch_outputs(q, 1, (po, plse, 0), None)
    assert got[0] is po and got[1] is plse and got[3:] == (0, 1, 1)  # the only partial before the merge
    into = torch.empty_like(q)
    got = launch_outputs(q, 1, (po, plse, 1), into)
    assert got[2] is into and got[3:] == (1, 1, 2)  # the merging launch after it
    assert launch_outputs(q, 1, None, None)[3:] == (0, 1, 0)  # alone, one split: straight to out
    own = launch_outputs(q, 3, None, None)  # alone, split: its own partials, reduced after
    assert own[0].shape == (2, 4, 3, 8) and own[3:] == (0, 3, 1)
    with pytest.raises(ValueError, match="pass them"):
        launch_outputs(q, 1, None, into)
    with pytest.raises(AssertionError):
        launch_outputs(q, 1, (po, plse, 0), into)  # a merge must come after every other partial


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA decode needs a GPU")
@pytest.mark.parametrize("one_split", [False, True])
# (fp8_e4m3 > int4_kivi: both tiers by CUDA, so the merging launch follows one CUDA launch of one split)
@pytest.mark.parametrize("ladder", [LADDER, ("bfloat16", "fp8_e4m3"), ("fp8_e4m3", "int4_kivi")])
def test_cuda_decode_merges_the_tiers(ladder, kv, one_split, monkeypatch):
    """The cuda backend's decode over a tiered cache: CUDA launches for the tiers it reads (fp8_e4m3,
    int4_kivi, through their arena views), Triton for the others, merged by log-sum-exp = the reference;
    ``one_split`` (a large batch's launch shape): the last CUDA launch merges the others in its epilogue,
    which gives the reduce's output to float rounding."""
    from kvq.attention.cuda import decode8
    from kvq.attention.cuda import kernels as cuda_kernels

    if decode8.unavailable_reason():
        pytest.skip(decode8.unavailable_reason())
    layout = LAYOUT if ladder == LADDER else ["q", "q1", "q", "q1", "q1", "q", "q"]
    layer, table, _, _ = tiered_layer(*ladder, kv, layout, DEV)
    bs = layer.block_size
    W = len(table)
    rows = np.zeros((2, W), np.int32)
    rows[0], rows[1] = table, table
    lens = [W * bs - 3, W * bs - bs - 5]  # (each row ends inside an hp or resident block: lower tiers' are whole)
    meta, _ = stage_step(HostStep(slots=[0, 1], tables=rows, seq_lens=lens, num_new=[1, 1]), bs, each_to(DEV))
    q = torch.randn(2, H * GROUP, D, generator=torch.Generator().manual_seed(2)).bfloat16().to(DEV)
    want = reference.paged_decode(q, layer, meta.block_tables, meta.seq_lens, D ** -0.5).float()
    if one_split:
        merges = []
        run = decode8.paged_decode
        monkeypatch.setattr(decode8, "splits_for", lambda *a, **k: 1)
        monkeypatch.setattr(triton_decode, "part_splits", lambda *a, **k: 1)
        monkeypatch.setattr(decode8, "paged_decode", lambda *a, **k: merges.append(k.get("merge_into") is not None)
                            or run(*a, **k))
        monkeypatch.setattr(triton_decode, "merge_parts", None)  # no reduce launch
    got = cuda_kernels.paged_decode(q, layer, meta.block_tables, meta.seq_lens, D ** -0.5, max_seq_len=max(lens),
                                    tiers=meta.tiers).float()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
    if one_split:
        assert merges[-1] and not any(merges[:-1]), merges
        monkeypatch.undo()
        parts = triton_decode.decode_parts(layer, meta.block_tables, meta.seq_lens, max(lens), None, meta.tiers)
        po, plse = triton_decode.partial_buffers(q, len(parts))
        for i, part in enumerate(parts):  # the same launches, one split each, merged by the reduce
            if decode8.routes(part.layer, GROUP, q.dtype):
                decode8.paged_decode(q, part.layer, part.tables, part.lens, D ** -0.5, max_seq_len=part.longest,
                                     has_hp=part.has_hp, num_splits=1, partials=(po, plse, i))
            else:
                triton_decode.launch_part(q, part, po, plse, i, D ** -0.5, 1, True)
        reduced = triton_decode.merge_parts(po, plse, torch.empty_like(q)).float()
        torch.testing.assert_close(got, reduced, rtol=2 ** -7, atol=1e-3)  # (a bf16 rounding apart)


@pytest.mark.parametrize("ladder", [LADDER, ("bfloat16", "fp8_e4m3")])
def test_graph_inputs_split_by_tier_decode_as_the_reference(ladder, kv):
    """A decode graph over a tiered cache reads static per-tier tables, refilled before each replay
    (kvq.engine.cuda_graphs.DecodeGraphs.stage): rows with and without lower tiers' blocks, a tier absent
    from the step (length 0) and padding rows; the decode over what was staged equals the reference."""
    from kvq.engine.cuda_graphs import DecodeGraphs

    layout = LAYOUT if ladder == LADDER else ["q", "q1", "q", "q1", "q1", "q"]
    pools: list = []
    layer, table, _, _ = tiered_layer(*ladder, kv, layout, DEV, pools=pools)
    bs = layer.block_size
    W = len(table)
    null = pools[0].layout.per_slab[0] * 15  # a resident block of the last slab, which nothing holds
    graphs = DecodeGraphs(None, pools[0], None, torch.device(DEV), max_batch=8, max_model_len=W * bs,
                          null_block=null, has_hp=True)
    assert graphs.num_tiers == len(ladder[1].split(","))
    q = torch.randn(8, H * GROUP, D, generator=torch.Generator().manual_seed(4)).bfloat16().to(DEV)
    plain = [e for e in table if e < 0] + [table[2]]  # no lower tier's block
    for rows in ([table, plain, table], [plain, plain]):  # a step with tiers, then one without
        lens = [len(r) * bs - 3 for r in rows]
        step = HostStep(slots=[0] * len(rows), tables=[list(r) for r in rows], seq_lens=lens, num_new=[1] * len(rows))
        g = graphs.stage([0] * len(rows), [0] * len(rows), step)
        assert g == {3: 4, 2: 2}[len(rows)] and graphs.lens[:len(rows)].tolist() == lens
        meta = graphs._meta(g)
        got = triton_decode.paged_decode(q[:g], layer, meta.block_tables, meta.seq_lens, D ** -0.5,
                                         max_seq_len=W * bs, tiers=meta.tiers).float()[:len(rows)]
        tab = torch.zeros(len(rows), W, dtype=torch.int32)
        for i, r in enumerate(rows):
            tab[i, :len(r)] = torch.tensor(r)
        want = reference.paged_decode(q[:len(rows)], layer, tab.to(DEV), torch.tensor(lens, dtype=torch.int32,
                                      device=DEV), D ** -0.5).float()
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
        assert graphs.part_lens[0][len(rows):g].tolist() == [1] * (g - len(rows))  # padding: the null block
        for t in range(1, graphs.num_tiers + 1):
            assert graphs.part_lens[t][len(rows):g].tolist() == [0] * (g - len(rows))


def test_split_tiers_keeps_order_and_lengths():
    from kvq.cache.pool import TIER_BASE

    t = np.array([[-1, 4, TIER_BASE + 2, 5, 2 * TIER_BASE, -3, 0]], np.int32)
    arrays, present, maxes = split_tiers(t, [6 * 16 - 1], 16)
    assert present == [1, 2]
    assert arrays[0].tolist() == [[-1, 4, 5, -3]] and arrays[1].tolist() == [95 - 32]
    assert arrays[2].tolist() == [[2]] and arrays[3].tolist() == [16]
    assert arrays[4].tolist() == [[0]] and arrays[5].tolist() == [16] and maxes == [63, 16, 16]
    with pytest.raises(ValueError, match="whole"):  # a row that ends inside a lower tier's block
        split_tiers(t, [3 * 16 - 1], 16)
    assert split_tiers(np.array([[-1, 4]], np.int32), [20], 16) is None


def test_a_step_flags_tiers_on_each_side_of_its_rows():
    """Decodes that hold demoted blocks beside a fresh prompt: the decodes split by tier, the prompt keeps
    the prefill's direct path (its table holds none); and the other way round."""
    from kvq.cache.pool import TIER_BASE

    aged = [-1, 4, TIER_BASE + 2, 5]  # a decode row with a block in tier 1
    fresh = [6, 7, 8, 0]  # a prompt of 40 tokens, all of it this step's
    for rows, nd, tiers, prefill in [([aged, fresh], 1, True, False), ([fresh, aged], 1, False, True),
                                     ([aged, aged], 2, True, False), ([fresh, fresh], 1, False, False)]:
        lens = [60 if r is aged else 40 for r in rows]
        new = [1] * nd + [lens[-1]] * (2 - nd)
        step = HostStep(slots=list(range(sum(new))), tables=np.asarray(rows, np.int32), seq_lens=lens, num_new=new)
        meta, _ = stage_step(step, 16, each_to("cpu"))
        assert (meta.tiers is not None, meta.prefill_tiers) == (tiers, prefill), rows


def _prefill(impl):
    """The prefill under test: the Triton kernel, or the library prefill (kvq.attention.split_prefill) over
    the torch library (FlashInfer's calls' definition; FlashInfer itself on a GPU that has it), its calls
    paged or ragged."""
    if impl == "triton":
        return triton_prefill.paged_attention
    from kvq.attention import paged_lib
    from kvq.attention.split_prefill import SplitPrefill

    if "flashinfer" in impl:
        from kvq.attention.flashinfer_lib import FlashInferLib

        lib = FlashInferLib(DEV)
    else:
        lib = paged_lib.TorchLib()
    ragged = impl.endswith("ragged")
    # f16 scratch, as the window tests: the bound below then shows one key read through the wrong tier
    return SplitPrefill(lib, model_dtype_scratch=False, ragged_windowed=ragged, ragged_past=ragged).paged_attention


def _flashinfer_missing() -> bool:
    from kvq.attention import flashinfer_lib

    return not torch.cuda.is_available() or flashinfer_lib.unavailable_reason(torch.device(DEV), D) is not None


PREFILLS = ["triton", "split", "split-ragged"] + ([] if _flashinfer_missing() else
                                                  ["split-flashinfer", "split-flashinfer-ragged"])


@pytest.mark.parametrize("impl", PREFILLS)
@pytest.mark.parametrize("windowed,ladder", [(False, LADDER), (True, LADDER), (False, CENTRED[0]), (True, CENTRED[0]),
                                             (False, ("bfloat16", "fp8_e4m3"))],  # (a bf16 tier reads hp blocks exact)
                         ids=["kivi", "kivi-window", "centred", "centred-window", "bf16"])
def test_prefill_reads_each_page_in_its_tier(windowed, ladder, impl, kv):
    """A chunk of 40 new tokens after a tiered past; with ``windowed`` the block before the chunk is
    still hp, and the chunk's first queries read it exact, its last ones quantized (the per-query
    window rule).  The Triton prefill and the library prefill (FlashInfer's in the engine) both."""
    layout = ["hp", "q1", "q", "q2" if "," in ladder[1] else "q1", "q1", "hp", "hp", "hp"]
    layer, table, _, _ = tiered_layer(*ladder, kv, layout, DEV)
    bs = layer.block_size
    n = len(layout) * bs - 5
    T = 40
    policy = replace(make_plan(bare_model(1, H, D), "fp8_e4m3", sink_tokens=32, residual_tokens=32,
                               tiers="int4_kivi").window_policy, block_size=bs, write_direct=False)
    rows = np.asarray([table], np.int32)
    step = HostStep(slots=list(range(T)), tables=rows, seq_lens=[n], num_new=[T])
    meta, _ = stage_step(step, bs, each_to(DEV), policy=policy if windowed else None)
    assert meta.prefill_tiers and meta.tiers is None  # no decode rows: the prefill reads the tags
    if windowed:
        assert meta.window is not None and meta.window.sealed_rows  # hp block 5 is read quantized by some
    g = torch.Generator().manual_seed(2)
    q = torch.randn(T, H * GROUP, D, generator=g).bfloat16().to(DEV)
    k_new, v_new = (torch.randn(T, H, D, generator=g).bfloat16().to(DEV) for _ in range(2))
    win = dict(window=meta.window, k_new=k_new, v_new=v_new) if windowed else {}
    args = (q, layer, meta.cu_seqlens_q, meta.block_tables, meta.seq_lens, D ** -0.5)
    want = reference.paged_attention(*args, **win).float()
    got = _prefill(impl)(*args, max_q_len=T, max_seq_len=n, host=meta.prefill_host, tiered=True, **win).float()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
