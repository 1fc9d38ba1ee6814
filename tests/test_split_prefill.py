"""The library prefill (kvq.attention.split_prefill, issue 43) against the definitions.

* the library contract (kvq.attention.paged_lib): causal attention aligned at the bottom right,
  base-2 log-sum-exp, rows without keys; the torch definition against a per-row computation, and
  on a GPU with FlashInfer its FA3/FA2 paged prefill against the torch definition;
* the three ways a layer's prefill goes (module docstring of split_prefill): a 16-bit pool read in
  place, pages dequantized into a scratch, and the per-query window split into a library bulk and
  the Triton band (tests/test_prefill_window.py runs the window cases with backend "split");
* the choice of prefill kernel is explicit: a named one that cannot serve raises.

On the CPU the library is the torch definition and the Triton kernels run under the interpreter.
"""

import pytest
import torch

from kvq.attention import paged_lib
from kvq.attention.backends import PREFILL_NAMES, BackendChoice, prefill_kernels, select_prefill, with_prefill
from kvq.attention.split_prefill import SplitPrefill
from kvq.cache.plan import bare_model, make_plan
from tests.paged_harness import dense_attention, expected_kv, make_harness, step

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _flashinfer_reason():
    if not GPU:
        return "needs a GPU"
    from kvq.attention.flashinfer_lib import unavailable_reason

    return unavailable_reason(DEV, 128)


def lib(name):
    if name == "torch":
        return paged_lib.TorchLib()
    from kvq.attention.flashinfer_lib import FlashInferLib

    return FlashInferLib(DEV)


LIBS = ["torch", pytest.param("flashinfer", marks=pytest.mark.skipif(
    bool(_flashinfer_reason()), reason=str(_flashinfer_reason())))]


def split_kernels(lib_name, model_dtype_scratch=False, ragged_windowed=False, band_gqa=None, ragged_past=True):
    """The library prefill as the kernels' prefill (windowed prompts through the paged calls unless
    ``ragged_windowed``: split_prefill.RAGGED_WINDOWED's other side; with it, chunks with a past too unless
    not ``ragged_past``).  Quantized pages dequantize into f16 here, not the
    default's bf16 (MODEL_DTYPE_SCRATCH): the window and chunk tests bound the error against the
    definition tighter than bf16's 8 significant bits allow, so that one key read from the wrong tier
    shows; the bf16 scratch has its own test (test_model_dtype_scratch_reads_queries_in_place)."""
    from kvq.attention.triton import kernels

    return with_prefill(kernels, SplitPrefill(lib(lib_name), model_dtype_scratch=model_dtype_scratch,
                                              ragged_windowed=ragged_windowed, band_gqa=band_gqa,
                                              ragged_past=ragged_past).paged_attention)


def _per_row(q, k, v, qo, lens, sm, window_left=-1):
    """Each request's rows one at a time: (out float32, lse base 2); ``window_left`` >= 0: only each
    row's last ``window_left + 1`` keys."""
    T, Hq, D = q.shape
    group = Hq // k[0].shape[0]
    out, lse = torch.zeros(T, Hq, D), torch.full((T, Hq), float("-inf"))
    for r, (q0, q1) in enumerate(zip(qo, qo[1:])):
        t, L = q1 - q0, lens[r]
        kk, vv = k[r].repeat_interleave(group, 0).float(), v[r].repeat_interleave(group, 0).float()  # [Hq, L, D]
        for i in range(t):
            n_seen = i + L - t + 1
            if n_seen <= 0:
                continue
            first = max(0, n_seen - 1 - window_left) if window_left >= 0 else 0
            s = torch.einsum("hd,hjd->hj", q[q0 + i].float(), kk[:, first:n_seen]) * sm
            out[q0 + i] = torch.einsum("hj,hjd->hd", s.softmax(-1), vv[:, first:n_seen])
            lse[q0 + i] = torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0))
    return out, lse


