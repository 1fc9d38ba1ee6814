#!/usr/bin/env python3
"""Prefill attention per KV format beside the library kernels, in one run (issue 43).

For each shape ``B x past + chunk`` (B sequences, ``past`` tokens already cached, ``chunk`` new
tokens each, causal) and Llama-3-8B heads (32 query, 8 KV heads, head_dim 128, bf16):

* kvq, per format with its default windows (KIVI: 4 sink and 128 recent tokens in bf16), the
  cache filled through the block manager (the past prefilled first, as the engine would), timed
  through the engine's own attention call (kvq.models.llama.attend):
  ``kvq-triton`` (the Triton prefill) and ``kvq-flashinfer`` (kvq.attention.split_prefill over
  FlashInfer's FA3; quantized pools through the page scratch and, windowed, the Triton band);
* anchors on the same bf16 pages and tables (HND): FlashInfer 0.7.0's paged prefill with its
  ``fa2`` and ``fa3`` backends; with no past only, over dense K/V as a user would call them on a
  prompt: torch SDPA with the cuDNN backend (K/V repeated to every query head, and ``-gqa`` with
  the kernel's own grouping) and FlashInfer's ragged prefill (``fa3``; ``cudnn`` where the cuDNN
  Python frontend is installed).

Rows (``docs/results/bench_prefill_h200.json``): impl, format, B, past, chunk, us (median of
``--iters`` calls, L2 flushed before each, CUDA events), tflops (4 B Hq D (chunk past + chunk^2/2)
per call), and for kvq rows ``x_best_library`` (us over the fastest anchor's at the shape) and
``x_kvq_bf16`` (us over the same impl's bf16 row).

    python benchmarks/bench_prefill.py                       # the issue's shapes and formats (H200)
    python benchmarks/bench_prefill.py --smoke               # tiny shapes, torch library (any device)
    python benchmarks/bench_prefill.py --f16-scratch         # also kvq rows with the scratch in f16 (q, output cast)
    python benchmarks/bench_prefill.py --paged-windowed      # also kvq rows: windowed fresh prompts, paged calls
    python benchmarks/bench_prefill.py --band-unpacked       # also kvq rows: the band's query heads one a program
    python benchmarks/bench_prefill.py --paged-fresh         # also kvq rows with fresh prompts through the pool
    python benchmarks/bench_prefill.py --fp8                 # also fp8_e4m3 rows through FA3's FP8 tensor cores
    (each variant's rows only for the formats whose path it changes; --no-triton leaves the fallback out)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(REPO / ".flashinfer"))
os.environ.setdefault("FLASHINFER_NO_DOWNLOAD", "1")
os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")

import torch  # noqa: E402

from benchmarks.bench_decode import Results, Timer, err_str, log, pkg_version  # noqa: E402
from benchmarks.bench_engine import tree_commit  # noqa: E402
from kvq.formats.registry import resolve_kv  # noqa: E402

SHAPES = "8x0+1024,4x0+4096,1x0+8192,1x7168+1024,1x0+32768,1x0+131072,1x122880+8192"
FORMATS = "bfloat16,fp8_e4m3,int8_per_token_head,int4_kivi,int2_kivi"


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for s in text.split(","):
        b, rest = s.split("x")
        past, chunk = rest.split("+")
        out.append((int(b), int(past), int(chunk)))
    return out


def flops(B: int, Hq: int, D: int, past: int, chunk: int) -> float:
    return 4.0 * B * Hq * D * (chunk * past + chunk * chunk / 2)


def _quantized(fmt: str) -> bool:
    from kvq.formats.registry import resolve_kv

    return resolve_kv(fmt).is_quantized


def _windowed(fmt: str) -> bool:
    from kvq.formats.registry import default_window, resolve_kv

    f = resolve_kv(fmt)
    return f.is_quantized and default_window(f)[1] > 0


#: The split's variants beside its defaults: impl suffix (and command-line flag) -> (SplitPrefill
#: arguments, what the rows show, the formats whose path they change: the others would repeat the
#: default's rows).
VARIANTS = {
    "f16-scratch": (dict(model_dtype_scratch=False), "quantized pages dequantized into f16, the queries and the "
                    "output cast (the default dequantizes into the queries' dtype: split_prefill.MODEL_DTYPE_SCRATCH)",
                    _quantized),
    "paged-fresh": (dict(ragged_fresh=False), "16-bit layers' fresh prompts through the library's paged call over "
                    "the pool instead of its ragged call over the new K/V (split_prefill.RAGGED_FRESH)",
                    lambda fmt: not _quantized(fmt)),
    "paged-past": (dict(ragged_past=False), "requests with a cached past through the library's paged call over the "
                   "pool or the page scratch instead of its ragged call over their keys copied (or dequantized) into "
                   "rows (split_prefill.RAGGED_PAST)", lambda fmt: True),
    "paged-windowed": (dict(ragged_windowed=False), "windowed fresh prompts' bulk and exact tail through the "
                       "library's paged call over the page scratch instead of its ragged call over the keys copied "
                       "into rows (split_prefill.RAGGED_WINDOWED)", _windowed),
    "band-unpacked": (dict(band_gqa=False), "the windowed band kernel with a program per query head instead of "
                      "each KV head's query heads packed into its rows (kvq.attention.triton.band.PACK_GQA)",
                      _windowed),
    "fp8": (dict(fp8=True), "fp8_e4m3 read as stored through FA3's FP8 tensor cores (--prefill-backend "
            "flashinfer-fp8)", lambda fmt: fmt == "fp8_e4m3"),
}


def variant_of(impl: str) -> str | None:
    """The :data:`VARIANTS` name of a kvq impl's rows, or None for a default impl."""
    return next((name for name in VARIANTS if impl.endswith("-" + name)), None)