@pytest.mark.parametrize("window_left", [-1, 0, 5, 40])
@pytest.mark.parametrize("name", LIBS)
def test_library_contract(name, window_left):
    """Requests with as many keys as rows, more (a past), fewer (an offset: early rows see none),
    pages scattered, a last page partly used; every causal key, or a sliding window of each row's
    last ``window_left + 1`` keys (what a windowed prefill's exact tail asks)."""
    gen = torch.Generator().manual_seed(0)
    H, group, D, P = 2, 4, 128, 16
    dt = torch.bfloat16 if name == "flashinfer" else torch.float32
    qo_lens, kv_lens = [20, 7, 33], [20, 50, 9]
    pages = torch.randn(40, H, P, D, generator=gen).to(dt)
    vpages = torch.randn(40, H, P, D, generator=gen).to(dt)
    table = torch.randperm(40, generator=gen).to(torch.int32).view(4, 10)
    plan = paged_lib.make_plan(qo_lens, kv_lens, [1, 0, 2], table.to(DEV), P, window_left)
    q = torch.randn(sum(qo_lens), H * group, D, generator=gen).to(dt)
    sm = D ** -0.5
    lb = lib(name)
    lb.new_step()
    o, lse = lb.run(lb.prepare(plan, H * group, H, D, dt, sm), q.to(DEV), pages.to(DEV), vpages.to(DEV))
    ks = [pages[table[r, f:f + 10].long()].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :L]
          for r, (f, L) in enumerate(zip([1, 0, 2], kv_lens))]
    vs = [vpages[table[r, f:f + 10].long()].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :L]
          for r, (f, L) in enumerate(zip([1, 0, 2], kv_lens))]
    want_o, want_lse = _per_row(q, ks, vs, list(plan.qo_indptr), kv_lens, sm, window_left)
    tol = 2e-2 if name == "flashinfer" else 1e-5
    assert torch.allclose(o.float().cpu(), want_o, atol=tol, rtol=tol)
    seen = torch.isfinite(want_lse)
    assert (~seen).any() and torch.equal(torch.isfinite(lse.cpu()), seen)  # rows 0..23 of request 2 see no key
    assert torch.allclose(lse.cpu()[seen], want_lse[seen], atol=tol * 10, rtol=tol)


def test_a_request_without_keys_reads_one_dummy_key():
    plan = paged_lib.make_plan([3, 4], [0, 17], [0, 0], torch.arange(4, dtype=torch.int32).view(2, 2), 16)
    assert plan.kv_lens == (1, 17) and plan.kv_indptr == (0, 1, 3) and plan.last_page_len == (1, 1)
    assert plan.page_indices.tolist() == [0, 2, 3]


class _Event:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_recycler_reuses_only_what_the_device_has_finished():
    """Under async scheduling the host plans step N+1 before step N ran: a wrapper of a step whose
    event the device has not passed is never handed out again (its pinned plan buffer is still to
    be copied); once passed, it is reused and the pool stops growing."""
    from kvq.attention.flashinfer_lib import Recycler

    made = []
    r = Recycler()

    def make():
        made.append(object())
        return made[-1]

    a, b = r.take(make), r.take(make)
    e1 = _Event()
    r.end_step(e1)
    c = r.take(make)  # step 1 still running: a new object
    assert c not in (a, b) and r.size == 3
    e2 = _Event()
    r.end_step(e2)
    e1.done = True
    d, e = r.take(make), r.take(make)  # step 1 done: its two come back, step 2's stays out
    assert {d, e} == {a, b} and len(made) == 3
    r.end_step(_Event())  # d and e in flight again, c still: a fourth object
    r.take(make)
    assert len(made) == 4
    e2.done = True
    assert r.take(make) is c
    r.end_step(_Event())  # a step with nothing used leaves nothing pending
    r.end_step(_Event())
    assert r.size == len(made)