def kvq_impls(device, smoke: bool, variants=(), no_triton: bool = False) -> dict:
    """impl name -> the kernels the engine would run (kvq.attention.backends.with_prefill); ``variants``:
    names of :data:`VARIANTS` to add; ``no_triton``: without the Triton prefill's rows."""
    from kvq.attention.backends import with_prefill
    from kvq.attention.split_prefill import SplitPrefill
    from kvq.attention.triton import kernels

    impls = {"kvq-triton": kernels}
    if smoke:
        from kvq.attention.paged_lib import TorchLib

        make_lib, prefix = TorchLib, "kvq-split-torch"
    else:
        from kvq.attention.flashinfer_lib import FlashInferLib, unavailable_reason

        why = unavailable_reason(device, 128)
        if why is not None:
            log(f"kvq-flashinfer: {why}")
            return impls
        lib = FlashInferLib(device)
        make_lib, prefix = (lambda: lib), f"kvq-flashinfer-{lib.backend}"
    impls[prefix] = with_prefill(kernels, SplitPrefill(make_lib()).paged_attention)
    for name in variants:
        if name == "fp8" and not smoke and prefix != "kvq-flashinfer-fa3":
            continue  # FA3's FP8 kernel only
        impls[f"{prefix}-{name}"] = with_prefill(kernels,
                                                 SplitPrefill(make_lib(), **VARIANTS[name][0]).paged_attention)
    if no_triton:
        del impls["kvq-triton"]
    return impls