@pytest.mark.skipif(_flashinfer_reason() is not None, reason=str(_flashinfer_reason()))
def test_flashinfer_plans_of_a_step_in_flight_are_kept():
    """The host plans the next step while the device is still behind (a sleep queued first): the
    first step's result is still the first step's (FlashInfer's plan copies its schedule from a
    pinned buffer that a second plan on the same wrapper would overwrite)."""
    gen = torch.Generator().manual_seed(1)
    H, group, D, P = 2, 4, 128, 16
    pages = torch.randn(64, H, P, D, generator=gen).to(torch.bfloat16).to(DEV)
    vpages = torch.randn(64, H, P, D, generator=gen).to(torch.bfloat16).to(DEV)
    table = torch.randperm(64, generator=gen).to(torch.int32).view(4, 16).to(DEV)
    lb, sm = lib("flashinfer"), D ** -0.5
    layouts = [([40, 5, 70], [200, 60, 70]), ([3], [250])]
    qs = [torch.randn(sum(qo), H * group, D, generator=gen).to(torch.bfloat16).to(DEV) for qo, _ in layouts]
    plans = [paged_lib.make_plan(qo, kv, [0] * len(qo), table, P) for qo, kv in layouts]
    outs = []
    torch.cuda._sleep(200_000_000)  # the device falls behind the host
    for plan, q in zip(plans, qs):
        lb.new_step()
        outs.append(lb.run(lb.prepare(plan, H * group, H, D, torch.bfloat16, sm), q, pages, vpages)[0])
    torch.cuda.synchronize()
    for plan, q, o in zip(plans, qs, outs):
        want, _ = paged_lib.torch_attention(q, pages, vpages, plan, sm)
        assert torch.allclose(o.float(), want.float(), atol=2e-2, rtol=2e-2)


def _step_errors(h, gen, steps=({"a": 37, "b": 70}, {"a": 45, "c": 20})) -> list[float]:
    """Two prefill steps (new prompts, then a chunk of one beside a new one): each sequence's relative
    error against the dense definition over what the cache holds."""
    errs = []
    for new in steps:
        q, meta, out = step(h, new, gen, torch.bfloat16)
        cu = meta.cu_seqlens_q.tolist()
        for b, sid in enumerate(new):
            exp = dense_attention(q[cu[b]:cu[b + 1]].cpu(), expected_kv(h, sid, "k"), expected_kv(h, sid, "v"),
                                  h.group)
            errs.append(((out[cu[b]:cu[b + 1]].float().cpu() - exp).norm() / exp.norm()).item())
    return errs


CASES = [("bfloat16", {}), ("fp8_e4m3", {}), ("fp8_e4m3", dict(sink=4, residual=40)),
         ("int8_per_token_head", {}), ("int4_kivi", dict(sink=0, residual=0)), ("int2_kivi/fp8_e4m3", {})]


@pytest.mark.parametrize("name", LIBS)
@pytest.mark.parametrize("fmt,win", CASES, ids=[f"{f}-{'w' if w else 'none'}" for f, w in CASES])
def test_split_prefill_reads_the_cache_as_stored(fmt, win, name):
    """No per-query window in the step: every key as stored, through the pool itself (16-bit pages,
    no hp block) or the page scratch (quantized pages, or hp blocks beside q blocks)."""
    gen = torch.Generator().manual_seed(1)
    h = make_harness(fmt, split_kernels(name), device=DEV, **win)
    seen_hp = False
    for new in ({"a": 37, "b": 70}, {"a": 45, "c": 20}):
        q, meta, out = step(h, new, gen, torch.bfloat16)
        seen_hp |= meta.has_hp
        cu = meta.cu_seqlens_q.tolist()
        for b, sid in enumerate(new):
            exp = dense_attention(q[cu[b]:cu[b + 1]].cpu(), expected_kv(h, sid, "k"), expected_kv(h, sid, "v"),
                                  h.group)
            got = out[cu[b]:cu[b + 1]].float().cpu()
            err = ((got - exp).norm() / exp.norm()).item()
            assert err < 1e-2, (fmt, sid, err)
    assert seen_hp == bool(win) or "kivi" in fmt


@pytest.mark.parametrize("name", LIBS)
@pytest.mark.parametrize("fmt,win", [("fp8_e4m3", {}), ("int4_kivi", dict(sink=4, residual=40))],
                         ids=["fp8_e4m3", "int4_kivi-window"])
def test_model_dtype_scratch_reads_queries_in_place(fmt, win, name, monkeypatch):
    """``model_dtype_scratch``: quantized pages dequantized into the queries' bf16, the library reading
    the queries and writing the output without a cast (no f16 tensor appears), the same bound on the
    error against the dense definition as the f16 scratch's rows above."""
    from kvq.attention.triton import kernels

    gen = torch.Generator().manual_seed(4)
    split = SplitPrefill(lib(name), model_dtype_scratch=True)
    h = make_harness(fmt, with_prefill(kernels, split.paged_attention), device=DEV, **win)
    seen = []
    for call in ("run", "run_ragged"):  # the paged calls, and the ragged calls over rows (split_prefill.RAGGED_PAST)
        real = getattr(split.lib, call)
        monkeypatch.setattr(split.lib, call, lambda handle, q, k, v, out=None, real=real: (
            seen.append((q.dtype, k.dtype, out.dtype if out is not None else None)), real(handle, q, k, v, out=out))[1])
    errs = _step_errors(h, gen)
    assert max(errs) < 1e-2, (fmt, errs)
    assert seen and all(d in (torch.bfloat16, None) for call in seen for d in call), seen


@pytest.mark.parametrize("name", LIBS)
def test_a_16_bit_layer_with_hp_blocks_goes_through_an_exact_copy(name):
    """A bf16 layer of a plan with windows holds hp blocks beside its pool's (kvq reads both through
    one signed table): its pages are copied into a bf16 scratch, exactly, and read there."""
    gen = torch.Generator().manual_seed(2)
    kernels = split_kernels(name)
    h = make_harness("bfloat16", kernels, device=DEV)
    q, meta, direct = step(h, {"a": 70, "b": 33}, gen, torch.bfloat16)
    assert not meta.has_hp
    via_copy = kernels.paged_attention(q, h.layer, meta.cu_seqlens_q, meta.block_tables, meta.seq_lens,
                                       h.layer.head_dim ** -0.5, has_hp=True)
    assert torch.equal(via_copy, direct)