def fill(fmt: str, kernels, B: int, past: int, chunk: int, H: int, D: int, group: int, device, gen):
    """A cache of ``B`` sequences holding ``past`` tokens, then a step writing ``chunk`` more: ->
    (harness, step metadata, q, k, v) for kvq.models.llama.attend."""
    from paged_harness import kv_data, make_harness, schedule

    from kvq.cache.step import apply_ops, each_to, host_step, stage_step

    bs = math.lcm(16, resolve_kv(fmt).min_block_size())
    nblk = B * -(-(past + chunk) // bs) + 8
    h = make_harness(fmt, kernels, H=H, D=D, group=group, num_q=nblk, num_hp=nblk, device=device)
    layer, pol = h.layer, h.plan.window_policy
    sids = list(range(B))
    for n in ([past] if past else []) + [chunk]:
        apply_ops(h.pool, kernels, schedule(h.manager, dict.fromkeys(sids, n)))
        meta, _ = stage_step(host_step(h.manager, sids, [n] * B), h.plan.block_size, each_to(device), policy=pol)
        k, v = (torch.cat(x) for x in zip(*(kv_data(gen, n, H, D, device) for _ in sids)))
        kernels.write_kv(layer, k, v, meta.slots, meta.full_blocks)
    q = torch.randn(k.shape[0], H * group, D, generator=gen).to(device, torch.bfloat16)
    return h, meta, q, k, v


def kernel_breakdown(fn, device, calls: int = 3, top: int = 8) -> dict[str, float]:
    """Microseconds a call in each of the ``top`` costliest kernels of ``fn`` (torch.profiler; on the
    CPU, operators): where a format's time over bf16 goes (the page scratch, casts, library calls)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        t = e.self_device_time_total if cuda else e.self_cpu_time_total
        if t > 0:
            key = e.key[:120]  # (kernels whose names differ only past that, e.g. two library calls, add up)
            times[key] = round(times.get(key, 0.0) + t / calls, 1)
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:top])


def host_breakdown(fn, calls: int = 5, top: int = 12) -> dict[str, float]:
    """Microseconds of host time a call in each of the ``top`` costliest Python functions of ``fn`` (their own
    time, cProfile; on a GPU the kernels run asynchronously, so this is what enqueueing them costs)."""
    import cProfile
    import pstats

    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats
    times = {f"{Path(f).name}:{line}({name})": tt * 1e6 / calls for (f, line, name), (_, _, tt, _, _) in stats.items()}
    return {k: round(v, 1) for k, v in sorted(times.items(), key=lambda kv: -kv[1])[:top]}


def anchors(h, meta, q, B, past, chunk, device, timer, iters, res, shape_row, sm):
    """FlashInfer fa2/fa3 over the bf16 pool kvq filled, and SDPA cuDNN over dense K/V (no past)."""
    layer = h.layer
    H, P, D, Hq = layer.num_kv_heads, layer.block_size, layer.head_dim, q.shape[1]
    try:
        import flashinfer

        from kvq.attention.paged_lib import make_plan

        lens = [past + chunk] * B
        plan = make_plan([chunk] * B, lens, [0] * B, meta.block_tables, P)
        ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        i32 = dict(dtype=torch.int32)
        for backend in ("fa2", "fa3"):
            try:
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="HND", backend=backend)
                w.plan(torch.tensor(plan.qo_indptr, **i32), torch.tensor(plan.kv_indptr, **i32), plan.page_indices,
                       torch.tensor(plan.last_page_len, **i32), Hq, H, D, P, causal=True, sm_scale=sm,
                       q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                t = timer(lambda: w.run(q, (layer.k["data"], layer.v["data"])), iters, 3)
                res.add("rows", dict(shape_row, impl=f"flashinfer-{backend}", **t))
            except Exception as e:
                res.add("errors", dict(shape_row, impl=f"flashinfer-{backend}", error=err_str(e)))
    except Exception as e:
        res.add("errors", dict(shape_row, impl="flashinfer", error=err_str(e)))
    if past:
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tab = meta.block_tables.long()
    k4 = layer.k["data"][tab].permute(0, 2, 1, 3, 4).reshape(B, H, -1, D)[:, :, :chunk].contiguous()  # [B, H, T, D]
    v4 = layer.v["data"][tab].permute(0, 2, 1, 3, 4).reshape(B, H, -1, D)[:, :, :chunk].contiguous()
    qd = q.view(B, chunk, Hq, D).transpose(1, 2).contiguous()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # dense K/V repeated to every query head (a user's call on a prompt), and with GQA in the kernel
    for impl, kk, vv, gqa in (("torch-sdpa-cudnn", k4.repeat_interleave(Hq // H, 1), v4.repeat_interleave(Hq // H, 1),
                               False), ("torch-sdpa-cudnn-gqa", k4, v4, True)):
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                t = timer(lambda: sdpa(qd, kk, vv, is_causal=True, scale=sm, enable_gqa=gqa), iters, 3)
            res.add("rows", dict(shape_row, impl=impl, **t))
        except Exception as e:
            res.add("errors", dict(shape_row, impl=impl, error=err_str(e)))
    # FlashInfer's ragged prefill over the prompts' own K/V [T, H, D] (what kvq runs for fresh prompts of
    # 16-bit layers): FA3 (K/V by TMA), and cuDNN where its Python frontend is installed
    try:
        import flashinfer

        kr, vr = (x.permute(0, 2, 1, 3).reshape(B * chunk, H, D).contiguous() for x in (k4, v4))
        ind = torch.arange(0, (B + 1) * chunk, chunk, dtype=torch.int32)
        ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        for backend in ("fa3", "cudnn"):
            impl = f"flashinfer-{backend}-ragged"
            try:
                w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout="NHD", backend=backend)
                common = dict(causal=True, sm_scale=sm, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                if backend == "cudnn":  # offsets in elements, lengths and maxima given (FlashInfer's cuDNN contract)
                    dv = dict(device=device)
                    lens = torch.full((B,), chunk, dtype=torch.int32, **dv)
                    w.plan((ind * Hq * D).to(device), (ind * H * D).to(device), Hq, H, D, **common,
                           seq_lens=lens, seq_lens_q=lens, max_token_per_sequence=chunk, max_sequence_kv=chunk,
                           v_indptr=(ind * H * D).to(device), o_indptr=(ind * Hq * D).to(device))
                else:
                    w.plan(ind, ind, Hq, H, D, **common)
                t = timer(lambda: w.run(q, kr, vr), iters, 3)
                res.add("rows", dict(shape_row, impl=impl, **t))
            except Exception as e:
                res.add("errors", dict(shape_row, impl=impl, error=err_str(e)))
    except Exception as e:
        res.add("errors", dict(shape_row, impl="flashinfer-ragged", error=err_str(e)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="BxPAST+CHUNK,...")
    ap.add_argument("--formats", default=FORMATS)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-anchors", action="store_true")
    for name, (_, what, _) in VARIANTS.items():
        ap.add_argument(f"--{name}", action="store_true", help=f"also rows of {what} (impl ...-{name})")
    ap.add_argument("--no-triton", action="store_true", help="without the Triton prefill's rows (the fallback)")
    ap.add_argument("--smoke", action="store_true", help="tiny heads and shapes, the torch library (any device)")
    ap.add_argument("--profile", action="store_true", help="add each kvq row's costliest kernels (us a call, "
                    "torch.profiler) as 'kernels_us' and its costliest host functions (own time, cProfile) as "
                    "'host_top_us'")
    ap.add_argument("--out", default=None, help="JSON (default docs/results/bench_prefill_h200.json; "
                    "docs/results/bench_prefill_smoke.json with --smoke)")
    ap.add_argument("--append", action="store_true", help="keep the rows already in --out and add this run's (a "
                    "record in parts, one device call each: each part's machine and commit under 'parts')")
    args = ap.parse_args(argv)
    from kvq.models.llama import attend

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("bench_prefill: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    H, group, D = (2, 2, 64) if args.smoke else (8, 4, 128)
    shapes = parse_shapes("2x0+48,1x40+24" if args.smoke and args.shapes == SHAPES else args.shapes)
    formats = args.formats.split(",")
    out = Path(args.out or REPO / "docs/results" / ("bench_prefill_smoke.json" if args.smoke
                                                    else "bench_prefill_h200.json"))
    env = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "flashinfer": pkg_version("flashinfer-python"), "commit": tree_commit(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "heads": {"query": H * group, "kv": H, "head_dim": D}}
    doc = {"env": env, "rows": [], "errors": []}
    if args.append and out.exists():
        doc = json.loads(out.read_text())
        doc.setdefault("parts", [doc["env"]]).append(env)
    res = Results(out, doc)
    timer = Timer(device, 256 << 20 if device.type == "cuda" else 1 << 20)
    impls = kvq_impls(device, args.smoke, [name for name in VARIANTS if getattr(args, name.replace("-", "_"))],
                      args.no_triton)
    gen = torch.Generator().manual_seed(0)
    sm = D ** -0.5
    iters = 2 if args.smoke else args.iters
    for B, past, chunk in shapes:
        shape_row = dict(B=B, past=past, chunk=chunk)
        fl = flops(B, H * group, D, past, chunk)
        for fmt in formats:
            for impl, kernels in impls.items():
                variant = variant_of(impl)
                if variant and not VARIANTS[variant][2](fmt):
                    continue  # a variant that does not change this format's path: the default impl's rows
                row = dict(shape_row, impl=impl, format=fmt)
                try:
                    h, meta, q, k, v = fill(fmt, kernels, B, past, chunk, H, D, group, device, gen)
                    t = timer(lambda: attend(kernels, q, h.layer, meta, sm, k, v), iters, 1 if args.smoke else 3)
                    if args.profile:
                        t["kernels_us"] = kernel_breakdown(lambda: attend(kernels, q, h.layer, meta, sm, k, v), device)
                        t["host_top_us"] = host_breakdown(lambda: attend(kernels, q, h.layer, meta, sm, k, v))
                    res.add("rows", dict(row, **t, tflops=fl / t["us"] / 1e6))
                    log(f"{impl:24s} {fmt:22s} {B}x{past}+{chunk}: {t['us']:10.1f} us {fl / t['us'] / 1e6:7.1f} "
                        "TFLOP/s")
                    if fmt == "bfloat16" and impl == next(iter(impls)) and not args.no_anchors and not args.smoke:
                        anchors(h, meta, q, B, past, chunk, device, timer, iters, res, dict(shape_row,
                                format="bfloat16"), sm)
                except Exception as e:
                    traceback.print_exc()
                    res.add("errors", dict(row, error=err_str(e)))
                h = meta = q = k = v = None
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    for r in res.doc["rows"]:
        r.setdefault("tflops", flops(r["B"], H * group, D, r["past"], r["chunk"]) / r["us"] / 1e6)
        r.pop("samples_us", None)
    summarize(res.doc)
    res.save()
    return 0


def summarize(doc: dict) -> None:
    """x_best_library and x_kvq_bf16 on the kvq rows; a table on stdout."""
    rows = doc["rows"]
    key = lambda r: (r["B"], r["past"], r["chunk"])  # noqa: E731
    best = {}
    for r in rows:
        if not r["impl"].startswith("kvq"):
            k = key(r)
            if k not in best or r["us"] < best[k]["us"]:
                best[k] = r
    bf16 = {(key(r), r["impl"]): r["us"] for r in rows if r["impl"].startswith("kvq") and r["format"] == "bfloat16"}
    for r in rows:
        if not r["impl"].startswith("kvq"):
            continue
        if key(r) in best:
            r["x_best_library"] = r["us"] / best[key(r)]["us"]
            r["best_library"] = best[key(r)]["impl"]
        variant = variant_of(r["impl"])  # a variant without a bf16 row: its default impl's
        base = r["impl"].removesuffix("-" + variant) if variant and (key(r), r["impl"]) not in bf16 else r["impl"]
        if (key(r), base) in bf16:
            r["x_kvq_bf16"] = r["us"] / bf16[(key(r), base)]
    print(f"\n{'shape':18s} {'impl':24s} {'format':22s} {'us':>10s} {'TFLOP/s':>8s} {'x best lib':>10s} {'x bf16':>7s}")
    for r in sorted(rows, key=lambda r: (key(r), r["impl"], r["format"])):
        xb, xf = r.get("x_best_library"), r.get("x_kvq_bf16")
        print(f"{r['B']}x{r['past']}+{r['chunk']:<10} {r['impl']:24s} {r['format']:22s} {r['us']:10.1f} "
              f"{r['tflops']:8.1f} {'' if xb is None else f'{xb:.2f}':>10s} {'' if xf is None else f'{xf:.2f}':>7s}")


if __name__ == "__main__":
    sys.exit(main())