@pytest.mark.parametrize("name", LIBS)
@pytest.mark.parametrize("fmt", ["bfloat16", "fp8_e4m3", "int8_per_token_head", "int4_kivi"])
def test_fresh_prompts_read_their_keys_in_the_rows_of_their_queries(name, fmt, monkeypatch):
    """A step whose requests are all fresh prompts (no cached past) goes through the library's ragged
    call: a 16-bit layer over the K/V it computed (kvq.models.llama.attend passes them), which the pool
    holds bit for bit, a quantized one over its pages dequantized into the rows of their queries
    (``dequant.dequantize_rows``).  With ``ragged_past`` (split_prefill.RAGGED_PAST) a step with a past
    goes through the ragged call too, each request's keys copied or dequantized into rows.  The output
    is the paged calls' (bit for bit through the torch library)."""
    gen = torch.Generator().manual_seed(5)
    from kvq.attention.triton import kernels as triton_kernels

    split = SplitPrefill(lib(name), ragged_past=True)
    paged_split = SplitPrefill(lib(name), ragged_fresh=False, ragged_past=False)
    kernels = with_prefill(triton_kernels, split.paged_attention)
    h = make_harness(fmt, kernels, device=DEV, **({} if fmt != "int4_kivi" else dict(sink=0, residual=0)))
    calls = []
    real = split.lib.run_ragged
    monkeypatch.setattr(split.lib, "run_ragged", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    sm = h.layer.head_dim ** -0.5
    for new in ({"a": 70, "b": 33}, {"a": 20, "c": 16}):  # fresh prompts, then a step where "a" has a past
        q, meta, _ = step(h, new, gen, torch.bfloat16)
        calls.clear()
        k = torch.cat([h.exact_k[s][-n:] for s, n in new.items()])
        v = torch.cat([h.exact_v[s][-n:] for s, n in new.items()])
        args = (q, h.layer, meta.cu_seqlens_q, meta.block_tables, meta.seq_lens, sm)
        kw = dict(max_q_len=meta.max_q_len, has_hp=meta.has_hp, k_new=k, v_new=v)
        got = kernels.paged_attention(*args, **kw)
        paged = paged_split.paged_attention(*args, **kw)
        assert len(calls) == 1
        if name == "torch":
            assert torch.equal(got, paged)
        else:
            assert torch.allclose(got.float(), paged.float(), atol=2e-2, rtol=2e-2)
        cu = meta.cu_seqlens_q.tolist()
        for b, sid in enumerate(new):
            exp = dense_attention(q[cu[b]:cu[b + 1]].cpu(), expected_kv(h, sid, "k"), expected_kv(h, sid, "v"),
                                  h.group)
            assert ((got[cu[b]:cu[b + 1]].float().cpu() - exp).norm() / exp.norm()).item() < 1e-2
        calls.clear()


def test_prefill_choice_is_explicit():
    plan = make_plan(bare_model(2, 2, 64, num_attention_heads=4), "int4_kivi")
    torch_choice = BackendChoice("auto", "torch", "x")
    assert select_prefill("auto", torch_choice, plan, "cpu").prefill == "torch"
    with pytest.raises(ValueError, match="'flashinfer'.*torch attention backend runs its own"):
        select_prefill("flashinfer", torch_choice, plan, "cpu")
    with pytest.raises(ValueError, match="'flashinfer'.*needs a CUDA device"):
        select_prefill("flashinfer", BackendChoice("triton", "triton", "x"), plan, "cpu")
    with pytest.raises(ValueError, match="attention backend 'torch'"):
        select_prefill("triton", torch_choice, plan, "cpu")
    with pytest.raises(ValueError, match=", ".join(PREFILL_NAMES)):
        select_prefill("fa3", torch_choice, plan, "cpu")
    tri = BackendChoice("auto", "triton", "x")
    assert select_prefill("triton", tri, plan, "cpu").prefill == "triton"
    module = object()
    assert prefill_kernels(module, select_prefill("auto", torch_choice, plan, "cpu"), "cpu") is module


def test_fp8_prefill_is_an_explicit_opt_in():
    """``--prefill-backend flashinfer-fp8`` serves only where FA3 runs and some layer is fp8_e4m3 read as
    stored (no window in high precision); otherwise it says why."""
    from kvq.attention.backends import _fp8_prefill_reason

    model = bare_model(2, 2, 64, num_attention_heads=4)
    tri = BackendChoice("triton", "triton", "x")
    with pytest.raises(ValueError, match="'flashinfer-fp8'.*needs a CUDA device"):
        select_prefill("flashinfer-fp8", tri, make_plan(model, "fp8_e4m3"), "cpu")
    assert "no layer is fp8_e4m3" in _fp8_prefill_reason(make_plan(model, "int8"))
    assert "no layer is fp8_e4m3" in _fp8_prefill_reason(make_plan(model, "turboquant_k8v4"))  # V is rotated
    assert "set both windows to 0" in _fp8_prefill_reason(make_plan(model, "fp8_e4m3", sink_tokens=4,
                                                                     residual_tokens=32))
    assert _fp8_prefill_reason(make_plan(model, "fp8_e4m3")) is None
    assert "tiered cache" in _fp8_prefill_reason(make_plan(model, "fp8_e4m3", tiers="int4_kivi"))


@pytest.mark.parametrize("name", LIBS)
def test_fp8_prefill_reads_the_e4m3_codes_in_place(name, monkeypatch):
    """``fp8=True``: an fp8_e4m3 layer read as stored goes to the library's FP8 call with the pool's e4m3
    pages and per-head static scales, the queries cast to e4m3; the output stays within e4m3 queries'
    precision (FlashInfer: and e4m3 probabilities') of the dense definition over what the cache holds."""
    from kvq.attention.triton import kernels as triton_kernels

    gen = torch.Generator().manual_seed(6)
    split = SplitPrefill(lib(name), fp8=True)
    h = make_harness("fp8_e4m3", with_prefill(triton_kernels, split.paged_attention), device=DEV)
    h.layer.k_scale.copy_(torch.tensor([0.02, 0.05]))  # static scales the reads must apply
    h.layer.v_scale.copy_(torch.tensor([0.01, 0.03]))
    seen = []
    real = split.lib.run_fp8
    monkeypatch.setattr(split.lib, "run_fp8", lambda handle, q, k, v, *a, **kw: (
        seen.append((q.dtype, k.dtype, v.dtype)), real(handle, q, k, v, *a, **kw))[1])
    worst = max(_step_errors(h, gen))
    assert seen and all(d == torch.float8_e4m3fn for call in seen for d in call), seen
    assert 0 < worst < 5e-2, worst  # e4m3 queries (3 mantissa bits) cost more than bf16's 1e-2, not more


def test_engine_reports_its_prefill_kernel():
    from kvq.engine.config import EngineConfig

    with pytest.raises(ValueError, match="unknown prefill backend"):
        EngineConfig(prefill_backend="fa3")


def test_bench_prefill_smoke(tmp_path, monkeypatch):
    """benchmarks/bench_prefill.py end to end on tiny shapes (the torch library on the CPU): one row per
    (impl, format, shape) with the fields the issue names.  --profile's breakdowns average one profiled
    call instead of 3 (torch.profiler) and 5 (cProfile): the same code, the triton rows' interpreter
    under cProfile was most of the test's time."""
    import json

    from benchmarks import bench_prefill
    from benchmarks.bench_prefill import main

    kernel_breakdown, host_breakdown = bench_prefill.kernel_breakdown, bench_prefill.host_breakdown
    monkeypatch.setattr(bench_prefill, "kernel_breakdown", lambda fn, device: kernel_breakdown(fn, device, calls=1))
    monkeypatch.setattr(bench_prefill, "host_breakdown", lambda fn: host_breakdown(fn, calls=1))
    out = tmp_path / "bp.json"
    assert main(["--smoke", "--formats", "bfloat16,int4_kivi,fp8_e4m3", "--profile", "--paged-fresh", "--fp8",
                 "--paged-windowed", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert not doc["errors"], doc["errors"]
    rows = doc["rows"]
    # a variant's rows only for the formats whose path it changes (the others would repeat the default's)
    changes = {"kvq-split-torch-paged-fresh": {"bfloat16"}, "kvq-split-torch-fp8": {"fp8_e4m3"},
               "kvq-split-torch-paged-windowed": {"int4_kivi"}}
    assert {(r["impl"], r["format"], r["B"], r["past"], r["chunk"]) for r in rows} == {
        (i, f, *s) for i in ("kvq-triton", "kvq-split-torch", *changes)
        for f in ("bfloat16", "int4_kivi", "fp8_e4m3") if f in changes.get(i, {f})
        for s in ((2, 0, 48), (1, 40, 24))}
    from benchmarks.bench_prefill import VARIANTS

    for kwargs, _, _ in VARIANTS.values():  # every variant's arguments are the split's (the others ran above)
        SplitPrefill(paged_lib.TorchLib(), **kwargs)
    for r in rows:
        assert r["us"] > 0 and r["tflops"] > 0 and r["x_kvq_bf16"] > 0
        assert r["kernels_us"] and all(t > 0 for t in r["kernels_us"].values())  # --profile: where the time goes
        assert r["host_top_us"] and max(r["host_top_us"].values()) > 0


def test_bench_prefill_appends_a_record_in_parts(tmp_path):
    """``--append`` keeps the rows of an earlier part (a record too long for one device call, in parts):
    both parts' shapes in the rows, each part's machine under 'parts'; without it a run starts afresh."""
    import json

    from benchmarks.bench_prefill import main

    out = tmp_path / "bp.json"
    common = ["--smoke", "--formats", "bfloat16", "--no-triton", "--no-anchors", "--out", str(out)]
    assert main([*common, "--shapes", "2x0+48"]) == 0
    assert main([*common, "--shapes", "1x40+24", "--append"]) == 0
    doc = json.loads(out.read_text())
    assert {(r["B"], r["past"], r["chunk"]) for r in doc["rows"]} == {(2, 0, 48), (1, 40, 24)}
    assert len(doc["parts"]) == 2 and all("commit" in p for p in doc["parts"])
    assert main([*common, "--shapes", "1x40+24"]) == 0
    assert {(r["B"], r["past"], r["chunk"]) for r in json.loads(out.read_text())["rows"]} == {(1, 40, 24)}
